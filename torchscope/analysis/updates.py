"""What each run did with its updates, from its history: which steps' updates were skipped
(the watch's ``on_spike``/``on_nan="skip"``, a loss scaler) and which steps the watch
flagged as a loss spike, and where the two runs' losses part.

Two runs of one job, one with ``--watch spike --on-spike skip`` and one without, part at the
step whose update one of them refused: every number after it differs. ``diff`` names that
step first ("step 80 skipped (loss spike) in A; applied in B"), so the diverging numbers that
follow read as its consequence. Plain data in, plain data out: no torch, no printing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torchscope.protocol.events import ALERT, HISTORY

__all__ = [
    "StepUpdate",
    "UpdateDifference",
    "compare_updates",
    "losses_part",
    "recorded_history",
    "step_updates",
]


@dataclass(frozen=True)
class StepUpdate:
    """One step's update as its history point says: ``skipped`` (refused), ``spike`` (the
    watch flagged a spike there), ``scaler`` (the step ran under a loss scaler), ``lead``
    (what spiked: "loss" or "gradient norm"), ``loss`` and ``line`` (the spike's alert)."""

    step: int
    skipped: bool = False
    spike: bool = False
    scaler: bool = False
    lead: str = "loss"
    loss: float | None = None
    line: str | None = None

    def text(self) -> str:
        """``skipped (loss spike)``, ``applied (loss spike flagged)``, ``skipped by the loss
        scaler``, ``skipped`` or ``applied``."""
        if self.skipped:
            if self.spike:
                return f"skipped ({self.lead} spike)"
            return "skipped by the loss scaler" if self.scaler else "skipped"
        return f"applied ({self.lead} spike flagged)" if self.spike else "applied"


@dataclass(frozen=True)
class UpdateDifference:
    """A step whose update the two runs treated differently."""

    step: int
    a: StepUpdate
    b: StepUpdate

    def text(self, name_a: str = "A", name_b: str = "B") -> str:
        return f"step {self.step} {self.a.text()} in {name_a}; {self.b.text()} in {name_b}"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"step": self.step, "a": self.a.text(), "b": self.b.text()}
        line = self.a.line or self.b.line
        if line:
            out["line"] = line
        return out


def step_updates(events: Iterable[dict[str, Any]]) -> dict[int, StepUpdate]:
    """Each step of the recording's history (its ``history`` events), with the line of the
    spike alert of that step where the watch raised one."""
    points: dict[int, dict[str, Any]] = {}
    spikes: dict[int, dict[str, Any]] = {}
    for ev in events:
        kind = ev.get("kind")
        if kind == HISTORY:
            for p in ev.get("points") or ():
                if isinstance(p, dict) and type(p.get("step")) is int:
                    points[p["step"]] = p
        elif kind == ALERT and ev.get("what") == "spike" and type(ev.get("step")) is int:
            spikes.setdefault(ev["step"], ev)
    out = {}
    for step, p in points.items():
        alert = spikes.get(step)
        line = alert.get("message") if alert is not None else None
        out[step] = StepUpdate(
            step,
            skipped=bool(p.get("skipped")),
            spike=bool(p.get("spike")),
            scaler=p.get("scale") is not None,
            lead=_lead(alert),
            loss=_float(p.get("loss")),
            line=line if isinstance(line, str) else None,
        )
    return out


def _lead(alert: dict[str, Any] | None) -> str:
    """What spiked, from the alert's figures (``spike.lead``) or its line's first words."""
    if alert is None:
        return "loss"
    figures = alert.get("spike")
    if isinstance(figures, dict) and figures.get("lead") in ("loss", "gradient norm"):
        return str(figures["lead"])
    message = alert.get("message")
    if isinstance(message, str) and message.startswith("gradient norm spike"):
        return "gradient norm"
    return "loss"


def _float(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def compare_updates(
    a: dict[int, StepUpdate], b: dict[int, StepUpdate], steps: set[int] | None = None
) -> list[UpdateDifference]:
    """The steps both histories hold whose update one run skipped and the other applied, or
    that one run flagged as a spike and the other did not, in step order."""
    out = []
    for step in sorted(set(a) & set(b)):
        if steps is not None and step not in steps:
            continue
        ua, ub = a[step], b[step]
        if ua.skipped != ub.skipped or ua.spike != ub.spike:
            out.append(UpdateDifference(step, ua, ub))
    return out


def losses_part(
    a: dict[int, StepUpdate], b: dict[int, StepUpdate], rtol: float = 1e-5, atol: float = 1e-8
) -> tuple[int, float | None, float | None] | None:
    """The first step both histories hold whose losses differ beyond the tolerances, with
    both losses, or None when they agree (or share no loss)."""
    for step in sorted(set(a) & set(b)):
        la, lb = a[step].loss, b[step].loss
        if la is None or lb is None:
            continue
        if math.isnan(la) and math.isnan(lb):
            continue
        if not (abs(la - lb) <= atol + rtol * max(abs(la), abs(lb))):
            return step, la, lb
    return None


def recorded_history(events: Iterable[dict[str, Any]]) -> tuple[dict[str, Any], dict[int, str]]:
    """A recording's history (its ``history`` events, merged as a live job's ``history``
    reply has them: ``points`` and ``buckets``) and the line of each spike the watch alerted,
    by step."""
    from torchscope.protocol.history import RunHistory

    hist = RunHistory(keep=10_000_000)
    lines: dict[int, str] = {}
    for ev in events:
        kind = ev.get("kind")
        if kind == HISTORY:
            hist.merge_wire(dict(ev))
        elif kind == ALERT and ev.get("what") == "spike" and type(ev.get("step")) is int:
            lines.setdefault(ev["step"], str(ev.get("message") or ""))
    return hist.to_wire(), lines
