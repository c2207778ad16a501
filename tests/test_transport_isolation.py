"""A UI that stops reading costs only itself.

What a user is promised: one stuck or slow UI (or a raw SUB socket that never calls recv) never
stops frames, heartbeats or "bye" reaching the other UIs; each UI loses frames alone, and learns
how many frames and events *it* lost from the numbers every frame carries.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest
import zmq
from live_events import ops, session_event

from torchscope.protocol import endpoints as ep
from torchscope.protocol.client import TOKEN_PREFIX, SessionClient
from torchscope.tracer.publisher import EventPublisher

BLOB = "x" * 2000  # ~20 KB frames: a stuck pipe and its kernel buffers fill within a few hundred


@pytest.fixture
def rt(monkeypatch: pytest.MonkeyPatch):
    base = Path(tempfile.mkdtemp(prefix="tsiso-", dir="/tmp"))
    monkeypatch.setenv(ep.ENV_RUNTIME_DIR, str(base / "run"))
    monkeypatch.delenv(ep.ENV_BIND, raising=False)
    yield base / "run"
    shutil.rmtree(base, ignore_errors=True)


def stuck_sub(pub: EventPublisher, name: bytes) -> zmq.Socket:
    """A raw SUB subscribed to everything that will never call recv."""
    s = zmq.Context.instance().socket(zmq.SUB)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVHWM, 10)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.setsockopt(zmq.SUBSCRIBE, TOKEN_PREFIX + name)  # lets us see it is in place
    s.connect(pub.endpoints[0])
    deadline = time.monotonic() + 30
    while TOKEN_PREFIX + name not in pub._tokens:
        assert time.monotonic() < deadline, "the raw SUB never got subscribed"
        time.sleep(0.01)
    return s


def burst(pub: EventPublisher, n_events: int, follows: Reader | None = None) -> None:
    """Frames of 10 events, ~20 KB each, at a pace one reading UI keeps up with (a training
    job does some work between its ops): ~10 MB/s. With ``follows``, never more than 50
    frames ahead of that reader: on a loaded machine a reading UI may fall behind a fixed
    pace through no fault of the publisher, and that is not what these tests are about."""
    for lo in range(0, n_events, 10):
        pub(ops(lo, lo + 10, blob=BLOB))
        if lo % 100 == 0:
            time.sleep(0.002)
        if follows is not None and lo % 500 == 0:
            deadline = time.monotonic() + 20
            while len(follows.seqs) < lo - 500 and time.monotonic() < deadline:
                time.sleep(0.002)


class Reader(threading.Thread):
    """Reads a SessionClient until "bye" (or a deadline), keeping what it got."""

    def __init__(self, client: SessionClient, seconds: float = 30.0) -> None:
        super().__init__(daemon=True)
        self.client = client
        self.seqs: list[int] = []
        self.kinds: list[str] = []
        self.deadline = time.monotonic() + seconds

    def run(self) -> None:
        while not self.client.ended and time.monotonic() < self.deadline:
            for f in self.client.recv(50):
                self.kinds.append(f["type"])
                if f["type"] == "events":
                    self.seqs += [e["seq"] for e in f["events"]]


def test_stuck_raw_subscriber_costs_only_itself(rt: Path, closing) -> None:
    pub = EventPublisher(session_event(), frame_events=10, sndhwm=200, heartbeat=0.2).start()
    closing.append(pub)
    stuck = stuck_sub(pub, b"stuck")
    closing.append(stuck)
    good = SessionClient()
    closing.append(good)
    good.connect(None)
    assert good.subscribed
    reader = Reader(good)
    reader.start()

    # A bounded burst: 3,000 frames of ~20 KB. Before the fix every UI stopped getting frames
    # once the stuck one's queue was full (~1,200 frames in the field, far fewer here).
    n_events = 30_000
    burst(pub, n_events, follows=reader)
    deadline = time.monotonic() + 60
    while len(reader.seqs) < n_events and time.monotonic() < deadline:
        time.sleep(0.02)
    got = len(reader.seqs)
    # Heartbeats still come after the burst.
    beats = reader.kinds.count("heartbeat")
    deadline = time.monotonic() + 30
    while reader.kinds.count("heartbeat") == beats and time.monotonic() < deadline:
        time.sleep(0.02)
    assert reader.kinds.count("heartbeat") > beats, "no heartbeat reached the good UI"
    pub.close()
    reader.join(30)
    assert good.ended, "'bye' never reached the good UI"
    # The good UI got every event, in order, and its own loss count says so.
    assert got == n_events, f"the good UI got {got} of {n_events} events"
    assert reader.seqs == list(range(n_events))
    assert good.frames_lost == 0 and good.events_lost == 0
    assert pub.dropped == 0  # nothing was lost for everyone
    assert pub.events_sent == n_events


def test_slow_ui_counts_its_own_losses(rt: Path, closing) -> None:
    """A SessionClient that stops reading for a while loses frames, alone, and knows exactly
    how many events it lost; a UI that keeps reading loses nothing meanwhile."""
    pub = EventPublisher(session_event(), frame_events=10, sndhwm=200, heartbeat=0.2).start()
    closing.append(pub)
    slow = SessionClient(rcvhwm=10)
    closing.append(slow)
    slow.connect(None)
    good = SessionClient()
    closing.append(good)
    good.connect(None)
    reader = Reader(good)
    reader.start()
    n_events = 10_000
    burst(pub, n_events, follows=reader)
    deadline = time.monotonic() + 60
    while pub.events_sent < n_events and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pub.events_sent == n_events
    # Now the slow UI catches up: what is still queued, then heartbeats that carry the total.
    slow_seqs: list[int] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for f in slow.recv(50):
            if f["type"] == "events":
                slow_seqs += [e["seq"] for e in f["events"]]
            elif f.get("sent") == n_events and f["type"] == "heartbeat":
                deadline = 0  # the heartbeat after the burst: every loss is known now
    assert slow.events_lost > 0 and slow.frames_lost > 0  # it really was too slow
    assert len(slow_seqs) + slow.events_lost == n_events  # and it knows exactly what it lost
    assert slow_seqs == sorted(slow_seqs) and len(set(slow_seqs)) == len(slow_seqs)
    # Whole frames of 10 events (heartbeats it missed carry none).
    assert slow.events_lost % 10 == 0 and slow.events_lost <= 10 * slow.frames_lost
    pub.close()
    reader.join(30)
    assert good.ended and good.events_lost == 0 and reader.seqs == list(range(n_events))
    assert pub.dropped == 0
