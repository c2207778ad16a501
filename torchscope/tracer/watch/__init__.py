"""What the NaN watch owns: the watch's hooks on every step (``nan_watch``), the check before
each update (``check``) and the norms it reads (``norms``), what it captures of the step to
replay it (``capture``), the traced replay of a bad step that names the origin (``replay``),
and the line it prints (``report``).

``WatchStop`` (raised from ``optimizer.step()`` under ``on_nan="stop"``) is importable from here
(``stop``, no torch) and from ``torchscope``.
"""

from torchscope.tracer.watch.stop import WatchStop

__all__ = ["WatchStop"]
