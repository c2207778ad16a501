"""The sources for what the command line names: a trace file, a control endpoint, the pid of
a traced job (every rank of its job), or nothing (the one running session).

No textual imports here, and no torch.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Any

from torchscope.protocol.runtime import split_tcp
from torchscope.tui.sources.base import EventSource, SourceError
from torchscope.tui.sources.file import FileSource
from torchscope.tui.sources.live import LiveSource

__all__ = [
    "check_files",
    "dialable",
    "expand_targets",
    "follows_job",
    "open_source",
    "open_sources",
]


def open_source(target: str | None) -> EventSource:
    """A source for what the command line names: a trace file, a control endpoint
    (``ipc://...``, ``tcp://...``), the pid of a traced job, or None for the one running
    session. Raises SourceError for a name that is none of these."""
    if target is None or "://" in target or target.isdigit():
        return LiveSource(target)
    if os.path.exists(target):
        return FileSource(target)
    raise SourceError(f"{target}: no such trace file, endpoint or pid")


_RANK_FILE = re.compile(r"^(.*)\.rank(\d+)(\.[^.]*)?$")


def _natural(path: str) -> tuple:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path))


def expand_targets(targets: list[str] | None) -> list[str]:
    """The command line's targets with globs the shell left alone expanded (``'t.rank*.tsc'``),
    in their order; files of one recording's ranks (``t.rank10.tsc``) in rank order."""
    out: list[str] = []
    for t in targets or ():
        if any(c in t for c in "*?[") and not os.path.exists(t):
            found = sorted(glob.glob(t), key=_natural)
            out.extend(found or [t])  # no match: the target stays, and is refused by name
        else:
            out.append(t)
    matches = [_RANK_FILE.match(t) for t in out]
    ranks = [m for m in matches if m is not None]
    if len(out) > 1 and len(ranks) == len(out) and len({m.group(1) for m in ranks}) == 1:
        out = [m.string for m in sorted(ranks, key=lambda m: int(m.group(2)))]
    return out


def check_files(targets: list[str]) -> str | None:
    """None when every trace file among several opens; else one line naming the bad one (a
    damaged header, or a damaged first chunk). Damage further in shows when it is read."""
    from torchscope.protocol.codec import ProtocolError
    from torchscope.protocol.tracefile import TraceReader

    for t in targets:
        if not os.path.isfile(t):
            continue
        try:
            with TraceReader(t) as reader:
                if reader.chunks:
                    reader.read_chunk(0)  # the session and the first step: cheap, and telling
        except ProtocolError as exc:  # TraceFileError, a chunk that breaks the schema
            return f"{t}: {' '.join(str(exc).split())}"
        except OSError as exc:
            return f"{t}: cannot open: {exc.strerror or exc}"
    return None


def _job_ranks(target: str | None) -> list[Any] | None:
    """The job's rank records when ``target`` (a pid, None for the one running job, or a
    control endpoint) is a rank of a multi-rank job; None otherwise (and when nothing is
    running yet). Ranks this machine's registry lacks (other hosts; an endpoint reached
    through a tunnel) are asked of the job itself."""
    from torchscope.protocol import endpoints as ep

    if target is not None and "://" in target:
        ranks = _ranks_through_the_job(ep.SessionRecord(control=target))
        return ranks if ranks is not None and len(ranks) > 1 else None
    if target is not None and not target.isdigit():
        return None
    try:
        record = ep.resolve(target)
    except Exception:  # nothing running yet, several jobs, no such pid: the one source says
        return None
    ranks = ep.job_sessions(record)
    if record.world_size is not None and len(ranks) < record.world_size:
        ranks = _ranks_through_the_job(record) or ranks
    return ranks if len(ranks) > 1 else None


def _ranks_through_the_job(record: Any) -> list[Any] | None:
    """Every rank's record as the ranks registered them in the job's c10d store (the
    ``ranks`` command), or None when the job does not say (not all registered yet, no agent,
    unreachable)."""
    from torchscope.protocol import endpoints as ep
    from torchscope.protocol.client import SessionClient

    try:
        with SessionClient() as client:
            hello = client.connect(record, timeout=2.0)
            listed = client.request("ranks")["ranks"]
        ranks = [ep.SessionRecord.from_dict(r) for r in listed]
    except Exception:  # not a ranked job: opened alone
        return None
    reached = hello.get("rank")
    for r in ranks:
        if r.rank == reached and record.control:
            # The rank asked: as this UI reached it (a name, an address, a tunnel), not as
            # it bound itself (tcp://0.0.0.0:PORT).
            r.control = record.control
        else:
            r.control = dialable(r.control, r.host)
        if r.events is not None:
            r.events = dialable(r.events, r.host)
    return sorted(ranks, key=lambda r: r.rank or 0) or None


_ANY_HOSTS = frozenset({"0.0.0.0", "::", "*", ""})


def dialable(endpoint: str, host: str) -> str:
    """A rank's endpoint as another machine dials it: one bound on every interface
    (``TORCHSCOPE_BIND=tcp://0.0.0.0:5555``, what a multi-node job binds) says
    ``tcp://0.0.0.0:PORT``, which means nothing elsewhere; it becomes PORT on the host name
    that rank's machine gave (the one the cluster resolves, through a SOCKS tunnel too)."""
    if not endpoint.startswith("tcp://") or not host:
        return endpoint
    try:
        bound, port = split_tcp(endpoint)
    except Exception:  # not tcp: kept as given
        return endpoint
    if bound not in _ANY_HOSTS or port is None:
        return endpoint
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def follows_job(targets: list[str] | None, sources: list[EventSource]) -> bool:
    """Whether the UI should add the ranks of the job that start after it opened: a pid or
    no target (not an endpoint, not files) that opened live sources."""
    names = list(targets or ())
    return (
        len(names) <= 1
        and all(t.isdigit() for t in names)
        and all(s.mode == "live" for s in sources)
    )


def open_sources(targets: list[str] | None) -> tuple[list[EventSource], int]:
    """Sources for the command line's targets, and which one to show first. A pid (or no
    target) that is a rank of a torchrun job opens every rank of that job on this machine,
    showing the rank asked for first. Raises SourceError for a target that names nothing."""
    names = expand_targets(targets)
    if len(names) <= 1:
        target = names[0] if names else None
        ranks = _job_ranks(target)
        if ranks:
            first = 0
            if target is not None and target.isdigit():
                pid = int(target)
                first = next((i for i, r in enumerate(ranks) if r.pid == pid), 0)
            elif target is not None:
                first = next((i for i, r in enumerate(ranks) if r.control == target), 0)
            return [LiveSource(r.control) for r in ranks], first
        return [open_source(target)], 0
    sources: list[EventSource] = []
    for name in names:
        if "://" not in name and not name.isdigit() and not os.path.exists(name):
            raise SourceError(f"{name}: no such trace file, endpoint or pid")
        sources.append(
            FileSource(name) if os.path.exists(name) and "://" not in name else open_source(name)
        )
    return sources, 0
