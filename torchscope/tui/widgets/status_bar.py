"""One line of session state: mode, pid, rank, step, events/s, dropped, paused, follow."""

from __future__ import annotations

import os
from typing import Any

from textual.markup import escape
from textual.widgets import Static


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
        if status.get("paused"):
            parts.append("[b $warning]⏸ PAUSED[/]")
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
