"""Tensor summaries that never force a host-device sync on the hot path.

A summary's numbers start life as device scalars. They wait in a ``PendingBatch``; when a step
ends, a buffer fills or time passes, the batch is *sealed* (one stack per dtype and one
asynchronous copy to the host) and later *resolved* into plain floats. On CUDA that is one
non-blocking copy per batch instead of one sync per tensor; on the CPU the copy is free.
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import Any

import torch

from torchscope.tracer.shards import local_shard, placements

_FAST_DTYPES = (torch.float32, torch.float64)
_HALF_DTYPES = (torch.float16, torch.bfloat16)
# Real dtypes whose few values (within the value limit) give their stats on the host.
_SMALL_REAL_DTYPES = frozenset(
    {torch.float16, torch.bfloat16, torch.bool, torch.uint8, torch.int8, torch.int16}
    | {torch.int32, torch.int64}
)
_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_strided = torch.strided
# What the four queued scalars after min and max hold.
_MEAN_VAR = 0  # mean and population variance (Welford)
_SUMS = 1  # sum and L2 norm (float32 accumulators, for float16/bfloat16)
# Tensors inside torch.func transforms (vmap's batched, grad's tracking wrappers) look like
# plain tensors, but their reductions cannot leave the transform (`.item()` raises, stacking
# them later fails for the whole batch): they get metadata only.
_is_wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", lambda t: False)
_dtype_names: dict[torch.dtype, str] = {}
_device_names: dict[torch.device, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _dtype_names.get(dtype)
    if name is None:
        name = _dtype_names[dtype] = str(dtype).removeprefix("torch.")
    return name


def _device_name(device: torch.device) -> str:
    name = _device_names.get(device)
    if name is None:
        name = _device_names[device] = str(device)
    return name


def tensor_meta(t: torch.Tensor) -> dict[str, Any]:
    """Shape, dtype and device: what every summary carries, safe for any tensor kind."""
    if t.is_nested:
        meta: dict[str, Any] = {"shape": None, "nested": True}
    else:
        meta = {"shape": list(t.shape)}
    meta["dtype"] = _dtype_name(t.dtype)
    meta["device"] = "cpu" if t.is_cpu else _device_name(t.device)
    if t.layout is not _strided:
        meta["layout"] = str(t.layout).removeprefix("torch.")
    cls = type(t)
    if cls is not torch.Tensor and cls is not torch.nn.Parameter:
        meta["type"] = f"{cls.__module__}.{cls.__qualname__}"
    return meta


def _local_shard(t: torch.Tensor) -> tuple[torch.Tensor, str] | None:
    """A DTensor's local tensor and its placements (``Shard(dim=0)``), or None for others."""
    local = local_shard(t)
    return None if local is None else (local, placements(t))


def _stat_view(t: torch.Tensor, keep_half: bool) -> tuple[torch.Tensor | None, str | None]:
    """The real floating tensor to reduce, or None when stats make no sense for this kind.

    Returns the tensor and a note for the reader ("abs" for complex, "dequantized"; "empty"
    with no tensor for one without elements). ``keep_half``: float16/bfloat16 stay as they are
    (the batched path reduces them with float32 accumulators; a float32 copy of a big
    activation, such as bf16 logits, could exhaust device memory).
    """
    cls = type(t)
    # Subclasses (DTensor, FakeTensor, ...) may run collectives or have no data: metadata only.
    if cls is not torch.Tensor and cls is not torch.nn.Parameter:
        return None, None
    if t.is_nested or t.layout is not torch.strided or t.device.type == "meta" or _is_wrapped(t):
        return None, None
    if t.numel() == 0:
        return None, "empty"
    note = None
    if t.is_quantized:
        t, note = t.dequantize(), "dequantized"
    if t.is_complex():
        t, note = t.abs(), "abs"
    if t.dtype not in _FAST_DTYPES and not (keep_half and t.dtype in _HALF_DTYPES):
        t = t.to(torch.float32 if t.is_floating_point() else torch.float64)
    return t, note


def _dense_view(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its dims reordered so that it is contiguous when that is possible.

    Reductions over a transposed tensor (the grad a TBackward0 sends on) run several times
    slower than over the same memory in order; the stats do not depend on the order.
    """
    if x.is_contiguous():
        return x
    order = sorted(range(x.dim()), key=x.stride().__getitem__, reverse=True)
    y = x.permute(order)
    return y if y.is_contiguous() else x


class PendingBatch:
    """Summaries whose numbers are still tensors, in the order they were made.

    ``entries`` rows: (summary, numel, stat dtype, stat index, stat kind (_MEAN_VAR or
    _SUMS), (weak reference to the tensor, its version) or None, value location or None,
    values are integers).
    """

    def __init__(self) -> None:
        self.entries: list[tuple] = []
        self.scalars: dict[torch.dtype, list[torch.Tensor]] = {}
        self.values: dict[torch.dtype, list[torch.Tensor]] = {}
        self.value_len: dict[torch.dtype, int] = {}

    def __len__(self) -> int:
        return len(self.entries)


class Summarizer:
    """Builds summary dicts for tensors, queueing their numbers in the current batch."""

    def __init__(self, value_limit: int = 16, *, host_now: bool = True) -> None:
        self.value_limit = value_limit
        # False sends host tensors through the batched path too (how CUDA tensors always go):
        # tests use it to cover that path on machines without a GPU.
        self.host_now = host_now
        self.batch = PendingBatch()

    def reads_now(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s stats are plain numbers as soon as ``summarize`` returns."""
        return self.host_now and t.is_cpu  # ``t.device.type`` costs ten times as much

    def summarize(self, t: torch.Tensor) -> dict[str, Any]:
        cls = type(t)
        if (
            (cls is _Tensor or cls is _Parameter)
            and t.layout is _strided
            and not t.is_nested
            and not _is_wrapped(t)
        ):
            # The common cases, kept free of the checks below: this runs for every tensor.
            dtype = t.dtype
            if t.is_cpu and self.host_now:
                # Host memory: the numbers are read at once, with as few torch calls as can be
                # (each costs more than the reduction itself at these sizes).
                numel = t.numel()
                if numel > self.value_limit:
                    if dtype in _FAST_DTYPES:
                        return {
                            "shape": list(t.shape),
                            "dtype": _dtype_name(dtype),
                            "device": "cpu",
                            "stats": _host_stats(_dense_view(t), numel),
                        }
                elif numel == 0:
                    return {
                        "shape": list(t.shape),
                        "dtype": _dtype_name(dtype),
                        "device": "cpu",
                        "stats": None,
                        "values": [],  # all of its (no) values: as for any small tensor
                    }
                elif dtype in _FAST_DTYPES:
                    vals = _flat_values(t)
                    return {
                        "shape": list(t.shape),
                        "dtype": _dtype_name(dtype),
                        "device": "cpu",
                        "values": vals,
                        "stats": _list_stats(vals),
                    }
                elif dtype in _SMALL_REAL_DTYPES:
                    # A few integers, booleans or half floats (an index, a mask, a label):
                    # their values, and stats from them, with no conversion and no reduction.
                    vals = _flat_values(t)
                    if dtype is torch.bool:
                        vals = list(map(int, vals))
                    return {
                        "shape": list(t.shape),
                        "dtype": _dtype_name(dtype),
                        "device": "cpu",
                        "values": vals,
                        "stats": _list_stats([float(v) for v in vals]),
                    }
            elif dtype in _FAST_DTYPES and not t.is_meta:
                summary: dict[str, Any] = {
                    "shape": list(t.shape),
                    "dtype": _dtype_name(dtype),
                    "device": _device_name(t.device),
                }
                numel = t.numel()
                if numel == 0:
                    summary["stats"] = None
                    summary["values"] = []
                else:
                    summary["stats"] = {}  # filled when the batch resolves
                    self._queue(summary, t, t, numel)
                return summary
        summary = tensor_meta(t)
        local = _local_shard(t)
        if local is not None:
            # A DTensor: the global shape above, the numbers of this rank's shard (reading
            # the whole would run a collective).
            t, summary["placement"] = local
            summary["local_shape"] = list(t.shape)
            summary["stats_of"] = "local"
        x, note = _stat_view(t, keep_half=not self.reads_now(t))
        if x is None:
            summary["stats"] = None
            if note == "empty":
                summary["values"] = []
            return summary
        summary["stats"] = {}
        if note:
            summary["stats_of"] = note
        self._queue(summary, x, t, x.numel())
        return summary

    def _queue(self, summary: dict, x: torch.Tensor, t: torch.Tensor, numel: int) -> None:
        """Launch the reductions for ``x`` (``t``'s real floating form) and queue them."""
        x = _dense_view(x)
        batch = self.batch
        if self.host_now and x.device.type == "cpu":
            # Host memory: reading numbers costs no sync, so they are read at once (cheaper
            # than stacking them for a batched copy) and the rare hard case gets a second pass.
            summary["stats"].update(_host_stats(x, numel))
            at, counts, stat_dtype, at_kind = -1, None, None, None
        else:
            mn, mx = torch.aminmax(x)
            if x.dtype in _HALF_DTYPES:
                # Sums with float32 accumulators and results, without a copy of x (any
                # layout: neither reduction needs a flat view).
                moments: tuple = (
                    mn.float(),
                    mx.float(),
                    x.sum(dtype=torch.float32),
                    torch.linalg.vector_norm(x, dtype=torch.float32),
                )
                stat_dtype, at_kind = torch.float32, _SUMS
            else:
                # Welford's mean and variance: one pass, no temporary the size of ``x``
                # (device memory may be tight), and no cancellation when the spread is tiny
                # next to the mean (LayerNorm weights near 1); the host derives std and norm
                # (see _moments_from_var).
                var, mean = torch.var_mean(x, correction=0)
                moments, stat_dtype, at_kind = (mn, mx, mean, var), x.dtype, _MEAN_VAR
            scalars = batch.scalars.get(stat_dtype)
            if scalars is None:
                scalars = batch.scalars[stat_dtype] = []
            at = len(scalars)
            scalars += moments
            # The same kernels on every device (host tensors come here only in tests, which is
            # how this path is covered without a GPU); stacked with the rest when sealed.
            # No NaN/Inf counting pass: finite min and max mean there is nothing to count
            # (aminmax propagates NaN), which the host sees when the batch resolves; only then,
            # and only for such a tensor, are the counts made, from ``t`` if it is unchanged.
            counts = _source_ref(t)
        value_at = None
        int_values = False
        if numel <= self.value_limit:
            src = t.detach()
            if src.is_quantized:
                src = src.dequantize()
            elif src.is_complex():
                src = torch.view_as_real(src.resolve_conj())
            vals = src.reshape(-1)
            # The values must be taken now: a later in-place op on ``t`` must not show up in
            # this summary. On the CPU reading them costs no sync and no kernel.
            if vals.device.type == "cpu":
                summary["values"] = (
                    vals.tolist() if vals.dtype is not torch.bool else list(map(int, vals.tolist()))
                )
            else:
                if vals.dtype not in _FAST_DTYPES:
                    int_values = not vals.is_floating_point()
                    vals = vals.to(torch.float64 if int_values else torch.float32)
                else:
                    vals = vals.clone()  # a view of ``t`` otherwise, read when the batch resolves
                vdt = vals.dtype
                vat = batch.value_len.get(vdt, 0)
                batch.values.setdefault(vdt, []).append(vals)
                batch.value_len[vdt] = vat + vals.numel()
                value_at = (vdt, vat, vals.numel())
        if at >= 0 or value_at is not None:
            batch.entries.append(
                (summary, numel, stat_dtype, at, at_kind, counts, value_at, int_values)
            )

    def alias_summary(self, t: torch.Tensor, base: torch.Tensor, base_summary: dict) -> dict | None:
        """A summary of ``t`` that shares ``base_summary``'s stats when both tensors are, right
        now, the same block of memory in another order (a transpose, a view, a detach).

        Stats do not depend on element order, so the reductions need not run again. Small
        tensors, whose summaries list values in order, are not shared.
        """
        try:
            if (
                t.data_ptr() != base.data_ptr()
                or base_summary.get("stats") is None
                or t.dtype != base.dtype
                or t.numel() != base.numel()
                or t.numel() <= self.value_limit
                or not _dense_view(t).is_contiguous()
                or not _dense_view(base).is_contiguous()
            ):
                return None
        except RuntimeError:  # tensors without storage (sparse, subclasses) have no data_ptr
            return None
        summary = tensor_meta(t)
        summary["stats"] = base_summary["stats"]  # the same dict: filled once, seen by both
        return summary

    def take_batch(self) -> PendingBatch:
        batch, self.batch = self.batch, PendingBatch()
        return batch


def _flat_values(t: torch.Tensor) -> list:
    """``t.detach().reshape(-1).tolist()`` for a host tensor, with fewer torch calls (each
    costs more than reading a few values): ``tolist`` reads without recording a graph."""
    dim = t.dim()
    if dim == 1:
        return t.tolist()
    if dim == 0:
        return [t.item()]
    if dim == 2:
        return [v for row in t.tolist() for v in row]
    return t.detach().reshape(-1).tolist()


def _host_stats(x: torch.Tensor, n: int) -> dict[str, Any]:
    """Stats of a host tensor: plain sums first, shifted sums when those would cancel."""
    flat = x if x.dim() == 1 else x.reshape(-1)
    lo, hi = torch.aminmax(flat)
    mn, mx = lo.item(), hi.item()
    total, sq = flat.sum().item(), torch.dot(flat, flat).item()
    if not (math.isfinite(total) and math.isfinite(sq)):
        if mn - mn == 0.0 and mx - mx == 0.0:  # finite values: the sums overflowed
            return _scaled_stats(flat, n, mn, mx)
        return _moments(n, mn, mx, math.nan, math.nan, *_count_bad(x))
    # float32 sums carry ~7 digits; if the variance is under 1e-4 of the mean square, most of
    # them cancel, so sum x - min instead (its spread is the data's spread).
    if (sq - total * total / n) < 1e-4 * sq:
        if mn == mx:
            return _moments(n, mn, mx, 0.0, 0.0, 0, 0)
        shifted = flat - mn
        return _moments(n, mn, mx, shifted.sum().item(), torch.dot(shifted, shifted).item(), 0, 0)
    mean = total / n
    return {
        "min": mn,
        "max": mx,
        "mean": mean,
        "std": math.sqrt(max(sq - total * mean, 0.0) / (n - 1)) if n > 1 else 0.0,
        "norm": math.sqrt(sq),
        "nan": 0,
        "inf": 0,
    }


def _scaled_stats(x: torch.Tensor, n: int, mn: float, mx: float) -> dict[str, Any]:
    """Stats of a finite tensor whose sums overflow its dtype (values near its largest, as
    bfloat16 or float32 near 1e38): the sums of ``x / max|x|`` (every value in [-1, 1]),
    scaled back in float64 on the host. Only such a tensor pays for this second pass. A
    norm (or std) past float64's largest is infinite: float64 has no number for it."""
    flat = x.reshape(-1)
    if flat.dtype not in _FAST_DTYPES:
        flat = flat.float()  # float16/bfloat16 on the device path
    scale = max(-mn, mx)
    y = flat / scale
    ymn, ymx = (v.item() for v in torch.aminmax(y))
    shifted = y - ymn
    unit = _moments(n, ymn, ymx, shifted.sum().item(), torch.dot(shifted, shifted).item(), 0, 0)
    return _stats(mn, mx, unit["mean"] * scale, unit["std"] * scale, unit["norm"] * scale, 0, 0)


def _scaled_list_stats(vals: list[float]) -> dict[str, Any]:
    """:func:`_list_stats` of finite values whose sums overflow float64: of ``v / max|v|``,
    scaled back."""
    scale = max(map(abs, vals))
    unit = _list_stats([v / scale for v in vals])
    mean, std, norm = (unit[k] * scale for k in ("mean", "std", "norm"))
    return _stats(min(vals), max(vals), mean, std, norm, 0, 0)


def _list_stats(vals: list[float]) -> dict[str, Any]:
    """Stats of a few values already read to the host, in float64, with no torch call.

    Same conventions as the reductions: a NaN makes min and max NaN.
    """
    n = len(vals)
    if n == 1:
        v = vals[0]
        if v - v == 0.0:  # finite: _moments(1, v, v, 0.0, 0.0, 0, 0) without the calls
            return {
                "min": v,
                "max": v,
                "mean": v + 0.0,
                "std": 0.0,
                "norm": abs(v),  # not sqrt(v * v): v * v overflows past 1e154
                "nan": 0,
                "inf": 0,
            }
    elif math.isfinite(sum(vals)):  # the common case: no NaN, no Inf (nor a sum overflowing)
        mn = min(vals)
        shifted = [v - mn for v in vals]
        total = sum(shifted)
        sq = sum([d * d for d in shifted])
        if sq < math.inf:  # as _moments, inlined (it runs for every small tensor)
            mean = mn + total / n
            return {
                "min": mn,
                "max": max(vals),
                "mean": mean,
                "std": math.sqrt(max(sq - total * total / n, 0.0) / (n - 1)),
                "norm": math.sqrt(max(sq + 2.0 * mn * total + n * mn * mn, 0.0)),
                "nan": 0,
                "inf": 0,
            }
        return _scaled_list_stats(vals)  # finite values whose squares overflow
    nan = sum(1 for v in vals if v != v)
    inf = sum(1 for v in vals if v in (math.inf, -math.inf))
    if nan:
        mn = mx = math.nan
    else:
        mn, mx = min(vals), max(vals)
    if nan or inf:
        return _moments(len(vals), mn, mx, math.nan, math.nan, nan, inf)
    return _scaled_list_stats(vals)  # finite values whose sum overflowed


def _count_bad(x: torch.Tensor) -> tuple[int, int]:
    return int(x.isnan().sum()), int(x.isinf().sum())


def _source_ref(t: torch.Tensor) -> tuple[weakref.ref, int] | None:
    """A weak reference to ``t`` and its version, to count its NaN/Inf later if need be."""
    try:
        return weakref.ref(t), t._version
    except (RuntimeError, TypeError):  # inference tensors; subclasses without weak refs
        return None


def _live_source(source: tuple[weakref.ref, int] | None) -> torch.Tensor | None:
    """The real floating form of a summarised tensor while it still holds the numbers it was
    summarised with (alive, same version); None once it is gone or changed."""
    if source is None:
        return None
    t = source[0]()
    if t is None:
        return None
    try:
        if t._version != source[1]:
            return None
        with torch._C.DisableTorchFunction(), torch.no_grad():
            return _stat_view(t, keep_half=True)[0]
    except RuntimeError:
        return None


def _overflow_stats(
    source: tuple[weakref.ref, int] | None, n: int, mn: float, mx: float, mean: float
) -> dict:
    """Stats of a finite tensor whose device sums overflowed (see :func:`_scaled_stats`),
    from the tensor itself while it holds the same numbers (one host read, paid only by such
    a tensor); once it is gone, the moments that overflowed are unknown (None, never NaN:
    its values are finite), marked inexact."""
    x = _live_source(source)
    if x is not None:
        try:
            with torch._C.DisableTorchFunction(), torch.no_grad():
                return _scaled_stats(x, n, mn, mx)
        except RuntimeError:
            pass
    known = mean if math.isfinite(mean) else None
    return {**_stats(mn, mx, known, None, None, 0, 0), "moments_exact": False}


def _count_nonfinite(
    source: tuple[weakref.ref, int] | None, vals: list | None, mn: float, mx: float
) -> tuple[int, int, bool]:
    """NaN and Inf counts of a tensor whose min or max came back non-finite: (nan, inf,
    exact). From its values when it has them; else from the tensor itself while it still holds
    the same numbers (one host read, paid only by a tensor that holds NaN or Inf); else the
    least that min and max prove (a NaN min: at least one NaN; an infinite bound, no NaN: at
    least one Inf), marked inexact."""
    if vals is not None:
        return (
            sum(1 for v in vals if v != v),
            sum(1 for v in vals if v == math.inf or v == -math.inf),
            True,
        )
    x = _live_source(source)
    if x is not None:
        try:
            with torch._C.DisableTorchFunction(), torch.no_grad():
                nan, inf = _count_bad(x)
            return nan, inf, True
        except RuntimeError:
            pass
    if mn != mn or mx != mx:
        return 1, 0, False
    return 0, int(mn == -math.inf) + int(mx == math.inf), False


class SealedBatch:
    """A batch whose numbers are on their way to (or already in) host memory."""

    def __init__(self, batch: PendingBatch) -> None:
        self.entries = batch.entries
        self._ready: Any = None
        # Sealing may happen at a step boundary, where the tracer's own mode is active: its
        # stacks must not be traced as user ops.
        with torch._C.DisableTorchFunction():
            self.scalars = {dt: self._to_host(torch.stack(ts)) for dt, ts in batch.scalars.items()}
            self.values = {dt: self._to_host(torch.cat(ts)) for dt, ts in batch.values.items()}

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu":
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
        host.copy_(t, non_blocking=True)
        if t.device.type == "cuda":
            self._ready = torch.cuda.Event()
            self._ready.record()
        return host

    def ready(self) -> bool:
        """True once the host copy has landed (always on the CPU)."""
        return self._ready is None or self._ready.query()

    def resolve(self) -> None:
        """Turn every pending summary into plain numbers (blocks only until the copy lands)."""
        if self._ready is not None:
            self._ready.synchronize()
        scalars = {dt: t.tolist() for dt, t in self.scalars.items()}
        values = {dt: t.tolist() for dt, t in self.values.items()}
        for summary, numel, dt, i, kind, source, value_at, int_values in self.entries:
            vals = None
            if value_at is not None:
                vdt, at, n = value_at
                vals = values[vdt][at : at + n]
                if int_values:
                    vals = [int(v) for v in vals]
                summary["values"] = vals
            if i >= 0:  # else the stats were read at once
                mn, mx, mean, var = scalars[dt][i : i + 4]
                if kind == _SUMS:  # sum and norm: mean and population variance from them
                    total, norm = mean, var
                    mean = total / numel
                    var = max(norm * norm / numel - mean * mean, 0.0)
                stats = summary["stats"]
                if mn - mn == 0.0 and mx - mx == 0.0:  # finite min and max: no NaN, no Inf
                    if mean - mean == 0.0 and var - var == 0.0:
                        stats.update(_moments_from_var(numel, mn, mx, mean, var, 0, 0))
                    else:  # the sums overflowed (values near the dtype's largest)
                        stats.update(_overflow_stats(source, numel, mn, mx, mean))
                    continue
                nan, inf, exact = _count_nonfinite(
                    source, vals if vals is not None and len(vals) == numel else None, mn, mx
                )
                stats.update(_moments_from_var(numel, mn, mx, mean, var, nan, inf))
                if not exact:
                    stats["counts_exact"] = False
        self.entries = []


def _moments(n: int, mn: float, mx: float, total: float, sq: float, nan: int, inf: int) -> dict:
    """Stats from min, max and the sums of ``x - min`` and ``(x - min)**2`` (in float64)."""
    if not (math.isfinite(mn) and math.isfinite(total) and math.isfinite(sq)):
        return _nonfinite_stats(mn, mx, nan, inf)
    mean = mn + total / n
    # Clamped: rounding can make a near-constant tensor's variance a hair negative.
    std = math.sqrt(max(sq - total * total / n, 0.0) / (n - 1)) if n > 1 else 0.0
    norm = math.sqrt(max(sq + 2.0 * mn * total + n * mn * mn, 0.0))
    return _stats(mn, mx, mean, std, norm, nan, inf)


def _moments_from_var(
    n: int, mn: float, mx: float, mean: float, var: float, nan: int, inf: int
) -> dict:
    """Stats from min, max, mean and population variance (the device's Welford pass)."""
    if nan or inf or not math.isfinite(mean):
        return _nonfinite_stats(mn, mx, nan, inf)
    var = max(var, 0.0)
    std = math.sqrt(var * n / (n - 1)) if n > 1 else 0.0
    # In float64 on the host, and hypot never squares: a float64 mean near its largest value
    # still has a norm (infinite only where float64 has no number for it).
    return _stats(mn, mx, mean, std, math.sqrt(n) * math.hypot(math.sqrt(var), mean), nan, inf)


# Every stats dict that counts a NaN or Inf is made by _nonfinite_stats, which ticks this
# counter (under a lock: summaries are made on more than one thread, and a lost tick would
# hide an alert). While it stands still, no summary made meanwhile needs the NaN/Inf checks
# (see nonfinite_made and the pipeline's delivery).
_nonfinite = [0]
_nonfinite_lock = threading.Lock()


def nonfinite_made() -> int:
    """How many stats dicts with NaN/Inf (or a non-finite mean) were made in this process."""
    return _nonfinite[0]


def _nonfinite_stats(mn: float, mx: float, nan: int, inf: int) -> dict:
    with _nonfinite_lock:
        _nonfinite[0] += 1
    mean = std = norm = math.nan
    if inf and not nan:
        # Infinite values but no NaN: the norm is infinite, and so is the mean unless both
        # signs of infinity are present.
        norm = math.inf
        if mn > -math.inf:
            mean = math.inf
        elif mx < math.inf:
            mean = -math.inf
    return _stats(mn, mx, mean, std, norm, nan, inf)


def _stats(
    mn: float,
    mx: float,
    mean: float | None,
    std: float | None,
    norm: float | None,
    nan: int,
    inf: int,
) -> dict:
    return {
        "min": mn,
        "max": mx,
        "mean": mean,
        "std": std,
        "norm": norm,
        "nan": int(nan),
        "inf": int(inf),
    }


class SummaryMemo:
    """Recent summaries by tensor identity and version: each tensor value is summarised once.

    An op's output is usually the next op's input, and a node's grad_input is usually the next
    node's grad_output (the very same object). Entries hold weak references only, so the memo
    never keeps a tensor alive; the version check catches in-place changes.
    """

    def __init__(self, max_entries: int = 200_000) -> None:
        self.max_entries = max_entries
        self._entries: dict[int, tuple[weakref.ref, int, dict]] = {}

    def get(self, t: torch.Tensor) -> dict | None:
        entry = self._entries.get(id(t))
        if entry is None or entry[0]() is not t:
            return None
        try:
            return entry[2] if entry[1] == t._version else None
        except RuntimeError:  # inference tensors have no version counter
            return None

    def put(self, t: torch.Tensor, summary: dict) -> None:
        # Inference tensors have no version counter; some subclasses refuse weak references.
        try:
            self._entries[id(t)] = (weakref.ref(t), t._version, summary)
        except (RuntimeError, TypeError):
            return
        if len(self._entries) > self.max_entries:
            self.prune()

    def discard(self, t: torch.Tensor) -> None:
        """Forget ``t``'s summary (its data changes behind the version counter)."""
        self._entries.pop(id(t), None)

    def clear(self) -> None:
        self._entries.clear()

    def prune(self) -> None:
        """Forget tensors that no longer exist; keeps a huge step's memo bounded."""
        self._entries = {k: e for k, e in self._entries.items() if e[0]() is not None}

    def __len__(self) -> int:
        return len(self._entries)
