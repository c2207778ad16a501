"""Per-module gradient norms for the run's history, inside the NaN watch's one host read.

The watch's check already takes ``torch._foreach_norm`` of every gradient, stacks the norms
and reduces them on the device to one total, which it reads with the step's only host sync
(see :mod:`~torchscope.tracer.watch.nan_watch`). :class:`ModuleNorms` computes the same total
from the same stacked norms (the same operations, so the same number), and beside it the L2
norm of each module's own parameters' gradients: the squares of the per-parameter norms summed
by module with one ``index_add_`` on the device. Both go out in the same ``.tolist()``: no
extra sync, a few small kernels per step.

A module here is the one that owns the parameter directly (``blocks.3.attn.c_attn`` for
``blocks.3.attn.c_attn.weight``), named as in the watched top-level modules
(``DistributedDataParallel``'s ``module.`` prefix left out). Parameters the watched modules do
not own (an optimizer's extra tensors) count as ``(other)``.

Update-to-weight ratios are not computed: ``||update|| / ||weight||`` needs the weights from
before the update next to those after it, a copy of every parameter each step (twice the
model's memory) or a second pass after ``optimizer.step()`` with one more host read. The
optimizer-specific shortcut (``lr * ||g||`` for plain SGD) is wrong under momentum, Adam and
weight decay, which is where the ratio matters.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from torchscope.protocol.history import ModuleValues
from torchscope.tracer.errors import ReportOnce
from torchscope.tracer.watch.capture import replay_target
from torchscope.tracer.watch.nan_watch import (
    _combined,
    _dense,
    _foreach_norms,
    _norm_of,
    _total_norms,
)

OTHER = "(other)"


class _Plan:
    """Which module each gradient belongs to, for one set of parameters (cached per step
    while the parameters with a gradient stay the same)."""

    __slots__ = ("groups", "index", "key", "names")

    def __init__(self, key: tuple[int, ...], params: list[torch.Tensor], owner: dict[int, str]):
        self.key = key
        names: dict[str, int] = {}
        # (device, dtype) -> (positions in the grads list, module index of each, on device)
        groups: dict[tuple[torch.device, torch.dtype], tuple[list[int], list[int]]] = {}
        # Groups whose gradients are all plain dense real tensors: each step takes them as
        # they are, without asking every one of them again what ``_dense`` asks.
        mixed: set[tuple[torch.device, torch.dtype]] = set()
        for i, p in enumerate(params):
            g = _dense(p.grad)  # type: ignore[arg-type]
            m = names.setdefault(owner.get(id(p), OTHER), len(names))
            key = (g.device, g.dtype)
            pos, mods = groups.setdefault(key, ([], []))
            pos.append(i)
            mods.append(m)
            if g is not p.grad or type(g) is not torch.Tensor:
                mixed.add(key)
        self.names = tuple(names)
        self.index = names
        self.groups = [
            (dev, dtype, pos, _on(dev, mods), (dev, dtype) not in mixed)
            for (dev, dtype), (pos, mods) in groups.items()
        ]


def _on(device: torch.device, values: list[int]) -> torch.Tensor:
    """An index tensor on ``device`` without a host sync (a plain copy from pageable memory
    would wait for the stream): staged in pinned memory, copied asynchronously."""
    t = torch.tensor(values, dtype=torch.long)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _float32(t: torch.Tensor) -> torch.Tensor:
    """``t.float()`` without the call where it is float32 already (the norms of every float
    dtype but float64 are): a small step pays per torch call."""
    return t if t.dtype == torch.float32 else t.float()


def _summed(squares: list[torch.Tensor], n: int, device: torch.device) -> torch.Tensor:
    """The modules' squares over every (device, dtype) group: one group (nearly every model)
    is its own sum; several add up in order, as from zeros (0 + x is x, bit for bit)."""
    if not squares:
        return torch.zeros(n, device=device)
    total = squares[0]
    for sq in squares[1:]:
        total = total + sq
    return total


class ModuleNorms:
    """Set as a :class:`NanWatch`'s ``norms``: its check then computes the step's totals here
    and hands every checked step's norms to ``sink(step, grad_norm, module_norms)``.

    roots: ``f() -> list of watched top-level modules`` (the watch's, found on its first step).
    """

    def __init__(
        self,
        sink: Callable[[int, float, ModuleValues | None], None],
        roots: Callable[[], list[nn.Module]],
    ) -> None:
        self.sink = sink
        self._roots = roots
        self._plan: _Plan | None = None
        # Plans by parameter set: a job whose set of gradients alternates (a branch that
        # trains every other step) builds each once.
        self._plans: dict[tuple[int, ...], _Plan] = {}
        self._owner: dict[int, str] = {}
        self._owner_of: tuple[int, ...] = ()  # the roots the names were taken from
        self._error = ReportOnce("the history's module norms", "the watch goes on without them")
        self.failed = False

    def _names(self) -> dict[int, str]:
        roots = self._roots()
        key = tuple(id(m) for m in roots)
        if key != self._owner_of:
            owner: dict[int, str] = {}
            for root in roots:
                for path, module in replay_target(root).named_modules():
                    for p in module.parameters(recurse=False):
                        owner.setdefault(id(p), path or type(module).__name__)
            self._owner, self._owner_of, self._plan = owner, key, None
            self._plans.clear()
        return self._owner

    def totals(
        self, params: list[torch.Tensor], grads: list[torch.Tensor], values: list[torch.Tensor]
    ) -> torch.Tensor:
        """What the watch reads: [total gradient norm, loss norm, module squares...], on the
        device of the first gradient (as ``_total_norms``), float32. No host sync. A failure
        here must not cost the watch its check: it falls back to the watch's own totals."""
        if not self.failed:
            try:
                return self._totals(params, grads, values)
            except Exception as exc:
                self.failed = True
                self._error("computing them", exc)
        return _total_norms(grads, values)

    def _totals(
        self, params: list[torch.Tensor], grads: list[torch.Tensor], values: list[torch.Tensor]
    ) -> torch.Tensor:
        if not grads:
            return _total_norms(grads, values)
        with_grad = [p for p in params if p.grad is not None]
        key = tuple(id(p) for p in with_grad)
        owner = self._names()
        plan = self._plan
        if plan is None or plan.key != key:
            plan = self._plans.get(key)
            if plan is None:
                if len(self._plans) >= 8:
                    self._plans.clear()
                plan = self._plans[key] = _Plan(key, with_grad, owner)
            self._plan = plan
        device = grads[0].device
        parts, squares = [], []
        for dev, dtype, pos, mods, plain in plan.groups:
            ts = [grads[i] for i in pos] if plain else [_dense(grads[i]) for i in pos]
            norms = _foreach_norms(ts, dtype)
            if norms is None:
                continue
            stacked = torch.stack(norms)
            # As nan_watch._norm_of does, so the total is the same number the check uses.
            part = _float32(torch.linalg.vector_norm(stacked))
            parts.append(part if dev == device else part.to(device))
            sq = torch.zeros(len(plan.names), device=dev).index_add_(
                0, mods, _float32(stacked).square()
            )
            squares.append(sq if dev == device else sq.to(device))
        total, loss = _combined(parts, device), _norm_of(values, device)
        return torch.cat([torch.stack([total, loss]), _summed(squares, len(plan.names), device)])

    def took(self, step: int, row: list[float]) -> None:
        """The watch read ``row`` (``totals``' values) for ``step``."""
        try:
            plan = self._plan
            modules = None
            if plan is not None and len(row) == 2 + len(plan.names):
                modules = ModuleValues(
                    plan.names, [math.sqrt(x) if x >= 0 else math.nan for x in row[2:]], plan.index
                )
            self.sink(step, row[0], modules)
        except Exception as exc:
            self._error("keeping them", exc)
