"""Between the training thread and the publisher thread: the bounded queue of encoded events the
sink hands over, and the doorbell that wakes the publisher thread when the queue fills up.

The sink never blocks and never waits for the thread: a publisher that cannot keep up loses
the oldest events, counted. The thread takes the queue on its own turn; only a queue filling up
rings the doorbell, at most once per turn (ringing per batch would make the thread fight the
training thread for the GIL at every batch, hundreds a second on a small model).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections import deque

# Queued by forget(): the ring drops what came before it. An empty batch, known by identity.
FORGET: list[bytes] = []


class PendingEvents:
    """Batches of encoded events, at most ``limit`` events in all, the oldest dropped first.

    Counters are written under the lock by the sink side (``put``, ``forget``) and by the
    thread (``take``); they are read anywhere."""

    def __init__(self, limit: int) -> None:
        self.limit = max(1, int(limit))
        self._lock = threading.Lock()
        self._batches: deque[list[bytes]] = deque()
        self.count = 0  # events queued and not yet taken
        self.total = 0  # events handed to the sink
        self.dropped = 0  # pushed out of the bounded queue, or not encodable

    def put(self, packed: list[bytes], total: int) -> bool:
        """Queue ``packed``, the encodable part of ``total`` events; True when the queue is past
        half full (the thread should be woken)."""
        with self._lock:
            self.total += total
            self.dropped += total - len(packed)
            if not packed:
                return False
            self._batches.append(packed)
            self.count += len(packed)
            forget = False
            while self.count > self.limit:
                old = self._batches.popleft()
                forget = forget or old is FORGET
                self.count -= len(old)
                self.dropped += len(old)
            if forget:  # still owed: everything before it is gone, the ring's old part too
                self._batches.appendleft(FORGET)
            return self.count > self.limit // 2

    def forget(self) -> None:
        """Events queued so far leave the ring once the thread reaches this point."""
        with self._lock:
            self._batches.append(FORGET)

    @property
    def waiting(self) -> bool:
        """Batches are queued (``FORGET`` markers included)."""
        return bool(self._batches)

    def take(self) -> list[bytes] | None:
        """The oldest batch (``FORGET`` included), or None when the queue is empty."""
        with self._lock:
            if not self._batches:
                return None
            batch = self._batches.popleft()
            self.count -= len(batch)
            return batch


class Doorbell:
    """Wakes the publisher thread: a socket pair whose reading end the thread polls."""

    def __init__(self) -> None:
        self.socket, self._bell = socket.socketpair()
        self.socket.setblocking(False)
        self._bell.setblocking(False)
        self._rung = False

    def ring_once(self) -> None:
        """Wake the thread unless it was woken since its last turn. Non-blocking; a full
        buffer (``OSError``) means the thread is awake anyway."""
        if not self._rung:
            self._rung = True
            self._bell.send(b"\0")

    def ring(self) -> None:
        with contextlib.suppress(OSError):  # closed at exit, or full: awake anyway
            self._bell.send(b"\0")

    def turn(self) -> None:
        """The thread takes the queue from now on: the next ``ring_once`` rings again."""
        self._rung = False

    def drain(self) -> None:
        with contextlib.suppress(OSError):  # empty: nothing more to read
            while self.socket.recv(4096):
                pass

    def close(self) -> None:
        for s in (self.socket, self._bell):
            with contextlib.suppress(OSError):  # closed already
                s.close()
