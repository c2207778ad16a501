"""Divergence, said as such: the NaN watch's line after a detection that ends a run of growth.

The watch already reads, every step, the loss and the global gradient norm (its one host
sync); :class:`Growth` keeps the last :data:`WINDOW` steps' figures as the floats it read. At
a detection, :func:`growth_line` says whether they grew into it. The rule: over the steps
just before the bad one (consecutive steps, finite positive figures), the loss -- else the
gradient norm -- rose at each of the last ``k >= MIN_RISES`` steps, and by at least
``MIN_FACTOR`` times from the first of them to the last. Then:

    torchscope: the loss grew from 1.46 to 8.52e18 over the 3 steps before; gradient norm
    3.1 -> 2.2e9

(one line; the other figure over the same steps, where it is known). A loss that falls, or
that wanders, says nothing. The loss is the size of the step's loss (its norm: ``|loss|``
for one value), as the check reads it.

The spike watch (``--watch spike``) also says a divergence *as it happens*, before the first
Inf (:meth:`Growth.diverging`): the loss -- else the gradient norm -- rose at each of the
last ``DIVERGE_RISES`` (3) checked steps or more, by ``DIVERGE_FACTOR`` (100) times or more
from the first of them to this one (on average x4.6 a step, or faster). Said once a stretch:

    torchscope: diverging since step 0: loss x228 per step (1.5 -> 8.52e18 over 3 steps);
    gradient norm 3.1 -> 2.2e9

A too-large learning rate does this (loss 1.5 -> 58 -> 7.8e4 -> 8.5e18 -> inf); a bad batch
does not (one step up, then back).
"""

from __future__ import annotations

import math
from collections import deque

WINDOW = 16  # steps kept
MIN_RISES = 2  # the figure rose at each of at least this many steps in a row...
MIN_FACTOR = 10.0  # ...and by at least this factor overall
DIVERGE_RISES = 3  # diverging: the figure rose at each of this many checked steps in a row...
DIVERGE_FACTOR = 100.0  # ...and by this factor from the first of them

Row = tuple[int, float, float]  # (step, loss, gradient norm)


class Growth:
    """The last :data:`WINDOW` checked steps' (step, loss, gradient norm)."""

    __slots__ = ("_said", "rows")

    def __init__(self) -> None:
        self.rows: deque[Row] = deque(maxlen=WINDOW)
        self._said: int | None = None  # the first step of the divergence said last

    def took(self, step: int, loss: float, grad_norm: float) -> None:
        """The check read these for ``step`` (checked again in the same step: the last)."""
        rows = self.rows
        if rows and rows[-1][0] == step:
            rows.pop()
        rows.append((step, loss, grad_norm))

    def line(self, step: int, who: str = "torchscope") -> str | None:
        return growth_line(list(self.rows), step, who)

    def diverging(self, who: str = "torchscope") -> tuple[int, str] | None:
        """(the step it began at, its line) when the figures up to the last step taken grow
        as a divergence does (see the module), once per stretch; else None."""
        rows = list(self.rows)
        run = [rows[-1]] if rows else []
        for row in reversed(rows[:-1]):
            if row[0] != run[-1][0] - 1:
                break  # consecutive steps only
            run.append(row)
        run.reverse()
        for name, other, i in (("loss", "gradient norm", 1), ("gradient norm", "loss", 2)):
            values = [r[i] for r in run]
            n = _rising(values)
            if n >= DIVERGE_RISES and values[-1] >= DIVERGE_FACTOR * values[-1 - n]:
                since = run[-1 - n][0]
                if self._said == since:
                    return None  # the same stretch, said already
                self._said = since
                first, last = values[-1 - n], values[-1]
                rate = (last / first) ** (1.0 / n)
                text = (
                    f"{who}: diverging since step {since}: {name} \u00d7{figure(rate)} per step "
                    f"({figure(first)} \u2192 {figure(last)} over {n} steps)"
                )
                a, b = run[-1 - n][3 - i], run[-1][3 - i]
                if _known(a) and _known(b):
                    text += f"; {other} {figure(a)} \u2192 {figure(b)}"
                return since, text
        return None


def growth_line(rows: list[Row], step: int, who: str = "torchscope") -> str | None:
    """What the detection at ``step`` ends, from the figures of the steps before it; None
    where they did not grow (see the module's rule)."""
    before: list[Row] = []
    for row in reversed([r for r in rows if r[0] < step]):
        if row[0] != (before[-1][0] if before else step) - 1:
            break  # consecutive steps only, ending at the one before the detection
        before.append(row)
    before.reverse()
    if len(before) < MIN_RISES + 1:
        return None
    losses = [r[1] for r in before]
    norms = [r[2] for r in before]
    lead, other = ("the loss", "gradient norm"), (losses, norms)
    rises = _rises(losses)
    if not rises:
        lead, other, rises = ("the gradient norm", "loss"), (norms, losses), _rises(norms)
        if not rises:
            return None
    grew, also = other
    first, last = grew[-1 - rises], grew[-1]
    text = f"{who}: {lead[0]} grew from {figure(first)} to {figure(last)}"
    text += f" over the {rises} steps before"
    a, b = also[-1 - rises], also[-1]
    if _known(a) and _known(b):
        text += f"; {lead[1]} {figure(a)} → {figure(b)}"
    return text


def _rises(values: list[float]) -> int:
    """How many of the last steps the figure rose at, in a row, when that is growth by the
    rule (else 0)."""
    n = 0
    while n + 1 < len(values):
        a, b = values[-2 - n], values[-1 - n]
        if not (_known(a) and _known(b) and b > a):
            break
        n += 1
    if n < MIN_RISES or values[-1] < MIN_FACTOR * values[-1 - n]:
        return 0
    return n


def _rising(values: list[float]) -> int:
    """How many of the last steps the figure rose at, in a row (finite positive figures)."""
    n = 0
    while n + 1 < len(values):
        a, b = values[-2 - n], values[-1 - n]
        if not (_known(a) and _known(b) and b > a):
            break
        n += 1
    return n


def _known(x: float) -> bool:
    return math.isfinite(x) and x > 0


def figure(x: float) -> str:
    """Three significant digits, exponents written short: ``1.46``, ``8.52e18``."""
    text = f"{x:.3g}"
    mantissa, e, exponent = text.partition("e")
    return f"{mantissa}e{int(exponent)}" if e else text
