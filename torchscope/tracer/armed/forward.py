"""Forward ops: a TorchFunctionMode that sees one event per torch API call."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode, resolve_name

if TYPE_CHECKING:
    from torchscope.tracer.armed.session import Tracer

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

_names: dict[Any, str | None] = {}
# Looked up once: __torch_function__ runs for every torch call of the job (dynamo recognises
# the function object itself, however it is reached).
_is_compiling = torch.compiler.is_compiling
_is_tracing = torch._C._is_tracing


def _resolve(func: Any) -> str | None:
    if getattr(func, "__module__", "").startswith("torch.distributed"):
        return "torch.distributed." + getattr(func, "__name__", repr(func))  # all_reduce, ...
    name = resolve_name(func) or getattr(func, "__qualname__", None) or repr(func)
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


def op_name(func: Any) -> str | None:
    """Qualified API name (``Tensor.mul``, ``torch.nn.functional.linear``) or None for noise."""
    try:
        return _names[func]
    except KeyError:
        name = _names[func] = _resolve(func)
        return name
    except TypeError:  # unhashable callable
        return _resolve(func)


class ForwardMode(TorchFunctionMode):
    """Hands every non-noise torch call to the tracer; never alters args or results."""

    def __init__(self, tracer: Tracer) -> None:
        super().__init__()
        self.tracer = tracer
        self.enabled = True

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        # Every torch call of the job comes through here, most of them noise (``p.grad``):
        # that path is one dict lookup.
        if _is_compiling():
            # Dynamo is tracing this call into a torch.compile graph: be transparent, so the
            # graph holds the ops alone (compiled regions are not traced op by op).
            return func(*args, **kwargs) if kwargs else func(*args)
        try:
            name = _names[func]
        except (KeyError, TypeError):
            name = op_name(func)
        if name is None or not self.enabled or _is_tracing():
            # Under torch.jit.trace our reductions would be recorded (and warned about) too.
            return func(*args, **kwargs) if kwargs else func(*args)
        if kwargs is None:
            kwargs = {}
        tracer = self.tracer
        if func in BACKWARD_CALLS:
            return tracer.run_backward(BACKWARD_CALLS[func], func, args, kwargs)
        try:
            pending = tracer.before_op(name, args, kwargs)
        except Exception as exc:
            tracer.report_error("forward op (before)", exc)
            pending = None
        stepper = tracer.stepper
        if pending is not None and stepper is not None and stepper.active:
            pending = tracer.pause_before_op(pending)
        result = func(*args, **kwargs)
        if pending is not None:
            try:
                done = tracer.after_op(pending, args, kwargs, result)
            except Exception as exc:
                tracer.report_error("forward op (after)", exc)
                done = None
            if done is not None and stepper is not None and stepper.active:
                tracer.pause_after_op(pending, *done)
        return result


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
