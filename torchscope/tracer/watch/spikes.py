"""Loss spikes, caught before the update: the watch's ``spike`` part (``--watch spike``).

The watch already reads, every step before the update, the loss and the global gradient
norm (its one host sync), and each module's gradient norm beside them. :class:`Spikes` keeps
those host figures for a window of recent steps and says when a step's figures jump far above
the run's own recent history: a bad batch (features x300 at one step: loss 1.2 -> 115,
gradient norm 1.2 -> 297). No extra host read, no device work: a few Python operations per
step on floats already read.

The rule, for the loss and for the gradient norm, each judged on its own (a step is a spike
when either is):

- the window: the figures of the last ``window`` (128) good steps, the median ``m`` and the
  robust spread ``s = 1.4826 * MAD`` (the median absolute deviation, scaled to be sigma for
  normal noise) of them;
- for the loss, ``s`` is the larger of that and its upper tail's spread, ``(q95 - m) /
  1.645`` (the window's 95th percentile; sigma for normal noise): a loss whose batches vary
  with a heavy upper tail (a regression's few hard samples, 5x the median now and then) is
  not a spike within it;
- the loss spiked when it is above ``m + sigmas * s`` (``sigmas`` 6) *and* at least
  ``min_ratio`` (2) times ``m``: a flat loss whose spread is tiny does not alarm at a small
  wobble;
- the gradient norm alone spiked by the same test with ``grad_ratio`` (10) times its ``m``:
  a gradient norm wanders more than the loss (early in a run it doubles within a few steps
  while the loss falls), so on its own it needs a jump of an order of magnitude; a bad batch
  moves both;
- judged from ``warmup`` (8) figures in the window on: a spike is caught from about step 10.

Only a figure *above* the window's median can be one: a loss that falls, however fast, never
alarms (the median of a falling loss's recent steps lies above it). Not added to the window:
a non-finite figure (NaN/Inf is the NaN watch's own detection, and a ``GradScaler``'s
overflowed, skipped step is neither a spike nor history), nor a spiked step (it would widen
the window). A jump that lasts ``lasting`` (16) checked steps in a row is the run's new
level, not a spike: the window starts again from those steps.

The loss is the size of the step's loss as the check reads it (``|loss|`` for one value; the
norm of the micro-batches' losses under gradient accumulation). At a spike, the modules whose
gradient norm jumped most against their own median over the window are named
(:meth:`Spike.top_modules`; the per-module figures are the rows the check read, kept by
reference: one append per step).
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

SPIKE = "spike"  # what a check finds (beside norms.NAN, INF, GRADNORM)
WINDOW = 128  # good steps kept
SIGMAS = 6.0  # robust sigmas above the window's median...
MIN_RATIO = 2.0  # ...and at least this many times the median (the loss)
GRAD_RATIO = 10.0  # the gradient norm on its own: this many times its median
WARMUP = 8  # figures in the window before a step is judged
LASTING = 16  # spiked steps in a row that make a new level: the window starts again
TOP_MODULES = 3  # modules named in the line
MAD_SIGMA = 1.4826  # MAD -> sigma for normal noise
UPPER_Q, UPPER_Z = 0.95, 1.645  # the loss's upper-tail spread: its 95th percentile, in sigmas
CARRIED = 2.0  # modules whose gradient norm jumped within this factor of the largest jump

# (module names, the check's row, where the modules' squared norms start in it)
ModuleRow = tuple[Sequence[str], Sequence[float], int]


class _Figure:
    """One figure's window: the values in arrival order and kept sorted (median in O(1))."""

    __slots__ = ("order", "sorted")

    def __init__(self) -> None:
        self.order: deque[float] = deque()
        self.sorted: list[float] = []

    def add(self, x: float, window: int) -> None:
        if len(self.order) >= window:
            old = self.order.popleft()
            del self.sorted[bisect_left(self.sorted, old)]
        self.order.append(x)
        insort(self.sorted, x)

    def pop_last(self) -> None:
        x = self.order.pop()
        del self.sorted[bisect_left(self.sorted, x)]

    def clear(self) -> None:
        self.order.clear()
        self.sorted.clear()

    def median(self) -> float:
        return _median_sorted(self.sorted)

    def sigma(self, median: float) -> float:
        return MAD_SIGMA * _median_sorted(sorted(abs(v - median) for v in self.sorted))

    def upper_sigma(self, median: float) -> float:
        """The spread of the window's upper tail: (its 95th percentile - the median) / 1.645,
        sigma for normal noise, larger where the tail is heavy."""
        values = self.sorted
        return (values[round(UPPER_Q * (len(values) - 1))] - median) / UPPER_Z


@dataclass
class Spike:
    """A spiked step's figures, against the window's."""

    step: int
    loss: float
    grad_norm: float
    loss_median: float
    loss_sigma: float
    grad_median: float
    grad_sigma: float
    steps: int  # figures in the window
    lead: str  # "loss" or "gradient norm": the figure that spiked (the loss where both did)
    modules: list[tuple[str, float, float]] = field(default_factory=list)  # (path, now, median)

    def top_modules(self, n: int = TOP_MODULES) -> list[tuple[str, float]]:
        """The modules whose gradient norm jumped most against their own median over the
        window: ``(path, ratio)``. Those whose jump is within ``CARRIED`` of the largest
        carry the same jump, and the deepest of them in the module tree comes first: a
        module's gradient flows back into the modules before it, so a jump made inside (the
        attention's query/key projections) shows as large in the embedding and in the root
        model's own parameters (a positional embedding), which only carry it. Then by
        ratio."""
        ratios = [
            (path, now / med)
            for path, now, med in self.modules
            if med > 0 and math.isfinite(now) and math.isfinite(med) and now > med
        ]
        if not ratios:
            return []
        top = max(r for _, r in ratios)

        def rank(item: tuple[str, float]) -> tuple[bool, int, float]:
            path, ratio = item
            carried = ratio * CARRIED >= top
            return (not carried, -_depth(path) if carried else 0, -ratio)

        ratios.sort(key=rank)
        return ratios[:n]

    def to_dict(self) -> dict[str, float | int | str]:
        return {
            "loss": self.loss,
            "grad_norm": self.grad_norm,
            "loss_median": self.loss_median,
            "loss_sigma": self.loss_sigma,
            "grad_median": self.grad_median,
            "grad_sigma": self.grad_sigma,
            "steps": self.steps,
            "lead": self.lead,
        }


class Spikes:
    """The last ``window`` good steps' loss and gradient norm; :meth:`took` judges each step
    (see the module's rule)."""

    def __init__(
        self,
        window: int = WINDOW,
        sigmas: float = SIGMAS,
        min_ratio: float = MIN_RATIO,
        grad_ratio: float = GRAD_RATIO,
        warmup: int = WARMUP,
        lasting: int = LASTING,
    ) -> None:
        if window < 2 or not 2 <= warmup <= window:
            raise ValueError("spikes: need 2 <= warmup <= window")
        if not sigmas > 0 or not min(min_ratio, grad_ratio) >= 1 or lasting < 1:
            raise ValueError("spikes: need sigmas > 0, ratios >= 1 and lasting >= 1")
        self.window = window
        self.sigmas = sigmas
        self.min_ratio = min_ratio
        self.grad_ratio = grad_ratio
        self.warmup = warmup
        self.lasting = lasting
        self._loss = _Figure()
        self._grad = _Figure()
        self._steps: deque[int] = deque()
        self._rows: deque[ModuleRow | None] = deque()
        self._run: list[tuple[float, float, ModuleRow | None]] = []  # the spiked steps in a row
        self._last_step: int | None = None  # the last step added (checked again: replaced)
        self.spikes = 0  # spiked steps seen (a run counts each)

    def __len__(self) -> int:
        return len(self._steps)

    def took(
        self, step: int, loss: float, grad_norm: float, modules: ModuleRow | None = None
    ) -> Spike | None:
        """The check read these for ``step``; the spike, or None (the figures then join the
        window where they are finite). ``modules``: the check's row of per-module figures."""
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return None  # the NaN watch's, or a loss scaler's overflow: neither spike nor history
        if self._last_step == step and self._steps:
            self._loss.pop_last()  # the same step checked again (LBFGS's closure): the last
            self._grad.pop_last()
            self._steps.pop()
            self._rows.pop()
            self._last_step = None
        spike = self._judge(step, loss, grad_norm, modules)
        if spike is not None:
            self.spikes += 1
            self._run.append((loss, grad_norm, modules))
            if len(self._run) < self.lasting:
                return spike
            # It lasted: the run's new level, not a spike. The window starts again from it.
            run, self._run = self._run, []
            self._clear()
            for i, (l_, g_, m_) in enumerate(run):
                self._add(step - len(run) + 1 + i, l_, g_, m_)
            return None
        self._run = []
        self._add(step, loss, grad_norm, modules)
        return None

    def _add(self, step: int, loss: float, grad_norm: float, modules: ModuleRow | None) -> None:
        if len(self._steps) >= self.window:
            self._steps.popleft()
            self._rows.popleft()
        self._loss.add(loss, self.window)
        self._grad.add(grad_norm, self.window)
        self._steps.append(step)
        self._rows.append(modules)
        self._last_step = step

    def _clear(self) -> None:
        self._loss.clear()
        self._grad.clear()
        self._steps.clear()
        self._rows.clear()
        self._last_step = None

    def _judge(
        self, step: int, loss: float, grad_norm: float, modules: ModuleRow | None
    ) -> Spike | None:
        if len(self._steps) < self.warmup:
            return None
        lm, gm = self._loss.median(), self._grad.median()
        # The cheap test first (nearly every step ends here): the spread only above the ratio.
        loss_up = loss > self.min_ratio * lm
        grad_up = grad_norm > self.grad_ratio * gm
        if not (loss_up or grad_up):
            return None
        ls = max(self._loss.sigma(lm), self._loss.upper_sigma(lm))
        gs = self._grad.sigma(gm)
        loss_up = loss_up and loss > lm + self.sigmas * ls
        grad_up = grad_up and grad_norm > gm + self.sigmas * gs
        if not (loss_up or grad_up):
            return None
        lead = "loss" if loss_up else "gradient norm"
        spike = Spike(step, loss, grad_norm, lm, ls, gm, gs, len(self._steps), lead)
        spike.modules = self._module_jumps(modules)
        return spike

    def _module_jumps(self, modules: ModuleRow | None) -> list[tuple[str, float, float]]:
        """Each module's gradient norm now and its median over the window's steps that had
        the same modules (at a spike only)."""
        if modules is None:
            return []
        names, row, start = modules
        rows = [r for r in self._rows if r is not None and tuple(r[0]) == tuple(names)]
        out = []
        for i, name in enumerate(names):
            now = _norm(row[start + i])
            past = sorted(_norm(r[1][r[2] + i]) for r in rows)
            past = [v for v in past if math.isfinite(v)]
            if past:
                out.append((name, now, _median_sorted(past)))
        return out


def _depth(path: str) -> int:
    """How deep a module is in its model's tree (``blocks.0.attn``: 2; the root model's own
    parameters, named by its class, and the model's children: 0)."""
    return path.count(".")


def _norm(square: float) -> float:
    return math.sqrt(square) if square >= 0 else math.nan


def _median_sorted(values: Sequence[float]) -> float:
    n = len(values)
    if not n:
        return math.nan
    mid = n // 2
    return values[mid] if n % 2 else 0.5 * (values[mid - 1] + values[mid])


def spike_line(
    spike: Spike, who: str = "torchscope", modules: Sequence[tuple[str, float]] = ()
) -> str:
    """The one line of a spike: ``torchscope: loss spike at step 80: loss 115 vs 1.1 ± 0.1
    over the last 79 steps; gradient norm 297 vs 1.2 — the gradient norms that jumped most:
    model.blocks.0 (Linear) x250, ...`` (a multiplication sign for the x); ``modules``:
    (name, ratio), as the line says them."""
    from torchscope.tracer.watch.growth import figure

    lead = [("loss", spike.loss, spike.loss_median, spike.loss_sigma)]
    other = [("gradient norm", spike.grad_norm, spike.grad_median, spike.grad_sigma)]
    if spike.lead != "loss":
        lead, other = other, lead
    name, x, med, sigma = lead[0]
    oname, ox, omed, _ = other[0]
    text = (
        f"{who}: {name} spike at step {spike.step}: {name} {figure(x)} vs {figure(med)} ± "
        f"{figure(sigma)} over the last {spike.steps} steps; {oname} {figure(ox)} vs "
        f"{figure(omed)}"
    )
    if modules:
        named = ", ".join(f"{m} \u00d7{figure(r)}" for m, r in modules)
        text += f" — the gradient norms that jumped most: {named}"
    return text
