"""Where a traced job listens, and how a UI finds it.

Each traced process binds two ZeroMQ sockets (events PUB, control ROUTER) and writes a small
JSON record into a per-user registry, ``<runtime_dir>/sessions/``, so that ``torchscope ls`` and
the UI can find it without being told an address. Security rests on the runtime directory:
it is private (0700, ours), so only our user can reach the ``ipc://`` sockets inside it. Every
TCP bind is CURVE (:mod:`torchscope.protocol.security`): on loopback with keys the job makes and
keeps in the runtime directory, on a public address with the user's keys (refused without);
every bind goes through :func:`check_bind_address`.

A process that dies without closing leaves its record, its ``ipc://`` socket files and its
session key file behind: :func:`list_sessions` (``torchscope ls``, ``tui``) removes those of
processes that are gone, and :func:`cleanup_process` is what a SIGTERM handler calls to
remove its own before exiting.

Imports neither torch nor textual nor zmq (a non-loopback bind loads keys, which uses zmq).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import socket
import stat
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torchscope.protocol.runtime import (
    ENV_RUNTIME_DIR,
    EndpointError,
    pid_alive,
    runtime_dir,
    sessions_dir,
    split_tcp,
    write_private,
)

ENV_BIND = "TORCHSCOPE_BIND"

# Linux's sockaddr_un.sun_path is 108 bytes including the NUL; libzmq refuses longer paths
# with an obscure "File name too long". We say it ourselves (macOS allows only 103).
MAX_IPC_PATH = 103 if sys.platform == "darwin" else 107

# A registry record is a few hundred bytes; anything much bigger is not ours.
MAX_RECORD_BYTES = 64 * 1024

RECORD_VERSION = 1


# -- addresses --------------------------------------------------------------------------------
def _digits(text: str) -> bool:
    """Only ASCII digits: ``"²".isdigit()`` is true, and ``int("²")`` fails."""
    return text.isascii() and text.isdigit()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # an interface name or hostname might mean any address: not provably safe


def is_public_tcp(addr: str | None) -> bool:
    """Whether ``addr`` is a tcp endpoint other machines may reach (not provably loopback):
    such an endpoint is bound, and connected to, with CURVE."""
    if not addr or not addr.startswith("tcp://"):
        return False
    try:
        host, _ = split_tcp(addr)
    except EndpointError:
        return True
    return not _is_loopback(host)


def check_bind_address(addr: str, *, server_keys: Any = None) -> str:
    """Validate an endpoint this process is about to *bind*; return it normalised.

    ``ipc://PATH`` (short enough for a Unix socket) and ``tcp://`` on a loopback address are
    allowed as they are. Anything reachable from other machines needs CURVE keys: allowed
    when ``server_keys`` (a ``security.ServerKeys``) is given or the key directory holds valid
    ones (the publisher then binds it as a CURVE server); else a one-line EndpointError
    (``security.SecurityError``) saying to run ``torchscope keys``.
    """
    if not isinstance(addr, str) or not addr:
        raise EndpointError(f"not an endpoint: {addr!r}")
    if addr.startswith("ipc://"):
        path = addr[len("ipc://") :]
        if not path or path == "*":
            raise EndpointError(f"ipc endpoint {addr!r} needs a socket path")
        if len(os.fsencode(path)) > MAX_IPC_PATH:
            raise EndpointError(
                f"ipc socket path {path} is longer than {MAX_IPC_PATH} bytes, the limit for "
                f"Unix sockets; set {ENV_RUNTIME_DIR} to a shorter directory"
            )
        return addr
    if addr.startswith("tcp://"):
        host, port = split_tcp(addr)
        if port is None or not (port == "*" or (_digits(port) and 0 < int(port) < 65536)):
            raise EndpointError(f"tcp address {addr!r} needs a port (1-65535) or ':*'")
        if not _is_loopback(host) and server_keys is None:
            from torchscope.protocol import security  # imports zmq: only for public binds

            security.load_server_keys(endpoint=addr)
        if host == "localhost":
            host = "127.0.0.1"  # libzmq binds interfaces or literal addresses, not host names
        return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
    scheme = addr.split("://", 1)[0] if "://" in addr else addr
    raise EndpointError(f"unsupported endpoint {addr!r} ({scheme}): use ipc:// or tcp://")


def default_endpoints(pid: int | None = None, rank: int | None = None) -> tuple[str, str]:
    """(events, control) endpoints this process should bind.

    Default: ``ipc://<runtime_dir>/<pid>[-<rank>].events|.control``. With
    ``TORCHSCOPE_BIND=tcp://127.0.0.1[:PORT]``: loopback TCP, events on a random port, control
    on PORT (+ rank, so the ranks of one host do not collide) or a random one. The actual
    random ports are known after binding; the UI learns them from the registry or ``hello``.
    ``TORCHSCOPE_BIND=tcp://0.0.0.0:PORT`` (any non-loopback host) is the same with CURVE, and
    refused without keys (see :func:`check_bind_address`).
    """
    pid = os.getpid() if pid is None else pid
    bind = os.environ.get(ENV_BIND, "").strip()
    if not bind or bind in ("ipc", "ipc://"):
        name = f"{pid}" if rank is None else f"{pid}-{rank}"
        base = runtime_dir() / name
        return (
            check_bind_address(f"ipc://{base}.events"),
            check_bind_address(f"ipc://{base}.control"),
        )
    if bind.startswith("tcp://"):
        host, port = split_tcp(bind)
        hostpart = f"[{host}]" if ":" in host else host
        if port in (None, "", "*", "0"):  # 0: any free port, as bind(2) means it
            control_port = "*"
        elif _digits(port):
            control_port = str(int(port) + (rank or 0))
        else:
            raise EndpointError(f"{ENV_BIND}={bind!r}: the port must be a number")
        # Control first: a refusal then names the address the user wrote.
        control = check_bind_address(f"tcp://{hostpart}:{control_port}")
        return check_bind_address(f"tcp://{hostpart}:*"), control
    raise EndpointError(
        f"{ENV_BIND}={bind!r} is not understood: use tcp://127.0.0.1[:PORT] (or a public "
        f"address, with CURVE keys: `torchscope keys`) or leave it unset"
    )


def ipc_path(endpoint: str | None) -> Path | None:
    """The socket file of an ``ipc://`` endpoint, else None."""
    if endpoint and endpoint.startswith("ipc://"):
        return Path(endpoint[len("ipc://") :])
    return None


# -- session records --------------------------------------------------------------------------
def _opt_int(d: dict, key: str, lo: int) -> int | None:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ValueError(f"{key!r} must be an integer >= {lo} or null")
    return v


def _opt_str(d: dict, key: str) -> str | None:
    v = d.get(key)
    if v is not None and not isinstance(v, str):
        raise ValueError(f"{key!r} must be a string or null")
    return v


@dataclass(kw_only=True)
class SessionRecord:
    """One traced process as the registry knows it.

    ``pid`` 0 means unknown: a record built from a bare endpoint by :func:`resolve`.
    ``events`` None means "ask the control socket" (``hello`` names it).
    """

    pid: int = 0
    rank: int | None = None
    world_size: int | None = None
    job: str | None = None  # the same for every rank of one torchrun job
    script: str | None = None
    argv: list[str] = field(default_factory=list)
    host: str = ""
    started: float = 0.0
    events: str | None = None
    control: str = ""
    path: str | None = None  # the registry file; not stored inside it

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        del d["path"]
        d["v"] = RECORD_VERSION
        return d

    @classmethod
    def from_dict(cls, d: Any, path: str | None = None) -> SessionRecord:
        """Build from untrusted data (a registry file); ValueError with one line if invalid."""
        if not isinstance(d, dict):
            raise ValueError(f"session record is a {type(d).__name__}, expected an object")
        if d.get("v", RECORD_VERSION) != RECORD_VERSION:
            raise ValueError(f"session record version {d.get('v')!r} is not supported")
        pid = d.get("pid")
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            raise ValueError("'pid' must be a positive integer")
        argv = d.get("argv", [])
        if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
            raise ValueError("'argv' must be a list of strings")
        started = d.get("started", 0.0)
        if not isinstance(started, (int, float)) or isinstance(started, bool):
            raise ValueError("'started' must be a number")
        control = d.get("control")
        if not isinstance(control, str) or not control.startswith(("ipc://", "tcp://")):
            raise ValueError("'control' must be an ipc:// or tcp:// endpoint")
        events = _opt_str(d, "events")
        if events is not None and not events.startswith(("ipc://", "tcp://")):
            raise ValueError("'events' must be an ipc:// or tcp:// endpoint or null")
        return cls(
            pid=pid,
            rank=_opt_int(d, "rank", 0),
            world_size=_opt_int(d, "world_size", 1),
            job=_opt_str(d, "job"),
            script=_opt_str(d, "script"),
            argv=list(argv),
            host=_opt_str(d, "host") or "",
            started=float(started),
            events=events,
            control=control,
            path=path,
        )

    @classmethod
    def from_session(
        cls, session: dict[str, Any], *, events: str | None, control: str
    ) -> SessionRecord:
        """Record of this process, from the tracer's ``session`` event."""

        def num(key: str) -> int | None:
            v = session.get(key)
            return v if isinstance(v, int) and not isinstance(v, bool) else None

        def text(key: str) -> str | None:
            v = session.get(key)
            return v if isinstance(v, str) else None

        argv = session.get("argv")
        started = session.get("started")
        host = text("host")
        return cls(
            pid=num("pid") or os.getpid(),
            rank=num("rank"),
            world_size=num("world_size"),
            job=text("job"),
            script=text("script"),
            argv=[str(a) for a in argv] if isinstance(argv, (list, tuple)) else list(sys.argv),
            host=host if host is not None else _hostname(),
            started=float(started) if isinstance(started, (int, float)) else time.time(),
            events=events,
            control=control,
        )

    def describe(self) -> str:
        """Short one-line label: ``pid 123 rank 0 train.py``."""
        parts = [f"pid {self.pid}" if self.pid else self.control]
        if self.rank is not None:
            parts.append(f"rank {self.rank}")
            if self.world_size:
                parts[-1] += f"/{self.world_size}"
        if self.script:
            parts.append(os.path.basename(self.script))
        return " ".join(parts)


def _describe_job(ranks: list[SessionRecord]) -> str:
    if len(ranks) == 1:
        return ranks[0].describe()
    pids = ",".join(str(r.pid) for r in ranks)
    script = os.path.basename(ranks[0].script or "") or "?"
    return f"pids {pids} ({len(ranks)} ranks) {script}"


def _hostname() -> str:
    try:
        return socket.gethostname()
    except OSError:
        return ""


def _record_name(record: SessionRecord) -> str:
    return f"{record.pid}-{record.rank or 0}.json"


def register(record: SessionRecord) -> Path:
    """Write ``record`` into the registry atomically (temp file, mode 0600, rename).

    Readers never see a half-written file: they only look at ``*.json`` names, and the rename
    replaces the old file in one step. Sets and returns ``record.path``.
    """
    final = sessions_dir() / _record_name(record)
    write_private(final, json.dumps(record.to_dict()).encode())
    record.path = str(final)
    return final


def unregister(record: SessionRecord) -> None:
    """Remove ``record``'s registry file, if it is still there (and still this process's)."""
    path = Path(record.path) if record.path else None
    if path is None:
        try:
            path = sessions_dir() / _record_name(record)
        except EndpointError:
            return
    try:
        current = _read_record(path)
        if current is not None and current.pid != record.pid:
            return  # another process reused the name; not ours to remove
        path.unlink()
    except OSError:
        pass
    record.path = None


def _read_record(path: Path) -> SessionRecord | None:
    """The record in ``path``; None if it is unreadable or invalid."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as fh:
            data = fh.read(MAX_RECORD_BYTES + 1)
        if len(data) > MAX_RECORD_BYTES:
            return None
        return SessionRecord.from_dict(json.loads(data), path=str(path))
    except (OSError, ValueError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None


def list_sessions() -> list[SessionRecord]:
    """Live session records, oldest first. Deletes records of dead processes and files that
    do not parse, and the socket and key files dead processes left in the runtime directory
    (a crashed or killed job cannot clean up after itself)."""
    directory = sessions_dir()
    here = _hostname()
    records: list[SessionRecord] = []
    for path in sorted(directory.glob("*.json")):
        rec = _read_record(path)
        stale = rec is None or (rec.host in ("", here) and not pid_alive(rec.pid, rec.started))
        if stale:
            if rec is not None:
                for endpoint in (rec.events, rec.control):
                    _remove_socket(ipc_path(endpoint))
            with contextlib.suppress(OSError):
                path.unlink()
            continue
        assert rec is not None
        records.append(rec)
    _sweep_runtime_dir(lambda pid: not pid_alive(pid))
    records.sort(key=lambda r: (r.started, r.pid, r.rank or 0))
    return records


# Files a traced process leaves in the runtime directory: <pid>[-rank].events / .control
# (ipc sockets) and <pid>[-rank].<hex>.curve (session keys, see security.write_session_keys).
_PROCESS_FILE = re.compile(r"(\d{1,10})(?:-\d{1,10})?\.(?:events|control|[0-9a-f]{1,64}\.curve)")


def _remove_socket(path: Path | None) -> bool:
    """Unlink ``path`` if it is a Unix socket (never a regular file someone named there)."""
    if path is None:
        return False
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return False
        os.unlink(path)
        return True
    except OSError:
        return False


def _sweep_runtime_dir(remove_pid: Any) -> int:
    """Remove the socket and key files in the runtime directory of the processes for which
    ``remove_pid(pid)`` is true; returns how many."""
    try:
        entries = list(os.scandir(runtime_dir()))
    except (OSError, EndpointError):
        return 0
    verdicts: dict[int, bool] = {}
    removed = 0
    for entry in entries:
        m = _PROCESS_FILE.fullmatch(entry.name)
        if m is None:
            continue
        pid = int(m.group(1))
        if pid not in verdicts:
            verdicts[pid] = pid > 0 and bool(remove_pid(pid))
        if not verdicts[pid]:
            continue
        path = Path(entry.path)
        if entry.name.endswith(".curve"):
            try:
                if entry.is_file(follow_symlinks=False):
                    os.unlink(path)
                    removed += 1
            except OSError:
                pass
        elif _remove_socket(path):
            removed += 1
    return removed


def cleanup_process(pid: int | None = None) -> int:
    """Remove what process ``pid`` (default: this one) left for UIs to find: its registry
    records (every rank), and its ipc socket files and session key files in the runtime
    directory. Returns how many files went.

    For a process about to exit without closing its publisher (a SIGTERM handler that
    cannot wait for it): afterwards no UI can find or reach this process's sessions. Safe to
    call twice, and after a clean close (it then finds nothing). Never raises.
    """
    pid = os.getpid() if pid is None else pid
    removed = 0
    here = _hostname()
    try:
        paths = list(sessions_dir().glob(f"{pid}-*.json"))
    except (OSError, EndpointError):
        paths = []
    for path in paths:
        rec = _read_record(path)
        if rec is not None and (rec.pid != pid or rec.host not in ("", here)):
            continue
        if rec is not None:
            for endpoint in (rec.events, rec.control):
                removed += _remove_socket(ipc_path(endpoint))
        with contextlib.suppress(OSError):
            path.unlink()
            removed += 1
    removed += _sweep_runtime_dir(lambda p: p == pid)
    return removed


def job_sessions(
    record: SessionRecord, records: list[SessionRecord] | None = None
) -> list[SessionRecord]:
    """The sessions of ``record``'s job on this machine (every rank of one torchrun job),
    sorted by rank; ``[record]`` for a job of one process."""
    if record.job is None:
        return [record]
    pool = list_sessions() if records is None else records
    same = {r.rank or 0: r for r in pool if r.job == record.job and r.host == record.host}
    same.setdefault(record.rank or 0, record)
    return [same[rank] for rank in sorted(same)]


def group_by_job(records: list[SessionRecord]) -> list[list[SessionRecord]]:
    """Records grouped into jobs (the ranks of one torchrun job together, by rank), jobs in
    the order their first record comes."""
    groups: dict[tuple, list[SessionRecord]] = {}
    for rec in records:
        key = ("job", rec.host, rec.job) if rec.job is not None else ("pid", rec.pid, rec.rank)
        groups.setdefault(key, []).append(rec)
    return [sorted(g, key=lambda r: r.rank or 0) for g in groups.values()]


def resolve(target: str | None) -> SessionRecord:
    """Which session a user means.

    None: the one running job (EndpointError if there are none or several; the ranks of one
    torchrun job are one job, and its rank 0 is returned); digits: the session of that pid;
    ``ipc://...`` / ``tcp://...``: a control endpoint, returned as a record with only
    ``control`` set.
    """
    if target is not None and not isinstance(target, str):
        raise EndpointError(f"session target must be a string, not {type(target).__name__}")
    if target is not None:
        target = target.strip()
        if target.startswith(("ipc://", "tcp://")):
            return SessionRecord(control=target)
    records = list_sessions()
    if target is None or target == "":
        if not records:
            raise EndpointError("no running torchscope session found")
        jobs = group_by_job(records)
        if len(jobs) > 1:
            listing = ", ".join(_describe_job(j) for j in jobs)
            raise EndpointError(
                f"{len(jobs)} torchscope jobs are running ({listing}); pick one by pid"
            )
        return jobs[0][0]
    if _digits(target):
        pid = int(target)
        matches = [r for r in records if r.pid == pid]
        if not matches:
            listing = ", ".join(r.describe() for r in records) or "none"
            raise EndpointError(f"no torchscope session with pid {pid} (running: {listing})")
        return min(matches, key=lambda r: r.rank or 0)
    raise EndpointError(
        f"cannot tell which session {target!r} means: give a pid, an ipc:// or tcp:// "
        f"control endpoint, or nothing"
    )
