"""In-process side of torchscope: forward mode, backward node hooks, summaries, steps.

Loaded lazily: ``torchscope.tracer.publisher`` (pyzmq only) stays importable without torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Tracer", "current_tracer"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from torchscope.tracer.armed import session

        return getattr(session, name)
    raise AttributeError(f"module 'torchscope.tracer' has no attribute {name!r}")
