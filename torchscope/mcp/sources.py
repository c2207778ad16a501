"""What the analysis tools read: a recording (a trace file), several ranks' recordings, or a
live job this server follows (:class:`~torchscope.mcp.live.JobLink`). Each gives the events of
a step, every alert, and the step list; the tools shape them with :mod:`~torchscope.mcp.views`.

A recording is read through its chunk index (a step's events only, never the whole file at
once), and what a full pass finds (alerts, the step list) is kept while the file is unchanged.
"""

from __future__ import annotations

import glob
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, Protocol

from torchscope.protocol.events import ALERT, SESSION, Event
from torchscope.protocol.tracefile import TraceFileError, TraceReader

__all__ = ["Recording", "Recordings", "Source", "SourceError", "looks_like_job"]

MAX_CACHED = 8  # recordings whose alerts and step list are kept
MAX_ALERTS = 10_000


class SourceError(ValueError):
    """A target that cannot be read; the text is one line."""


class Source(Protocol):
    label: str
    rank: int | None

    def step_events(self, step: int) -> list[Event]: ...

    def alerts(self) -> list[Event]: ...

    def step_table_events(self) -> Iterator[Event]: ...

    def notes(self) -> list[str]: ...


def looks_like_job(target: str) -> bool:
    """A pid or a control endpoint (not a file name)."""
    t = target.strip()
    return (t.isascii() and t.isdigit()) or t.startswith(("ipc://", "tcp://"))


class Recording:
    """One trace file. ``key`` changes when the file does (a recording still being written)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.label = path
        try:
            st = os.stat(path)
        except OSError as exc:
            raise SourceError(f"{path}: {exc.strerror or exc}") from None
        self.key = (os.path.realpath(path), st.st_mtime_ns, st.st_size)
        self._lock = threading.Lock()
        self._alerts: list[Event] | None = None
        self._session: Event | None = None
        self.truncated = False
        self.damaged: str | None = None
        try:
            with TraceReader(path) as reader:
                meta = reader.metadata.get("session")
                self.truncated = bool(reader.truncated)
                self.damaged = reader.damaged
        except (TraceFileError, OSError) as exc:
            raise SourceError(f"{path}: {exc}") from None
        if isinstance(meta, dict):
            self._session = Event(meta)
        rank = self._session.get("rank") if self._session is not None else None
        self.rank: int | None = rank if type(rank) is int else None

    def _read(self, step: int | None = None) -> Iterator[Event]:
        try:
            with TraceReader(self.path) as reader:
                yield from reader.iter_events(step=step)
        except (TraceFileError, OSError) as exc:
            raise SourceError(f"{self.path}: {exc}") from None

    def step_events(self, step: int) -> list[Event]:
        return list(self._read(step))

    def step_table_events(self) -> Iterator[Event]:
        return self._read()

    def alerts(self) -> list[Event]:
        """Every alert event of the file, in order (one full pass, kept)."""
        with self._lock:
            if self._alerts is None:
                found: list[Event] = []
                for e in self._read():
                    kind = e.get("kind")
                    if kind == ALERT and len(found) < MAX_ALERTS:
                        found.append(e)
                    elif kind == SESSION and self._session is None:
                        self._session = e
                self._alerts = found
                rank = self._session.get("rank") if self._session is not None else None
                self.rank = rank if type(rank) is int else None
            return self._alerts

    def notes(self) -> list[str]:
        out = []
        if self.truncated:
            out.append(f"{self.path} was cut short (its writer did not finish): events end early")
        if self.damaged:
            out.append(f"{self.path}: {self.damaged}")
        return out


class Recordings:
    """Recordings by path, kept while unchanged (the newest :data:`MAX_CACHED`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: OrderedDict[str, Recording] = OrderedDict()

    def get(self, path: str) -> Recording:
        path = os.path.expanduser(path)
        if not os.path.exists(path):
            raise SourceError(f"{path}: no such recording (give a trace file, pid or endpoint)")
        if os.path.isdir(path):
            raise SourceError(f"{path} is a directory, not a recording")
        fresh = Recording(path)
        with self._lock:
            have = self._open.get(fresh.key[0])
            if have is not None and have.key == fresh.key:
                self._open.move_to_end(fresh.key[0])
                return have
            self._open[fresh.key[0]] = fresh
            while len(self._open) > MAX_CACHED:
                self._open.popitem(last=False)
        return fresh

    def many(self, pattern: str) -> list[Recording]:
        """A recording, or several named by a glob (``t.rank*.tsc``: the ranks of one job)."""
        if os.path.exists(os.path.expanduser(pattern)) or not glob.has_magic(pattern):
            return [self.get(pattern)]
        paths = sorted(glob.glob(os.path.expanduser(pattern)))[:64]
        if not paths:
            raise SourceError(f"{pattern}: no recording matches")
        return [self.get(p) for p in paths]


def source_summary(src: Any) -> dict[str, Any]:
    """Who a source is, for the top of an answer."""
    out: dict[str, Any] = {"target": src.label}
    if getattr(src, "rank", None) is not None:
        out["rank"] = src.rank
    notes = src.notes()
    if notes:
        out["notes"] = notes
    return out
