"""Live stream of a traced job to UIs: an event sink plus one background thread with the sockets.

The training thread encodes each event of a delivered batch (``__call__``: one msgpack call
per event, which the frames and the snapshot ring need anyway) and appends the bytes to a
bounded deque: no socket calls, no waiting on a UI. Encoded at once, events do not stay alive
as dicts and lists in the queue (up to a quarter of a second while nobody reads) and in the
ring (thousands of them): objects that live that long reach the collector's oldest
generation, and there they make CPython run full collections, each a fraction of a second in
a process with torch loaded. Bytes are not tracked by the collector at all. One daemon thread
owns every ZeroMQ socket (they are not thread-safe) and does the rest:

* XPUB (events): frames of at most ``frame_events`` events, sent with NOBLOCK. Each subscriber
  has its own queue (``sndhwm`` frames); when a UI stops reading, libzmq drops frames for that
  UI alone and every other UI keeps getting everything (frames, heartbeats, bye). (With
  ``XPUB_NODROP`` one full queue made every send fail, for everyone: a UI that stopped reading
  cut off all the others.) A UI learns what *it* lost from the numbers every frame carries:
  ``frame`` (consecutive) and ``sent`` (events published up to and including this frame), so
  ``SessionClient.frames_lost`` / ``events_lost`` count its own gaps. ``dropped`` counts what
  every UI lost: events the job's side could not take (bounded queue, unencodable). Frames are
  only built (the events' bytes joined) when somebody is subscribed (XPUB tells us about
  subscriptions).
* ROUTER (control): ``hello`` / ``snapshot`` / ``ping`` requests, each validated by
  :func:`torchscope.protocol.frames.parse_request`; a malformed request gets an error reply
  and bumps ``bad_requests``, nothing else happens.
* a ring of the last ``ring`` events (encoded) for snapshots, heartbeats every second, and
  "bye" at close.
* every tcp socket is a CURVE server, and a ZAP authenticator (pyzmq ``zmq.auth``) in this
  thread's context admits only known client keys (see :mod:`torchscope.protocol.security`):
  on loopback, the session's own client key, written with the session's keys into a 0600
  file in the user's 0700 runtime directory (so the same user's UIs connect with no set-up
  and other users get nothing); on a public address, the user's ``authorized_clients/``.
  ipc: plain (the runtime directory is private).

Snapshot consistency (zguide "Clone"): events enter the ring and a frame in the same step on
this thread, so a snapshot's ``frame`` number says exactly which frames it covers; the client
drops frames up to it. (Sequence numbers cannot do this exactly: alerts are numbered when
they are delivered, after the events that follow them.)

Imports neither torch nor textual.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from torchscope.protocol import endpoints as ep
from torchscope.protocol import security
from torchscope.protocol.codec import MAX_MESSAGE_BYTES, pack, pack_with_packed, unpack
from torchscope.protocol.frames import (
    BYE,
    HEARTBEAT,
    RequestError,
    error_reply,
    events_frame,
    ok_reply,
    one_line,
    parse_request,
    status_frame,
)
from torchscope.tracer.pending_events import FORGET, Doorbell, PendingEvents
from torchscope.tracer.ranks import waiting

# Subscriptions whose topic starts with this byte are client tokens, not interest in data:
# 0xC1 is never the first byte of a msgpack message, so no frame ever matches them.
TOKEN_PREFIX = b"\xc1"
# Bounds on what peers can make us remember.
MAX_TOPICS = 4096
CONTROL_MAX_MSG = 1024 * 1024  # ROUTER MAXMSGSIZE: a bigger message drops its connection
SUBSCRIBE_MAX_MSG = 4096  # XPUB MAXMSGSIZE: subscriptions are tiny
REQUESTS_PER_TURN = 100  # control messages handled before publishing again
EVENTS_PER_TURN = 20_000  # events framed before looking at control again
# How often the thread takes the queue while a UI reads (a frame's latency, at most).
READER_TURN = 0.02


class EventPublisher:
    """Sink that streams events to UIs. ``start()`` binds and registers; ``close()`` undoes it.

    ``session`` is the tracer's session event (sent in ``hello`` and snapshots). Endpoints
    default to :func:`torchscope.protocol.endpoints.default_endpoints`. The sink never blocks
    and never raises; at most ``max_pending`` events wait for the thread, older ones are dropped
    and counted.
    """

    def __init__(
        self,
        session: dict[str, Any],
        *,
        events_endpoint: str | None = None,
        control_endpoint: str | None = None,
        register: bool = True,
        ring: int = 10_000,
        max_pending: int = 100_000,
        frame_events: int = 1000,
        sndhwm: int = 1000,
        heartbeat: float = 1.0,
        close_linger_ms: int = 200,
    ) -> None:
        self.session = dict(session)
        rank = self.session.get("rank")
        self.rank: int | None = rank if isinstance(rank, int) else None
        pid = self.session.get("pid")
        self.pid: int = pid if isinstance(pid, int) and pid > 0 else os.getpid()
        if events_endpoint is None or control_endpoint is None:
            default_events, default_control = ep.default_endpoints(self.pid, self.rank)
            events_endpoint = events_endpoint or default_events
            control_endpoint = control_endpoint or default_control
        self.endpoints: tuple[str, str] = (
            ep.check_bind_address(events_endpoint),
            ep.check_bind_address(control_endpoint),
        )
        # A non-loopback tcp endpoint is bound as a CURVE server that admits only the UIs in
        # authorized_clients/ (check_bind_address refused it above if there are no keys).
        public = [e for e in self.endpoints if ep.is_public_tcp(e)]
        self._curve: security.ServerKeys | None = (
            security.load_server_keys(endpoint=public[0]) if public else None
        )
        # A loopback tcp endpoint is open to every local user: CURVE with keys made for this
        # session, the client's half written where only this user can read it (at start()).
        loopback = [e for e in self.endpoints if e.startswith("tcp://") and e not in public]
        if loopback:
            security.require_curve(loopback[0])
        self._session_keys: security.SessionKeys | None = (
            security.new_session_keys() if loopback else None
        )
        self.keys_file: str | None = None
        self.record = ep.SessionRecord.from_session(
            self.session, events=self.endpoints[0], control=self.endpoints[1]
        )
        self._register = register
        self.ring_size = max(0, int(ring))
        self.frame_events = max(1, int(frame_events))
        self.sndhwm = max(1, int(sndhwm))
        self.heartbeat_interval = heartbeat
        self.close_linger_ms = close_linger_ms

        # The sink's queue to the publisher thread, and the doorbell that wakes the thread.
        self._queue = PendingEvents(max_pending)
        self._doorbell = Doorbell()
        # Counters the publisher thread writes (the queue counts the sink's side). Read anywhere.
        self._dropped_send = 0  # a send error
        self.frames_sent = 0  # messages handed to the events socket
        # Events handed to the events socket; frames carry it as "sent", so each UI can tell
        # how many events it missed (libzmq drops per subscriber and does not say).
        self.events_sent = 0
        self.requests = 0
        self.bad_requests = 0
        self.errors = 0
        self.step: int | None = (
            self.session.get("step") if isinstance(self.session.get("step"), int) else None
        )
        # An agent's dormant / arming / traced, asked when a heartbeat or an answer says it.
        self.tracing_state: Callable[[], str | None] = lambda: None

        self._ring: deque[bytes] = deque(maxlen=self.ring_size)
        self._frame = 0  # number of the last message sent (or tried) on the events socket
        self._topics: set[bytes] = set()
        self._tokens: set[bytes] = set()
        self._has_subscriber = False
        self._errors_seen: set[str] = set()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._owner_pid = os.getpid()
        self._closed = False
        self._accepting = False
        self._bound_ipc: list[str] = []
        # Extra commands the tracer serves (step-through control, arming): name ->
        # handler(args, client), where client is the asking connection's id (bytes).
        # Handlers run on this thread; they must be quick and thread-safe.
        self.commands: dict[str, Callable[[dict[str, Any], bytes], dict[str, Any]]] = {}
        # Called with the client id and command of every valid request: a UI is alive.
        self.on_request: Callable[[bytes, str], None] | None = None
        # Called on this thread about four times a second (lease expiry).
        self.on_tick: Callable[[], None] | None = None

    # -- training-thread side ------------------------------------------------------------------
    def __call__(self, events: list[Any]) -> None:
        """Sink: encode ``events`` and queue them for the publisher thread. One msgpack call per
        event, never blocks on I/O, never raises. Safe to call from several threads (the
        tracer's watchdog flushes too)."""
        if not self._accepting or not events:
            return
        try:
            total = len(events)
            if total > self._queue.limit:  # one giant batch: keep its newest part
                events = events[-self._queue.limit :]
            if self._queue.put(self._encoded(events), total):
                self._doorbell.ring_once()
        except Exception:  # OSError on a closed pipe at exit included
            pass  # never into the job

    def _encoded(self, events: list[Any]) -> list[bytes]:
        """Each event's msgpack bytes; an event the codec cannot encode is left out (counted
        as dropped by the caller, said once) and the others go on."""
        try:
            return [pack(e) for e in events]
        except Exception:  # msgpack raises several types; sort out the bad events one by one
            out = []
            for e in events:
                try:
                    out.append(pack(e))
                except Exception as exc:
                    self._report("encoding events", exc)
            return out

    def forget(self) -> None:
        """Snapshots leave out every event queued so far: they still go out to the UIs
        subscribed now, and then the ring lets go of them (a dormant agent keeps none of its
        last armed period; a UI that joins later starts from the next one)."""
        if not self._accepting:
            return
        self._queue.forget()

    def note_step(self, step: int) -> None:
        """The job's current step, reported by hello, snapshots and heartbeats."""
        self.step = step

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> EventPublisher:
        """Bind the sockets (on the publisher thread), register the session, return self.

        Raises EndpointError / zmq.ZMQError with a clear message if binding fails; the tracer
        should then carry on without a live stream.
        """
        if self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._run, name="torchscope-publisher", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            self._thread.join()
            self._doorbell.close()
            self._closed = True
            err = self._start_error
            if isinstance(err, zmq.ZMQError):
                raise ep.EndpointError(f"cannot bind torchscope live endpoints: {err}") from None
            raise err
        self.record.events, self.record.control = self.endpoints
        if self._session_keys is not None:
            # Before registering: a UI that finds the session must find its keys too.
            try:
                self.keys_file = str(
                    security.write_session_keys(
                        self._session_keys,
                        [e for e in self.endpoints if not ep.is_public_tcp(e)],
                        pid=self.pid,
                        rank=self.rank,
                    )
                )
            except (OSError, ep.EndpointError) as exc:
                self._report("writing the session's keys (no UI can connect)", exc)
        if self._register:
            try:
                ep.register(self.record)
            except (OSError, ep.EndpointError) as exc:
                # The stream still works for a UI told the endpoint; say why `ls` cannot see it.
                self._report("registering the session", exc)
        self._accepting = True
        # A forked child (DataLoader workers) inherits this object but not the thread or the
        # sockets: it must neither queue events nor touch the parent's sockets and registry.
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _disown(ref))
        # Interpreter exit without stop(): still say bye, still leave no registry file behind.
        atexit.register(self.close)
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Publish what is queued (without waiting for slow UIs), send "bye", unregister, close
        the sockets. Returns within about ``close_linger_ms`` even when a UI is stuck or gone.
        Idempotent. Does nothing in a forked child (the sockets belong to the parent)."""
        if self._closed or os.getpid() != self._owner_pid:
            return
        self._closed = True
        self._accepting = False
        with contextlib.suppress(Exception):  # at interpreter exit atexit may be gone
            atexit.unregister(self.close)
        self._stop.set()
        self._doorbell.ring()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._register and self.record.path:
            ep.unregister(self.record)
        security.remove_session_keys(self.keys_file)
        self.keys_file = None
        for path in self._bound_ipc:
            # libzmq removes the socket files it created; this covers the cases it does not.
            with contextlib.suppress(OSError):
                os.unlink(path)
        self._doorbell.close()

    def __enter__(self) -> EventPublisher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def dropped(self) -> int:
        """Events no UI can get: pushed out of the bounded queue, or unencodable. What one UI
        lost because it read too slowly, it counts itself (``SessionClient.events_lost``)."""
        return self._queue.dropped + self._dropped_send

    @property
    def pending(self) -> int:
        """Events queued by the sink and not yet taken by the publisher thread."""
        return self._queue.count

    @property
    def events_total(self) -> int:
        """Events handed to the sink."""
        return self._queue.total

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def subscribed(self) -> bool:
        """Whether some UI is subscribed to the events socket (as the thread last saw it)."""
        return self._has_subscriber

    # -- publisher thread ----------------------------------------------------------------------
    def _run(self) -> None:
        ctx: zmq.Context | None = None
        pub = router = auth = None
        try:
            ctx = zmq.Context()
            if self._curve is not None or self._session_keys is not None:
                # The ZAP handler must be there before any client.
                auth = security.start_authenticator(
                    ctx,
                    self._curve,
                    [self._session_keys.client_public] if self._session_keys is not None else [],
                )
            pub = ctx.socket(zmq.XPUB)
            router = ctx.socket(zmq.ROUTER)
            for s in (pub, router):
                s.setsockopt(zmq.LINGER, 0)
            # Per subscriber: a UI whose queue is full loses frames alone (no XPUB_NODROP,
            # which would make one stuck UI stop the stream for every UI).
            pub.setsockopt(zmq.SNDHWM, self.sndhwm)
            pub.setsockopt(zmq.MAXMSGSIZE, SUBSCRIBE_MAX_MSG)
            router.setsockopt(zmq.MAXMSGSIZE, CONTROL_MAX_MSG)
            router.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a vanished UI: drop its reply
            router.setsockopt(zmq.SNDHWM, 100)  # a UI that never reads its replies
            actual = []
            for s, addr in ((pub, self.endpoints[0]), (router, self.endpoints[1])):
                if addr.startswith("tcp://["):
                    s.setsockopt(zmq.IPV6, 1)
                if self._curve is not None and ep.is_public_tcp(addr):
                    security.configure_server(s, self._curve)
                elif self._session_keys is not None and addr.startswith("tcp://"):
                    security.configure_server(s, self._session_keys.server)
                s.bind(addr)
                bound = s.getsockopt_string(zmq.LAST_ENDPOINT)
                actual.append(bound)
                path = ep.ipc_path(bound)
                if path is not None:
                    self._bound_ipc.append(str(path))
            self.endpoints = (actual[0], actual[1])
        except BaseException as exc:  # kept and raised in the job's thread by start()
            self._start_error = exc
            for sock in (pub, router):
                if sock is not None:
                    sock.close(linger=0)
            if auth is not None:
                auth.stop()
            if ctx is not None:
                ctx.term()
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop(pub, router)
        finally:
            try:
                self._finish(pub)
            except Exception as exc:
                self._report("closing the live stream", exc)
            pub.close(linger=self.close_linger_ms if self._has_subscriber else 0)
            router.close(linger=0)
            if auth is not None:
                auth.stop()
            ctx.term()  # returns once the bounded linger above has passed

    def _loop(self, pub: zmq.Socket, router: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(pub, zmq.POLLIN)
        poller.register(router, zmq.POLLIN)
        poller.register(self._doorbell.socket, zmq.POLLIN)
        wake_fd = self._doorbell.socket.fileno()  # the poller reports plain sockets by descriptor
        next_beat = time.monotonic() + self.heartbeat_interval
        next_tick = 0.0
        busy = False
        while not self._stop.is_set():
            try:
                turn = READER_TURN if self._has_subscriber else 0.25
                wait = 0 if busy else max(0.0, min(turn, next_beat - time.monotonic()))
                ready = dict(poller.poll(int(wait * 1000)))
                if wake_fd in ready:
                    self._doorbell.drain()
                if pub in ready:
                    self._read_subscriptions(pub)
                if router in ready:
                    self._serve(router, pub)
                busy = self._pump(pub)
                now = time.monotonic()
                if self.on_tick is not None and now >= next_tick:
                    next_tick = now + 0.25
                    self.on_tick()
                if now >= next_beat:
                    next_beat = now + self.heartbeat_interval
                    if self._has_subscriber:
                        self._send_status(pub, HEARTBEAT)
            except Exception as exc:  # a bug here must not kill the stream, nor the job
                self._report("the live stream", exc)
                time.sleep(0.05)

    def _finish(self, pub: zmq.Socket) -> None:
        """Last turn: what the job produced up to close() goes out (best effort), then bye."""
        self._read_subscriptions(pub)
        while self._pump(pub):
            pass
        if self._has_subscriber:
            self._send_status(pub, BYE)

    # -- events --------------------------------------------------------------------------------
    def _pump(self, pub: zmq.Socket) -> bool:
        """Move queued events into the ring and out as frames; True if more are waiting."""
        self._doorbell.turn()  # before taking: a sink call from now on rings again
        taken = 0
        buf: list[bytes] = []
        more = False
        while self._queue.waiting:
            if taken >= EVENTS_PER_TURN:
                more = True
                break
            batch = self._queue.take()
            if batch is None:
                break
            if batch is FORGET:
                # Events of ``buf`` are in the ring already: a snapshot's frame number covers
                # them once sent, and a UI that joins from now on never sees them.
                self._ring.clear()
                continue
            taken += len(batch)
            if self.ring_size:
                self._ring.extend(batch)
            if self._has_subscriber:
                buf.extend(batch)
                while len(buf) >= self.frame_events:
                    self._send_events(pub, buf[: self.frame_events])
                    del buf[: self.frame_events]
        if buf:
            # Not held back to fill a frame: the ring already has these events, so a snapshot
            # taken from now on must find them covered by a frame number.
            self._send_events(pub, buf)
        return more

    def _send_events(self, pub: zmq.Socket, events: list[bytes]) -> None:
        """One frame of encoded events: their bytes joined into the frame, not decoded."""
        self._frame += 1
        msg = events_frame(frame=self._frame, rank=self.rank, dropped=self.dropped, events=[])
        del msg["events"]
        msg["sent"] = self.events_sent + len(events)  # if this frame goes out
        if self._send(pub, pack_with_packed(msg, "events", events)):
            self.events_sent += len(events)
        else:
            self._dropped_send += len(events)

    def _send_status(self, pub: zmq.Socket, kind: str) -> None:
        self._frame += 1
        msg = status_frame(
            kind,
            frame=self._frame,
            rank=self.rank,
            dropped=self.dropped,
            step=self.step if isinstance(self.step, int) else None,
            events_total=self.events_total,
            pid=self.pid,
            t=time.time(),
            tracing=self.tracing_state(),
            waiting=waiting(),  # a rank held in a meeting by a paused one: UIs show it
        )
        msg["sent"] = self.events_sent
        self._send(pub, pack(msg))

    def _send(self, pub: zmq.Socket, data: bytes) -> bool:
        try:
            pub.send(data, zmq.NOBLOCK, copy=len(data) < 65536)
        except zmq.ZMQError:  # not expected without XPUB_NODROP; never wait, never raise
            return False
        self.frames_sent += 1
        return True

    def _read_subscriptions(self, pub: zmq.Socket) -> None:
        """XPUB hands us (un)subscriptions: b"\\x01topic" / b"\\x00topic". Without XPUB_VERBOSE
        it passes the first subscriber of a topic and the last to leave, so a set tracks it."""
        for _ in range(1000):
            try:
                msg = pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            if not msg or msg[0] not in (0, 1):
                continue  # an XSUB peer may send anything; we only act on subscriptions
            topic = bytes(msg[1:])
            target = self._tokens if topic.startswith(TOKEN_PREFIX) else self._topics
            if msg[0] == 1:
                if len(target) < MAX_TOPICS:
                    target.add(topic)
            else:
                target.discard(topic)
        self._has_subscriber = bool(self._topics)

    # -- control -------------------------------------------------------------------------------
    def _serve(self, router: zmq.Socket, pub: zmq.Socket) -> None:
        for _ in range(REQUESTS_PER_TURN):
            try:
                parts = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            # DEALER: [identity, payload]; REQ: [identity, b"", payload]. Anything else: error.
            if len(parts) == 3 and parts[1] == b"":
                envelope, payload = parts[:2], parts[2]
            elif len(parts) == 2:
                envelope, payload = parts[:1], parts[1]
            else:
                self.bad_requests += 1
                self._reply(router, parts[:1], error_reply(None, "expected one message frame"))
                continue
            self.requests += 1
            try:
                req = parse_request(payload)
            except RequestError as exc:
                self.bad_requests += 1
                self._reply(router, envelope, error_reply(exc.request_id, str(exc)))
                continue
            client = envelope[0]  # ROUTER's id of the UI's connection
            if self.on_request is not None:
                # the agent's bookkeeping of who asked: never costs the reply
                with contextlib.suppress(Exception):
                    self.on_request(client, req.cmd)
            try:
                handler = getattr(self, f"_cmd_{req.cmd}", None)
                extra = self.commands.get(req.cmd)
                if handler is not None:
                    reply = ok_reply(req.id, handler(req.args, pub))
                elif extra is not None:
                    try:
                        reply = ok_reply(req.id, extra(req.args, client))
                    except ValueError as exc:  # a refused command (bad breakpoint, not paused)
                        reply = error_reply(req.id, str(exc))
                else:
                    reply = error_reply(req.id, f"command '{req.cmd}' is not supported by this job")
                data = pack(reply)
            except Exception as exc:
                self._report(f"answering '{req.cmd}'", exc)
                data = pack(error_reply(req.id, f"internal error: {type(exc).__name__}: {exc}"))
            self._reply(router, envelope, data)

    def _reply(self, router: zmq.Socket, envelope: list[bytes], reply: dict | bytes) -> None:
        data = reply if isinstance(reply, bytes) else pack(reply)
        # The UI went away or never reads its replies: its problem, not the job's.
        with contextlib.suppress(zmq.ZMQError):
            router.send_multipart([*envelope, data], zmq.NOBLOCK)

    def _counters(self) -> dict[str, Any]:
        return {
            "step": self.step if isinstance(self.step, int) else None,
            "frame": self._frame,
            "dropped": self.dropped,
            "events_total": self.events_total,
            "tracing": self.tracing_state(),
        }

    def _cmd_hello(self, args: dict[str, Any], pub: zmq.Socket) -> dict[str, Any]:
        result = {
            "session": self.session,
            "events_endpoint": self.endpoints[0],
            "pid": self.pid,
            "rank": self.rank,
            **self._counters(),
        }
        token = args.get("sub")
        if token is not None:
            self._read_subscriptions(pub)  # it may have arrived since this turn's poll
            result["subscribed"] = TOKEN_PREFIX + token.encode() in self._tokens
        return result

    def _cmd_snapshot(self, args: dict[str, Any], pub: zmq.Socket) -> dict[str, Any]:
        while self._pump(pub):  # events queued while nobody read, not yet in the ring
            pass
        n = min(args["max_events"], len(self._ring))
        packed = list(itertools.islice(self._ring, len(self._ring) - n, None))
        # Keep the reply decodable by the client's limit: halve (keeping the newest) until so.
        truncated = False
        while packed and sum(map(len, packed)) > MAX_MESSAGE_BYTES // 2:
            packed = packed[len(packed) // 2 :]
            truncated = True
        # Decoded again for the reply: snapshots are rare, the ring is encoded for every step.
        events = [unpack(b) for b in packed]
        counters = self._counters()
        return {"session": self.session, "events": events, "truncated": truncated, **counters}

    def _cmd_ping(self, args: dict[str, Any], pub: zmq.Socket) -> dict[str, Any]:
        return {"t": time.time()}

    # -- helpers -------------------------------------------------------------------------------
    def _report(self, where: str, exc: BaseException) -> None:
        """Say a problem once per place and kind on stderr; never raise it."""
        self.errors += 1
        key = f"{where}:{type(exc).__name__}"
        if key in self._errors_seen:
            return
        self._errors_seen.add(key)
        print(
            f"torchscope: live stream: {where}: {one_line(f'{type(exc).__name__}: {exc}')} "
            "(the job continues; reported once)",
            file=sys.stderr,
        )


def _disown(ref: weakref.ref[EventPublisher]) -> None:
    pub = ref()
    if pub is not None:
        pub._accepting = False
        pub._closed = True
