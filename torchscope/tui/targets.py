"""What ``torchscope tui`` / ``replay`` may open: one rule, checked before the screen opens.

An unusable target is a one-line error (exit 2) before any escape code is written: a file
that is not a trace, a pid with no process, ``replay`` given a pid, output that is not a
terminal. Waiting is only for a session that may yet start: no target with nothing running
yet, or the pid of a job that is still starting (run by ``torchscope run``); the pid of any
other process is an error that says how to make it a torchscope job. The status bar says
what it waits for. ``--wait`` waits for any pid or endpoint.

Several targets (``tui t.rank0.tsc t.rank1.tsc``, ``tui A.tsc B.tsc``, a quoted glob) follow
the same rule, each of them; their trace files are also opened (header and index) before the
screen opens, so a damaged one among several is refused by name.
"""

from __future__ import annotations

import os
import sys
from typing import Protocol

__all__ = ["check_target", "check_targets", "is_trace_file"]

_MAGIC = b"TSCTRACE"  # torchscope.protocol.tracefile.MAGIC (read without importing zmq)


class Terminal(Protocol):
    """A stream the UI would draw on or read from; only whether it is a terminal counts
    (the browser UI passes a stand-in for its pipes)."""

    def isatty(self) -> bool: ...


def is_trace_file(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(_MAGIC)) == _MAGIC
    except OSError:
        return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return pid > 0  # someone else's process (it exists), or an absurd number
    except OSError:
        return False
    return True


def _argv(pid: int) -> list[str] | None:
    """The process's command line; None where it cannot be read (no /proc: not Linux)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return raw.decode(errors="replace").split("\0")


def _parent_pid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        return int(stat.rsplit(")", 1)[1].split()[1])  # after "pid (comm) state"
    except (OSError, IndexError, ValueError):
        return None


def _runs_torchscope(argv: list[str]) -> bool:
    """``torchscope run ...``, ``python /venv/bin/torchscope run``, ``python -m torchscope``."""
    for i, arg in enumerate(argv[:3]):
        if os.path.basename(arg) == "torchscope":
            return True
        if arg == "-m" and i + 1 < len(argv) and argv[i + 1] in ("torchscope", "torchscope.cli"):
            return True
    return False


def _may_be_a_session(pid: int) -> bool:
    """A live pid the UI may wait for: a session already, or a job still starting (run by
    ``torchscope run``, itself or its parent: torch takes seconds to import before the job
    registers). Where the command line cannot be read, give it the benefit of the doubt."""
    from torchscope.protocol.endpoints import list_sessions

    if any(rec.pid == pid for rec in list_sessions()):
        return True
    argv = _argv(pid)
    if argv is None:
        return True
    parent = _parent_pid(pid)
    parent_argv = _argv(parent) if parent is not None else None
    return _runs_torchscope(argv) or (parent_argv is not None and _runs_torchscope(parent_argv))


def check_target(
    command: str,
    target: str | None,
    *,
    wait: bool = False,
    stdin: Terminal | None = None,
    stdout: Terminal | None = None,
) -> str | None:
    """None when the UI can open on ``target``; otherwise the one-line reason it cannot."""
    problem = target_problem(command, target, wait)
    if problem is not None:
        return problem
    return _terminal_problem(stdin, stdout)


def check_targets(
    command: str,
    targets: list[str] | None,
    *,
    wait: bool = False,
    stdin: Terminal | None = None,
    stdout: Terminal | None = None,
) -> str | None:
    """``check_target`` for the command line's targets, one or several."""
    targets = list(targets or ())
    if len(targets) > 1 or any(c in t for t in targets for c in "*?["):
        from torchscope.tui.sources.open import check_files, expand_targets

        targets = expand_targets(targets)
        if len(targets) > 1:
            for t in targets:
                problem = target_problem(command, t, wait)
                if problem is not None:
                    return problem
            problem = check_files(targets)
            if problem is not None:
                return problem
            return _terminal_problem(stdin, stdout)
    return check_target(
        command, targets[0] if targets else None, wait=wait, stdin=stdin, stdout=stdout
    )


def _terminal_problem(stdin: Terminal | None, stdout: Terminal | None) -> str | None:
    stdin = sys.stdin if stdin is None else stdin
    stdout = sys.stdout if stdout is None else stdout
    for name, stream in (("output", stdout), ("input", stdin)):
        try:
            tty = stream.isatty()
        except (AttributeError, ValueError):
            tty = False
        if not tty:
            return (
                f"the terminal UI needs a terminal, and its {name} is not one "
                "(for text: torchscope dump FILE)"
            )
    return None


def _tcp_problem(target: str, timeout: float = 3.0) -> str | None:
    """Whether anything listens at a ``tcp://host:port`` endpoint (ZeroMQ would connect in
    the background for ever, and the UI open on a session that is not there)."""
    import socket

    from torchscope.protocol.runtime import EndpointError, split_tcp

    try:
        host, port = split_tcp(target)
    except EndpointError:
        host, port = "", None
    if not host or host == "*" or port is None or not port.isdigit():
        return f"{target}: expected tcp://HOST:PORT"
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return None
    except OSError as exc:
        why = (
            "nothing listens there"
            if isinstance(exc, ConnectionRefusedError)
            else (exc.strerror or str(exc) or type(exc).__name__)
        )
        return f"{target}: cannot connect: {why} (is the job running? --wait waits for it)"


def target_problem(command: str, target: str | None, wait: bool) -> str | None:
    if command == "replay":
        if target is None or not os.path.isfile(target):
            hint = f"; for a live session: torchscope tui {target}" if target else ""
            return f"{target}: replay takes a trace file (no such file){hint}"
        if not is_trace_file(target):
            return f"{target}: not a torchscope trace file (record one with --record FILE)"
        return None
    if target is None:
        return None  # waits for the one session, and says so
    if target.startswith(("ipc://", "tcp://")):
        if target.startswith("ipc://") and not wait:
            path = target[len("ipc://") :]
            if not os.path.exists(path):
                return f"{target}: no such socket (is the job running? --wait waits for it)"
        if target.startswith("tcp://") and not wait:
            return _tcp_problem(target)
        return None
    if target.isdigit():
        pid = int(target)
        if wait:
            return None
        if not _pid_alive(pid):
            return f"no process with pid {pid} (torchscope ls lists sessions; --wait waits)"
        if not _may_be_a_session(pid):
            return (
                f"{pid} is not a torchscope job: start it with `torchscope run SCRIPT` or call "
                "torchscope.serve() in it (torchscope ls lists jobs; --wait waits for this one)"
            )
        return None
    if os.path.isdir(target):
        return f"{target}: a directory, not a trace file"
    if os.path.exists(target):
        if not is_trace_file(target):
            hint = (
                " (to trace a script: torchscope run " + target + ")"
                if target.endswith(".py")
                else ""
            )
            return f"{target}: not a torchscope trace file{hint}"
        return None
    return f"{target}: no such trace file, endpoint or pid"
