"""What the tracer needs to know when the job runs in a Jupyter kernel (or any IPython shell).

A notebook's code runs from file names IPython makes up (``/tmp/ipykernel_<pid>/<hash>.py``
in a kernel, ``<ipython-input-4-...>`` in older shells), and its ``sys.argv[0]`` is the
kernel's launcher: neither tells the user anything. IPython itself knows which cell a file
name belongs to (the execution count it compiled it under, the ``In [4]`` of the notebook),
and the notebook server tells the kernel the notebook's path (``JPY_SESSION_NAME``).

Nothing here imports IPython: a job that has not loaded it is no notebook.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from typing import Any

KERNEL_SCRIPT = "ipykernel"  # what `torchscope ls` shows for a kernel whose notebook is unknown


def shell() -> Any:
    """The running IPython shell, or None (not imported, or imported by a plain script)."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return None
    try:
        return ipython.get_ipython()
    except Exception:  # a half-imported or odd IPython: then no notebook
        return None


def cell_of(filename: str) -> int | None:
    """The execution count of the cell that ``filename`` holds (``In [4]``: 4), or None for a
    file that is no cell. IPython's compiler maps every cell's file name to it (it is what
    IPython's own tracebacks show as ``Cell In[4]``)."""
    ip = shell()
    if ip is None:
        return None
    try:
        number = ip.compile._filename_map.get(filename)
    except Exception:  # another shell, another IPython: the plain file name then
        return None
    return number if isinstance(number, int) else None


def kernel_script() -> str | None:
    """What stands for the script of a job that runs in a kernel: the notebook's file name
    where the notebook server or the editor says it, else ``ipykernel``; None outside a
    kernel."""
    ip = shell()
    if ip is None or getattr(ip, "kernel", None) is None:  # a terminal IPython has no kernel
        return None
    path = os.environ.get("JPY_SESSION_NAME")  # set by jupyter_server for the kernel it starts
    if not path:
        user_ns = getattr(ip, "user_ns", None) or {}
        path = user_ns.get("__vsc_ipynb_file__")  # VS Code's notebooks
    if isinstance(path, str) and path.strip():
        return os.path.basename(path.rstrip("/\\")) or path
    return KERNEL_SCRIPT


def after_this_cell(then: Callable[[], None]) -> bool:
    """Call ``then`` once, when the running cell has finished (an error ended it or not): the
    moment between two cells, outside every hook of the job. False outside an IPython shell,
    where nothing is called."""
    ip = shell()
    events = getattr(ip, "events", None)
    if events is None:
        return False

    def once(*_: Any) -> None:
        with contextlib.suppress(Exception):  # already unregistered (a shell reset)
            events.unregister("post_run_cell", once)
        then()

    try:
        events.register("post_run_cell", once)
    except Exception:  # no cell events in this shell: the caller acts at once instead
        return False
    return True
