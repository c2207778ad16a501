"""A run's history: one point per step (loss, gradient norms), bounded, plain data.

The dormant agent keeps one :class:`RunHistory` for the whole job; a UI that attaches asks for
it, a recording carries it as ``history`` events, and ``torchscope history`` prints it. No torch
and no textual here: the tracer fills it, the UI and the CLI read it.

Memory stays bounded: the newest ``keep`` steps are kept at full resolution; older points are
folded, oldest first, into :class:`Bucket`s of ``bucket`` steps that keep min, max and last of
each series. When the buckets too exceed ``keep // bucket``, neighbouring buckets merge two by
two (so a job of any length costs at most about ``2 * keep`` records).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

HISTORY = "history"  # event kind: a batch of points and buckets (``points``, ``buckets``)


@dataclass
class StepPoint:
    """One step of the run.

    ``loss``: the root of the step's top-level ``backward()`` when it holds one value (under
    gradient accumulation, the last micro-batch's; under a loss scaler, the scaled value as the
    job passed it to ``backward``). ``grad_norm``: the global L2 norm of the gradients (the
    watch's). ``module_norms``: module path -> L2 norm of that module's own parameters'
    gradients. ``update_ratios``: module path -> ||update|| / ||weight|| for the step.
    ``traced``: whether the step was traced in full.
    """

    step: int
    loss: float | None = None
    grad_norm: float | None = None
    module_norms: dict[str, float] | None = None
    update_ratios: dict[str, float] | None = None
    traced: bool = False

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"step": self.step, "loss": self.loss}
        if self.grad_norm is not None:
            out["grad_norm"] = self.grad_norm
        if self.module_norms:
            out["module_norms"] = dict(self.module_norms)
        if self.update_ratios:
            out["update_ratios"] = dict(self.update_ratios)
        if self.traced:
            out["traced"] = True
        return out

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> StepPoint:
        return cls(
            step=int(d["step"]),
            loss=_float_or_none(d.get("loss")),
            grad_norm=_float_or_none(d.get("grad_norm")),
            module_norms=_float_map(d.get("module_norms")),
            update_ratios=_float_map(d.get("update_ratios")),
            traced=bool(d.get("traced", False)),
        )


@dataclass
class Series:
    """min, max and last of one series over a bucket (None where no step had a value)."""

    lo: float | None = None
    hi: float | None = None
    last: float | None = None

    def add(self, x: float | None) -> None:
        if x is None:
            return
        self.last = x
        if math.isnan(x):
            # NaN is what a user looks for: it must survive folding, as hi (lo stays finite)
            self.hi = x
            return
        if self.lo is None or x < self.lo:
            self.lo = x
        if self.hi is None or (not math.isnan(self.hi) and x > self.hi):
            self.hi = x

    def merge(self, other: Series) -> None:
        for x in (other.lo, other.hi):
            self.add(x)
        if other.last is not None:
            self.last = other.last

    def to_wire(self) -> list[float | None]:
        return [self.lo, self.hi, self.last]

    @classmethod
    def from_wire(cls, v: Any) -> Series:
        if not isinstance(v, (list, tuple)) or len(v) != 3:
            return cls()
        return cls(*(_float_or_none(x) for x in v))


@dataclass
class Bucket:
    """Steps ``first``..``last`` (inclusive) folded: min/max/last of loss and gradient norm."""

    first: int
    last: int
    loss: Series = field(default_factory=Series)
    grad_norm: Series = field(default_factory=Series)

    def add(self, p: StepPoint) -> None:
        self.last = max(self.last, p.step)
        self.loss.add(p.loss)
        self.grad_norm.add(p.grad_norm)

    def merge(self, other: Bucket) -> None:
        self.first = min(self.first, other.first)
        self.last = max(self.last, other.last)
        self.loss.merge(other.loss)
        self.grad_norm.merge(other.grad_norm)

    def to_wire(self) -> dict[str, Any]:
        return {
            "first": self.first,
            "last": self.last,
            "loss": self.loss.to_wire(),
            "grad_norm": self.grad_norm.to_wire(),
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Bucket:
        return cls(
            first=int(d["first"]),
            last=int(d["last"]),
            loss=Series.from_wire(d.get("loss")),
            grad_norm=Series.from_wire(d.get("grad_norm")),
        )


class RunHistory:
    """The run's points, newest ``keep`` at full resolution, older ones folded into buckets."""

    def __init__(self, keep: int = 100_000, bucket: int = 100) -> None:
        if keep < 1 or bucket < 1:
            raise ValueError("keep and bucket must be positive")
        self.keep = keep
        self.bucket = bucket
        self.points: deque[StepPoint] = deque()
        self.buckets: list[Bucket] = []
        self.span = bucket  # steps per bucket; doubles each time the buckets halve

    def __len__(self) -> int:
        return len(self.points)

    def add(self, point: StepPoint) -> None:
        """Append a step (or update it when it is the newest one again)."""
        if self.points and self.points[-1].step == point.step:
            self.points[-1] = point
            return
        self.points.append(point)
        if len(self.points) > self.keep:
            self._fold(self.points.popleft())

    def update(self, step: int, **values: Any) -> StepPoint | None:
        """Set fields of a step still at full resolution (the watch's norms arrive after the
        loss); returns the point, or None when the step is not (or no longer) held."""
        for p in reversed(self.points):
            if p.step == step:
                for k, v in values.items():
                    setattr(p, k, v)
                return p
            if p.step < step:
                break
        return None

    def _fold(self, p: StepPoint) -> None:
        last = self.buckets[-1] if self.buckets else None
        if last is None or p.step - last.first >= self.span:
            self.buckets.append(Bucket(first=p.step, last=p.step))
            last = self.buckets[-1]
        last.add(p)
        if len(self.buckets) > max(2, self.keep // self.bucket):
            self._halve()

    def _halve(self) -> None:
        merged: list[Bucket] = []
        for i in range(0, len(self.buckets) - 1, 2):
            a, b = self.buckets[i], self.buckets[i + 1]
            a.merge(b)
            merged.append(a)
        if len(self.buckets) % 2:
            merged.append(self.buckets[-1])
        self.buckets = merged
        self.span *= 2

    def latest(self) -> StepPoint | None:
        return self.points[-1] if self.points else None

    def since(self, step: int) -> Iterator[StepPoint]:
        """Points with ``step`` greater than ``step``, oldest first."""
        for p in self.points:
            if p.step > step:
                yield p

    def to_wire(self) -> dict[str, Any]:
        return {
            "points": [p.to_wire() for p in self.points],
            "buckets": [b.to_wire() for b in self.buckets],
        }

    def merge_wire(self, d: dict[str, Any]) -> None:
        """Take a ``history`` event's (or reply's) points and buckets into this history."""
        for b in d.get("buckets") or ():
            if isinstance(b, dict):
                self.buckets.append(Bucket.from_wire(b))
        for p in d.get("points") or ():
            if isinstance(p, dict) and isinstance(p.get("step"), int):
                self.add(StepPoint.from_wire(p))


def _float_or_none(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x)


def _float_map(d: Any) -> dict[str, float] | None:
    if not isinstance(d, dict):
        return None
    out = {str(k): float(v) for k, v in d.items() if isinstance(v, (int, float))}
    return out or None
