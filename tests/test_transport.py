"""Live stream: publisher (in the job) and client (in the UI) over real ZeroMQ sockets.

What a user of a training job is promised: the job never waits for a UI, a UI that joins late
sees a consistent picture (snapshot + live frames, no gap, no duplicate), bad input on the
control socket changes nothing, and nothing is left behind at exit.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from live_events import ops, session_event
from sessions import some_events

from torchscope.protocol import client as client_mod
from torchscope.protocol import endpoints as ep
from torchscope.protocol import frames
from torchscope.protocol.client import SessionClient, SessionRefused, SessionUnreachable
from torchscope.protocol.codec import ProtocolError, pack
from torchscope.protocol.frames import (
    MAX_REQUEST_BYTES,
    RequestError,
    build_request,
    parse_frame,
    parse_reply,
    parse_request,
)
from torchscope.tracer.publisher import EventPublisher

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def rt(monkeypatch: pytest.MonkeyPatch):
    base = Path(tempfile.mkdtemp(prefix="tstr-", dir="/tmp"))  # short: ipc path limit
    monkeypatch.setenv(ep.ENV_RUNTIME_DIR, str(base / "run"))
    monkeypatch.delenv(ep.ENV_BIND, raising=False)
    yield base / "run"
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(autouse=True)
def _no_thread_left():
    yield
    deadline = time.monotonic() + 15
    while any(t.name == "torchscope-publisher" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "a publisher thread outlived its test"
        time.sleep(0.01)


@pytest.fixture
def publishers(rt: Path):
    made: list[EventPublisher] = []

    def make(**kw) -> EventPublisher:
        session = kw.pop("session", None) or session_event()
        pub = EventPublisher(session, **kw).start()
        made.append(pub)
        return pub

    yield make
    for pub in made:
        pub.close()


@pytest.fixture
def clients():
    made: list[SessionClient] = []

    def make(**kw) -> SessionClient:
        c = SessionClient(**kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def eventually(cond, timeout: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def collect(client: SessionClient, n_events: int, timeout: float = 5.0) -> list[dict]:
    """Frames until ``n_events`` events arrived (or timeout)."""
    frames: list[dict] = []
    got = 0
    deadline = time.monotonic() + timeout
    while got < n_events and time.monotonic() < deadline:
        for f in client.recv(50):
            frames.append(f)
            got += len(f.get("events", ()))
    return frames


# -- round trip -------------------------------------------------------------------------------
def test_round_trip_in_order_with_frame_numbers(rt: Path, publishers, clients) -> None:
    pub = publishers(frame_events=100)
    assert pub.endpoints == (
        f"ipc://{rt}/{os.getpid()}.events",
        f"ipc://{rt}/{os.getpid()}.control",
    )
    c = clients()
    info = c.connect(None)  # the only registered session
    assert c.subscribed and info["subscribed"] is True
    assert info["session"]["script"] == "/work/train.py" and info["pid"] == os.getpid()
    assert info["events_endpoint"] == pub.endpoints[0]
    for lo in range(0, 1000, 50):
        pub(ops(lo, lo + 50))
    frames = collect(c, 1000)
    events = [e for f in frames if f["type"] == "events" for e in f["events"]]
    assert [e["seq"] for e in events] == list(range(1000))
    assert all(e.kind == "op" and e.name == "Tensor.mul" for e in events)  # Event objects
    numbers = [f["frame"] for f in frames]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))  # +1, no gap
    assert all(len(f["events"]) <= 100 for f in frames if f["type"] == "events")
    assert c.frames_lost == 0 and c.bad_frames == 0 and pub.dropped == 0
    # The counters are bumped right after each send returns: the client may be quicker.
    assert eventually(lambda: pub.events_sent == 1000) and pub.frames_sent >= 10
    assert c.ping() < 1.0


def test_snapshot_then_live_has_no_gap_or_duplicate(publishers, clients) -> None:
    pub = publishers(ring=100_000, frame_events=64)
    pub(ops(0, 3000))  # before any UI: only the ring has them
    total = 20_000  # a multiple of the feeder's batch size below (3000 + 7 * 2429 = 20003)
    fed_upto = [3000]

    def feed() -> None:
        seq = 3000
        while seq < total:
            pub(ops(seq, seq + 7))
            seq += 7
            fed_upto[0] = seq
            time.sleep(0.0002)

    feeder = threading.Thread(target=feed)
    feeder.start()
    live: list[int] = []
    try:
        c = clients()
        deadline = time.monotonic() + 60
        while fed_upto[0] == 3000:  # the job is producing when the UI comes
            assert time.monotonic() < deadline, "the feeder never started"
            time.sleep(0.001)
        c.connect(str(os.getpid()))
        snap = c.snapshot(100_000)
        assert snap["session"]["kind"] == "session" and snap["truncated"] is False
        seqs = [e["seq"] for e in snap["events"]]
        assert seqs == list(range(len(seqs)))  # the ring from the start, in order
        assert 3000 <= len(seqs) < total  # taken while the job was still producing
        # Keep up with the job, as a UI does (a UI that falls behind sees counted drops).
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(seqs) + len(live) < total + 3:
            live += [e["seq"] for e in c.recv_events(50)]
    finally:
        feeder.join()
    live += [e["seq"] for e in c.recv_events(100)]  # anything extra would be a duplicate
    merged = seqs + live
    assert len(merged) == len(set(merged)), "duplicates between snapshot and live frames"
    assert merged == list(range(fed_upto[0])), "gap between snapshot and live frames"
    assert pub.dropped == 0 and c.frames_lost == 0


def test_snapshot_returns_the_most_recent(publishers, clients) -> None:
    pub = publishers(ring=500)
    pub(ops(0, 2000))
    c = clients()
    c.connect(None)
    snap = c.snapshot(100)
    assert [e["seq"] for e in snap["events"]] == list(range(1900, 2000))
    assert [e["seq"] for e in c.snapshot(10_000)["events"]] == list(range(1500, 2000))
    assert snap["events_total"] == 2000 and snap["dropped"] == 0
    with pytest.raises(ProtocolError, match="max_events"):
        c.snapshot(100_001)  # refused before it is sent, with the tracer's own rule


# -- the job never waits ----------------------------------------------------------------------
def test_sink_without_ui_is_cheap_and_bounded(publishers) -> None:
    pub = publishers(max_pending=1000)
    batch = ops(0, 1)
    worst = 0
    t0 = time.perf_counter()
    for i in range(100_000):
        pub(batch)
        if i % 997 == 0:
            worst = max(worst, pub.pending)
    elapsed = time.perf_counter() - t0
    # Never waits on a UI (a sink that did would wait forever here); what it costs a step is
    # benchmarks/overhead.py's, not a timed test's (about 0.3 s for these 100k calls).
    assert elapsed < 15, f"100k sink calls took {elapsed:.2f} s"
    assert worst <= 1000 and pub.pending <= 1000
    assert pub.events_total == 100_000
    assert not pub.subscribed and pub.frames_sent == 0  # nobody listens: nothing packed
    t0 = time.perf_counter()
    pub.close()
    assert time.perf_counter() - t0 < 10  # (its linger is bounded: 0.2 s; unbounded is forever)


def test_ui_that_never_reads_never_blocks_the_job(publishers, clients) -> None:
    pub = publishers(max_pending=2000, sndhwm=10, frame_events=20)
    c = clients(rcvhwm=10)
    c.connect(None)  # subscribed, and then never reads
    payload = b"x" * 2048
    batch_events = ops(0, 10, blob=payload)
    worst = 0
    t0 = time.perf_counter()
    for i in range(10_000):
        pub(batch_events)  # 100k events, ~200 MB if anything kept them all
        if i % 101 == 0:
            worst = max(worst, pub.pending)
    elapsed = time.perf_counter() - t0
    assert elapsed < 30, f"sink calls took {elapsed:.2f} s with a stuck UI"  # blocked: forever
    assert worst <= 2000
    deadline = time.monotonic() + 30
    while pub.dropped == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pub.dropped > 0  # counted, not waited for
    t0 = time.perf_counter()
    pub.close()
    assert time.perf_counter() - t0 < 10  # (a stuck UI's frames are not waited for)
    assert pub.events_total == 100_000
    # Every event is accounted for: sent, or dropped and counted.
    assert pub.events_sent + pub.dropped == pub.events_total
    assert not pub.running


def test_close_with_dead_ui_is_quick(publishers, clients, rt: Path) -> None:
    pub = publishers()
    c = clients()
    c.connect(None)
    pub(ops(0, 100))
    c.close()  # the UI dies without a word
    del c
    ev_path, ctl_path = (ep.ipc_path(e) for e in pub.endpoints)
    assert ev_path.exists() and ctl_path.exists()
    t0 = time.perf_counter()
    pub.close()
    assert time.perf_counter() - t0 < 10  # (a dead UI's frames are not waited for)
    assert not pub.running
    assert not ev_path.exists() and not ctl_path.exists()  # socket files removed
    assert ep.list_sessions() == [] and not list((rt / "sessions").iterdir())
    pub(ops(100, 200))  # a sink call after close is ignored, not an error
    pub.close()  # idempotent


def test_bye_and_heartbeat(publishers, clients) -> None:
    pub = publishers(heartbeat=0.2)
    c = clients()
    c.connect(None)
    pub.note_step(7)
    beats: list[dict] = []
    deadline = time.monotonic() + 30
    while len(beats) < 2 and time.monotonic() < deadline:
        beats += [f for f in c.recv(50) if f["type"] == "heartbeat"]
    assert len(beats) >= 2
    hb = beats[-1]
    assert hb["step"] == 7 and hb["pid"] == os.getpid() and hb["rank"] is None
    assert hb["dropped"] == 0 and isinstance(hb["t"], float) and c.step == 7
    assert c.alive
    pub(ops(0, 5))
    pub.close()
    frames: list[dict] = []
    deadline = time.monotonic() + 30
    while not c.ended and time.monotonic() < deadline:
        frames += c.recv(50)
    # What the job produced before close() still goes out, then the bye.
    assert [f["type"] for f in frames][-2:] == ["events", "bye"]
    assert frames[-1]["events_total"] == 5
    assert c.ended and not c.alive


def test_heartbeat_at_default_interval(publishers, clients) -> None:
    pub = publishers()
    c = clients()
    c.connect(None)
    t0 = time.monotonic()
    kinds: list[str] = []
    while "heartbeat" not in kinds and time.monotonic() - t0 < 30:
        kinds += [f["type"] for f in c.recv(50)]
    assert "heartbeat" in kinds  # unasked: the publisher sends one every heartbeat_interval
    assert pub.heartbeat_interval == 1.0


def test_alive_turns_false_without_frames(publishers, clients, monkeypatch) -> None:
    monkeypatch.setattr(client_mod, "ALIVE_SECONDS", 0.3)
    pub = publishers(heartbeat=0.1)
    c = clients()
    c.connect(None)
    c.recv(200)
    assert c.alive
    # The job stops answering (simulated: no more frames arrive for this client).
    c.sub.setsockopt(zmq.UNSUBSCRIBE, b"")
    deadline = time.monotonic() + 60
    while c.alive:  # ALIVE_SECONDS (0.3 s) without a frame
        assert time.monotonic() < deadline, "still alive without frames"
        c.recv(50)
    assert not c.alive
    pub.close()


# -- hostile or broken control input ---------------------------------------------------------
def test_malformed_control_messages_get_error_replies(publishers, clients) -> None:
    pub = publishers()
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, 2000)
    dealer.connect(pub.endpoints[1])
    v = [1, 0]
    bad: list[bytes | list[bytes]] = [
        b"",
        b"\xc1",  # never-used msgpack byte
        os.urandom(64),
        pack([1, 2, 3]),
        pack("hello"),
        pack({"v": v, "id": 1}),  # no cmd
        pack({"v": v, "id": 2, "cmd": "rm -rf /"}),
        pack({"v": v, "id": 3, "cmd": 42}),
        pack({"v": v, "id": "4", "cmd": "ping"}),
        pack({"v": v, "id": -5, "cmd": "ping"}),
        pack({"v": v, "id": 2**64 - 1, "cmd": "ping"}),
        pack({"v": v, "id": True, "cmd": "ping"}),
        pack({"v": [2, 0], "id": 6, "cmd": "ping"}),  # future major version
        pack({"id": 7, "cmd": "ping"}),
        pack({"v": v, "id": 8, "cmd": "snapshot", "max_events": 2**63}),
        pack({"v": v, "id": 9, "cmd": "snapshot", "max_events": -1}),
        pack({"v": v, "id": 10, "cmd": "snapshot", "max_events": 1.5}),
        pack({"v": v, "id": 11, "cmd": "snapshot", "max_events": [[{}]]}),
        pack({"v": v, "id": 12, "cmd": "ping", "extra": {"a": [1, {"b": None}]}}),
        pack({"v": v, "id": 13, "cmd": "hello", "sub": "../../etc"}),
        pack({"v": v, "id": 14, "cmd": "hello", "sub": "x" * 100}),
        pack({1: 2, "v": v, "id": 15, "cmd": "ping"}),
        pack({"v": v, "id": 16, "cmd": "ping", "nested": [[[[[[[[[[[]]]]]]]]]]]}),
        msgpack.packb({"v": v, "id": 17, "cmd": msgpack.ExtType(5, b"x")}),
        b"\xdd\xff\xff\xff\xff",  # array header claiming 4G items
        pack({"v": v, "id": 18, "cmd": "ping", "pad": "x" * (MAX_REQUEST_BYTES + 1)}),
        [b"part1", b"part2"],  # multi-part
    ]
    for msg in bad:
        if isinstance(msg, list):
            dealer.send_multipart(msg)
        else:
            dealer.send(msg)
        reply = parse_reply(dealer.recv())
        assert reply.ok is False, msg[:60]
        assert reply.error and "\n" not in reply.error and len(reply.error) <= 300
    assert pub.bad_requests == len(bad)
    # The id survives where it could be read, so the UI can match the error to its request.
    dealer.send(pack({"v": v, "id": 99, "cmd": "nope"}))
    reply = parse_reply(dealer.recv())
    assert reply.id == 99 and "unknown command" in reply.error and "ping" in reply.error
    # Bigger than MAXMSGSIZE: zmq drops that connection; the publisher carries on.
    dealer.send(b"\x00" * (2 * 1024 * 1024))
    dealer.close()
    c = clients()
    c.connect(None)
    assert c.ping() < 1.0
    pub(ops(0, 10))
    assert [e["seq"] for e in c.recv_events(1000)] == list(range(10))
    assert pub.running and pub.errors == 0


def test_client_reports_refusals_and_unreachable(publishers, clients, rt: Path) -> None:
    publishers()
    c = clients()
    c.connect(None)
    with pytest.raises(ProtocolError, match="unknown command"):
        c.request("launch")  # checked locally first
    # A command the protocol knows but this publisher serves no handler for (a job without
    # step-through control): a one-line refusal.
    with pytest.raises(SessionRefused, match="pause: command 'pause' is not supported"):
        c.request("pause")
    gone = clients()
    with pytest.raises(SessionUnreachable, match="no socket file"):
        gone.connect(f"ipc://{rt}/999999.control")
    silent = zmq.Context.instance().socket(zmq.ROUTER)  # accepts, never answers
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        t0 = time.monotonic()
        with pytest.raises(SessionUnreachable) as err:
            clients().connect(f"tcp://127.0.0.1:{port}", timeout=0.3)
        assert time.monotonic() - t0 < 1.8  # its own 0.3 s, not the default 2 s
        assert f"tcp://127.0.0.1:{port}" in str(err.value) and "\n" not in str(err.value)
    finally:
        silent.close()


def test_client_skips_bad_frames(clients) -> None:
    """A publisher that sends garbage (or a newer tracer's unknown frame type)."""
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.XPUB)  # a PUB that tells when the client's subscription arrived
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.RCVTIMEO, 60_000)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    c = clients()
    c.sub = c._socket(zmq.SUB)
    c.sub.setsockopt(zmq.SUBSCRIBE, b"")
    c.sub.connect(f"tcp://127.0.0.1:{port}")
    good = {"v": [1, 0], "type": "events", "frame": 1, "rank": 0, "dropped": 0,
            "events": [{"kind": "op", "seq": 1}]}  # fmt: skip
    assert pub.recv() == b"\x01"  # subscribed: no slow joiner (no snapshot handshake here)
    try:
        for raw in [
            b"junk",
            pack({**good, "v": [9, 0]}),
            pack({**good, "frame": -1}),
            pack({**good, "events": [{"seq": 1}]}),
            pack({**good, "events": "x"}),
            pack(good),
            pack({**good, "type": "future-thing", "frame": 2}),
            pack({**good, "frame": 5}),
        ]:
            pub.send(raw)
        frames: list[dict] = []
        deadline = time.monotonic() + 30
        while len(frames) < 3 and time.monotonic() < deadline:
            frames += c.recv(50)
        assert [f["frame"] for f in frames] == [1, 2, 5]
        assert frames[1]["type"] == "future-thing"
        assert c.bad_frames == 5 and c.frames_lost == 2
    finally:
        pub.close()


# -- fuzzing the request parser ---------------------------------------------------------------
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=8) | st.integers(-5, 5), inner, max_size=4)
    ),
    max_leaves=20,
)
_near_valid = st.fixed_dictionaries(
    {
        "v": st.sampled_from([[1, 0], [1, 7], [2, 0], [1], "1.0", None]) | _values,
        "id": st.integers(min_value=-(2**63), max_value=2**64 - 1) | _values,
        "cmd": st.sampled_from(["hello", "snapshot", "ping", "pause", ""]) | _values,
    },
    optional={
        "max_events": st.integers(min_value=-(2**63), max_value=2**64 - 1) | _values,
        "sub": st.text(max_size=70) | _values,
        "extra": _values,
    },
)


def _check_parse(raw: bytes) -> None:
    try:
        req = parse_request(raw)
    except RequestError as exc:
        assert isinstance(exc, ProtocolError)
        assert "\n" not in str(exc) and len(str(exc)) <= 300
        assert exc.request_id is None or 0 <= exc.request_id < 2**63
        return
    assert req.cmd in frames.COMMANDS and 0 <= req.id < 2**63
    if req.cmd == "snapshot":
        assert 0 <= req.args["max_events"] <= 100_000


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_fuzz_parse_request_random_bytes(raw: bytes) -> None:
    _check_parse(raw)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_near_valid | _values)
def test_fuzz_parse_request_structures(obj) -> None:
    _check_parse(pack(obj))


@settings(max_examples=200, deadline=None)
@given(_near_valid | _values | st.binary(max_size=100))
def test_fuzz_parse_frame(obj) -> None:
    raw = obj if isinstance(obj, bytes) else pack(obj)
    with contextlib.suppress(ProtocolError):
        parse_frame(raw)


def test_valid_requests_parse() -> None:
    req = parse_request(build_request(3, "snapshot", max_events=50))
    assert (req.id, req.cmd, req.args) == (3, "snapshot", {"max_events": 50})
    assert parse_request(build_request(4, "snapshot")).args == {"max_events": 10_000}
    assert parse_request(build_request(5, "hello", sub="ab-12")).args == {"sub": "ab-12"}
    assert parse_request(build_request(6, "ping")).args == {}
    # A newer minor version is read; unknown fields are refused (strict control).
    assert parse_request(pack({"v": [1, 9], "id": 1, "cmd": "ping"})).cmd == "ping"


# -- transports -------------------------------------------------------------------------------
def test_tcp_loopback(publishers, clients, monkeypatch) -> None:
    monkeypatch.setenv(ep.ENV_BIND, "tcp://127.0.0.1")
    pub = publishers()
    assert all(e.startswith("tcp://127.0.0.1:") and not e.endswith(":*") for e in pub.endpoints)
    assert ep.list_sessions()[0].control == pub.endpoints[1]  # actual port registered
    c = clients()
    c.connect(pub.endpoints[1])  # a bare control endpoint: the rest comes from hello
    assert c.events_endpoint == pub.endpoints[0]
    pub(ops(0, 3))
    assert [e["seq"] for e in c.recv_events(1000)] == [0, 1, 2]


def test_public_address_is_refused(rt: Path, monkeypatch) -> None:
    with pytest.raises(ep.EndpointError, match=r"^binding tcp://0\.0\.0\.0:\* requires CURVE"):
        EventPublisher(session_event(), events_endpoint="tcp://0.0.0.0:*")
    monkeypatch.setenv(ep.ENV_BIND, "tcp://0.0.0.0:7000")
    with pytest.raises(ep.EndpointError, match="requires CURVE keys"):
        EventPublisher(session_event())


def test_bind_failure_is_a_clear_error(publishers, rt: Path) -> None:
    publishers()
    with pytest.raises(ep.EndpointError, match="cannot bind torchscope live endpoints"):
        # Same tcp port twice (ipc would silently take the path over).
        busy = zmq.Context.instance().socket(zmq.ROUTER)
        busy.setsockopt(zmq.LINGER, 0)
        port = busy.bind_to_random_port("tcp://127.0.0.1")
        try:
            EventPublisher(
                session_event(), control_endpoint=f"tcp://127.0.0.1:{port}", register=False
            ).start()
        finally:
            busy.close()


def test_ranks_get_their_own_endpoints_and_records(publishers, clients) -> None:
    a = publishers(session=session_event(rank=0, world_size=2))
    b = publishers(session=session_event(rank=1, world_size=2))
    assert a.endpoints[1].endswith(f"{os.getpid()}-0.control")
    assert b.endpoints[1].endswith(f"{os.getpid()}-1.control")
    assert [r.rank for r in ep.list_sessions()] == [0, 1]
    c = clients()
    info = c.connect(ep.list_sessions()[1])
    assert info["rank"] == 1
    b(ops(0, 2, rank=1))
    frames = collect(c, 2)
    assert all(f["rank"] == 1 for f in frames)


def test_forked_child_leaves_the_parent_alone(publishers) -> None:
    pub = publishers()
    registry = Path(pub.record.path)
    pid = os.fork()
    if pid == 0:  # child: sink calls are ignored, close() touches nothing of the parent's
        code = 0
        try:
            pub(ops(0, 10))
            pub.close()
            code = 0 if pub.pending == 0 and registry.exists() else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert registry.exists() and pub.running


# -- a real job that dies, and the next run of the same script ---------------------------------
JOB = textwrap.dedent(
    """
    import os, sys, time, types
    sys.modules["torch"] = None  # proves the publisher needs no torch (import torch fails)
    sys.modules["textual"] = None
    # Import the publisher without the torch-importing tracer package __init__.
    pkg = types.ModuleType("torchscope.tracer")
    pkg.__path__ = [os.path.join(sys.argv[1], "torchscope", "tracer")]
    sys.modules["torchscope.tracer"] = pkg
    from torchscope.tracer.publisher import EventPublisher

    session = {"kind": "session", "seq": 0, "step": 0, "pid": os.getpid(),
               "script": __file__, "argv": sys.argv, "host": os.uname().nodename,
               "started": time.time()}
    pub = EventPublisher(session, heartbeat=0.1).start()
    seq = 1
    while True:
        pub([{"kind": "op", "seq": seq, "step": 0}])
        seq += 1
        time.sleep(0.01)
    """
)


def test_job_killed_then_next_run_is_found(rt: Path, clients, monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(client_mod, "ALIVE_SECONDS", 0.5)
    script = tmp_path / "train_job.py"
    script.write_text(JOB)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def launch() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(script), str(ROOT)], env=env)

    first = launch()
    try:
        rec = client_mod.wait_for_session(str(script), timeout=60)
        assert rec is not None and rec.pid == first.pid
        c = clients()
        c.connect(rec)
        assert some_events(c) and c.alive
        first.send_signal(signal.SIGKILL)  # no bye, no unregister
        first.wait()
        deadline = time.monotonic() + 30
        while c.alive and time.monotonic() < deadline:
            c.recv(50)
        assert not c.alive and not c.ended
        second = launch()
        try:
            nxt = client_mod.wait_for_session(
                "train_job.py", timeout=60, newer_than=rec.started, exclude_pids=(rec.pid,)
            )
            assert nxt is not None and nxt.pid == second.pid
            assert [r.pid for r in ep.list_sessions()] == [second.pid]  # dead one pruned
            c.connect(nxt)
            assert some_events(c) and c.alive
        finally:
            second.terminate()
            second.wait()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert client_mod.wait_for_session("nothing.py", timeout=0.1) is None


# -- with the real tracer (the one test that needs torch) ---------------------------------------
def test_real_tracer_streams_ops_and_grads(publishers, clients) -> None:
    """Until the Tracer creates its publisher itself, an extra sink does the same job."""
    import torch
    from models import mlp

    from torchscope.tracer import Tracer

    pub = publishers()
    c = clients()
    c.connect(None)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tracer = Tracer(sinks=[pub])
    try:
        with tracer:
            for _ in range(2):
                loss = model(torch.randn(4, 8)).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                pub.note_step(tracer.step_index)
    finally:
        tracer.stop()
    want = len(tracer.events)
    events: list = []
    deadline = time.monotonic() + 30
    while len(events) < want and time.monotonic() < deadline:
        events += c.recv_events(50)
    assert [e["seq"] for e in events] == [e["seq"] for e in tracer.events]
    kinds = {e.kind for e in events}
    assert {"session", "step", "op", "grad", "graph"} <= kinds
    assert any(e.kind == "grad" and e.node == "AddmmBackward0" for e in events)
    assert pub.step == tracer.step_index == 2


class _WeakEvent(dict):
    """An event the test can hold a weak reference to (a plain dict takes none)."""


def test_queue_and_ring_keep_no_event_objects_alive(publishers, clients) -> None:
    """Nobody subscribed: what the stream keeps for snapshots is encoded, so the events handed
    to it die with the job's last reference (no dict or list of theirs lives on to reach the
    collector's oldest generation), and a UI that asks later still gets them, unchanged."""
    import weakref

    pub = publishers()
    events = [
        _WeakEvent(kind="op", seq=i, step=0, inputs=[{"shape": [2, i], "stats": {"min": 0.5}}])
        for i in range(200)
    ]
    refs = [weakref.ref(e) for e in events]
    pub(events)
    expected = [dict(e) for e in events]
    del events
    assert all(r() is None for r in refs), "the stream keeps event objects alive"
    c = clients()
    c.connect(None)
    snap = c.snapshot(1000)
    got = [dict(e) for e in snap["events"]]
    assert got == expected and snap["dropped"] == 0


def test_an_unencodable_event_is_dropped_and_counted_alone(publishers, clients) -> None:
    pub = publishers()
    pub(
        [
            {"kind": "op", "seq": 0},
            {"kind": "op", "seq": 1, "bad": object()},
            {"kind": "op", "seq": 2},
        ]
    )
    assert pub.events_total == 3 and pub.dropped == 1
    c = clients()
    c.connect(None)
    assert [e["seq"] for e in c.snapshot(10)["events"]] == [0, 2]
