"""In-process side of torchscope. Imports no textual.

The public API's side: ``api`` (what ``trace()``, ``serve()``, ``step()`` do) and ``options``
(``Options``, the one options type of trace, serve, ``torchscope run`` and the callbacks).
What runs always, from the job's start (the dormant agent costs nothing until armed):
  ``agent``         arms and disarms at step boundaries; the commands UIs send
  ``served_watch``, ``served_again``  the agent's NaN watch; a second ``serve()``
  ``holders``       who holds the job traced, and their leases
  ``rank_checks``   what one rank checks against the others (origins, replicas, endpoints)
  ``clock``, ``backward_calls``, ``steps``  where steps begin and end; step selections
  ``stepper``       pauses and breakpoints (they outlive an armed period)
  ``outputs``, ``publisher``  where events go: the trace file, the live stream
  ``ranks``, ``errors``  the c10d store's helpers; internal errors said once
What runs while armed: ``armed/`` (the session and one recorder per level).
What the NaN watch owns: ``watch/``.

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
