"""What the NaN watch owns: the always-on check of every step (``nan_watch``), what it captures
of the step to replay it (``capture``), and the traced replay of a bad step that names the
origin (``replay``).

``WatchStop`` (raised from ``optimizer.step()`` under ``on_nan="stop"``) is importable from here
(``stop``, no torch) and from ``torchscope``.
"""

from torchscope.tracer.watch.stop import WatchStop

__all__ = ["WatchStop"]
