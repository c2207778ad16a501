"""The hand-off from a source's worker thread to the UI thread."""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from torchscope.protocol.events import Event
from torchscope.session.items import Events, InboxItem, Status, StepPart
from torchscope.session.rows import Rec

__all__ = ["Inbox"]


class Inbox:
    """Thread-safe hand-off from a source's worker thread to the UI thread.

    A source puts items (one dataclass per kind of news: :mod:`torchscope.session.items`);
    the app drains all of them on its timer and applies them to its store in one batch.

    ``max_pending`` bounds buffered events: past it, ``put_events`` refuses the batch (the
    caller counts it as dropped), the same policy the tracer's PUB socket has.
    """

    def __init__(self, max_pending: int = 500_000) -> None:
        self._lock = threading.Lock()
        self._items: deque[InboxItem] = deque()
        self._pending_events = 0
        self.max_pending = max_pending
        self.dropped = 0

    def put(self, item: InboxItem) -> None:
        with self._lock:
            self._items.append(item)

    def put_events(self, items: list[Rec | Event]) -> bool:
        if not items:
            return True
        with self._lock:
            if self._pending_events + len(items) > self.max_pending:
                self.dropped += len(items)
                return False
            self._pending_events += len(items)
            self._items.append(Events(items))
        return True

    def put_step_part(
        self, step: int, items: list[Rec | Event], first: bool, last: bool, done: int, total: int
    ) -> None:
        """Part of a step being loaded (see :class:`StepPart`). Never refused: the source
        waits while ``pending_events`` is high instead."""
        with self._lock:
            self._pending_events += len(items)
            self._items.append(StepPart(step, items, first, last, done, total))

    def status(self, **values: Any) -> None:
        self.put(Status(values))

    def drain(self, max_events: int | None = None) -> list[InboxItem]:
        """Take buffered items. With ``max_events``, stop after roughly that many events so one
        UI frame never applies an unbounded backlog (the rest waits for the next tick)."""
        with self._lock:
            if max_events is None:
                items = list(self._items)
                self._items.clear()
                self._pending_events = 0
                return items
            out: list[InboxItem] = []
            taken = 0
            while self._items and taken < max_events:
                item = self._items.popleft()
                match item:
                    case Events(items=events) | StepPart(items=events):
                        taken += len(events)
                        self._pending_events -= len(events)
                out.append(item)
            return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    @property
    def pending_events(self) -> int:
        return self._pending_events
