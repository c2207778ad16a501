"""The UI's end of a live session: control requests over DEALER, frames over SUB.

Used by the TUI's live source, ``torchscope ls`` and ``torchscope record``. Not thread-safe:
one thread (the UI's ingest worker) owns a client, like ZeroMQ sockets themselves.

Joining a running job without gaps or duplicates (zguide "Clone")::

    client = SessionClient()
    client.connect(None)             # DEALER + SUB; returns once the SUB is known subscribed
    snap = client.snapshot(10_000)   # the latest events, and the frame number they cover
    while client.alive:
        for frame in client.recv(100):   # frames covered by the snapshot are skipped
            ...

Every tcp endpoint is reached with CURVE (see :mod:`torchscope.protocol.security`): a loopback
one with the keys its job wrote for this session into the user's private runtime directory
(nothing to set up; another user's job is unreachable), a public one with this machine's
client key pair and the job's public key, from the key directory. A job bound to ``0.0.0.0``
names its events endpoint ``tcp://0.0.0.0:PORT``; the client connects to that port on the
host it reached control on. IPv6 literals (``tcp://[::1]:PORT``) work.

Losses are counted per UI: the job drops frames for a UI that reads too slowly (that UI
alone), and every frame carries its number and the running count of events sent, so
``frames_lost`` and ``events_lost`` say what *this* client missed; ``dropped`` is what the job
could not send to anyone.

Imports neither torch nor textual.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import secrets
import time
from collections.abc import Iterator
from typing import Any

import zmq

from torchscope.protocol import endpoints as ep
from torchscope.protocol import security
from torchscope.protocol.codec import MAX_MESSAGE_BYTES, ProtocolError
from torchscope.protocol.events import Event
from torchscope.protocol.frames import (
    BYE,
    EVENTS,
    HEARTBEAT,
    build_request,
    check_result,
    parse_frame,
    parse_reply,
)
from torchscope.protocol.runtime import EndpointError, runtime_dir, split_tcp

# Token subscriptions start with this byte (see tracer.publisher.TOKEN_PREFIX; duplicated here
# because the UI must not import the tracer package, which imports torch).
TOKEN_PREFIX = b"\xc1"
ALIVE_SECONDS = 3.0  # no frame for this long (heartbeats come every second): not alive
MAX_FRAMES_PER_RECV = 10_000
# One recv() call drains for at most this long, so a UI that fell behind stays responsive.
MAX_RECV_SECONDS = 0.2
# A job bound to one of these hosts listens on every interface; "hello" names it as bound.
ANY_HOSTS = frozenset({"0.0.0.0", "::", "*", ""})
# ``HOST:PORT`` of a SOCKS5 proxy (``ssh -N -D 1080 LOGIN``) that every connection to a
# public tcp endpoint goes through: one tunnel from a laptop reaches every rank of a cluster
# job by its own address (host names are resolved at the far end). Loopback and ipc: direct.
ENV_SOCKS = "TORCHSCOPE_SOCKS_PROXY"


class SessionUnreachable(ConnectionError):
    """The session did not answer in time (the job ended, hung, or the address is wrong)."""


class SessionRefused(RuntimeError):
    """The session answered with an error (``ok: false``); the text is its one line."""


class SessionClient:
    """Connection to one traced process."""

    def __init__(
        self, context: zmq.Context | None = None, *, rcvhwm: int = 1000, curve: bool | None = None
    ) -> None:
        self._ctx = context or zmq.Context.instance()
        self._rcvhwm = rcvhwm
        # CURVE on tcp endpoints: None/True = always (session keys on loopback, the key
        # directory's on a public address); False = never (only for tests of refusals).
        self._curve = curve
        self._client_keys: dict[str, security.ClientKeys] = {}
        self._ids = itertools.count(1)
        self.dealer: zmq.Socket | None = None
        self.sub: zmq.Socket | None = None
        self.record: ep.SessionRecord | None = None
        self.control_endpoint: str | None = None
        self.events_endpoint: str | None = None
        self.session: dict[str, Any] | None = None
        self.subscribed = False  # the publisher confirmed our subscription
        self.ended = False  # a "bye" frame arrived
        self.last_frame: int | None = None  # number of the newest frame received
        self.snapshot_frame = 0  # frames up to this number are covered by the snapshot
        self.frames_lost = 0  # gaps in frame numbers: frames this client missed
        self.events_lost = 0  # events in the frames this client missed (from "sent" counts)
        self.bad_frames = 0  # frames that failed validation (skipped)
        self.stale_replies = 0  # replies to requests we had given up on
        self.dropped = 0  # the publisher's total, as of the last frame
        self.step: int | None = None
        self.tracing: str | None = None  # dormant / arming / traced, for jobs that say
        self.events_total = 0
        self._last_seen: float | None = None
        self._sent: int | None = None  # the "sent" count of the newest frame

    # -- connecting -----------------------------------------------------------------------------
    def connect(
        self, target: str | ep.SessionRecord | None = None, *, timeout: float = 2.0
    ) -> dict[str, Any]:
        """Connect to ``target`` (see :func:`endpoints.resolve`: None, a pid, or a control
        endpoint; or a SessionRecord) and subscribe to its events. Returns the ``hello``
        result. Raises EndpointError (cannot tell which session), SessionUnreachable.

        Returns only once the publisher has confirmed the subscription (or ``timeout``
        passed, then ``subscribed`` is False), so a snapshot taken next leaves no gap.
        """
        self.close()
        self._reset()
        record = target if isinstance(target, ep.SessionRecord) else ep.resolve(target)
        self.record = record
        self.control_endpoint = record.control
        path = ep.ipc_path(record.control)
        if path is not None and not path.exists():
            raise SessionUnreachable(
                f"torchscope session at {record.control} is gone (no socket file)"
            )
        curve = self._uses_curve(record.control)
        self._client_keys = {}
        self.dealer = self._socket(
            zmq.DEALER, record.control if curve else None, ipv6=_ipv6(record.control)
        )
        self.dealer.connect(record.control)
        deadline = time.monotonic() + timeout
        try:
            info = self.hello(timeout=timeout)
        except SessionUnreachable as exc:
            raise SessionUnreachable(f"{exc}{_hint(record.control, curve)}") from None
        advertised = info.get("events_endpoint") or record.events
        if not advertised:
            raise SessionUnreachable(f"session at {record.control} names no events endpoint")
        self.events_endpoint = reachable_endpoint(advertised, record.control)
        curve = self._uses_curve(advertised) or self._uses_curve(self.events_endpoint)
        token = secrets.token_hex(8)
        self.sub = self._socket(
            zmq.SUB,
            self.events_endpoint if curve else None,
            ipv6=_ipv6(self.events_endpoint),
            also=record.control if curve else None,
        )
        self.sub.setsockopt(zmq.RCVHWM, self._rcvhwm)
        # Everything, plus a topic no frame matches: when the publisher reports seeing that
        # one, our subscription to everything (sent before it on the same pipe) is in place.
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.SUBSCRIBE, TOKEN_PREFIX + token.encode())
        self.sub.connect(self.events_endpoint)
        while True:
            remaining = max(0.05, deadline - time.monotonic())
            info = self.hello(sub=token, timeout=remaining)
            if info.get("subscribed"):
                self.subscribed = True
                break
            if time.monotonic() >= deadline:
                break  # usable, but the first frames may be missed; `subscribed` says so
            time.sleep(0.01)
        self._last_seen = time.monotonic()
        return info

    def _reset(self) -> None:
        self.subscribed = self.ended = False
        self.last_frame = None
        self.snapshot_frame = self.frames_lost = self.bad_frames = self.stale_replies = 0
        self.dropped = self.events_total = self.events_lost = 0
        self._sent = None
        self.step = None
        self.tracing = None
        self.waiting: dict[str, Any] | None = None  # the meeting this rank is held in, if any
        self._last_seen = None

    def _uses_curve(self, endpoint: str) -> bool:
        return self._curve is not False and endpoint.startswith("tcp://")

    def _keys(self, endpoint: str, also: str | None = None) -> security.ClientKeys:
        """CURVE keys for ``endpoint``: a public address uses the key directory's (SecurityError
        when missing); a loopback one the keys its job wrote for this session (found by this
        endpoint, or by ``also``, the same job's control endpoint); SessionUnreachable when
        there are none (not this user's job, or it has ended)."""
        keys = self._client_keys.get(endpoint)
        if keys is not None:
            return keys
        if ep.is_public_tcp(endpoint):
            keys = security.load_client_keys(endpoint=endpoint)
        else:
            keys = security.find_session_keys(endpoint)
            if keys is None and also is not None:
                keys = self._client_keys.get(also) or security.find_session_keys(also)
            if keys is None:
                where = _runtime_dir_text()
                raise SessionUnreachable(
                    f"no torchscope session of yours listens at {endpoint}: a job bound to "
                    f"loopback TCP admits only UIs holding the keys it keeps in {where}, and "
                    "there are none for this address (another user's job, or it has ended)"
                )
        self._client_keys[endpoint] = keys
        return keys

    def _socket(
        self,
        kind: int,
        curve_endpoint: str | None = None,
        *,
        ipv6: bool | None = None,
        also: str | None = None,
    ) -> zmq.Socket:
        """A socket with our limits; a CURVE client when ``curve_endpoint`` is given (see
        :meth:`_keys`); IPv6-capable for an IPv6 literal endpoint."""
        keys = self._keys(curve_endpoint, also) if curve_endpoint is not None else None
        s = self._ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)  # bound what a peer can make us hold
        if ipv6 if ipv6 is not None else _ipv6(curve_endpoint):
            s.setsockopt(zmq.IPV6, 1)
        if keys is not None:
            security.configure_client(s, keys)
        proxy = os.environ.get(ENV_SOCKS, "").strip()
        if proxy and curve_endpoint is not None and ep.is_public_tcp(curve_endpoint):
            s.setsockopt(zmq.SOCKS_PROXY, proxy.encode())
        return s

    def close(self) -> None:
        """Close the sockets (LINGER 0: nothing waits). The context is left to its owner."""
        for s in (self.dealer, self.sub):
            if s is not None:
                s.close(linger=0)
        self.dealer = self.sub = None

    def __enter__(self) -> SessionClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- control --------------------------------------------------------------------------------
    def request(self, cmd: str, timeout: float = 2.0, **fields: Any) -> dict[str, Any]:
        """Send one request and wait for its reply; returns the validated result.

        Raises SessionUnreachable on timeout, SessionRefused on an error reply, ProtocolError
        on a reply that does not validate. Replies to earlier, abandoned requests are skipped.
        """
        if self.dealer is None:
            raise SessionUnreachable("not connected to a torchscope session")
        rid = next(self._ids)
        raw = build_request(rid, cmd, **fields)
        where = self.control_endpoint
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.dealer.send(raw, zmq.NOBLOCK)
                break
            except zmq.Again:  # no connection yet and the queue is full
                if time.monotonic() >= deadline:
                    raise SessionUnreachable(
                        f"torchscope session at {where} is not accepting requests"
                    ) from None
                time.sleep(0.01)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.dealer.poll(max(1, int(left * 1000)), zmq.POLLIN):
                raise SessionUnreachable(
                    f"torchscope session at {where} did not answer '{cmd}' within "
                    f"{timeout:g} s (has the job ended?)"
                )
            reply = parse_reply(self.dealer.recv())
            if reply.id != rid:
                self.stale_replies += 1
                continue
            self._last_seen = time.monotonic()
            if not reply.ok:
                raise SessionRefused(f"{cmd}: {reply.error}")
            assert reply.result is not None
            return check_result(cmd, reply.result)

    def hello(self, sub: str | None = None, timeout: float = 2.0) -> dict[str, Any]:
        args = {"sub": sub} if sub is not None else {}
        info = self.request("hello", timeout=timeout, **args)
        self.session = info["session"]
        self._note(info)
        return info

    def snapshot(self, max_events: int = 10_000, timeout: float = 5.0) -> dict[str, Any]:
        """The newest ``max_events`` events; later :meth:`recv` calls skip the frames the
        snapshot already covers, so snapshot + live frames have no gap and no duplicate."""
        snap = self.request("snapshot", timeout=timeout, max_events=max_events)
        self.snapshot_frame = max(self.snapshot_frame, snap["frame"])
        self.session = snap["session"]
        self._note(snap)
        return snap

    def ping(self, timeout: float = 1.0) -> float:
        """Round-trip time in seconds."""
        t0 = time.monotonic()
        self.request("ping", timeout=timeout)
        return time.monotonic() - t0

    def _note(self, d: dict[str, Any]) -> None:
        if isinstance(d.get("dropped"), int):
            self.dropped = d["dropped"]
        if isinstance(d.get("events_total"), int):
            self.events_total = d["events_total"]
        if "step" in d and (d["step"] is None or isinstance(d["step"], int)):
            self.step = d["step"]
        if isinstance(d.get("tracing"), str):
            self.tracing = d["tracing"]
        if d.get("type") == HEARTBEAT:  # a rank held in a meeting says what it waits for
            wait = d.get("waiting")
            self.waiting = wait if isinstance(wait, dict) else None

    # -- events ---------------------------------------------------------------------------------
    def recv(self, timeout_ms: int = 100) -> list[dict[str, Any]]:
        """Frames that arrived, waiting up to ``timeout_ms`` for the first one.

        Validated; invalid ones are skipped and counted in ``bad_frames``; frames covered by
        the snapshot are skipped. Every kind is returned (events, heartbeat, bye, and types a
        newer tracer may add); see :meth:`recv_events` for just the events.
        """
        if self.sub is None:
            return []
        out: list[dict[str, Any]] = []
        if not self.sub.poll(max(0, int(timeout_ms)), zmq.POLLIN):
            return out
        with _gc_paused():
            self._drain(self.sub, out)
        return out

    def _drain(self, sub: zmq.Socket, out: list[dict[str, Any]]) -> None:
        deadline = time.monotonic() + MAX_RECV_SECONDS
        for _ in range(MAX_FRAMES_PER_RECV):
            if time.monotonic() > deadline:
                break
            try:
                raw = sub.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                frame = parse_frame(raw)
            except ProtocolError:
                self.bad_frames += 1
                continue
            self._last_seen = time.monotonic()
            n = frame["frame"]
            if self.last_frame is not None:
                if n > self.last_frame + 1:
                    self.frames_lost += n - self.last_frame - 1
                elif n <= self.last_frame:
                    # Numbers went back: a new publisher on the same endpoint (the process
                    # traced again). Its frames are all new.
                    self.snapshot_frame = 0
                    self.ended = False
                    self._sent = None
            self.last_frame = n
            sent = frame.get("sent")
            if type(sent) is int:
                # Events sent before this frame's own.
                before = sent - len(frame["events"]) if frame["type"] == EVENTS else sent
                if self._sent is not None and before > self._sent:
                    self.events_lost += before - self._sent
                self._sent = sent
            self.dropped = frame.get("dropped", self.dropped)
            if frame["type"] == BYE:
                self.ended = True
            if frame["type"] != EVENTS:
                self._note(frame)
            if n <= self.snapshot_frame:
                continue
            out.append(frame)

    def recv_events(self, timeout_ms: int = 100) -> list[Event]:
        """Only the events of :meth:`recv`, flattened, in order."""
        return [e for f in self.recv(timeout_ms) if f["type"] == EVENTS for e in f["events"]]

    @property
    def alive(self) -> bool:
        """A "bye" has not arrived and something came from the job within ALIVE_SECONDS.

        Judged from what :meth:`recv` and requests saw: call ``recv`` regularly."""
        return (
            not self.ended
            and self._last_seen is not None
            and time.monotonic() - self._last_seen <= ALIVE_SECONDS
        )


def reachable_endpoint(endpoint: str, control: str) -> str:
    """``endpoint`` as named by a job, made connectable: a tcp endpoint bound to every
    interface (``tcp://0.0.0.0:PORT``) becomes PORT on the host ``control`` reached."""
    if not (endpoint.startswith("tcp://") and control.startswith("tcp://")):
        return endpoint
    try:
        host, port = split_tcp(endpoint)
        control_host, _ = split_tcp(control)
    except EndpointError:
        return endpoint
    if host not in ANY_HOSTS or port is None:
        return endpoint
    hostpart = f"[{control_host}]" if ":" in control_host else control_host
    return f"tcp://{hostpart}:{port}"


def _hint(control: str, curve: bool) -> str:
    """What else an unanswered hello may mean, on tcp."""
    if curve and ep.is_public_tcp(control):
        return (
            "; with CURVE, also check that this machine's client.key is in the job's "
            "authorized_clients and that server.key is the job's"
        )
    if control.startswith("tcp://") and not curve:
        return "; a job bound to tcp answers only CURVE clients"
    return ""


def _ipv6(endpoint: str | None) -> bool:
    """An IPv6 literal tcp endpoint (``tcp://[::1]:PORT``): its socket needs zmq.IPV6."""
    return endpoint is not None and endpoint.startswith("tcp://[")


def _runtime_dir_text() -> str:
    try:
        return str(runtime_dir())
    except EndpointError:
        return "your torchscope runtime directory"


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Decoding creates many small containers; in a UI that already holds 100k events, the
    collections they trigger cost 3-4x the decoding itself (measured). Nothing decoded here
    is cyclic garbage, so the collector can wait until the batch is in."""
    was = gc.isenabled()
    if was:
        gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _matches(record: ep.SessionRecord, script: str | int) -> bool:
    if isinstance(script, int) or (
        isinstance(script, str) and script.isascii() and script.isdigit()
    ):
        return record.pid == int(script)
    if not record.script:
        return False
    if record.script == script or os.path.basename(record.script) == os.path.basename(script):
        return True
    try:
        return os.path.realpath(record.script) == os.path.realpath(script)
    except OSError:
        return False


def wait_for_session(
    script: str | int,
    timeout: float,
    *,
    newer_than: float | None = None,
    exclude_pids: tuple[int, ...] = (),
    poll: float = 0.2,
) -> ep.SessionRecord | None:
    """Wait until a session of ``script`` (path or file name) or ``pid`` is registered; the
    newest match, or None after ``timeout`` seconds.

    For the UI to follow a job across restarts: after the old session ends, call it with the
    old script, ``newer_than=old.started`` and ``exclude_pids=(old.pid,)``.
    """
    deadline = time.monotonic() + timeout
    while True:
        matches = [
            r
            for r in ep.list_sessions()
            if _matches(r, script)
            and r.pid not in exclude_pids
            and (newer_than is None or r.started > newer_than)
        ]
        if matches:
            return max(matches, key=lambda r: (r.started, -(r.rank or 0)))
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        time.sleep(min(poll, left))
