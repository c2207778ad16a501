"""``torch.distributed`` calls as ops: which tensors they write, in which group.

The forward mode sees ``dist.all_reduce(t)`` and friends as single calls. Most write their
result into a tensor argument in place, and gloo does so without bumping the tensor's version
counter: a summary cached by (identity, version) would show the value from before the
collective. So a collective's written tensors are always summarised afresh, after it returns,
and that summary replaces whatever the memo held for them.

An ``async_op=True`` call returns before the data is there; its written tensors get metadata
only (``pending: true``) and the memo forgets them, so the first op that reads them after
``wait()`` summarises what they really hold.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

# Short names: what each writes. "first": the first argument (a tensor, or a list of them);
# "second": the second argument (gather's list, on the destination rank); "none": nothing.
_WRITES = {
    "all_reduce": "first",
    "broadcast": "first",
    "reduce": "first",
    "recv": "first",
    "irecv": "first",
    "all_gather": "first",
    "all_gather_into_tensor": "first",
    "all_gather_single": "first",  # torch 2.13's name for all_gather_into_tensor
    "reduce_scatter": "first",
    "reduce_scatter_tensor": "first",
    "reduce_scatter_single": "first",  # ... and for reduce_scatter_tensor
    "all_to_all": "first",
    "all_to_all_single": "first",
    "scatter": "first",
    "gather": "second",
    "send": "none",
    "isend": "none",
    "barrier": "none",
}
PREFIX = "torch.distributed."
COLLECTIVES = frozenset(PREFIX + n for n in _WRITES)
_signatures: dict[str, inspect.Signature | None] = {}


def written_tensors(name: str, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors collective ``name`` (qualified) writes, as passed to it."""
    rule = _WRITES.get(name.removeprefix(PREFIX), "none")
    if rule == "none":
        return []
    index = 0 if rule == "first" else 1
    value = args[index] if len(args) > index else _keyword(name, index, kwargs)
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for t in value if isinstance(t, torch.Tensor)]
    return []


def group_size(name: str, args: tuple, kwargs: dict) -> int | None:
    """The size of the process group the call runs in (None if it cannot be told)."""
    import torch.distributed as dist

    try:
        bound = _bind(name, args, kwargs)
        group = bound.arguments.get("group") if bound is not None else kwargs.get("group")
        return dist.get_world_size(group) if dist.is_initialized() else None
    except Exception:  # a group torch no longer knows: the size is only shown
        return None


def is_async(name: str, args: tuple, kwargs: dict, result: Any) -> bool:
    short = name.removeprefix(PREFIX)
    return short in ("isend", "irecv") or (result is not None and hasattr(result, "wait"))


def _keyword(name: str, index: int, kwargs: dict) -> Any:
    sig = _signature(name)
    if sig is None:
        return None
    params = list(sig.parameters)
    return kwargs.get(params[index]) if len(params) > index else None


def _bind(name: str, args: tuple, kwargs: dict) -> inspect.BoundArguments | None:
    sig = _signature(name)
    if sig is None:
        return None
    try:
        return sig.bind_partial(*args, **kwargs)
    except TypeError:
        return None


def _signature(name: str) -> inspect.Signature | None:
    short = name.removeprefix(PREFIX)
    if short not in _signatures:
        import torch.distributed as dist

        try:
            _signatures[short] = inspect.signature(getattr(dist, short))
        except (AttributeError, TypeError, ValueError):
            _signatures[short] = None
    return _signatures[short]


# The collectives' kernels, as a dispatch mode sees them (the aten level): c10d's in-place
# ops under ``torch.distributed.*`` and the functional ones (``_c10d_functional.*``, what
# compiled code and FSDP2 issue). Their outputs hold the result only once the collective
# completes: at ``wait_tensor`` for the functional ones, by the time their op returns for the
# others.
KERNEL_PREFIXES = ("c10d.", "_c10d_functional.")
WAIT_KERNEL = "_c10d_functional.wait_tensor.default"


def kernel_group_size(args: tuple, kwargs: dict) -> int | None:
    """The group size of a collective kernel: from its ProcessGroup argument, or its group
    name (the functional ones); None if neither says."""
    import torch.distributed as dist

    values = (*args, *kwargs.values())
    for value in values:
        if isinstance(value, dist.ProcessGroup):
            return value.size()
        if isinstance(value, torch.ScriptObject):  # c10d ops pass the group boxed
            try:
                return dist.ProcessGroup.unbox(value).size()
            except Exception:  # not a boxed group after all: try the next argument
                continue
    for value in reversed(values):  # the group name comes after the reduce op's name
        if isinstance(value, str):
            try:
                group = dist.distributed_c10d.GroupName(value)  # a NewType: the str itself
                return dist.distributed_c10d._resolve_process_group(group).size()
            except Exception:  # a string that names no group: try the next argument
                continue
    return None
