"""CURVE on public addresses: keys, refusals, and who gets through.

What a user is promised: ipc needs no keys and loopback tcp uses per-session keys (see
test_transport_auth.py); a job refuses to bind a public address without keys, in one line
that says to run `torchscope keys`; with keys, a UI holding an authorized client key gets
events and control, and a UI with any other key, or none, gets nothing at all.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import shutil
import socket
import stat
import tempfile
import time
from pathlib import Path

import pytest
import zmq
from live_events import ops, session_event
from sessions import NO_ANSWER, _nothing_left, some_events  # noqa: F401

from torchscope.cli.keys import cmd_keys
from torchscope.protocol import endpoints as ep
from torchscope.protocol import security
from torchscope.protocol.client import SessionClient, SessionUnreachable, reachable_endpoint
from torchscope.protocol.frames import build_request
from torchscope.protocol.security import SecurityError
from torchscope.tracer.publisher import EventPublisher

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")

ANY = "tcp://0.0.0.0:*"


# -- helpers ----------------------------------------------------------------------------------
def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def port_of(endpoint: str) -> str:
    return endpoint.rsplit(":", 1)[1]


def machine_ip() -> str | None:
    """A non-loopback IPv4 address of this machine, or None."""
    candidates = []
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # UDP: picks the outgoing interface, sends nothing
        candidates.append(s.getsockname()[0])
    with contextlib.suppress(OSError):
        candidates += [
            i[4][0] for i in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
        ]
    for ip in candidates:
        addr = ipaddress.ip_address(ip)
        if not addr.is_loopback and not addr.is_unspecified:
            return ip
    return None


@pytest.fixture
def rt(monkeypatch: pytest.MonkeyPatch):
    base = Path(tempfile.mkdtemp(prefix="tsec-", dir="/tmp"))
    monkeypatch.setenv(ep.ENV_RUNTIME_DIR, str(base / "run"))
    monkeypatch.delenv(ep.ENV_BIND, raising=False)
    yield base / "run"
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rt: Path) -> security.KeyPaths:
    monkeypatch.setenv(security.ENV_KEYS_DIR, str(tmp_path / "keys"))
    return security.generate_keys()


@pytest.fixture
def ip() -> str:
    found = machine_ip()
    if found is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    return found


@pytest.fixture
def publishers():
    made: list[EventPublisher] = []

    def make(**kw) -> EventPublisher:
        pub = EventPublisher(session_event(), register=kw.pop("register", False), **kw).start()
        made.append(pub)
        return pub

    yield make
    for pub in made:
        pub.close()


@pytest.fixture
def sockets():
    ctx = zmq.Context.instance()
    made: list[zmq.Socket] = []

    def make(kind: int, keys: security.ClientKeys | None = None) -> zmq.Socket:
        s = ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            security.configure_client(s, keys)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close(linger=0)


def other_ui(tmp_path: Path, keys: security.KeyPaths, *, server_key: bool = True) -> Path:
    """A key directory of a UI the job does not know: its own client pair, and (unless
    ``server_key`` is False) the job's real server.key."""
    d = tmp_path / "stranger"
    security.generate_keys(d)
    if server_key:
        shutil.copyfile(keys.server_public, d / "server.key")
    return d


# -- keys -------------------------------------------------------------------------------------
def test_generated_keys_modes_and_contents(keys: security.KeyPaths) -> None:
    assert mode(keys.directory) == 0o700
    assert mode(keys.authorized_dir) == 0o700
    for p in (keys.server_public, keys.client_public, keys.authorized_client):
        assert mode(p) == 0o644, p
    for p in (keys.server_secret, keys.client_secret):
        assert mode(p) == 0o600, p
    assert sorted(os.listdir(keys.directory)) == [
        "authorized_clients",
        "client.key",
        "client.key_secret",
        "server.key",
        "server.key_secret",
    ]  # no temporary left behind
    assert b"secret-key" not in keys.server_public.read_bytes()
    assert b"secret-key" not in keys.client_public.read_bytes()
    server = security.load_server_keys()
    client = security.load_client_keys()
    assert client.server_public == server.public
    assert server.authorized == {client.public}
    assert security.load_authorized() == {client.public}
    assert zmq.curve_public(server.secret) == server.public
    # Secrets stay out of logs and tracebacks.
    assert server.secret.decode() not in repr(server)
    assert client.secret.decode() not in repr(client)


@pytest.mark.parametrize("umask", [0o000, 0o077, 0o027])
def test_modes_do_not_depend_on_the_umask(tmp_path: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        p = security.generate_keys(tmp_path / "a" / "keys")
    finally:
        os.umask(old)
    assert mode(p.directory) == mode(p.authorized_dir) == 0o700
    assert mode(p.server_secret) == mode(p.client_secret) == 0o600
    assert mode(p.server_public) == mode(p.client_public) == mode(p.authorized_client) == 0o644


def test_refuses_to_overwrite_without_force(keys: security.KeyPaths) -> None:
    before = keys.server_secret.read_bytes()
    with pytest.raises(SecurityError, match=r"already exist in .*--force") as err:
        security.generate_keys()
    assert "\n" not in str(err.value)
    assert keys.server_secret.read_bytes() == before
    # Another UI's authorization survives --force; the replaced client is re-authorized.
    shutil.copyfile(keys.client_public, keys.authorized_dir / "laptop.key")
    old_client = security.load_client_keys().public
    security.generate_keys(force=True)
    assert keys.server_secret.read_bytes() != before
    new_client = security.load_client_keys().public
    assert security.load_authorized() == {old_client, new_client}


def test_keys_dir_location(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(security.ENV_KEYS_DIR, raising=False)
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert security.keys_dir() == tmp_path / ".config" / "torchscope" / "keys"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    assert security.keys_dir() == tmp_path / "cfg" / "torchscope" / "keys"
    monkeypatch.setenv(security.ENV_KEYS_DIR, str(tmp_path / "elsewhere"))
    assert security.keys_dir() == tmp_path / "elsewhere"


def test_cli_keys(monkeypatch, tmp_path: Path, capsys) -> None:
    monkeypatch.setenv(security.ENV_KEYS_DIR, str(tmp_path / "k"))
    assert cmd_keys(argparse.Namespace(force=False)) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "k") in out
    assert "TORCHSCOPE_BIND=tcp://0.0.0.0:5555 torchscope run train.py" in out
    assert "scp -p" in out and "authorized_clients" in out
    assert cmd_keys(argparse.Namespace(force=False)) == 2
    err = capsys.readouterr().err
    assert err.startswith("torchscope: error: CURVE keys already exist") and err.count("\n") == 1
    assert cmd_keys(argparse.Namespace(force=True)) == 0


# -- binding ----------------------------------------------------------------------------------
def test_public_bind_refused_without_keys(tmp_path: Path, monkeypatch, rt: Path) -> None:
    empty = tmp_path / "nokeys"
    monkeypatch.setenv(security.ENV_KEYS_DIR, str(empty))
    with pytest.raises(ep.EndpointError) as err:
        ep.check_bind_address("tcp://0.0.0.0:5555")
    assert str(err.value) == (
        f"binding tcp://0.0.0.0:5555 requires CURVE keys: run `torchscope keys` (looked in {empty})"
    )
    assert isinstance(err.value, SecurityError)
    with pytest.raises(ep.EndpointError, match=r"^binding tcp://0\.0\.0\.0:\* requires CURVE keys"):
        EventPublisher(session_event(), events_endpoint=ANY, control_endpoint=ANY)
    monkeypatch.setenv(ep.ENV_BIND, "tcp://0.0.0.0:5555")
    with pytest.raises(ep.EndpointError, match=r"requires CURVE keys: run `torchscope keys`"):
        EventPublisher(session_event())
    assert not empty.exists()  # looking created nothing


def test_loopback_and_ipc_never_look_at_keys(tmp_path: Path, monkeypatch) -> None:
    bad = tmp_path / "file"
    bad.write_text("not a directory")
    monkeypatch.setenv(security.ENV_KEYS_DIR, str(bad))
    assert ep.check_bind_address("tcp://127.0.0.1:5555") == "tcp://127.0.0.1:5555"
    assert ep.check_bind_address("tcp://localhost:*") == "tcp://127.0.0.1:*"
    assert ep.check_bind_address("ipc:///tmp/x/1.control") == "ipc:///tmp/x/1.control"
    assert not ep.is_public_tcp("tcp://127.0.0.1:5555")
    assert not ep.is_public_tcp("tcp://[::1]:5555")
    assert not ep.is_public_tcp("ipc:///tmp/x")
    assert ep.is_public_tcp("tcp://0.0.0.0:5555")
    assert ep.is_public_tcp("tcp://*:5555")
    assert ep.is_public_tcp("tcp://gpu-node:5555")


def test_public_bind_allowed_with_keys(keys: security.KeyPaths) -> None:
    assert ep.check_bind_address("tcp://0.0.0.0:5555") == "tcp://0.0.0.0:5555"
    assert ep.check_bind_address("tcp://[::]:*") == "tcp://[::]:*"


def _tamper(keys: security.KeyPaths, what: str) -> str:
    """Break the key directory one way; return a fragment of the expected message."""
    if what == "open dir":
        os.chmod(keys.directory, 0o755)
        return r"mode is 0755, so other users can reach it; run 'chmod 700 "
    if what == "readable secret":
        os.chmod(keys.server_secret, 0o644)
        return r"can read the secret key; run 'chmod 600 "
    if what == "nobody authorized":
        keys.authorized_client.unlink()
        return r"no UI is authorized: .*authorized_clients holds no \*\.key file"
    if what == "garbage authorized":
        (keys.authorized_dir / "junk.key").write_text("hello\n")
        return r"junk\.key is not a CURVE certificate"
    if what == "writable authorized dir":
        os.chmod(keys.authorized_dir, 0o777)
        return r"authorized_clients: its mode is 0777"
    if what == "mismatched secret":
        client_public = security.load_client_keys().public.decode()
        text = keys.server_secret.read_text().splitlines()
        text = [
            f'    public-key = "{client_public}"' if "public-key" in line else line for line in text
        ]
        keys.server_secret.write_text("\n".join(text) + "\n")
        return r"the secret key does not match the public key"
    raise AssertionError(what)


@pytest.mark.parametrize(
    "what",
    [
        "open dir",
        "readable secret",
        "nobody authorized",
        "garbage authorized",
        "writable authorized dir",
        "mismatched secret",
    ],
)
def test_unsafe_or_broken_keys_are_refused(keys: security.KeyPaths, what: str) -> None:
    match = _tamper(keys, what)
    with pytest.raises(SecurityError, match=match) as err:
        ep.check_bind_address("tcp://0.0.0.0:5555")
    assert str(err.value).startswith("binding tcp://0.0.0.0:5555: ")
    assert "\n" not in str(err.value)
    with pytest.raises(ep.EndpointError, match=match):
        EventPublisher(session_event(), events_endpoint=ANY, control_endpoint=ANY)


def test_client_without_keys_is_told_what_to_copy(tmp_path: Path, monkeypatch) -> None:
    empty = tmp_path / "nokeys"
    monkeypatch.setenv(security.ENV_KEYS_DIR, str(empty))
    with pytest.raises(ep.EndpointError) as err:
        SessionClient().connect("tcp://192.0.2.7:5555", timeout=0.2)
    assert str(err.value) == (
        "connecting to tcp://192.0.2.7:5555 requires CURVE keys: copy server.key, client.key "
        "and client.key_secret from the job's machine (made there by `torchscope keys`) "
        f"into {empty}"
    )


def test_reachable_endpoint() -> None:
    assert (
        reachable_endpoint("tcp://0.0.0.0:41000", "tcp://10.0.0.5:5555") == "tcp://10.0.0.5:41000"
    )
    assert reachable_endpoint("tcp://[::]:41000", "tcp://gpu-node:5555") == "tcp://gpu-node:41000"
    assert reachable_endpoint("tcp://0.0.0.0:41000", "tcp://[fd00::2]:5555") == (
        "tcp://[fd00::2]:41000"
    )
    assert reachable_endpoint("tcp://10.0.0.9:41000", "tcp://10.0.0.5:5555") == (
        "tcp://10.0.0.9:41000"
    )
    assert reachable_endpoint("ipc:///tmp/a.events", "ipc:///tmp/a.control") == (
        "ipc:///tmp/a.events"
    )


# -- who gets through -------------------------------------------------------------------------
def test_authorized_client_round_trip(keys, ip: str, publishers, rt: Path) -> None:
    pub = publishers(events_endpoint=ANY, control_endpoint=ANY, register=True)
    assert all(e.startswith("tcp://0.0.0.0:") for e in pub.endpoints)
    with SessionClient() as c:
        hello = c.connect(f"tcp://{ip}:{port_of(pub.endpoints[1])}", timeout=30)
        assert hello["events_endpoint"] == pub.endpoints[0]
        assert c.events_endpoint == f"tcp://{ip}:{port_of(pub.endpoints[0])}"  # rewritten
        assert c.subscribed
        pub(ops(0, 5))
        assert [e["seq"] for e in some_events(c)] == [0, 1, 2, 3, 4]
        assert [e["seq"] for e in c.snapshot(100)["events"]] == [0, 1, 2, 3, 4]
        assert c.ping() < 1
    # On the job's own machine, through the registry (`torchscope ls`, `torchscope tui PID`).
    (record,) = ep.list_sessions()
    assert record.control == pub.endpoints[1]
    with SessionClient() as c:
        c.connect(record, timeout=30)
        assert c.subscribed
        pub(ops(5, 6))
        assert [e["seq"] for e in some_events(c)] == [5]


@pytest.mark.parametrize("who", ["unauthorized key", "wrong server key", "no CURVE"])
def test_other_clients_get_nothing(
    who: str, keys, ip: str, publishers, sockets, tmp_path: Path, monkeypatch
) -> None:
    pub = publishers(events_endpoint=ANY, control_endpoint=ANY)
    control = f"tcp://{ip}:{port_of(pub.endpoints[1])}"
    events = f"tcp://{ip}:{port_of(pub.endpoints[0])}"
    good = SessionClient()
    good.connect(control, timeout=30)  # proves the job is up and streaming meanwhile
    requests = pub.requests

    if who == "no CURVE":
        stranger_keys = None
        stranger = SessionClient(curve=False)
    else:
        d = other_ui(tmp_path, keys, server_key=who == "unauthorized key")
        if who == "wrong server key":  # our authorized pair, but a server.key that is not the job's
            for name in ("client.key", "client.key_secret"):
                shutil.copyfile(keys.directory / name, d / name)
        monkeypatch.setenv(security.ENV_KEYS_DIR, str(d))
        stranger_keys = security.load_client_keys()
        stranger = SessionClient()
    try:
        with pytest.raises(SessionUnreachable, match=NO_ANSWER) as err:
            stranger.connect(control, timeout=0.5)
        assert "\n" not in str(err.value)
        if stranger_keys is not None:
            assert "authorized_clients" in str(err.value)  # the hint says what to check
    finally:
        stranger.close()

    # Raw sockets, so nothing in SessionClient hides what would arrive.
    sub = sockets(zmq.SUB, stranger_keys)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(events)
    dealer = sockets(zmq.DEALER, stranger_keys)
    dealer.connect(control)
    # A refused handshake drops the connection's queue: on a loaded machine it may be gone
    # before the send, which then cannot queue at all. Either way nothing gets through.
    with contextlib.suppress(zmq.Again):
        dealer.send(build_request(1, "ping"), zmq.NOBLOCK)
    deadline = time.monotonic() + 0.6
    seq = 0
    while time.monotonic() < deadline:
        pub(ops(seq, seq + 10))
        seq += 10
        assert not sub.poll(50, zmq.POLLIN), f"{who}: received events"
        assert not dealer.poll(0, zmq.POLLIN), f"{who}: received a reply"
    assert len(some_events(good)) > 0  # meanwhile the authorized UI gets them
    assert pub.requests == requests  # not one request from the stranger reached the job
    good.close()


def test_loopback_publisher_is_curve_with_session_keys(keys, publishers, sockets, rt: Path) -> None:
    """Loopback TCP is reachable by every local user: it is CURVE too, with keys of its own
    (the user's keys are for public addresses). More in test_transport_auth.py."""
    pub = publishers(events_endpoint="tcp://127.0.0.1:*", control_endpoint="tcp://127.0.0.1:*")
    assert pub._curve is None and pub._session_keys is not None
    dealer = sockets(zmq.DEALER)  # no CURVE at all
    dealer.connect(pub.endpoints[1])
    dealer.send(build_request(1, "ping"))
    assert not dealer.poll(500, zmq.POLLIN)
    with SessionClient() as c:  # the same user: no set-up
        c.connect(pub.endpoints[1], timeout=30)
        assert c.subscribed and c.ping() < 1


def test_authorizations_are_read_at_start(keys, ip: str, publishers, tmp_path, monkeypatch) -> None:
    """A key added while the job runs is not admitted (documented: restart the job)."""
    pub = publishers(events_endpoint=ANY, control_endpoint=ANY)
    d = other_ui(tmp_path, keys)
    shutil.copyfile(d / "client.key", keys.authorized_dir / "late.key")
    pub2 = publishers(events_endpoint=ANY, control_endpoint=ANY)  # the next job
    monkeypatch.setenv(security.ENV_KEYS_DIR, str(d))  # from here on: the late UI's keys
    with SessionClient() as c, pytest.raises(SessionUnreachable):
        c.connect(f"tcp://{ip}:{port_of(pub.endpoints[1])}", timeout=0.3)
    with SessionClient() as c:
        c.connect(f"tcp://{ip}:{port_of(pub2.endpoints[1])}", timeout=30)
        assert c.subscribed
