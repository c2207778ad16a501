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
import re
from array import array
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from torchscope.protocol.events import HISTORY

__all__ = [
    "HISTORY",
    "Bucket",
    "Condition",
    "ModuleValues",
    "RunHistory",
    "Series",
    "StepPoint",
    "parse_condition",
]


@dataclass(slots=True)  # one per step of a long run: small and quick to make
class StepPoint:
    """One step of the run.

    ``loss``: the root of the step's top-level ``backward()`` when it holds one value (under
    gradient accumulation, the last micro-batch's; under a loss scaler, the scaled value as the
    job passed it to ``backward``). ``grad_norm``: the global L2 norm of the gradients (the
    watch's). ``module_norms``: module path -> L2 norm of that module's own parameters'
    gradients. ``update_ratios``: module path -> ||update|| / ||weight|| for the step.
    ``traced``: whether the step was traced in full. ``skipped``: whether its update was
    skipped (by the NaN watch under ``on_nan="skip"``, or by a loss scaler). Under a loss
    scaler: ``scale``, the scale the step ran with; ``skipped`` when the scaler skipped its
    update (inf/NaN in the
    scaled gradients). ``spike``: the watch caught a loss spike at the step (``watch="spike"``).
    """

    step: int
    loss: float | None = None
    grad_norm: float | None = None
    module_norms: Mapping[str, float] | None = None
    update_ratios: dict[str, float] | None = None
    traced: bool = False
    scale: float | None = None
    skipped: bool = False
    spike: bool = False

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
        if self.scale is not None:
            out["scale"] = self.scale
        if self.skipped:
            out["skipped"] = True
        if self.spike:
            out["spike"] = True  # (absent otherwise: older readers never see it)
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
            scale=_float_or_none(d.get("scale")),
            skipped=bool(d.get("skipped", False)),
            spike=bool(d.get("spike", False)),
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
    """Steps ``first``..``last`` (inclusive) folded: min/max/last of loss and gradient norm,
    and how many of them had their update skipped (a loss scaler's, the watch's)."""

    first: int
    last: int
    loss: Series = field(default_factory=Series)
    grad_norm: Series = field(default_factory=Series)
    skipped: int = 0

    def add(self, p: StepPoint) -> None:
        self.last = max(self.last, p.step)
        self.loss.add(p.loss)
        self.grad_norm.add(p.grad_norm)
        self.skipped += p.skipped

    def merge(self, other: Bucket) -> None:
        self.first = min(self.first, other.first)
        self.last = max(self.last, other.last)
        self.loss.merge(other.loss)
        self.grad_norm.merge(other.grad_norm)
        self.skipped += other.skipped

    def to_wire(self) -> dict[str, Any]:
        out = {
            "first": self.first,
            "last": self.last,
            "loss": self.loss.to_wire(),
            "grad_norm": self.grad_norm.to_wire(),
        }
        if self.skipped:
            out["skipped"] = self.skipped
        return out

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Bucket:
        return cls(
            first=int(d["first"]),
            last=int(d["last"]),
            loss=Series.from_wire(d.get("loss")),
            grad_norm=Series.from_wire(d.get("grad_norm")),
            skipped=_count(d.get("skipped")),
        )


class RunHistory:
    """The run's points, newest ``keep`` at full resolution, older ones folded into buckets."""

    def __init__(self, keep: int = 100_000, bucket: int = 100, module_keep: int = 10_000) -> None:
        if keep < 1 or bucket < 1 or module_keep < 0:
            raise ValueError("keep and bucket must be positive")
        self.keep = keep
        self.bucket = bucket
        # Per-module values cost one number per module and step: only the newest
        # ``module_keep`` steps keep them (older points keep loss and global norm).
        self.module_keep = module_keep
        self.points: deque[StepPoint] = deque()
        self.buckets: list[Bucket] = []
        self.span = bucket  # steps per bucket; doubles each time the buckets halve

    def __len__(self) -> int:
        return len(self.points)

    def add(self, point: StepPoint) -> None:
        """Append a step, or replace the point of a step already held (a live event that
        repeats part of a reply); an older step not held (folded already) is left out."""
        if self.points and point.step <= self.points[-1].step:
            for i in range(len(self.points) - 1, -1, -1):
                if self.points[i].step == point.step:
                    self.points[i] = point
                    return
                if self.points[i].step < point.step:
                    return
            return
        self.points.append(point)
        n = len(self.points)
        if n > self.module_keep:
            old = self.points[n - self.module_keep - 1]
            old.module_norms = old.update_ratios = None
        if n > self.keep:
            self._fold(self.points.popleft())

    def discard_from(self, step: int) -> int:
        """Drop the full-resolution points numbered ``step`` or later (the job renumbered its
        steps: micro-batches counted before its first optimizer step, a resumed job's
        ``torchscope.step(n)``); returns how many went."""
        n = 0
        while self.points and self.points[-1].step >= step:
            self.points.pop()
            n += 1
        return n

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
        # From the newest end: a UI asks for the few points it has not seen yet.
        newer = []
        for p in reversed(self.points):
            if p.step <= step:
                break
            newer.append(p)
        return reversed(newer)

    def to_wire(self, since: int | None = None) -> dict[str, Any]:
        """Plain data for a reply or a ``history`` event: every point and bucket, or (``since``)
        only the points after that step and no buckets."""
        if since is not None:
            return {"points": [p.to_wire() for p in self.since(since)], "buckets": []}
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


def _count(x: Any) -> int:
    return x if isinstance(x, int) and not isinstance(x, bool) and x > 0 else 0


def _float_or_none(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x)


def _float_map(d: Any) -> dict[str, float] | None:
    if not isinstance(d, dict):
        return None
    out = {str(k): float(v) for k, v in d.items() if isinstance(v, (int, float))}
    return out or None


class ModuleValues(Mapping[str, float]):
    """One number per module for one step, read-only: the module names are shared by every
    step that has the same modules and the numbers sit in a flat array, about eight times less
    memory than a dict of floats (a 100-module model over 10k steps: ~9 MB)."""

    # The numbers are kept as ``_numbers``: an attribute named ``values`` would shadow
    # Mapping.values(), so ``norms.values()`` would call the array.
    __slots__ = ("_index", "_numbers", "names")

    def __init__(self, names: tuple[str, ...], values: Any, index: dict[str, int] | None = None):
        self.names = names
        self._numbers = values if isinstance(values, array) else array("d", values)
        self._index = index if index is not None else {n: i for i, n in enumerate(names)}

    def __getitem__(self, key: str) -> float:
        return self._numbers[self._index[key]]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __repr__(self) -> str:
        return f"ModuleValues({dict(self)!r})"


# -- arm-on-condition ------------------------------------------------------------------------
_CONDITION = re.compile(r"\s*(?:(loss|gradnorm)\s*([<>])\s*(\S+)|(nonfinite))\s*")
CONDITION_FORMS = "gradnorm>X, loss>X, loss<X or nonfinite"


@dataclass(frozen=True)
class Condition:
    """When an ``arm`` with ``when`` takes effect: tested on each new point of the history, at
    step boundaries (never per op). ``gradnorm`` needs the watch (its norm); ``nonfinite``
    holds for a NaN/Inf loss or gradient norm."""

    text: str
    metric: str  # "loss", "gradnorm" or "nonfinite"
    op: str = ""  # ">" or "<"
    value: float = 0.0

    def holds(self, point: StepPoint) -> bool:
        if self.metric == "nonfinite":
            return any(
                x is not None and not math.isfinite(x) for x in (point.loss, point.grad_norm)
            )
        x = point.loss if self.metric == "loss" else point.grad_norm
        if x is None or math.isnan(x):
            return False
        return x > self.value if self.op == ">" else x < self.value


def parse_condition(text: str) -> Condition:
    """``gradnorm>1e3``, ``loss>X``, ``loss<X``, ``gradnorm<X`` or ``nonfinite``; a bad one
    raises ValueError with one line."""
    m = _CONDITION.fullmatch(text) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"{text!r} is not a condition (one of: {CONDITION_FORMS})")
    if m.group(4):
        return Condition(text.strip(), "nonfinite")
    metric, op, number = m.group(1), m.group(2), m.group(3)
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"{text!r} is not a condition: {number!r} is not a number") from None
    if math.isnan(value):
        raise ValueError(f"{text!r}: compare with a number, not nan (for NaN: nonfinite)")
    return Condition(text.strip(), metric, op, value)
