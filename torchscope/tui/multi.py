"""Several sources in one UI: the ranks of a torchrun job, or recordings side by side.

Each source is a :class:`Lane`: its own source, inbox, store and status, so each rank keeps
its own step list, alerts and stepper state; the app shows one lane at a time and switches
between them keeping the position (same step, same op aligned as ``torchscope diff`` aligns
two recordings: :mod:`torchscope.analysis.align`).

- :func:`open_sources`: what ``torchscope tui`` opens for its command-line targets: every
  file (globs expanded), and for a pid or the one running session, every rank of its job
  (``endpoints.job_sessions``).
- :func:`lane_labels`: what the source bar calls each lane ("rank 1", "B.tsc").
- :func:`job_alerts`: every rank's alerts, for the alerts list's view of the whole job (each
  NaN/Inf origin once, alike on every rank's lane).
- :func:`row_key` / :func:`find_key`: an event's alignment key in a store, and the row with
  that key in another store's step.

No textual imports here, and no torch.
"""

from __future__ import annotations

import glob
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

from torchscope.analysis.align import keyed
from torchscope.protocol.events import ATEN, GRAD, OP, Event
from torchscope.protocol.runtime import split_tcp
from torchscope.tui.replay_stepping import ReplayBreakpoints
from torchscope.tui.sources import EventSource, FileSource, LiveSource, SourceError, open_source
from torchscope.tui.stepping import pause_key
from torchscope.tui.store import (
    FLAG_ACCUMULATE,
    FLAGS,
    KIND,
    NAME,
    AtenRow,
    EventStore,
    Inbox,
    RateMeter,
    Row,
    StepData,
)

__all__ = [
    "STEPPING",
    "JobAlerts",
    "Lane",
    "check_files",
    "describe_key",
    "dialable",
    "expand_targets",
    "find_key",
    "follows_job",
    "job_alerts",
    "lane_labels",
    "open_sources",
    "rank_lanes",
    "row_key",
]

#: Commands that act on every rank together unless the scope is "this rank only".
STEPPING = frozenset({"pause", "step", "next", "continue"})


@dataclass(eq=False)
class Lane:
    """One source and what the UI knows of it."""

    source: EventSource
    store: EventStore
    index: int = 0
    inbox: Inbox = field(default_factory=Inbox)
    status: dict[str, Any] = field(default_factory=dict)
    rate: RateMeter = field(default_factory=RateMeter)
    worker: Any = None
    fatal: str | None = None
    sent: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # commands (tests)
    # the pause the lane is in, and when (monotonic) this UI counts it from
    pause_key: Any = None
    paused_at: float | None = None
    # a recording's breakpoints (the b and B screens' commands are answered here)
    breakpoints: ReplayBreakpoints = field(default_factory=ReplayBreakpoints)

    @classmethod
    def of(cls, source: EventSource, index: int, max_events: int) -> Lane:
        store = EventStore(
            max_events=max_events, reloadable=source.can_reload, live=source.mode == "live"
        )
        return cls(source=source, store=store, index=index, status={"mode": source.mode})

    def fresh_store(self) -> None:
        """A new run of the followed job: what came before belongs to the old store."""
        self.store = EventStore(
            max_events=self.store.max_events, reloadable=self.source.can_reload, live=True
        )

    @property
    def paused(self) -> dict | None:
        return self.store.stepper.paused

    @property
    def live(self) -> bool:
        return self.source.mode == "live"

    def note_pause(self, now: float | None = None, wall: float | None = None) -> bool:
        """Track when this lane's current pause began; True when it just began."""
        pause = self.paused
        key = pause_key(pause) if pause is not None else None
        if pause is None:
            self.pause_key, self.paused_at = None, None
            return False
        if self.paused_at is not None and key == self.pause_key:
            return False
        now = time.monotonic() if now is None else now
        wall = time.time() if wall is None else wall
        since = pause.get("since")
        age = wall - since if isinstance(since, (int, float)) else None
        # the job's own clock when it is plausible (same machine, say); else from now on
        self.paused_at = now - age if age is not None and 0 <= age < 86_400 else now
        self.pause_key = key
        return True

    def paused_for(self, now: float | None = None) -> float | None:
        if self.paused is None or self.paused_at is None:
            return None
        return max(0.0, (time.monotonic() if now is None else now) - self.paused_at)

    @property
    def rank(self) -> int | None:
        r = self.status.get("rank")
        if type(r) is not int and self.store.session is not None:
            r = self.store.session.get("rank")
        return r if type(r) is int else None

    @property
    def world_size(self) -> int | None:
        w = self.status.get("world_size")
        if type(w) is not int and self.store.session is not None:
            w = self.store.session.get("world_size")
        return w if type(w) is int else None

    def session_value(self, key: str) -> Any:
        session = self.store.session
        value = session.get(key) if session is not None else None
        return self.status.get(key) if value is None else value

    def newest_step(self) -> int | None:
        return self.store.newest_step

    def has_step(self, step: int) -> bool:
        """Whether ``step`` is (or may be) in this lane: known, or inside the span of a file
        whose index names only each chunk's first and last step (then it is listed as on
        disk, and loading it tells)."""
        store = self.store
        if step in store:
            return True
        order = store.order
        if self.live or not self.source.can_reload or not order:
            return False
        if not order[0] < step < order[-1]:
            return False
        store.apply([("index", [(step, False)])])
        return True


@dataclass(frozen=True)
class JobAlerts:
    """What the alerts list shows of a multi-rank job: every rank's alerts (each lane's
    store's, as they are now), which lane shows each rank, where each rank's job ran (its
    sources' paths are shortened against it), and the rank of the lane shown."""

    alerts: dict[int, list[Event]]
    lanes: dict[int, int]  # rank -> lane index
    cwds: dict[int, str | None]
    rank: int

    def key(self) -> tuple:
        """Changes when what the job view shows may have: a lane's alerts grew or were
        replaced (a new run), another rank is shown, a rank's session came. The stores only
        add alerts, so their counts say it without comparing them."""
        lists = tuple((r, id(a), len(a)) for r, a in sorted(self.alerts.items()))
        return (self.rank, lists, tuple(sorted(self.cwds.items())))


def job_alerts(lanes: list[Lane], current: int) -> JobAlerts | None:
    """The job view of the alerts when the lanes are ranks of one job, lane ``current``
    shown; None otherwise (one source, recordings side by side)."""
    by_rank = rank_lanes(lanes)
    if by_rank is None or not 0 <= current < len(lanes):
        return None
    shown = lanes[current].rank
    if shown is None:
        return None
    cwds = {}
    for r, lane in by_rank.items():
        cwd = lane.session_value("cwd")
        cwds[r] = cwd if isinstance(cwd, str) else None
    return JobAlerts(
        alerts={r: lane.store.alerts for r, lane in by_rank.items()},
        lanes={r: lane.index for r, lane in by_rank.items()},
        cwds=cwds,
        rank=shown,
    )


# -- labels ------------------------------------------------------------------------------------
def _file_of(lane: Lane) -> str | None:
    path = getattr(lane.source, "path", None) or lane.status.get("file")
    return str(path) if path else None


def rank_lanes(lanes: list[Lane]) -> dict[int, Lane] | None:
    """``{rank: lane}`` when the lanes are distinct ranks of one job (several of them, each
    naming its rank, in one job or each a file); None otherwise."""
    ranks = [lane.rank for lane in lanes]
    worlds = {lane.world_size for lane in lanes}
    jobs = {lane.session_value("job") for lane in lanes}
    same_job = len(jobs) == 1 or all(_file_of(lane) for lane in lanes)
    if (
        len(lanes) > 1
        and all(r is not None for r in ranks)
        and len(set(ranks)) == len(ranks)
        and worlds != {1}
        and same_job
    ):
        return {lane.rank: lane for lane in lanes if lane.rank is not None}
    return None


def lane_labels(lanes: list[Lane]) -> list[str]:
    """``rank N`` when the lanes are distinct ranks of one job; else the files' names (their
    shortest distinct tails); else the sources' own labels."""
    if rank_lanes(lanes) is not None:
        return [f"rank {lane.rank}" for lane in lanes]
    files = [_file_of(lane) for lane in lanes]
    if all(files):
        return _short_names([str(f) for f in files])
    out = []
    for lane in lanes:
        label = lane.source.label or lane.status.get("endpoint") or "session"
        pid = lane.status.get("pid")
        out.append(f"pid {pid}" if pid else str(label))
    return out


def _short_names(paths: list[str]) -> list[str]:
    """The basenames, or longer tails where two basenames are the same."""
    parts = [os.path.normpath(p).split(os.sep) for p in paths]
    depth = [1] * len(paths)
    for _ in range(8):
        names = [os.sep.join(p[-d:]) for p, d in zip(parts, depth, strict=True)]
        dups = {n for n in names if names.count(n) > 1}
        if not dups:
            return names
        for i, n in enumerate(names):
            if n in dups and depth[i] < len(parts[i]):
                depth[i] += 1
    return [os.sep.join(p[-d:]) for p, d in zip(parts, depth, strict=True)]


# -- opening -----------------------------------------------------------------------------------
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
    groups = {m.group(1) for m in map(_RANK_FILE.match, out) if m}
    if len(out) > 1 and len(groups) == 1 and all(_RANK_FILE.match(t) for t in out):
        out.sort(key=lambda p: int(_RANK_FILE.match(p).group(2)))  # type: ignore[union-attr]
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
    except Exception:
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
    except Exception:
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


# -- alignment of rows ---------------------------------------------------------------------------
def _candidates(data: StepData, kind: str, name: str) -> list[tuple]:
    recs = data.ops if kind == OP else data.grads
    return [t for t in recs if t[NAME] == name]


def row_key(store: EventStore, data: StepData | None, row: Any) -> tuple | None:
    """``(kind, name, module or parameter[, backward call], occurrence)`` of a timeline row
    within its step (:func:`torchscope.analysis.align.keyed`), or None (no row, a pending row).
    An aten call's: see ``_call_key``."""
    if data is None or row is None or getattr(row, "pending", False):
        return None
    if isinstance(row, AtenRow):
        return _call_key(store, data, row)
    cands = _candidates(data, row.kind, row.name)
    for t, (_, key, _) in zip(cands, keyed(store.event(t) for t in cands), strict=True):
        if t[1] == row.seq:
            return key
    return None


def find_key(store: EventStore, data: StepData | None, key: tuple | None) -> Row | None:
    """The row of ``data`` (a step in ``store``) whose alignment key is ``key``."""
    if data is not None and key and key[0] == ATEN:
        return _find_call(store, data, key)
    if data is None or not key or key[0] not in (OP, GRAD):
        return None
    cands = _candidates(data, key[0], key[1])
    for t, (_, k, _) in zip(cands, keyed(store.event(t) for t in cands), strict=True):
        if k == key and t[KIND] == key[0]:
            return data.view(t)
    return None


# An aten call is aligned under its op or node, as ``torchscope diff`` aligns the aten level:
# ``(ATEN, its row's key, an engine sum or not, name, occurrence among that row's calls)``.
def _same_calls(data: StepData, parent: Row, name: str, accumulate: bool) -> list[tuple]:
    """The calls of ``parent`` named ``name``, the engine's sums or its own kernels."""
    return [
        t
        for t in data.aten_of(parent)
        if t[NAME] == name and bool(t[FLAGS] & FLAG_ACCUMULATE) == accumulate
    ]


def _call_key(store: EventStore, data: StepData, row: AtenRow) -> tuple | None:
    parent = row_key(store, data, row.parent)
    if parent is None:
        return None
    same = _same_calls(data, row.parent, row.name, row.accumulate)
    return (ATEN, parent, row.accumulate, row.name, same.index(row.t))


def _find_call(store: EventStore, data: StepData, key: tuple) -> Row | None:
    _, parent_key, accumulate, name, n = key
    parent = find_key(store, data, parent_key)
    same = _same_calls(data, parent, name, accumulate) if parent is not None else []
    return AtenRow(same[n], parent) if n < len(same) and parent is not None else None


def describe_key(key: tuple | None) -> str:
    if not key:
        return "?"
    if key[0] == ATEN:
        _, parent, accumulate, name, n = key
        which = f" (occurrence {n + 1})" if n else ""
        under = "summed after" if accumulate else "in"
        return f"{name}{which} {under} {describe_key(parent)}"
    where = key[2] or "the top level"
    n = key[-1] + 1
    return f"{key[1]} in {where}" + (f" (occurrence {n} in its step)" if n > 1 else "")
