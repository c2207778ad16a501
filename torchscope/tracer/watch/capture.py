"""What the NaN watch captures of a step, to replay it: each top-level module call with its
inputs, RNG and autocast state, and each top-level ``backward()``.

Shared by the watch (which captures) and the replay (which runs the captured calls again).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch._C._autograd import _get_sequence_nr

# A bad step is replayed at the aten level: the report names the kernel that made the value.
REPLAY_ATEN = True


class Call:
    """One top-level module call of the step."""

    __slots__ = (
        "args",
        "autocast",
        "grad_bytes",
        "handles",
        "kwargs",
        "module",
        "n_out",
        "out_grads",
        "released",
        "rng",
        "seq_hi",
        "seq_lo",
        "target",
        "unit",
        "versions",
        "versions_after",
    )

    def __init__(self, module: nn.Module, args: tuple, kwargs: dict | None) -> None:
        self.module = module
        self.target = replay_target(module)
        self.args = args
        self.kwargs = kwargs
        self.rng = rng_state()
        self.autocast = autocast_state()
        self.seq_lo = _get_sequence_nr()
        self.seq_hi = self.seq_lo
        self.versions = versions_of(args, kwargs)
        self.versions_after: list[int] = []
        self.out_grads: dict[int, torch.Tensor] = {}
        self.grad_bytes = 0
        self.n_out = 0
        self.unit = False  # some output gradient did not fit under the cap
        self.handles: list[Any] = []
        self.released = False

    def release(self) -> None:
        self.released = True
        for h in self.handles:
            h.remove()
        self.handles = []
        self.args = ()
        self.kwargs = None
        self.out_grads = {}
        self.rng = None


class Backward:
    """One top-level ``backward()`` of the step."""

    __slots__ = ("grad_tensors", "inputs", "roots", "source", "user_retains", "values")

    def __init__(self, roots: list[torch.Tensor], kwargs: dict[str, Any], user_retains: bool):
        self.values = [r.detach() for r in roots]  # for the loss check: no graph reference
        self.roots: list[torch.Tensor] | None = None  # set while the watch keeps the graph
        self.grad_tensors = kwargs.get("grad_tensors")
        self.inputs = kwargs.get("inputs")
        self.user_retains = user_retains
        self.source = _call_site()

    def drop_graph(self) -> None:
        self.roots = None
        self.grad_tensors = None
        self.inputs = None


def replay_target(module: nn.Module) -> nn.Module:
    """What the replay calls for a top-level module: the module inside a DDP/DataParallel
    wrapper (its forward would run collectives) or a ``torch.compile`` wrapper (traced eagerly)."""
    seen = 0
    while seen < 8:
        seen += 1
        cls = type(module).__name__
        if cls in ("DistributedDataParallel", "DataParallel") and isinstance(
            getattr(module, "module", None), nn.Module
        ):
            module = module.module
        elif cls == "OptimizedModule" and isinstance(getattr(module, "_orig_mod", None), nn.Module):
            module = module._orig_mod
        else:
            break
    return module


def tensors_in(obj: Any, depth: int = 0) -> list[torch.Tensor]:
    """Tensors in a call's output or arguments, in a fixed order: tuples, lists, dicts (a
    ``ModelOutput`` is one), three levels deep."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth >= 3:
        return []
    out: list[torch.Tensor] = []
    if isinstance(obj, dict):
        for v in obj.values():
            out.extend(tensors_in(v, depth + 1))
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            out.extend(tensors_in(v, depth + 1))
    return out


def versions_of(args: tuple, kwargs: dict | None) -> list[int]:
    return [t._version for t in tensors_in((args, kwargs or {}))]


def rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    cuda = None
    if torch.cuda.is_initialized():
        cuda = torch.cuda.get_rng_state_all()
    return torch.get_rng_state(), cuda


def set_rng_state(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


_AUTOCAST_DEVICES = ("cuda", "cpu")


def autocast_state() -> tuple[tuple[str, torch.dtype], ...]:
    """(device type, dtype) of each autocast that is on; () almost always."""
    on = []
    for dev in _AUTOCAST_DEVICES:
        if torch.is_autocast_enabled(dev):
            on.append((dev, torch.get_autocast_dtype(dev)))
    return tuple(on)


def _call_site() -> str | None:
    """``file:line`` of the user's ``backward()`` call."""
    from torchscope.tracer.armed.source import user_frame

    frame = user_frame(2)
    return f"{frame[0]}:{frame[1]}" if frame else None
