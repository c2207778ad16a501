"""The ground endpoints and keys stand on: this user's private runtime directory, private files
in it, whether a process lives, and how a ``tcp://`` address splits.

The runtime directory (mode 0700, ours) holds the ``ipc://`` sockets of traced processes, the
session registry (``sessions/``, :mod:`torchscope.protocol.endpoints`) and the per-session
CURVE key files (:mod:`torchscope.protocol.security`); both modules build on this one, and
this one on nothing of theirs.

Imports neither torch nor textual nor zmq.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import stat
import time
from pathlib import Path

ENV_RUNTIME_DIR = "TORCHSCOPE_RUNTIME_DIR"

__all__ = [
    "ENV_RUNTIME_DIR",
    "EndpointError",
    "pid_alive",
    "runtime_dir",
    "sessions_dir",
    "split_tcp",
    "write_private",
]


class EndpointError(RuntimeError):
    """A runtime directory, registry or address we refuse to use. The text is one line."""


# -- the private runtime directory ------------------------------------------------------------
def _uid() -> int | None:
    return os.getuid() if hasattr(os, "getuid") else None


def _xdg_usable(base: str) -> bool:
    """``$XDG_RUNTIME_DIR`` is only worth using when it is a directory of ours we can write."""
    try:
        st = os.stat(base)
    except OSError:
        return False
    uid = _uid()
    return (
        stat.S_ISDIR(st.st_mode)
        and (uid is None or st.st_uid == uid)
        and os.access(base, os.W_OK | os.X_OK)
    )


def _private_dir(path: Path) -> Path:
    """Create ``path`` with mode 0700, or check that the existing one is ours and private.

    We never "fix" a directory we did not create: a foreign or shared directory may be a trap
    (another user could read our sockets or plant records), so we refuse and say why.
    """
    created = False
    try:
        os.mkdir(path, 0o700)
        created = True
    except FileExistsError:
        pass
    except FileNotFoundError:
        try:
            os.makedirs(path.parent, 0o700, exist_ok=True)
            os.mkdir(path, 0o700)
            created = True
        except FileExistsError:
            pass
        except OSError as exc:
            raise EndpointError(
                f"cannot create torchscope runtime directory {path}: {exc.strerror or exc}"
            ) from None
    except OSError as exc:
        raise EndpointError(
            f"cannot create torchscope runtime directory {path}: {exc.strerror or exc}"
        ) from None
    try:
        st = os.lstat(path)  # lstat: a symlink planted by someone else must not be followed
    except OSError as exc:
        raise EndpointError(f"cannot inspect {path}: {exc.strerror or exc}") from None
    hint = f"remove it or set {ENV_RUNTIME_DIR} to a private directory"
    if stat.S_ISLNK(st.st_mode):
        raise EndpointError(f"refusing to use {path}: it is a symbolic link; {hint}")
    if not stat.S_ISDIR(st.st_mode):
        raise EndpointError(f"refusing to use {path}: it is not a directory; {hint}")
    uid = _uid()
    if uid is not None and st.st_uid != uid:
        raise EndpointError(
            f"refusing to use {path}: it is owned by uid {st.st_uid}, not by you (uid {uid}); "
            f"{hint}"
        )
    if created and stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)  # an odd umask may have taken owner bits away; this one is ours
    elif uid is not None and st.st_mode & 0o077:
        raise EndpointError(
            f"refusing to use {path}: its mode is {stat.S_IMODE(st.st_mode):04o}, so other "
            f"users can reach it; run 'chmod 700 {path}' or {hint}"
        )
    return path


def runtime_dir() -> Path:
    """This user's private torchscope directory, created 0700 if needed.

    ``$TORCHSCOPE_RUNTIME_DIR`` if set, else ``$XDG_RUNTIME_DIR/torchscope`` when that base is
    usable, else ``/tmp/torchscope-<uid>``. Raises EndpointError rather than use a directory
    that is not ours or is open to other users.
    """
    override = os.environ.get(ENV_RUNTIME_DIR)
    if override:
        path = Path(override).expanduser().absolute()
    else:
        xdg = os.environ.get("XDG_RUNTIME_DIR")
        if xdg and os.path.isabs(xdg) and _xdg_usable(xdg):
            path = Path(xdg) / "torchscope"
        else:
            # Literally /tmp, not $TMPDIR: ipc paths must stay short (see endpoints.MAX_IPC_PATH).
            uid = _uid()
            path = Path("/tmp") / f"torchscope-{uid if uid is not None else getpass.getuser()}"
    return _private_dir(path)


def sessions_dir() -> Path:
    """``<runtime_dir>/sessions``, where each running traced process has one JSON record."""
    return _private_dir(runtime_dir() / "sessions")


def write_private(final: Path, data: bytes) -> None:
    """Write ``data`` to ``final``, mode 0600, atomically (a temp file beside it, renamed):
    a reader never sees half a file, and a link planted at the temp name is not followed."""
    tmp = final.parent / f".{final.name}.{os.getpid()}.{time.monotonic_ns()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# -- processes --------------------------------------------------------------------------------
def _process_start_time(pid: int) -> float | None:
    """Unix time at which ``pid`` started (Linux /proc), or None when unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat_line = fh.read()
        # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
        fields = stat_line[stat_line.rindex(b")") + 2 :].split()
        ticks = int(fields[19])  # field 22 overall: starttime, in clock ticks after boot
        with open("/proc/stat", "rb") as fh:
            for line in fh:
                if line.startswith(b"btime "):
                    return int(line.split()[1]) + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        pass
    return None


def pid_alive(pid: int, started: float | None = None) -> bool:
    """Whether ``pid`` runs, and (if ``started`` is given) is not a newer process that
    happens to reuse the number of a dead one."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, belongs to someone else
    except OSError:
        return False
    if started:
        began = _process_start_time(pid)
        # The session event is written after the process started; a process that began
        # later than the record is another one with the same pid. (2 s of slack: clock ticks.)
        if began is not None and began > started + 2.0:
            return False
    return True


# -- addresses --------------------------------------------------------------------------------
def split_tcp(addr: str) -> tuple[str, str | None]:
    """``tcp://HOST[:PORT]`` → (HOST without brackets, PORT or None)."""
    rest = addr[len("tcp://") :]
    if rest.startswith("["):
        host, sep, tail = rest[1:].partition("]")
        if not sep or (tail and not tail.startswith(":")):
            raise EndpointError(f"malformed tcp address {addr!r}")
        return host, (tail[1:] if tail else None)
    if rest.count(":") > 1:
        raise EndpointError(f"malformed tcp address {addr!r}: put an IPv6 host in [brackets]")
    host, sep, port = rest.partition(":")
    return host, (port if sep else None)
