"""torchscope: see every forward op and the gradient through every backward node, live.

Importing ``torchscope`` does not import torch; the tracer is loaded on first use so the UI
and the file readers run on machines without torch.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from torchscope.protocol.events import Trace
    from torchscope.tracer.session import Tracer


def trace(
    record: str | os.PathLike | None = None,
    *,
    steps: str | int | None = None,
    values: int = 16,
    keep: bool | int = True,
    optimizer_steps: bool = True,
    optimizer_ops: bool = False,
) -> Tracer:
    """Trace the code in a ``with`` block on this thread.

    record: write a trace file there (nothing touches the disk without it).
    steps: which training steps to trace (``"0-9"``, ``5``, ``"every:100"``); default all.
    values: tensors with at most this many elements keep their values in the summary.
    keep: keep events in memory (``tr.ops``, ``tr.grads``); an int keeps only the newest N.
    optimizer_steps: advance the step index at every ``optimizer.step()``.
    optimizer_ops: also trace the ops inside ``optimizer.step()`` (off by default: they are
        many and rarely what you look for; a NaN the update writes into a weight is still
        reported, at the weight's next use). A step given a closure (LBFGS) is always
        traced: the closure runs the model.
    """
    from torchscope.tracer.session import Tracer

    return Tracer(
        record,
        steps=steps,
        values=values,
        keep=keep,
        optimizer_steps=optimizer_steps,
        optimizer_ops=optimizer_ops,
    )


def step() -> None:
    """Mark the end of a training step (for loops that do not call ``optimizer.step()``)."""
    from torchscope.tracer.session import current_tracer

    tracer = current_tracer()
    if tracer is not None:
        tracer.advance_step()


def load(path: str | os.PathLike) -> Trace:
    """Read a trace file back as the same ``Event`` records ``trace()`` produces."""
    from torchscope.protocol.tracefile import load_trace

    return load_trace(path)


def __getattr__(name: str) -> Any:
    if name == "Tracer":
        from torchscope.tracer.session import Tracer

        return Tracer
    raise AttributeError(f"module 'torchscope' has no attribute {name!r}")


__all__ = ["__version__", "load", "step", "trace"]
