"""The run's history (loss and gradient norms of every step, traced or not) as flat arrays, for
the step list, the history plot and the module heatmap."""

from __future__ import annotations

import bisect
import math
from itertools import islice

from torchscope.protocol.history import Bucket, RunHistory, StepPoint

__all__ = ["HistoryIndex", "SeriesIndex"]


class SeriesIndex:
    """One series of the history (loss, a gradient norm) as flat lists, step order: ``xs``
    and ``ys`` the steps with a finite value and those values, ``bad_xs``/``bad_ys`` the
    steps whose value is NaN or Inf. Plain lists so a plot's column costs two bisects and a
    ``min``/``max`` over a slice (C loops), not a Python loop over its points."""

    __slots__ = ("bad_xs", "bad_ys", "xs", "ys")

    def __init__(self) -> None:
        self.xs: list[int] = []
        self.ys: list[float] = []
        self.bad_xs: list[int] = []
        self.bad_ys: list[float] = []

    def __len__(self) -> int:
        return len(self.xs) + len(self.bad_xs)

    def append(self, step: int, value: float | None) -> None:
        if value is None:
            return
        if math.isfinite(value):
            self.xs.append(step)
            self.ys.append(value)
        else:
            self.bad_xs.append(step)
            self.bad_ys.append(value)

    def drop_before(self, step: int) -> None:
        k = bisect.bisect_left(self.xs, step)
        del self.xs[:k], self.ys[:k]
        k = bisect.bisect_left(self.bad_xs, step)
        del self.bad_xs[:k], self.bad_ys[:k]

    def drop_from(self, step: int) -> None:
        k = bisect.bisect_left(self.xs, step)
        del self.xs[k:], self.ys[k:]
        k = bisect.bisect_left(self.bad_xs, step)
        del self.bad_xs[k:], self.bad_ys[k:]

    def value_at(self, step: int) -> float | None:
        """The value at ``step`` (NaN/Inf included), None when it has none."""
        for xs, ys in ((self.xs, self.ys), (self.bad_xs, self.bad_ys)):
            i = bisect.bisect_left(xs, step)
            if i < len(xs) and xs[i] == step:
                return ys[i]
        return None

    def span(self, a: int, b: int) -> tuple[float, float] | None:
        """min and max of the finite values of steps ``a`` <= step < ``b``, or None."""
        i = bisect.bisect_left(self.xs, a)
        j = bisect.bisect_left(self.xs, b, lo=i)
        if i == j:
            return None
        if j - i == 1:
            return self.ys[i], self.ys[i]
        part = self.ys[i:j]
        return min(part), max(part)

    def bad_in(self, a: int, b: int) -> bool:
        """Whether a step ``a`` <= step < ``b`` has a NaN or Inf value."""
        i = bisect.bisect_left(self.bad_xs, a)
        return i < len(self.bad_xs) and self.bad_xs[i] < b


class HistoryIndex:
    """The store's :class:`RunHistory` as flat arrays for the step list, the plot and the
    heatmap: ``points`` (a list, indexable where the history's deque is not), ``steps``,
    the ``loss`` and ``grad_norm`` series and, built on first use, one series per module
    (``module_series``). Kept in step with the history incrementally (new steps appended,
    the oldest dropped as the history folds them), so a live job's history events cost what
    they bring, not the 100k steps held."""

    def __init__(self) -> None:
        self.points: list[StepPoint] = []
        self.steps: list[int] = []
        # step - (its index since the first step ever held): equal values mark a run of
        # consecutive steps, so the step list finds runs by bisection (see ``run_end``)
        self._runs: list[int] = []
        self._dropped = 0
        self.loss = SeriesIndex()
        self.grad_norm = SeriesIndex()
        self.buckets: list[Bucket] = []
        # the steps the watch flagged as a loss spike, and those whose update was skipped
        # (the watch's on_spike/on_nan="skip", a loss scaler), in step order: the plot's marks
        self.spikes: list[int] = []
        self.skips: list[int] = []
        self.version = 0
        self._modules: dict[str, SeriesIndex] | None = None
        self._modules_upto = 0  # points read into the module series
        # the newest steps that keep per-module values in the history (RunHistory's
        # module_keep): the module series keep no more, or a long live session would hold
        # every module's norm for every step the UI ever saw
        self.module_keep: int | None = None

    def __len__(self) -> int:
        return len(self.points)

    @property
    def first_step(self) -> int | None:
        """The oldest step the history covers (a bucket's, else a point's)."""
        if self.buckets:
            return self.buckets[0].first
        return self.steps[0] if self.steps else None

    @property
    def last_step(self) -> int | None:
        if self.steps:
            return self.steps[-1]
        return self.buckets[-1].last if self.buckets else None

    def point(self, step: int) -> StepPoint | None:
        i = bisect.bisect_left(self.steps, step)
        return self.points[i] if i < len(self.steps) and self.steps[i] == step else None

    @property
    def marked(self) -> bool:
        """Whether any step held is a spike or had its update skipped."""
        return bool(self.spikes or self.skips)

    def marks_in(self, a: int, b: int) -> tuple[bool, bool, bool]:
        """For steps ``a`` <= step < ``b``: (a spike whose update was applied, a spike whose
        update was skipped, a skipped update that was no spike)."""
        spikes, skips = self.spikes, self.skips
        i, j = bisect.bisect_left(spikes, a), bisect.bisect_left(spikes, b)
        k, m = bisect.bisect_left(skips, a), bisect.bisect_left(skips, b)
        if i == j and k == m:
            return False, False, False
        spiked, skipped = set(spikes[i:j]), set(skips[k:m])
        return bool(spiked - skipped), bool(spiked & skipped), bool(skipped - spiked)

    def run_end(self, i: int, hi: int) -> int:
        """The end (exclusive, at most ``hi``) of the run of consecutive steps at ``i``."""
        return bisect.bisect_right(self._runs, self._runs[i], lo=i, hi=hi)

    def sync(self, hist: RunHistory, dirty_from: int | None = None) -> None:
        """Catch up with ``hist``: drop what it folded, re-read steps from ``dirty_from`` on
        (points replaced or updated), append the new ones."""
        self.version += 1
        self.buckets = hist.buckets
        self.module_keep = getattr(hist, "module_keep", None)
        if not hist.points:
            self._truncate(0)
            return
        first = hist.points[0].step
        if self.steps and self.steps[0] < first:
            k = bisect.bisect_left(self.steps, first)
            del self.points[:k], self.steps[:k], self._runs[:k]
            self._dropped += k
            for s in (self.loss, self.grad_norm, *(self._modules or {}).values()):
                s.drop_before(first)
            for marks in (self.spikes, self.skips):
                del marks[: bisect.bisect_left(marks, first)]
            self._modules_upto = max(0, self._modules_upto - k)
        if dirty_from is not None and self.steps and dirty_from <= self.steps[-1]:
            self._truncate(bisect.bisect_left(self.steps, dirty_from))
        last = self.steps[-1] if self.steps else None
        fresh: list[StepPoint] = []
        for p in reversed(hist.points):
            if last is not None and p.step <= last:
                break
            fresh.append(p)
        fresh.reverse()
        base = self._dropped
        for p in fresh:
            step = p.step
            self._runs.append(step - base - len(self.steps))
            self.points.append(p)
            self.steps.append(step)
            self.loss.append(step, p.loss)
            self.grad_norm.append(step, p.grad_norm)
            if p.spike:
                self.spikes.append(step)
            if p.skipped:
                self.skips.append(step)

    def _truncate(self, k: int) -> None:
        if k >= len(self.steps):
            return
        step = self.steps[k]
        del self.points[k:], self.steps[k:], self._runs[k:]
        for s in (self.loss, self.grad_norm, *(self._modules or {}).values()):
            s.drop_from(step)
        for marks in (self.spikes, self.skips):
            del marks[bisect.bisect_left(marks, step) :]
        self._modules_upto = min(self._modules_upto, k)

    def module_series(self) -> dict[str, SeriesIndex]:
        """Per-module gradient norms (module path -> series), in the order modules first
        appear; read on first use (most views never need them) and kept up to date after."""
        if self._modules is None:
            self._modules = {}
            self._modules_upto = 0
        mods = self._modules
        keep, steps = self.module_keep, self.steps
        cutoff = steps[-keep] if keep is not None and 0 < keep < len(steps) else None
        if keep == 0:
            cutoff = steps[-1] + 1 if steps else None
        if cutoff is not None:
            self._modules_upto = max(self._modules_upto, bisect.bisect_left(steps, cutoff))
            for s in mods.values():
                s.drop_before(cutoff)
        for p in islice(self.points, self._modules_upto, None):
            if p.module_norms:
                for name, value in p.module_norms.items():
                    series = mods.get(name)
                    if series is None:
                        series = mods[name] = SeriesIndex()
                    series.append(p.step, value)
        self._modules_upto = len(self.points)
        return mods
