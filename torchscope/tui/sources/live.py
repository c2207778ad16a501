"""Following a running job (:class:`LiveSource`), through
``torchscope.protocol.client.SessionClient``.

No textual imports here, and no torch.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from torchscope.protocol.events import DORMANT, SESSION
from torchscope.protocol.tracefile import TraceFileError, TraceReader
from torchscope.session.countpass import LiveOverview
from torchscope.session.inbox import Inbox
from torchscope.session.items import NewSession, Refused, Reply, Unavailable, WholeStep
from torchscope.session.rows import prepare
from torchscope.tui.sources.base import EventSource, session_status

__all__ = ["LiveSource"]


def _default_client_factory() -> Any:
    from torchscope.protocol.client import SessionClient

    return SessionClient()


class LiveSource(EventSource):
    """Follows a running job through ``torchscope.protocol.client.SessionClient``.

    ``target`` is what ``SessionClient.connect`` takes: a control endpoint (``ipc://...``,
    ``tcp://...``), a pid (as a string), or None for the one running session. Connects
    (subscribing first), takes a snapshot of the events the job still holds, asks the job's
    stepping ``state`` (it may be paused already), then applies frames as they come; the client
    skips frames the snapshot covers and counts lost ones. An unreachable session is retried
    every ``retry_seconds``.

    This thread is the only one that touches the client: ``command`` queues a command, the
    loop sends it between two receives and posts the reply. While connected it also sends a
    ``ping`` every ``ping_seconds``: the lease that keeps a paused job waiting for this UI (a
    job resumes by itself once its UI stops talking). Quitting sends nothing: the sockets
    close, and a job this UI paused resumes when its lease runs out.
    """

    mode = "live"
    can_command = True

    def __init__(
        self,
        control_endpoint: str | None = None,
        *,
        timeout: float = 2.0,
        snapshot_events: int = 100_000,
        recording: str | os.PathLike[str] | None = None,
        client_factory: Callable[[], Any] | None = None,
        retry_seconds: float = 1.0,
        recv_timeout_ms: int = 100,
        ping_seconds: float = 1.0,
        command_timeout: float = 5.0,
    ) -> None:
        super().__init__()
        self.target = control_endpoint
        self.label = control_endpoint or "the running session"
        self.timeout = timeout
        self.snapshot_events = snapshot_events
        self.recording = os.fspath(recording) if recording is not None else None
        self.can_reload = self.recording is not None
        self._factory = client_factory or _default_client_factory
        self.retry_seconds = retry_seconds
        self.recv_timeout_ms = recv_timeout_ms
        self.ping_seconds = ping_seconds
        self.command_timeout = command_timeout
        self.client: Any = None
        self.pings = 0  # answered pings (tests)
        self._armed = False  # this UI holds the job (arm answered): it keeps it held
        self._last_ping = 0.0
        self._running = False
        self._snapshot_seqs: set[int] = set()
        self._snapshot_max = -1
        # (script, started, pid) of the run being followed: when it ends, the next run of the
        # same script (e.g. the user starts it again) is followed.
        self._followed: tuple[str, float, int] | None = None
        self._lost = False
        self._reported: dict[str, Any] = {}
        self.overview = LiveOverview()  # the Steps panel's loss and |g|

    def run(self, inbox: Inbox, stop: threading.Event) -> None:
        inbox.status(mode="live", connected=False, state="connecting", endpoint=self.target)
        self._running = True
        try:
            while not stop.is_set():
                if self.client is None:
                    if not self._connect(inbox):
                        self._serve_commands(inbox)  # refused: nothing to send them to
                        stop.wait(self.retry_seconds)
                    continue
                try:
                    frames = self.client.recv(self.recv_timeout_ms)
                except Exception as exc:  # a broken connection: report it, connect again
                    inbox.status(connected=False, state="disconnected", error=_one_line(exc))
                    self._close_client()
                    continue
                for frame in frames or ():
                    if isinstance(frame, dict):
                        self._frame(frame, inbox)
                self._report(inbox)
                if self._job_gone():
                    # The job ended or went silent: say so (done by _report), then watch for
                    # the next run of the same script and follow it (see _connect).
                    self._close_client()
                    self._lost = True
                    continue
                self._serve_commands(inbox)
                self._ping(inbox)
                for step in self._take_requests():
                    self._load_recorded(step, inbox)
        finally:
            self._running = False
            self._let_go()
            self._close_client()

    def close(self) -> None:
        """Close the client, unless ``run`` is using it: ZeroMQ sockets belong to one thread,
        so a running loop closes its client itself once its stop event is set."""
        if not self._running:
            self._close_client()

    def _serve_commands(self, inbox: Inbox) -> None:
        """Send the queued commands, one at a time; post each reply or refusal."""
        for token, cmd, fields in self._take_commands():
            client = self.client
            if client is None:
                why = "not connected to the job"
                if self.target:
                    why += f" at {self.target}"
                inbox.put(Refused(token, cmd, fields, why))
                continue
            try:
                result = client.request(cmd, timeout=self.command_timeout, **fields)
            except Exception as exc:  # SessionRefused, SessionUnreachable, a bad field, ...
                inbox.put(Refused(token, cmd, fields, _one_line(exc)))
            else:
                inbox.put(Reply(token, cmd, fields, result))
                self._last_ping = time.monotonic()  # any request renews the lease

    def _ping(self, inbox: Inbox) -> None:
        """The lease: any request tells the job its UI is alive. A job that let this UI's
        hold go (the UI stalled past the lease: stopped, swapped out) is armed again."""
        now = time.monotonic()
        if self.client is None or now - self._last_ping < self.ping_seconds:
            return
        self._last_ping = now
        try:
            self.client.request("ping", timeout=min(self.timeout, self.ping_seconds * 2))
        except Exception:  # a job gone or hung shows as not alive; nothing to add here
            return
        self.pings += 1
        if self._armed and getattr(self.client, "tracing", None) == DORMANT:
            self._arm(inbox)

    def _arm(self, inbox: Inbox) -> None:
        """Hold the job traced while this UI is here (a dormant job arms at its next step
        boundary). A job that cannot be armed (a ``trace(live=True)`` block) is traced anyway."""
        try:
            result = self.client.request("arm", timeout=self.timeout)
        except Exception:  # a gone job: its end comes as news
            return
        self._armed = True
        if isinstance(result.get("tracing"), str):
            self.client.tracing = result["tracing"]  # not dormant any more: no second arm
            inbox.status(tracing=result["tracing"])

    def _let_go(self) -> None:
        """Quitting: the job goes dormant at its next step boundary (unless others hold it),
        and this UI's breakpoints and pauses go with it. Best effort: a gone job needs none."""
        c = self.client
        if c is None or getattr(c, "ended", False) or not getattr(c, "alive", True):
            return
        with contextlib.suppress(Exception):  # a gone job needs no disarm
            c.request("disarm", timeout=0.5)

    def _ask_state(self, inbox: Inbox) -> None:
        """The job's stepping state (is it paused already?), posted as a reply with token 0
        (no one waits for it). A job without step-through control refuses: nothing to say."""
        try:
            result = self.client.request("state", timeout=self.timeout)
        except Exception:  # a gone job: its end comes as news
            return
        inbox.put(Reply(0, "state", {}, result))

    def _close_client(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            with contextlib.suppress(Exception):  # closing: nothing left to tell
                client.close()

    def _job_gone(self) -> bool:
        c = self.client
        return c is not None and (
            bool(getattr(c, "ended", False)) or not bool(getattr(c, "alive", True))
        )

    def _next_run(self) -> tuple[bool, Any]:
        """(found, target): what to connect to. After the followed job ended, the next run of
        the same script, once it has registered; before that, the target we were given (None
        means the only running session)."""
        if not self._lost:
            return True, self.target
        if self._followed is None:
            return False, None  # nothing to recognise a next run by
        script, started, pid = self._followed
        from torchscope.protocol.client import wait_for_session

        record = wait_for_session(script, 0, newer_than=started, exclude_pids=(pid,))
        return record is not None, record

    def _connect(self, inbox: Inbox) -> bool:
        client = None
        found, target = self._next_run()
        if not found:
            return False  # the old run ended and no new one yet: keep waiting
        try:
            client = self._factory()
            hello = client.connect(target, timeout=self.timeout)
            snap = client.snapshot(self.snapshot_events, timeout=max(self.timeout, 5.0))
        except Exception as exc:  # EndpointError, SessionUnreachable, SessionRefused, ...
            if client is not None:
                with contextlib.suppress(Exception):
                    client.close()
            inbox.status(connected=False, state="unreachable", error=_one_line(exc))
            return False
        self.client = client
        self._reported = {}
        hello = hello if isinstance(hello, dict) else {}
        session = hello.get("session")
        if self._lost:
            inbox.put(NewSession())  # a new run: the UI starts a fresh store
            self._lost = False
            self.overview = LiveOverview()
        if isinstance(session, dict) and session.get("script") and session.get("pid"):
            self._followed = (session["script"], session.get("started") or 0.0, session["pid"])
        record = session.get("record") if isinstance(session, dict) else None
        if self.recording is None and isinstance(record, str) and record:
            self.recording = record
            self.can_reload = True
        status = {
            "mode": "live",
            "connected": True,
            "state": "connected",
            "error": None,
            "endpoint": getattr(client, "control_endpoint", None) or self.target,
            "step": hello.get("step"),
            "dropped": hello.get("dropped") or 0,
            "events_total": hello.get("events_total"),
            "recording": self.recording,
            "subscribed": hello.get("subscribed"),
            "tracing": hello.get("tracing"),
            **session_status(session),
        }
        for key in ("pid", "rank"):
            if hello.get(key) not in (None, 0):
                status[key] = hello[key]
        inbox.status(**status)
        if isinstance(session, dict) and session.get("kind") == SESSION:
            inbox.put_events(prepare([session]))
        events = snap.get("events") if isinstance(snap, dict) else None
        if events:
            self._snapshot_seqs = {e["seq"] for e in events if isinstance(e, dict) and "seq" in e}
            self._snapshot_max = max(self._snapshot_seqs, default=-1)
            self._put(inbox, prepare(events))
            self.overview.put(inbox, events)
        self._ask_state(inbox)
        self._arm(inbox)
        self._last_ping = time.monotonic()
        return True

    def _frame(self, frame: dict, inbox: Inbox) -> None:
        status: dict[str, Any] = {}
        if "paused" in frame:
            status["paused"] = bool(frame["paused"])
        if frame.get("type") == "heartbeat":  # a rank held in a meeting by a paused one
            wait = frame.get("waiting")
            status["waiting"] = wait if isinstance(wait, dict) else None
        state = frame.get("state")
        if isinstance(state, dict) and "paused" in state:
            status["paused"] = bool(state["paused"])
        if frame.get("type") == "events":
            events = frame.get("events") or ()
            if self._snapshot_seqs:  # clients that do not skip what the snapshot covered
                kept = []
                for e in events:
                    seq = e.get("seq") if isinstance(e, dict) else None
                    if seq in self._snapshot_seqs:
                        continue
                    kept.append(e)
                    if type(seq) is int and seq > self._snapshot_max + 10_000:
                        self._snapshot_seqs = set()
                events = kept
            self._put(inbox, prepare(events))
            self.overview.put(inbox, events)
        if status:
            inbox.status(**status)

    def _report(self, inbox: Inbox) -> None:
        """Status the client keeps (dropped, lost frames, step, alive, ended), when it changes."""
        c = self.client
        if c is None:
            return
        ended = bool(getattr(c, "ended", False))
        alive = bool(getattr(c, "alive", True))
        now = {
            "dropped": getattr(c, "dropped", 0) or 0,
            "gaps": getattr(c, "frames_lost", 0) or 0,
            "lost": getattr(c, "events_lost", 0) or 0,  # what this UI missed, reading slowly
            "step": getattr(c, "step", None),
            "tracing": getattr(c, "tracing", None),
            "connected": alive and not ended,
            "state": "ended" if ended else ("connected" if alive else "disconnected"),
        }
        changed = {k: v for k, v in now.items() if self._reported.get(k, object()) != v}
        if changed:
            self._reported.update(changed)
            inbox.status(**changed)

    def _put(self, inbox: Inbox, items: list) -> None:
        if not inbox.put_events(items):
            inbox.status(ui_dropped=inbox.dropped)

    def _load_recorded(self, step: int, inbox: Inbox) -> None:
        if not self.recording:
            inbox.put(Unavailable(step, f"step {step} was evicted from memory"))
            return
        try:
            with TraceReader(self.recording) as reader:
                events = list(reader.iter_events(step=step))
        except TraceFileError as exc:
            inbox.put(Unavailable(step, f"step {step}: {exc}"))
            return
        inbox.put(WholeStep(step, prepare(events)))


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text
