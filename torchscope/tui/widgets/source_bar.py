"""The source bar: one line over the status bar when the UI holds several sources (the ranks of
a job, recordings side by side). Each source with its number key, its name and its state
(⏸ paused, ● running, ○ gone, ! alerts), the shown one highlighted; where stepping commands
go (all ranks or the shown one); and, while ranks are paused, for how long against the
process group's timeout when the job says what it is."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from textual.content import Content
from textual.markup import escape
from textual.widgets import Static

from torchscope.tui import glyphs
from torchscope.tui.widgets.status_bar import fit_parts

if TYPE_CHECKING:
    from torchscope.tui.lanes import Lane


def duration_text(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
    return f"{seconds // 60}:{seconds % 60:02d}"


def _state(lane: Lane) -> tuple[str, str]:
    """(glyph, style) of a lane's state."""
    if lane.paused is not None:
        return glyphs.pause(), "$warning"
    status = lane.status
    if lane.live:
        if status.get("connected"):
            return "●", "$success"
        return "○", "$error" if status.get("state") != "ended" else "$text-muted"
    if status.get("state") == "error":
        return "✗", "$error"
    return "▪", "$accent"


def pg_timeout(lanes: list[Lane]) -> float | None:
    """The process group's timeout in seconds, as the ranks' steppers report it (or a
    session event carries it)."""
    for lane in lanes:
        value = lane.store.stepper.pg_timeout or lane.session_value("pg_timeout_s")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return float(value)
    return None


def waiting_text(lane: Lane, label: str) -> str:
    """ "rank 0 waits for rank 1" while a lane's rank is held in a meeting of the ranks by a
    paused one (its heartbeats say so); "" otherwise."""
    wait = lane.status.get("waiting") if lane.live else None
    if not isinstance(wait, dict):
        return ""
    paused = wait.get("paused")
    who = (
        ", ".join(f"rank {r}" for r in sorted(paused, key=str))
        if isinstance(paused, dict) and paused
        else "the other ranks"
    )
    return f"{escape(label)} waits for {escape(who)}"


class SourceBar(Static):
    DEFAULT_CSS = """
    SourceBar {
        display: none;
        height: 1;
        padding: 0 1;
        background: $panel-darken-1;
    }
    SourceBar.-shown {
        display: block;
    }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__("", id=id, markup=True)
        self._parts: list[tuple[int, str]] = []
        self._last: Content | None = None
        self.text = ""  # plain, everything (tests)

    def on_resize(self) -> None:
        self._render_parts()

    def show(
        self, lanes: list[Lane], labels: list[str], current: int, scope: str, now: Any = None
    ) -> None:
        self.set_class(len(lanes) > 1, "-shown")
        if len(lanes) < 2:
            return
        now = time.monotonic() if now is None else now
        width = self.content_region.width or self.size.width or 80
        full = []
        short = []
        for lane, label in zip(lanes, labels, strict=True):
            glyph, style = _state(lane)
            key = str(lane.index + 1) if lane.index < 9 else " "
            store = lane.store  # eager checks are not NaN/Inf alerts
            alerts = "[b $error]![/]" if len(store.alerts) > sum(store.checks.values()) else ""
            step = lane.newest_step() if lane.live else None
            where = f" s{step}" if step is not None else ""
            body = f"[b]{key}[/] {escape(label)} [{style}]{glyph}[/]{alerts}{where}"
            tiny = f"[b]{key}[/][{style}]{glyph}[/]{alerts}"
            if lane.index == current:
                body = f"[reverse]{body}[/]"
                tiny = f"[reverse]{tiny}[/]"
            full.append(body)
            short.append(tiny)
        live = [lane for lane in lanes if lane.source.can_command]
        paused = [lane for lane in live if lane.paused is not None]
        parts: list[tuple[int, str]] = []
        line = " ".join(full)
        if Content.from_markup(line).cell_length > width * 2 // 3:
            line = " ".join(short)
        parts.append((0, line))
        if live:
            if scope == "all":
                parts.append((1, f"c s n → [b]all {len(live)}[/]"))
            else:
                parts.append((1, f"c s n → [b $warning]{escape(labels[current])} only[/] (o)"))
        if paused:
            since = max((lane.paused_for(now) or 0.0) for lane in paused)
            text = f"{glyphs.pause()} {len(paused)}/{len(live)} paused {duration_text(since)}"
            timeout = pg_timeout(lanes)
            if timeout is not None:
                style = "$error" if since > 0.8 * timeout else "$warning"
                text = f"[{style}]{text} of {duration_text(timeout)} pg timeout[/]"
            parts.append((2, text))
        waits = [waiting_text(lane, label) for lane, label in zip(lanes, labels, strict=True)]
        if any(waits):
            parts.append((2, f"[$warning]{'; '.join(w for w in waits if w)}[/]"))
        self._parts = parts
        self.text = Content.from_markup(" │ ".join(m for _, m in parts)).plain
        self._render_parts()

    def _render_parts(self) -> None:
        if not self._parts:
            return
        width = self.content_region.width or self.size.width or 80
        line = fit_parts(self._parts, width)
        if self._last is None or line != self._last:
            self._last = line
            self.update(line, layout=False)
