"""What a torch call is, by its function: its name (or noise), whether it writes into its
tensor arguments, which of them are tensors. Shared by the forward recorder, the alert rules
and the backward-call listener; imports nothing of torchscope.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch._functorch.autograd_function import custom_function_call as _custom_function_call
from torch.overrides import resolve_name

BACKWARD_CALLS: dict[Any, str] = {
    torch.Tensor.backward: "Tensor.backward",
    torch.autograd.backward: "torch.autograd.backward",
    torch.autograd.grad: "torch.autograd.grad",
}

# Attribute reads that produce a new tensor are real ops; every other property access
# (shape, grad, requires_grad, grad_fn, ...) is metadata noise.
_TENSOR_PROPERTIES = {"T", "mT", "H", "mH", "real", "imag"}
_NOISE = {
    f"Tensor.{n}"
    for n in """
    dim ndimension size stride numel nelement is_contiguous data_ptr element_size storage_offset
    __len__ __repr__ __format__ __hash__ is_floating_point is_complex get_device __bool__
    __index__ __int__ __float__ __complex__ item tolist untyped_storage _is_view is_set_to
    __reduce_ex__ __deepcopy__ __array__ numpy register_hook register_post_accumulate_grad_hook
    retain_grad requires_grad_ __iter__ __contains__ __dir__ is_shared is_pinned _typed_storage
    storage __setstate__ __getstate__ _version __torch_function__ has_names is_inference
    """.split()
}

op_names: dict[Any, str | None] = {}


def _resolve(func: Any) -> str | None:
    if getattr(func, "__module__", "").startswith("torch.distributed"):
        return "torch.distributed." + getattr(func, "__name__", repr(func))  # all_reduce, ...
    name = resolve_name(func) or getattr(func, "__qualname__", None) or repr(func)
    short = getattr(func, "__name__", None)
    if (
        short
        and name.startswith("torch.")
        and name.count(".") == 1
        and name != "torch." + short
        and getattr(torch, short, None) is func
    ):
        name = "torch." + short  # the name called, not an alias torch.overrides prefers (spmm)
    if name.startswith("torch.Tensor."):
        name = name[6:]
    if name.startswith(("profiler.", "torch.ops.profiler.")):
        return None  # record_function bookkeeping that optimizers and profilers wrap around

    elif name.startswith("_VariableFunctionsClass."):  # torch._foreach_add_ and other privates
        name = "torch." + name[24:]
    if name.endswith((".__get__", ".__set__", ".__delete__")):
        attr = name.rsplit(".", 2)[-2]
        return (
            name[: -len(".__get__")]
            if name.endswith(".__get__") and attr in _TENSOR_PROPERTIES
            else None
        )
    return None if name in _NOISE else name


def op_name(func: Any, args: tuple = ()) -> str | None:
    """Qualified API name (``Tensor.mul``, ``torch.nn.functional.linear``) or None for noise.
    ``args``: the call's, for the one function whose name depends on them."""
    if func is _custom_function_call:
        # Under torch.func a custom autograd.Function's apply reaches the mode as this one
        # operator for every Function, the Function's class first: never cached.
        return apply_name(args[0]) if args and isinstance(args[0], type) else "Function.apply"
    try:
        return op_names[func]
    except KeyError:
        name = op_names[func] = _resolve(func)
        return name
    except TypeError:  # unhashable callable
        return _resolve(func)


def apply_name(function_class: type) -> str:
    """``ScaledTanh.apply``: what the user called."""
    return function_class.__name__ + ".apply"


_INPLACE_DUNDERS = frozenset(
    f"Tensor.__i{op}__"
    for op in "add sub mul truediv floordiv mod pow matmul and or xor lshift rshift".split()
) | {"Tensor.__setitem__"}


def writes_inputs(name: str, kwargs: dict) -> bool:
    """Whether a call may overwrite one of its tensor arguments (``add_``, ``x[i] = v``,
    ``out=``, ``inplace=True``)."""
    return (
        (name.endswith("_") and not name.endswith("__"))
        or name in _INPLACE_DUNDERS
        or (bool(kwargs) and (kwargs.get("out") is not None or bool(kwargs.get("inplace"))))
    )


# In-place calls whose result does not depend on the old values of their first argument: that
# argument's numbers (often uninitialised memory, as under nn.init) are neither summarised nor
# blamed for NaN.
_OVERWRITING_METHODS = frozenset(
    f"Tensor.{n}_"
    for n in "fill zero uniform normal random bernoulli exponential geometric cauchy "
    "log_normal copy".split()
)


def overwrites_first_input(name: str) -> bool:
    """``x.uniform_()``, ``x.copy_(y)``, ``nn.init.kaiming_uniform_(w)``: ``x``/``w``'s old
    values do not matter."""
    return name in _OVERWRITING_METHODS or (
        name.startswith("torch.nn.init.") and name.endswith("_")
    )


def iter_tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """Tensors among call arguments, one level into lists and tuples (``torch.cat([a, b])``)."""
    out = []
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(b for b in a if isinstance(b, torch.Tensor))
    return out


def result_tensors(result: Any) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (list, tuple)):
        return [r for r in result if isinstance(r, torch.Tensor)]
    return []


def nested_tensors(obj: Any, depth: int = 4) -> list[torch.Tensor]:
    """Every tensor in a pytree-like value, in order, each once: lists, tuples, mappings
    (a Hugging Face ``ModelOutput`` is an ``OrderedDict``) and dataclasses, ``depth`` levels
    down. What a model's call returns (``{"loss": loss}``), not a torch call's result: that
    one is a tensor or a flat sequence (``result_tensors``, on the hot path)."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()

    def walk(value: Any, left: int) -> None:
        if isinstance(value, torch.Tensor):
            if id(value) not in seen:
                seen.add(id(value))
                found.append(value)
        elif left <= 0 or isinstance(value, (str, bytes)):
            return
        elif isinstance(value, Mapping):
            for v in value.values():
                walk(v, left - 1)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v, left - 1)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for f in dataclasses.fields(value):
                walk(getattr(value, f.name, None), left - 1)

    walk(obj, depth)
    return found


def has_inf_scalar(args: tuple, kwargs: dict) -> bool:
    """The call was given an infinite float (``masked_fill(mask, -inf)``): its Infs are meant."""
    for a in args:
        if type(a) is float and (a == math.inf or a == -math.inf):
            return True
    if kwargs:
        for a in kwargs.values():
            if type(a) is float and (a == math.inf or a == -math.inf):
                return True
    return False
