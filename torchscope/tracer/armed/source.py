"""Which line of the user's code made a call: the first frame outside torch and torchscope
(and outside the code torch generates)."""

from __future__ import annotations

import os
import sys
import sysconfig
from collections.abc import Iterator
from types import CodeType, FrameType, ModuleType

import torch

from torchscope.tracer.notebook import cell_of

# The package's directory from this file's place in it (tracer/armed/): importing the
# top-level package here would make it and the tracer import each other.
TORCHSCOPE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIBRARY_DIRS = (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep, TORCHSCOPE_DIR + os.sep)
# The verdict per file name keeps the frame walk to a dict lookup per frame (file names hash
# once; code objects hash their whole contents at every lookup).
_internal: dict[str, bool] = {}


# Code torch generates is never the user's line: FX graph modules (the eager backend, and
# graph-break code) run from "<eval_with_key>.N", inductor's wrappers from its cache directory
# (torchinductor_<user> under the temp dir, or TORCHINDUCTOR_CACHE_DIR).
_GENERATED_PREFIXES = ("<frozen ", "<eval_with_key>")
_GENERATED_DIR_MARK = os.sep + "torchinductor_"


def is_internal(code: CodeType) -> bool:
    """Code of torch's, torchscope's, or code torch generated."""
    filename = code.co_filename
    verdict = _internal.get(filename)
    if verdict is None:
        verdict = (
            filename.startswith(LIBRARY_DIRS)
            or filename.startswith(_GENERATED_PREFIXES)
            or _GENERATED_DIR_MARK in filename
            or _in_inductor_cache(filename)
        )
        _internal[filename] = verdict
    return verdict


def _in_inductor_cache(filename: str) -> bool:
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not cache:
        return False
    return filename.startswith(os.path.abspath(cache) + os.sep)


def user_frame(depth: int = 2) -> tuple[str, int, str] | None:
    """(path, line, function) of the innermost user frame above the caller, or None."""
    frame: FrameType | None = sys._getframe(depth)
    while frame is not None:
        if not is_internal(frame.f_code):
            return frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name
        frame = frame.f_back
    return None


_TORCHSCOPE_DIR = LIBRARY_DIRS[1]
# FSDP's own code: its collectives' copy-in/copy-out around buffers it fills behind the ops.
FSDP_DIR = os.path.join(LIBRARY_DIRS[0], "distributed", "fsdp") + os.sep


def called_from(directory: str, depth: int = 2) -> bool:
    """Whether the code that made the current call (the first frame above the caller outside
    torchscope) lies under ``directory``. A frame walk: for rare questions, not every op."""
    frame: FrameType | None = sys._getframe(depth)
    while frame is not None and frame.f_code.co_filename.startswith(_TORCHSCOPE_DIR):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.startswith(directory)


# "path:line" per (path, line): the op event's source field, formatted once per call site.
_sites: dict[tuple[str, int], str] = {}


def site_text(filename: str, line: int) -> str:
    """What an event's ``source`` says of a line: ``path:line``, or ``cell 4, line 11`` for a
    notebook cell's code (see :func:`cell_site`)."""
    return cell_site(filename, line) or f"{filename}:{line}"


def cell_site(filename: str, line: int) -> str | None:
    """``cell 4, line 11`` where ``filename`` is a notebook cell's (``In [4]``), else None. The
    one place a cell's made-up file name (``/tmp/ipykernel_<pid>/<hash>.py``) becomes what
    the user sees; never cached: the same cell's text run again keeps its file name under a
    new number."""
    cell = cell_of(filename)
    return None if cell is None else f"cell {cell}, line {line}"


def user_site(depth: int = 2) -> tuple[str, str] | None:
    """``("path:line", function)`` of the innermost user frame above the caller, or None: what
    an op event records, without formatting the same line again at every call."""
    frame: FrameType | None = sys._getframe(depth)
    internal = _internal
    while frame is not None:
        code = frame.f_code
        verdict = internal.get(code.co_filename)  # is_internal, inlined: once per frame
        if verdict is None:
            verdict = is_internal(code)
        if not verdict:
            key = (code.co_filename, frame.f_lineno)
            site = _sites.get(key)
            if site is None:
                cell = cell_site(*key)
                if cell is not None:  # a notebook cell's: not kept (see cell_site)
                    return cell, code.co_name
                if len(_sites) > 100_000:  # generated code (exec) could make lines endless
                    _sites.clear()
                site = _sites[key] = f"{key[0]}:{key[1]}"
            return site, code.co_name
        frame = frame.f_back
    return None


def thread_stack(ident: int, limit: int = 32) -> list[tuple[str, int, str]]:
    """User frames of thread ``ident``, innermost first: the training thread's stack even when
    asked from another thread (backward hooks run on autograd's own thread on CUDA)."""
    frame = sys._current_frames().get(ident)
    out: list[tuple[str, int, str]] = []
    while frame is not None and len(out) < limit:
        if not is_internal(frame.f_code):
            out.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return out


_INSTALLED = os.sep + "site-packages" + os.sep
_INSTALLED_DEBIAN = os.sep + "dist-packages" + os.sep


# The verdict per module file: arming asks for the user's modules (twice), and a process with
# torch loaded holds over a thousand.
_user_files: dict[str, bool] = {}
_library: tuple[str, ...] | None = None  # the standard library's and installed packages' dirs


def user_modules() -> Iterator[ModuleType]:
    """``__main__`` and the modules loaded from outside the standard library, the installed
    packages, torch and torchscope."""
    for name, module in list(sys.modules.items()):
        if not isinstance(module, ModuleType):
            continue
        path = module.__dict__.get("__file__")
        if name == "__main__":
            yield module
        elif isinstance(path, str):
            verdict = _user_files.get(path)
            if verdict is None:
                verdict = _user_files[path] = _is_user_file(path)
            if verdict:
                yield module


def _is_user_file(path: str) -> bool:
    global _library
    if _library is None:
        paths = sysconfig.get_paths()
        where = ("stdlib", "platstdlib", "purelib", "platlib")
        _library = tuple({os.path.abspath(paths[k]) + os.sep for k in where}) + LIBRARY_DIRS
    return (
        not os.path.abspath(path).startswith(_library)
        and _INSTALLED not in path
        and _INSTALLED_DEBIAN not in path
    )
