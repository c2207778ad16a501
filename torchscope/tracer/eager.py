"""Running a compiled module's work again, eagerly: the module ``torch.compile`` wrapped, and
the random-number state to run it with. The NaN watch's replay (``watch/replay.py``) and the
eager check of a compiled step (``armed/eager_check.py``) both re-run calls this way; a
compiled module is known by its class name, so that nothing here imports Dynamo."""

from __future__ import annotations

import torch
from torch import nn

RngState = tuple[torch.Tensor, "list[torch.Tensor] | None"]


def is_compiled_module(module: object) -> bool:
    """A module ``torch.compile(module)`` returned (Dynamo's ``OptimizedModule``)."""
    return type(module).__name__ == "OptimizedModule" and isinstance(
        getattr(module, "_orig_mod", None), nn.Module
    )


def eager_module(module: nn.Module) -> nn.Module:
    """The module a compiled one wraps (what runs eagerly); any other module itself."""
    # torch's Module stub types any attribute a Tensor or a Module; _orig_mod is a Module.
    return module._orig_mod if is_compiled_module(module) else module  # type: ignore[return-value]


def rng_state() -> RngState:
    """The CPU generator's state, and every CUDA device's where CUDA is in use."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def set_rng_state(state: RngState) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def drew_random(before: RngState, after: RngState) -> bool:
    """Whether random numbers were drawn between the two states (dropout ran)."""
    if not torch.equal(before[0], after[0]):
        return True
    return (
        before[1] is not None
        and after[1] is not None
        and any(not torch.equal(a, b) for a, b in zip(before[1], after[1], strict=False))
    )
