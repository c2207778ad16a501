"""The NaN watch's norms: the totals its check reads each step (every gradient's and the
loss's L2 norm, one fused reduction per device, no host sync; the exact verdict after a
non-finite one), and the per-module gradient norms for the run's history, in the same read.

The check reads through :class:`ModuleNorms` (``read``): ``torch._foreach_norm`` of every
gradient, the norms stacked and reduced on the device to one total, and beside it the L2
norm of each module's own parameters' gradients (the squares of the per-parameter norms
summed by module with one ``index_add_`` on the device), all read in one ``.tolist()``, the
step's only host sync (see :mod:`~torchscope.tracer.watch.nan_watch`): a few small kernels
per step. :func:`total_norms` is the same total without the modules (the fallback). On the
CPU, where ``_foreach_norm`` is a loop of one reduction per tensor, many small gradients are
read instead through one flat copy, with the loss, and one segmented sum of squares (in
float64), a segment per module and one for the loss; the totals are finished on the host from
the figures read: the same figures to rounding, in five torch calls.

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

import itertools
import math
from collections.abc import Callable

import torch
from torch import nn

from torchscope.protocol.history import ModuleValues
from torchscope.tracer.errors import ReportOnce
from torchscope.tracer.shards import local_shard
from torchscope.tracer.watch.capture import replay_target

OTHER = "(other)"

NAN, INF, GRADNORM = "nan", "inf", "gradnorm"  # what a check finds


# -- the check's norms: one fused reduction per device, no host sync ------------------------
def unscaled(row: list[float], scale: float) -> list[float]:
    """A check's row read off scaled gradients, as the job's unscaled values: the total
    gradient norm divided by the scale, the loss as it is, each module's sum of squares by
    the scale squared."""
    if not scale or not math.isfinite(scale):
        return row
    return [row[0] / scale, row[1], *(x / (scale * scale) for x in row[2:])]


def dense(t: torch.Tensor) -> torch.Tensor:
    """Values whose L2 norm is ``t``'s: a sparse tensor's stored values, a complex tensor's
    real and imaginary parts (``foreach_norm`` takes no real dtype for complex input). A
    DTensor (FSDP2) gives its local shard: the figures are this rank's (the whole would take
    a collective, which hangs the job if the ranks' checks ever disagree)."""
    local = local_shard(t)
    if local is not None:
        t = local
    if t.is_sparse:
        t = t._values()
    if t.is_complex():
        t = torch.view_as_real(t.conj() if t.is_conj() else t)  # |conj z| = |z|
    return t


def norm_of(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """L2 norm of all ``tensors`` together, as a float32 0-d tensor on ``device``; NaN if any
    is NaN, Inf if any is Inf (or the squares overflow). No host sync."""
    if len(tensors) == 1:
        t = tensors[0]
        if type(t) is torch.Tensor and t.dim() == 0 and t.dtype.is_floating_point:
            # The loss, nearly always: its norm is its absolute value (one call, not four).
            norm = _float32(t.abs())
            return norm if t.device == device else norm.to(device)
    groups: dict[tuple[torch.device, torch.dtype, bool], list[torch.Tensor]] = {}
    for t in tensors:
        # Nearly every gradient is a plain dense real tensor: read as it is (the check runs
        # every step, over every gradient; dense's questions cost more than the norm here).
        if type(t) is not torch.Tensor or t.is_sparse or t.is_complex():
            t = dense(t)
        groups.setdefault((t.device, t.dtype, type(t) is torch.Tensor), []).append(t)
    parts = []
    for (dev, dtype, plain), ts in groups.items():
        if plain and _flat_readable(dev, dtype, ts):
            # Squares summed in float64, as the module norms' flat read does.
            flat = torch._utils._flatten_dense_tensors(ts).double()
            part = _float32(torch.linalg.vector_norm(flat))
            parts.append(part if dev == device else part.to(device))
            continue
        norms = foreach_norms(ts, dtype)
        if norms is None:
            continue
        part = torch.linalg.vector_norm(torch.stack(norms)).float()
        parts.append(part if dev == device else part.to(device))
    return combined(parts, device)


def foreach_norms(ts: list[torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, ...] | None:
    """Each tensor's L2 norm, in one fused call (half precisions reduced in float32); None
    for a dtype that has none (integers, bool)."""
    if dtype in (torch.float32, torch.float64):
        return torch._foreach_norm(ts)
    if dtype.is_floating_point:
        return torch._foreach_norm(ts, dtype=torch.float32)
    return None


def combined(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The L2 norm of several parts' norms (0 without any), on ``device``."""
    if not parts:
        return torch.zeros((), device=device)
    return torch.linalg.vector_norm(torch.stack(parts)) if len(parts) > 1 else parts[0]


def total_norms(grads: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    device = (grads or values)[0].device
    return torch.stack([norm_of(grads, device), norm_of(values, device)])


def confirm(
    grads: list[torch.Tensor], values: list[torch.Tensor]
) -> tuple[str | None, list[int], bool]:
    """Exact verdict after a non-finite norm: ("nan"/"inf"/None, indices of bad grads, whether
    a loss is bad)."""
    with torch.no_grad(), torch._C.DisableTorchFunction():
        kinds = []
        for t in (*grads, *values):
            t = dense(t)
            if not (t.dtype.is_floating_point or t.dtype.is_complex):
                kinds.append((False, False))
                continue
            kinds.append((bool(torch.isnan(t).any()), bool(torch.isinf(t).any())))
    bad = [i for i, (n, f) in enumerate(kinds[: len(grads)]) if n or f]
    in_loss = any(n or f for n, f in kinds[len(grads) :])
    if any(n for n, _ in kinds):
        return NAN, bad, in_loss
    if any(f for _, f in kinds):
        return INF, bad, in_loss
    return None, [], False


# -- per-module norms for the history -------------------------------------------------------


class _Plan:
    """Which module each gradient belongs to, for one set of parameters (cached per step
    while the parameters with a gradient stay the same)."""

    __slots__ = ("_offsets", "ends", "groups", "index", "key", "names", "order")

    def __init__(self, key: tuple[int, ...], params: list[torch.Tensor], owner: dict[int, str]):
        self.key = key
        names: dict[str, int] = {}
        # (device, dtype) -> (positions in the grads list, module index of each, on device)
        groups: dict[tuple[torch.device, torch.dtype], tuple[list[int], list[int]]] = {}
        # Groups whose gradients are all plain dense real tensors: each step takes them as
        # they are, without asking every one of them again what ``dense`` asks.
        mixed: set[tuple[torch.device, torch.dtype]] = set()
        for i, p in enumerate(params):
            grad = p.grad
            assert grad is not None  # the parameters that have a gradient
            g = dense(grad)
            m = names.setdefault(owner.get(id(p), OTHER), len(names))
            group = (g.device, g.dtype)
            pos, mods = groups.setdefault(group, ([], []))
            pos.append(i)
            mods.append(m)
            if g is not p.grad or type(g) is not torch.Tensor:
                mixed.add(group)
        self.names = tuple(names)
        self.index = names
        # The CPU's one-group case (nearly every small model): the gradients in module order,
        # read with the losses in one flat copy and one segmented sum, a segment per module
        # and one for the losses (``_fused``).
        self.order: list[int] | None = None
        self.ends: list[int] = []  # where each module's segment ends in the flat copy
        self._offsets: dict[int, torch.Tensor] = {}
        if len(groups) == 1 and not mixed:
            (dev, dtype), (pos, mods) = next(iter(groups.items()))
            if _flat_readable(dev, dtype, params):
                module_of = dict(zip(pos, mods, strict=True))
                self.order = sorted(pos, key=module_of.__getitem__)  # stable: params' order
                sizes = [0] * len(names)
                for i in pos:
                    sizes[module_of[i]] += params[i].numel()
                self.ends = list(itertools.accumulate(sizes))
        self.groups = [
            (
                dev,
                dtype,
                pos,
                _on(dev, mods),
                (dev, dtype) not in mixed,
                _flat_lengths(dev, dtype, [params[i] for i in pos], (dev, dtype) in mixed),
            )
            for (dev, dtype), (pos, mods) in groups.items()
        ]

    def offsets(self, n_values: int) -> torch.Tensor:
        """The fused read's segment bounds: one per module, then one for ``n_values`` loss
        values (none without them)."""
        offsets = self._offsets.get(n_values)
        if offsets is None:
            last = [self.ends[-1] + n_values] if n_values else []
            offsets = self._offsets[n_values] = torch.tensor([0, *self.ends, *last])
        return offsets


# The CPU has no fused ``_foreach_norm``: it runs one reduction per gradient, and on a model
# of many small tensors those calls are most of the check. Up to this many elements in all,
# one copy into a flat buffer and one segmented float64 sum cost less (the check's total
# alone, without module norms: one norm of that copy); above it the copy and its float64
# squares cost far more than the calls they save. Measured on one CPU thread, the flat read
# against a norm per gradient: 40 x 136 elements 40 against 65 µs, 64 x 256 69 against
# 104 µs, 32 x 1024 71 against 53 µs, 32 x 16384 (an MLP's) 3.7 ms against 0.11 ms. It takes
# ten calls of its own: below eight gradients a norm each costs no more.
FLAT_MAX_ELEMENTS = 1 << 14
FLAT_MIN_TENSORS = 8


def _flat_lengths(
    device: torch.device, dtype: torch.dtype, params: list[torch.Tensor], mixed: bool
) -> torch.Tensor | None:
    """Each gradient's number of elements, where a group is read through a flat copy."""
    if mixed or not _flat_readable(device, dtype, params):
        return None
    return torch.tensor([p.numel() for p in params], dtype=torch.long)


def _flat_readable(device: torch.device, dtype: torch.dtype, ts: list[torch.Tensor]) -> bool:
    """Whether a group of plain dense tensors is read through one flat copy (see above)."""
    if device.type != "cpu" or not dtype.is_floating_point or len(ts) < FLAT_MIN_TENSORS:
        return False
    sizes = [t.numel() for t in ts]
    return min(sizes) > 0 and sum(sizes) <= FLAT_MAX_ELEMENTS


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


def _with(t: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
    """``t`` with ``extra``'s one value after it, for the same read."""
    if extra is None:
        return t
    return torch.cat([t, extra.to(t.device, t.dtype).reshape(1)])


def _fusable(value: torch.Tensor) -> bool:
    """Whether a loss value can join the CPU's flat copy of the gradients."""
    return (
        type(value) is torch.Tensor
        and value.device.type == "cpu"
        and value.dtype.is_floating_point
        and not value.is_sparse
    )


def _fused(
    plan: _Plan, grads: list[torch.Tensor], values: list[torch.Tensor], extra: torch.Tensor | None
) -> list[float]:
    """The CPU's read of many small gradients: one flat float64 copy of the gradients (in
    module order) and the losses, their squares summed per module and for the losses in one
    segmented sum; the totals are finished on the host from the figures read. A small step
    pays per torch call: five here, where a norm per tensor would take one per gradient."""
    ts = [grads[i] for i in plan.order or ()]
    ts.extend(values)
    n_values = sum(v.numel() for v in values)
    # Squares summed in float64: no square of a float32 gradient overflows there.
    flat = torch._utils._flatten_dense_tensors(ts).double()
    sums = torch.segment_reduce(flat.square_(), "sum", offsets=plan.offsets(n_values))
    row = _with(sums, extra).tolist()
    n = len(plan.names)
    modules = row[:n]
    rest = row[n + 1 :] if n_values else row[n:]
    loss = math.sqrt(row[n]) if n_values else 0.0
    # sum, not fsum: a NaN or Inf square shows in the total as it is (fsum raises on Inf)
    return [math.sqrt(sum(modules)), loss, *modules, *rest]


class ModuleNorms:
    """A :class:`NanWatch`'s ``norms``: its check reads the step's totals here, and hands
    every checked step's norms to ``sink(step, grad_norm, module_norms)`` (the agent's
    history; a watch of its own has none).

    roots: ``f() -> list of watched top-level modules`` (the watch's, found on its first step).
    """

    def __init__(
        self,
        sink: Callable[[int, float, ModuleValues | None], None] | None,
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

    def read(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        values: list[torch.Tensor],
        extra: torch.Tensor | None = None,
    ) -> list[float]:
        """What the watch reads, read: [total gradient norm, loss norm, each module's sum of
        squares..., then ``extra``'s one value (the loss scale) if given]; ``grads[i]`` is
        ``params[i].grad``. The step's one host sync. A failure here must not cost the watch
        its check: it falls back to the watch's own totals."""
        if not self.failed:
            try:
                return self._read(params, grads, values, extra)
            except Exception as exc:
                self.failed = True
                self._error("computing them", exc)
        return _with(total_norms(grads, values), extra).tolist()

    def _read(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        values: list[torch.Tensor],
        extra: torch.Tensor | None,
    ) -> list[float]:
        if not grads:
            return _with(total_norms(grads, values), extra).tolist()
        plan = self._plan_for(params)
        if plan.order is not None and all(_fusable(v) for v in values):
            return _fused(plan, grads, values, extra)
        return _with(self._totals(plan, grads, values), extra).tolist()

    def _plan_for(self, params: list[torch.Tensor]) -> _Plan:
        key = tuple(map(id, params))
        owner = self._names()
        plan = self._plan
        if plan is None or plan.key != key:
            plan = self._plans.get(key)
            if plan is None:
                if len(self._plans) >= 8:
                    self._plans.clear()
                plan = self._plans[key] = _Plan(key, params, owner)
            self._plan = plan
        return plan

    def _totals(
        self, plan: _Plan, grads: list[torch.Tensor], values: list[torch.Tensor]
    ) -> torch.Tensor:
        """``read``'s figures (without the extra one) as a float32 tensor on the device of
        the first gradient, unread: the accelerators' way, and the CPU's for large
        gradients."""
        device = grads[0].device
        parts, squares = [], []
        for dev, dtype, pos, mods, plain, lengths in plan.groups:
            ts = [grads[i] for i in pos] if plain else [dense(grads[i]) for i in pos]
            if lengths is not None:
                # Squares summed in float64: no square of a float32 gradient overflows there.
                flat = torch._utils._flatten_dense_tensors(ts).double()
                each = torch.segment_reduce(flat.square(), "sum", lengths=lengths)
                sq = torch.zeros(len(plan.names), dtype=torch.float64).index_add_(0, mods, each)
                part, sq = _float32(sq.sum().sqrt()), _float32(sq)
                parts.append(part if dev == device else part.to(device))
                squares.append(sq if dev == device else sq.to(device))
                continue
            norms = foreach_norms(ts, dtype)
            if norms is None:
                continue
            stacked = torch.stack(norms)
            # As norm_of does, so the total is the same number the check uses.
            part = _float32(torch.linalg.vector_norm(stacked))
            parts.append(part if dev == device else part.to(device))
            sq = torch.zeros(len(plan.names), device=dev).index_add_(
                0, mods, _float32(stacked).square()
            )
            squares.append(sq if dev == device else sq.to(device))
        total, loss = combined(parts, device), norm_of(values, device)
        return torch.cat([torch.stack([total, loss]), _summed(squares, len(plan.names), device)])

    def module_row(self, row: list[float]) -> tuple[tuple[str, ...], list[float], int] | None:
        """``row`` (``read``'s values) with the names of the modules whose squared gradient
        norms it holds from index 2 on, for the spike watch's window (a reference: no copy);
        None where the read had no modules (its fallback)."""
        plan = self._plan
        if plan is None or self.failed or len(row) != 2 + len(plan.names):
            return None
        return plan.names, row, 2

    def took(self, step: int, row: list[float]) -> None:
        """The watch read ``row`` (``read``'s values, without the extra one) for ``step``."""
        if self.sink is None:
            return
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
