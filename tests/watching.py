"""What the NaN watch's tests share: a watch that reports into a list, batches from their own
generator, exact comparison of losses, and the ``path:line`` of a line of a test's code."""

from __future__ import annotations

import inspect
import struct

import torch

from torchscope.tracer.watch.nan_watch import NanWatch


def watch(**kw) -> tuple[NanWatch, list[str]]:
    """A watch whose one-line reports go into the list returned beside it."""
    lines: list[str] = []
    return NanWatch(report=lines.append, **kw), lines


def data(step: int, *shape: int) -> torch.Tensor:
    """Batches from their own generator: the global RNG belongs to the model (dropout)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1000 + step))


def bits(values: list[float]) -> list[bytes]:
    """Exact comparison, NaN included."""
    return [struct.pack("<d", v) for v in values]


def line_of(func, needle: str) -> str:
    """``path:N``: the one line of ``func``'s source that holds ``needle``."""
    lines, first = inspect.getsourcelines(func)
    (i,) = [i for i, s in enumerate(lines) if needle in s]
    return f"{inspect.getsourcefile(func)}:{first + i}"
