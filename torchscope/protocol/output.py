"""Writing a whole output file (an export, a snapshot) without harming what the path names.

A regular file, or a path that does not exist yet, is written beside itself and moved over the
path only when complete: a failure leaves the old file whole and no half-written one. A pipe,
a device or ``/dev/fd/N`` (``-o >(gzip > x.gz)``) is written as it is: replacing it would
turn a FIFO into a plain file its reader never sees, or a device node into a file.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
from collections.abc import Iterator
from typing import IO


def is_special(path: str) -> bool:
    """Whether ``path`` names something other than a regular file (a pipe, a device)."""
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False  # not there yet: a new regular file


def same_file(a: str, b: str) -> bool:
    """Whether two paths name one existing file (an export over its own input)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


@contextlib.contextmanager
def replacing(path: str, mode: str = "w") -> Iterator[IO]:
    """The file to write ``path``'s new content to (``mode`` "w" for text, "wb" for bytes)."""
    encoding = None if "b" in mode else "utf-8"
    if is_special(path) or os.path.isdir(path):
        # A directory falls through to open(), which says so in its own words.
        with open(path, mode, encoding=encoding) as f:
            yield f
        return
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, mode, encoding=encoding) as f:
            yield f
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def drop_stdout() -> None:
    """After stdout failed (a closed pipe, a full disk): point it at /dev/null, so the flush
    at exit cannot fail again with a traceback."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
