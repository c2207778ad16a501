"""Feeding a list of events (:class:`ScriptedSource`): tests, benchmarks, demos.

No textual imports here, and no torch.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

from torchscope.protocol.events import SESSION, Event
from torchscope.session.countpass import LiveOverview
from torchscope.session.inbox import Inbox
from torchscope.session.items import Unavailable, WholeStep
from torchscope.session.rows import prepare, step_of
from torchscope.tui.sources.base import EventSource, session_status

__all__ = ["ScriptedSource"]


class ScriptedSource(EventSource):
    """Feeds a fixed list of events, all at once or at ``rate`` events per second.

    Behaves like a live session (``mode="live"``) unless ``mode="replay"`` is given. ``feed``
    adds more events later (thread-safe); ``done`` is set once the initial list is delivered.
    With ``bye=True`` the session reports itself ended after the list. It keeps every event, so
    an evicted step can be loaded again unless ``reloadable=False``.
    """

    def __init__(
        self,
        events: Iterable[dict],
        rate: float | None = None,
        *,
        mode: str = "live",
        batch: int = 2000,
        bye: bool = False,
        reloadable: bool = True,
        status: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        # A list is delivered as is; any other iterable is pulled lazily (benchmarks feed
        # millions of events that never exist all at once).
        if isinstance(events, (list, tuple)):
            self.events: list[Event] | None = [
                e if isinstance(e, Event) else Event(e) for e in events
            ]
            self._iter: Iterator[dict] = iter(self.events)
        else:
            self.events = None
            self._iter = iter(events)
        self.rate = rate
        self.mode = mode
        self.batch = max(1, batch)
        self.bye = bye
        self.can_reload = reloadable
        self.label = "scripted"
        self.extra_status = dict(status or {})
        self.done = threading.Event()
        self.delivered = 0
        self._more: queue.Queue[list[dict]] = queue.Queue()
        self._all: list[dict] = list(self.events or ()) if reloadable else []
        self._lock = threading.Lock()
        # live: the Steps panel's loss and |g| as the events come (a replay's come from
        # the count pass of its file; a scripted replay has none)
        self.overview = LiveOverview() if mode == "live" else None

    def feed(self, events: Iterable[dict]) -> None:
        self._more.put([e if isinstance(e, Event) else Event(e) for e in events])

    def run(self, inbox: Inbox, stop: threading.Event) -> None:
        session = next((e for e in self.events or () if e.get("kind") == SESSION), None)
        live = self.mode == "live"
        inbox.status(
            mode=self.mode,
            connected=True if live else None,
            state="connected" if live else "ready",
            file=None if live else self.label,
            events_total=len(self.events) if self.events is not None else None,
            complete=None if live else True,
            **session_status(session),
            **self.extra_status,
        )
        it = self._iter
        if self.rate is None:
            while not stop.is_set():
                chunk = list(itertools.islice(it, self.batch))
                if not chunk:
                    break
                self._deliver(inbox, chunk)
        else:
            start = time.perf_counter()
            sent = 0
            exhausted = False
            while not exhausted and not stop.is_set():
                due = int((time.perf_counter() - start) * self.rate)
                if due > sent:
                    # One hand-off holds at most ~50 ms of events, as a batching publisher.
                    n = min(due - sent, max(self.batch, int(self.rate * 0.05)))
                    chunk = list(itertools.islice(it, n))
                    exhausted = len(chunk) < n
                    if chunk:
                        self._deliver(inbox, chunk)
                    sent += n
                else:
                    time.sleep(0.002)
        self.done.set()
        if self.bye and live:
            inbox.status(connected=False, state="ended")
        while not stop.is_set():
            try:
                more = self._more.get(timeout=0.02)
            except queue.Empty:
                more = None
            if more:
                if self.can_reload:
                    with self._lock:
                        self._all.extend(more)
                self._deliver(inbox, more)
            for step in self._take_requests():
                self._load(step, inbox)

    def _deliver(self, inbox: Inbox, events: list[dict]) -> None:
        if self.can_reload and self.events is None:
            with self._lock:
                self._all.extend(events)
        items = prepare(events)
        if inbox.put_events(items):
            self.delivered += len(items)
            if self.overview is not None:
                self.overview.put(inbox, events)
        else:
            inbox.status(ui_dropped=inbox.dropped)

    def _load(self, step: int, inbox: Inbox) -> None:
        if not self.can_reload:
            inbox.put(Unavailable(step, f"step {step} was evicted from memory"))
            return
        with self._lock:
            events = [e for e in self._all if step_of(e) == step]
        inbox.put(WholeStep(step, prepare(events)))
