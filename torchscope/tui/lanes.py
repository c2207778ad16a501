"""Several sources in one UI: the ranks of a torchrun job, or recordings side by side.

Each source is a :class:`Lane`: its own source, inbox, store and status, so each rank keeps
its own step list, alerts and stepper state; the app shows one lane at a time and switches
between them keeping the position (same step, same op aligned as ``torchscope diff`` aligns
two recordings: :mod:`torchscope.session.align`).

- :func:`lane_labels`: what the source bar calls each lane ("rank 1", "B.tsc").
- :func:`job_alerts`: every rank's alerts, for the alerts list's view of the whole job (each
  NaN/Inf origin once, alike on every rank's lane).

What ``torchscope tui`` opens for its command-line targets: :mod:`torchscope.tui.sources.open`.

No textual imports here, and no torch.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from torchscope.protocol.events import Event
from torchscope.session.inbox import Inbox
from torchscope.session.items import StepIndex
from torchscope.session.rate import RateMeter
from torchscope.session.replay_cursor import ReplayBreakpoints
from torchscope.session.stepper_view import pause_key
from torchscope.session.store import EventStore
from torchscope.tui.sources.base import EventSource

__all__ = [
    "STEPPING",
    "JobAlerts",
    "Lane",
    "job_alerts",
    "lane_labels",
    "rank_lanes",
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
        store.apply([StepIndex([(step, False)])])
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
