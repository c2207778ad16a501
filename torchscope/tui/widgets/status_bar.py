"""One line of session state: mode, pid, rank, step, events/s, dropped, paused (why, and
before or after which op or node), breakpoints, follow."""

from __future__ import annotations

import os
from typing import Any

from textual.markup import escape
from textual.widgets import Static

from torchscope.tui.format import short_name
from torchscope.tui.stepping import StepperView, pause_event, pause_title


def _rate(x: float) -> str:
    if x >= 10_000:
        return f"{x / 1000:.0f}k"
    if x >= 1000:
        return f"{x / 1000:.1f}k"
    return f"{x:.0f}"


class StatusBar(Static):
    """Rendered from the merged status the source reports plus what the app measures."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__("", id=id, markup=True)
        self._last = ""

    def show(
        self,
        status: dict[str, Any],
        *,
        rate: float,
        follow: bool | None,
        step: Any,
        resident: int,
        steps: int,
        stepper: StepperView | None = None,
    ) -> None:
        parts = []
        mode = status.get("mode", "replay")
        state = status.get("state")
        if mode == "live":
            if status.get("connected"):
                parts.append("[b $success]● LIVE[/] connected")
            elif state == "ended":
                parts.append("[b $warning]○ LIVE[/] session ended")
            else:
                text = "disconnected" if state != "connecting" else "connecting…"
                parts.append(f"[b $error]○ LIVE[/] {text}")
        else:
            name = os.path.basename(str(status.get("file") or "")) or "trace"
            parts.append(f"[b $accent]REPLAY[/] {escape(name)}")
            if state == "error":
                parts.append("[b $error]unreadable[/]")
            elif status.get("truncated"):
                parts.append("[$warning]cut short[/]")
            elif status.get("damaged"):
                parts.append("[$warning]index damaged (read by scanning)[/]")
        pause = stepper.paused if stepper is not None else None
        if pause is not None:
            ev = pause_event(pause)
            name = ev.get("name") if ev.get("kind") == "op" else ev.get("node")
            at = f" {escape(short_name(str(name)))}" if name else ""
            parts.append(f"[b $warning]⏸ PAUSED[/] ({escape(pause_title(pause))}){at}")
        elif status.get("paused"):
            parts.append("[b $warning]⏸ PAUSED[/]")
        elif stepper is not None and stepper.mode in ("pause", "step", "next"):
            parts.append(f"[$warning]{'pausing' if stepper.mode == 'pause' else stepper.mode}…[/]")
        if stepper is not None and stepper.breakpoints:
            on = sum(1 for b in stepper.breakpoints if b.get("enabled", True))
            n = len(stepper.breakpoints)
            text = f"{n} breakpoint{'s' if n != 1 else ''}"
            parts.append(text + (f" ({on} on)" if on != n else ""))
        tracing = status.get("tracing") if mode == "live" and status.get("connected") else None
        if tracing == "dormant":
            parts.append("[$text-muted]dormant[/]")
        elif tracing == "arming":
            parts.append("[$warning]arming at the next step…[/]")
        elif tracing == "traced":
            parts.append("traced")
        if status.get("pid") is not None:
            parts.append(f"pid {escape(str(status['pid']))}")
        if status.get("rank") is not None:
            parts.append(f"rank {escape(str(status['rank']))}")
        job_step = status.get("step") if mode == "live" else None
        if job_step is not None:
            parts.append(f"job step {escape(str(job_step))}")
        if step is not None:
            parts.append(f"viewing step {escape(str(step))}")
        parts.append(f"{steps} steps")
        if mode == "live":
            parts.append(f"{_rate(rate)} ev/s")
            dropped = (status.get("dropped") or 0) + (status.get("ui_dropped") or 0)
            dropped += status.get("lost") or 0  # the stream's drops for this UI alone
            gaps = status.get("gaps") or 0
            style = "$error" if dropped or gaps else "$text-muted"
            text = f"dropped {dropped}" + (f" (gaps {gaps})" if gaps else "")
            parts.append(f"[{style}]{text}[/]")
        else:
            total = status.get("events_total")
            if total is not None:
                parts.append(f"{total:,} events")
        parts.append(f"[$text-muted]{resident:,} in memory[/]")
        if follow is not None:
            parts.append("[b $success]following[/]" if follow else "[$warning]following off (f)[/]")
        if status.get("error") and (state in ("unreachable", "disconnected", "error")):
            parts.append(f"[$error]{escape(str(status['error']))}[/]")
        text = " │ ".join(parts)
        if text != self._last:
            self._last = text
            self.update(text, layout=False)
