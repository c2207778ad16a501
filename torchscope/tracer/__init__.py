"""In-process side of torchscope: forward mode, backward node hooks, summaries, steps."""

from torchscope.tracer.session import Tracer, current_tracer

__all__ = ["Tracer", "current_tracer"]
