"""TCP, loopback included, is authenticated; IPv6 loopback works.

What a user is promised: with ``TORCHSCOPE_BIND=tcp://127.0.0.1:PORT`` (or ``[::1]``) the
user's own UI connects with no set-up, and nobody without the session's keys (another user of
the machine, a raw socket) gets anything: no reply, no frame, not one request reaches the job.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import stat
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import other_user
import pytest
import zmq
from live_events import ops, session_event
from sessions import NO_ANSWER, _nothing_left, some_events  # noqa: F401

from torchscope.protocol import endpoints as ep
from torchscope.protocol import security
from torchscope.protocol.client import SessionClient, SessionUnreachable
from torchscope.protocol.frames import build_request
from torchscope.tracer.publisher import EventPublisher

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
ROOT = Path(__file__).resolve().parents[1]


def have_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.fixture
def rt(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    base = Path(tempfile.mkdtemp(prefix="tsauth-", dir="/tmp"))
    monkeypatch.setenv(ep.ENV_RUNTIME_DIR, str(base / "run"))
    monkeypatch.delenv(ep.ENV_BIND, raising=False)
    # No user keys anywhere: loopback must need none.
    monkeypatch.setenv(security.ENV_KEYS_DIR, str(tmp_path / "no-keys"))
    yield base / "run"
    shutil.rmtree(base, ignore_errors=True)


def raw(kind: int, keys: security.ClientKeys | None = None) -> zmq.Socket:
    s = zmq.Context.instance().socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.IPV6, 1)
    if keys is not None:
        security.configure_client(s, keys)
    return s


# -- the same user: no set-up ---------------------------------------------------------------
@pytest.mark.parametrize("host", ["127.0.0.1", "[::1]"])
def test_same_user_connects_with_no_setup(host: str, rt: Path, monkeypatch, closing) -> None:
    if host == "[::1]" and not have_ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    monkeypatch.setenv(ep.ENV_BIND, f"tcp://{host}")
    pub = EventPublisher(session_event()).start()
    closing.append(pub)
    assert all(e.startswith(f"tcp://{host}:") for e in pub.endpoints)
    # The session's keys: a private file in the private runtime directory.
    keyfile = Path(pub.keys_file)
    assert keyfile.parent == rt and keyfile.name.endswith(".curve")
    assert stat.S_IMODE(os.stat(keyfile).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(rt).st_mode) == 0o700
    stored = json.loads(keyfile.read_text())
    assert set(stored["endpoints"]) == set(pub.endpoints)
    # By bare endpoint, and through the registry (`torchscope tui PID`).
    for target in (pub.endpoints[1], None, str(os.getpid())):
        c = SessionClient()
        closing.append(c)
        info = c.connect(target, timeout=30)
        assert c.subscribed and info["events_endpoint"] == pub.endpoints[0]
        pub(ops(0, 3))
        assert [e["seq"] for e in some_events(c)] == [0, 1, 2]
        assert c.ping() < 1
        c.close()
    pub.close()
    assert not keyfile.exists()  # the keys go with the session


# -- everyone else: nothing -------------------------------------------------------------------
@pytest.mark.parametrize("who", ["no CURVE", "own keys", "other user's runtime dir"])
def test_without_the_session_keys_nothing_gets_through(
    who: str, rt: Path, monkeypatch, tmp_path: Path, closing
) -> None:
    monkeypatch.setenv(ep.ENV_BIND, "tcp://127.0.0.1")
    pub = EventPublisher(session_event()).start()
    closing.append(pub)
    control, events = pub.endpoints[1], pub.endpoints[0]
    good = SessionClient()
    closing.append(good)
    good.connect(control, timeout=30)  # the job is up and streaming meanwhile
    requests = pub.requests

    keys = None
    if who == "own keys":
        # CURVE with a key pair the job never saw, and even the job's real public key.
        public, secret = zmq.curve_keypair()
        server = security.find_session_keys(control)
        assert server is not None
        keys = security.ClientKeys(public, secret, server.server_public, tmp_path)
    elif who == "other user's runtime dir":
        # Another user's UI looks in its own runtime directory, where this job's keys are not.
        other = tmp_path / "other-run"
        monkeypatch.setenv(ep.ENV_RUNTIME_DIR, str(other))
        stranger = SessionClient()
        closing.append(stranger)
        t0 = time.monotonic()
        with pytest.raises(SessionUnreachable, match="no torchscope session of yours") as err:
            stranger.connect(control, timeout=20)
        # said at once (no keys to try), not after waiting out the timeout: a loaded machine
        # may take a second or two, never twenty
        assert "\n" not in str(err.value) and time.monotonic() - t0 < 20
        with pytest.raises(SessionUnreachable):
            stranger.connect(events, timeout=0.5)
        # And it cannot simply force its way in without CURVE.
        stranger_plain = SessionClient(curve=False)
        closing.append(stranger_plain)
        with pytest.raises(SessionUnreachable, match=NO_ANSWER):
            stranger_plain.connect(control, timeout=0.5)
        monkeypatch.setenv(ep.ENV_RUNTIME_DIR, str(rt))

    # Raw sockets, so nothing in SessionClient hides what would arrive.
    sub = raw(zmq.SUB, keys)
    closing.append(sub)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(events)
    dealer = raw(zmq.DEALER, keys)
    closing.append(dealer)
    dealer.connect(control)
    # A refused handshake drops the connection's queue: on a loaded machine it may be gone
    # before the send, which then cannot queue at all. Either way nothing gets through.
    with contextlib.suppress(zmq.Again):
        dealer.send(build_request(1, "hello"), zmq.NOBLOCK)
    deadline = time.monotonic() + 0.8
    seq = 0
    while time.monotonic() < deadline:
        pub(ops(seq, seq + 10))
        seq += 10
        assert not sub.poll(50, zmq.POLLIN), f"{who}: received frames"
        assert not dealer.poll(0, zmq.POLLIN), f"{who}: received a reply"
    assert len(some_events(good)) > 0  # meanwhile the job's own user's UI gets them
    assert pub.requests == requests  # not one request from the stranger reached the job


def test_keys_file_is_private_and_found_only_for_its_endpoints(rt: Path, monkeypatch) -> None:
    keys = security.new_session_keys()
    path = security.write_session_keys(
        keys, ["tcp://127.0.0.1:40001", "tcp://127.0.0.1:40002"], pid=os.getpid(), rank=3
    )
    assert path.name.startswith(f"{os.getpid()}-3.") and path.suffix == ".curve"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    found = security.find_session_keys("tcp://localhost:40002")  # same address, spelt otherwise
    assert found is not None and found.public == keys.client_public
    assert found.server_public == keys.server_public and found.secret == keys.client_secret
    assert security.find_session_keys("tcp://127.0.0.1:40003") is None
    assert security.find_session_keys("tcp://[::1]:40001") is None
    os.chmod(path, 0o644)  # a file others could read is not trusted (nor used)
    assert security.find_session_keys("tcp://127.0.0.1:40001") is None
    os.chmod(path, 0o600)
    security.remove_session_keys(path)
    assert not path.exists() and security.find_session_keys("tcp://127.0.0.1:40001") is None


# -- a real second user -----------------------------------------------------------------------
STRANGER = textwrap.dedent(
    """
    import json, os, sys, time
    import zmq
    from torchscope.protocol.client import SessionClient, SessionUnreachable
    from torchscope.protocol.frames import build_request
    control, events, keyfile = sys.argv[1:4]
    out = {"uid": os.getuid()}
    try:
        open(keyfile).read()
        out["read_keys"] = True
    except OSError as exc:
        out["read_keys"] = False
    c = SessionClient()
    try:
        c.connect(control, timeout=1)
        out["client"] = "connected"
    except SessionUnreachable as exc:
        out["client"] = "unreachable: " + str(exc)
    c.close()
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB); sub.setsockopt(zmq.LINGER, 0); sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(events)
    dealer = ctx.socket(zmq.DEALER); dealer.setsockopt(zmq.LINGER, 0); dealer.connect(control)
    dealer.send(build_request(1, "hello"))
    out["frames"] = bool(sub.poll(1500, zmq.POLLIN))
    out["reply"] = bool(dealer.poll(10, zmq.POLLIN))
    print(json.dumps(out))
    """
)


def test_another_uid_gets_nothing(rt: Path, monkeypatch, tmp_path: Path, closing) -> None:
    """Run only where this test can become another user (root); skipped elsewhere."""
    if not other_user.can_become_other():
        pytest.skip("needs root to run a second uid")
    monkeypatch.setenv(ep.ENV_BIND, "tcp://127.0.0.1")
    pub = EventPublisher(session_event()).start()
    closing.append(pub)
    home = other_user.other_home("tsother-")
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(home),
        "PYTHONPATH": str(ROOT),
        "TORCHSCOPE_RUNTIME_DIR": str(home / "run"),
        "TORCHSCOPE_KEYS_DIR": str(home / "keys"),
    }

    stop = threading.Event()

    def stream() -> None:
        seq = 0
        while not stop.is_set():
            pub(ops(seq, seq + 10))
            seq += 10
            time.sleep(0.02)

    # The other user may not reach this interpreter (e.g. a pyenv under /root): then the same
    # Python version from the system, with this environment's zmq and msgpack on its path.
    import msgpack

    deps = {str(Path(m.__file__).resolve().parents[1]) for m in (zmq, msgpack)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *sorted(deps)])
    feeder = threading.Thread(target=stream, daemon=True)
    feeder.start()
    try:
        args = ["-c", STRANGER, pub.endpoints[1], pub.endpoints[0], pub.keys_file]
        proc = other_user.run_as_other(args, env, home, other_user.system_pythons())
    finally:
        stop.set()
        feeder.join()
        shutil.rmtree(home, ignore_errors=True)
    if proc is None:
        pytest.skip("no Python this test can run as another uid")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["uid"] == other_user.UID
    assert out["read_keys"] is False
    assert out["client"].startswith("unreachable: no torchscope session of yours")
    assert out["frames"] is False and out["reply"] is False
    assert pub.requests == 0
