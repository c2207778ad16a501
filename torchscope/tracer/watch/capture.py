"""What the NaN watch captures of a step, to replay it: each top-level module call with its
inputs, RNG and autocast state, and each top-level ``backward()``.

Shared by the watch (which captures) and the replay (which runs the captured calls again).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._C._autograd import _get_sequence_nr

from torchscope.tracer.armed.backward import node_name
from torchscope.tracer.armed.source import site_text, user_frame
from torchscope.tracer.eager import RngState, eager_module, is_compiled_module, rng_state

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
        "site",
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
        self.rng: RngState | None = rng_state()  # None once released
        self.autocast = autocast_state()
        self.seq_lo = _get_sequence_nr()
        self.seq_hi = self.seq_lo
        self.versions = versions_of(args, kwargs)
        # (path, line, function) of the user's line that called the module: a replay runs it
        # again from there (see replay.called_at), not from the optimizer.step() it runs under
        self.site = user_frame(2)
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

    __slots__ = (
        "grad_tensors",
        "inputs",
        "marks",
        "roots",
        "scale",
        "scaler",
        "source",
        "unscaled",
        "user_retains",
        "values",
    )

    def __init__(
        self,
        roots: list[torch.Tensor],
        kwargs: dict[str, Any],
        user_retains: bool,
        scaled: tuple[list[torch.Tensor], Any] | None = None,
    ):
        # Under a loss scaler (``scaler.scale(loss).backward()``): the loss as the job computed
        # it, before scaling -- what the check reads, and where a replay starts from.
        self.unscaled: list[torch.Tensor] | None
        self.scaler: Any
        self.unscaled, self.scaler = scaled if scaled is not None else (None, None)
        self.scale: Any = None  # the scale this backward ran with (a tensor), when scaled
        # for the loss check: no graph reference
        self.values = [r.detach() for r in (self.unscaled or roots)]
        self.roots: list[torch.Tensor] | None = None  # set while the watch keeps the graph
        self.grad_tensors = kwargs.get("grad_tensors")
        self.inputs = kwargs.get("inputs")
        self.user_retains = user_retains
        self.source = _call_site()
        self.marks: LoopMarks | None = None  # set when the graph cannot be kept (compiled)

    def drop_graph(self) -> None:
        self.roots = None
        self.unscaled = None
        self.grad_tensors = None
        self.inputs = None
        if self.marks is not None:
            self.marks.release()
            self.marks = None


# Loop code is a loss and a few ops: a graph walk that finds more stops marking there.
MAX_LOOP_NODES = 256


class LoopMarks:
    """The loop code's part of one ``backward()`` whose graph cannot be kept for a replay (a
    model compiled with AOT autograd refuses ``retain_graph``): each node between the roots
    and the module calls' own nodes (outside every call's sequence-number window) is marked
    as it runs with whether the gradients it got, and those it sent, are finite. The flags
    stay on the device and are read only at a detection: the first node that got finite
    gradients and sent non-finite ones is where the backward first shows a loop-code NaN."""

    __slots__ = ("flags", "handles", "truncated")

    def __init__(self, roots: list[torch.Tensor], windows: list[tuple[int, int]]) -> None:
        self.flags: list[tuple[str, torch.Tensor]] = []  # (node name, flags_of(got, sent))
        self.handles: list[Any] = []
        nodes, self.truncated = loop_nodes(roots, windows)
        for node in nodes:
            self.handles.append(node.register_hook(self._marker(node_name(node))))

    def _marker(self, name: str) -> Any:
        flags = self.flags

        def mark(sent: tuple, got: tuple) -> None:  # a node post-hook: (grad_inputs, outputs)
            with torch.no_grad(), torch._C.DisableTorchFunction():
                ok = flags_of(got, sent)
            if ok is not None:
                flags.append((name, ok))

        return mark

    def first_poisoned(self) -> tuple[str, str] | None:
        """(node name, "nan" or "inf") of the first node, in the order the backward ran
        them, that got finite gradients and sent a non-finite one."""
        with torch.no_grad(), torch._C.DisableTorchFunction():
            for name, ok in self.flags:
                got_finite, sent_finite, sent_nan_free = ok.tolist()
                if got_finite and not sent_finite:
                    return name, "inf" if sent_nan_free else "nan"
        return None

    def release(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        self.flags = []


def loop_nodes(roots: list[torch.Tensor], windows: list[tuple[int, int]]) -> tuple[list, bool]:
    """The nodes reachable from ``roots`` without entering a module call's own nodes (whose
    sequence numbers fall in one of ``windows``) or a leaf's ``AccumulateGrad``; and whether
    the walk stopped at ``MAX_LOOP_NODES``."""
    found: list[Any] = []  # holds the wrappers: their ids stay unique meanwhile
    seen: set[int] = set()
    todo = [r.grad_fn for r in roots if r.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen or hasattr(node, "variable"):
            continue
        seen.add(id(node))
        seq = node._sequence_nr()
        if any(lo <= seq < hi for lo, hi in windows):
            continue
        if len(found) >= MAX_LOOP_NODES:
            return found, True
        found.append(node)
        todo.extend(n for n, _ in node.next_functions if n is not None)
    return found, False


def flags_of(got: tuple, sent: tuple) -> torch.Tensor | None:
    """``[got all finite, sent all finite, sent free of NaN]`` as a bool tensor on their
    device, with no host sync; None when neither holds a floating-point tensor."""
    got_floats, sent_floats = _floats(got), _floats(sent)
    device = next((t.device for t in (*got_floats, *sent_floats)), None)
    if device is None:
        return None

    def every(ts: list[torch.Tensor], test: Any) -> torch.Tensor:
        if not ts:
            return torch.ones((), dtype=torch.bool, device=device)
        return torch.stack([test(t).all().to(device) for t in ts]).all()

    def nan_free(t: torch.Tensor) -> torch.Tensor:
        return ~torch.isnan(t)

    return torch.stack(
        [
            every(got_floats, torch.isfinite),
            every(sent_floats, torch.isfinite),
            every(sent_floats, nan_free),
        ]
    )


def _floats(grads: tuple) -> list[torch.Tensor]:
    return [
        g
        for g in grads
        if isinstance(g, torch.Tensor)
        and (g.is_floating_point() or g.is_complex())
        and g.layout == torch.strided
    ]


def replay_target(module: nn.Module) -> nn.Module:
    """What the replay calls for a top-level module: the module inside a DDP/DataParallel
    wrapper (its forward would run collectives) or a ``torch.compile`` wrapper (traced eagerly)."""
    seen = 0
    while seen < 8:
        seen += 1
        cls = type(module).__name__
        wrapped = cls in ("DistributedDataParallel", "DataParallel")
        inner = getattr(module, "module", None) if wrapped else None
        if isinstance(inner, nn.Module):
            module = inner
        elif is_compiled_module(module):
            module = eager_module(module)
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


_AUTOCAST_DEVICES = ("cuda", "cpu")


def autocast_state() -> tuple[tuple[str, torch.dtype], ...]:
    """(device type, dtype) of each autocast that is on; () almost always."""
    on = []
    for dev in _AUTOCAST_DEVICES:
        if torch.is_autocast_enabled(dev):
            on.append((dev, torch.get_autocast_dtype(dev)))
    return tuple(on)


def _call_site() -> str | None:
    """``file:line`` (``cell 4, line 11`` in a notebook) of the user's ``backward()`` call."""
    frame = user_frame(2)
    return site_text(frame[0], frame[1]) if frame else None


@dataclass
class StepCaptures:
    """What the watch has captured of the step so far (dropped when the step is checked)."""

    calls: list[Call] = field(default_factory=list)  # the top-level module calls
    backwards: list[Backward] = field(default_factory=list)  # the top-level backward() calls
    pending: Call | None = None  # a top-level call whose forward is running
    current_backward: Backward | None = None  # the backward() running now
    overflow: bool = False  # more calls than the watch keeps (``max_calls``)
    unseen_backward: bool = False  # a backward() whose roots the watch could not see
    fsdp: bool = False  # a top-level call of an FSDP module: replayed by every rank together
    grad_bytes: int = 0  # the output gradients held, against ``capture_bytes``
