"""The live jobs this server reaches, each through one :class:`SessionClient`, as a UI does.

A :class:`JobLink` connects (subscribing, then a snapshot: no gap), keeps the events it
receives in a bounded buffer (the analysis tools read a live job from it), and follows the
job's stepper (``pause``/``resume`` events, the ``state`` every stepping reply carries: the
UI's :class:`~torchscope.session.stepper_view.StepperView`).

Once the agent drives the job (a breakpoint, pause, step...), the link *holds* it as a UI
does: armed (traced from its next step boundary) and a ``ping`` every second, the lease that
keeps a pause waiting for this server. When the server stops (its client closed it) the link lets go
(``disarm``: the job goes dormant, this server's breakpoints and pauses with it); if the
server dies instead, the lease runs out and the job resumes by itself. Only the commands a UI
sends are sent, over the same endpoints with the same keys: an agent can do nothing here that
its user's UI could not.

One thread per link receives; requests from the tools' threads take the same lock, so the
client is never used by two threads at once.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from torchscope.protocol import endpoints as ep
from torchscope.protocol.client import SessionClient, SessionRefused, SessionUnreachable
from torchscope.protocol.codec import ProtocolError
from torchscope.protocol.events import ALERT, DORMANT, PAUSE, RESUME, SESSION, TRACED, Event
from torchscope.protocol.runtime import EndpointError
from torchscope.session.stepper_view import StepperView, pause_key

__all__ = ["JobError", "JobLink", "Jobs"]

MAX_EVENTS = 200_000  # events of a live job kept for the analysis tools (newest)
MAX_ALERTS = 10_000
SNAPSHOT_EVENTS = 100_000
PING_SECONDS = 1.0
RECV_MS = 20


class JobError(RuntimeError):
    """A job that cannot be reached or refused a command; the text is one line."""


def _line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


class JobLink:
    """One live job: its client, its recent events, its stepper as this server knows it."""

    def __init__(self, record: ep.SessionRecord, *, timeout: float = 5.0) -> None:
        self.record = record
        self.client = SessionClient()
        self._lock = threading.RLock()
        self.events: deque[Event] = deque(maxlen=MAX_EVENTS)
        self._alerts: deque[Event] = deque(maxlen=MAX_ALERTS)
        self.stepper = StepperView()
        self.state: dict[str, Any] | None = None
        self.held = False  # armed as a UI: traced while this server holds it
        self.session: dict[str, Any] = {}
        self.rank: int | None = None
        self._stop = threading.Event()
        self._last_contact = time.monotonic()
        self._step_seen: int | None = None  # the newest step an event or a reply named
        try:
            hello = self.client.connect(self.record, timeout=timeout)
            snap = self.client.snapshot(SNAPSHOT_EVENTS, timeout=max(timeout, 5.0))
        except (SessionUnreachable, SessionRefused, EndpointError, ProtocolError) as exc:
            self.client.close()
            raise JobError(_line(exc)) from None
        self.session = dict(self.client.session or {})
        self.pid = hello.get("pid") or self.session.get("pid") or self.record.pid
        rank = hello.get("rank", self.session.get("rank"))
        self.rank = rank if type(rank) is int else None
        self.label = f"pid {self.pid}" + (f" rank {self.rank}" if self.rank is not None else "")
        self._take(snap.get("events") or [])
        with contextlib.suppress(JobError):  # a job without step-through control refuses
            self.request("state")
        self._thread = threading.Thread(target=self._run, name="torchscope-mcp-job", daemon=True)
        self._thread.start()

    # -- the receiving thread -------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                if self.client.sub is None:
                    return
                try:
                    frames = self.client.recv(RECV_MS)
                except Exception:  # a broken connection: the job shows as gone
                    frames = []
                for f in frames:
                    if f.get("type") == "events":
                        self._take(f.get("events") or [])
                due = time.monotonic() - self._last_contact >= PING_SECONDS
            if due and self.gone is None:
                self._ping()
            self._stop.wait(0.01)

    def _take(self, events: list[Event]) -> None:
        for e in events:
            kind = e.get("kind")
            self._saw_step(e.get("step"))
            if kind == PAUSE:
                self.stepper.on_pause_event(e)
            elif kind == RESUME:
                self.stepper.on_resume_event(e)
            elif kind == ALERT:
                self._alerts.append(e)
            elif kind == SESSION:
                self.session = dict(e)
            self.events.append(e)

    def _ping(self) -> None:
        """The lease (any request renews it). A held job that went dormant (the lease ran
        out while this server stalled) is armed again, as the UI does."""
        try:
            self.request("ping", timeout=2.0)
        except JobError:
            return
        if self.held and self.client.tracing == DORMANT:
            with contextlib.suppress(JobError):
                self.request("arm", timeout=2.0)

    # -- requests -------------------------------------------------------------------------------
    def request(self, cmd: str, timeout: float = 5.0, **fields: Any) -> dict[str, Any]:
        with self._lock:
            if self.client.dealer is None:
                raise JobError(f"{self.label}: no longer connected")
            try:
                result = self.client.request(cmd, timeout=timeout, **fields)
            except (SessionUnreachable, SessionRefused, ProtocolError, EndpointError) as exc:
                raise JobError(_line(exc)) from None
            self._last_contact = time.monotonic()
            self._saw_step(result.get("step"))
            if isinstance(result.get("state"), dict):
                self._adopt(result["state"])
            return result

    def _saw_step(self, step: Any) -> None:
        if type(step) is int and (self._step_seen is None or step > self._step_seen):
            self._step_seen = step

    def _adopt(self, result: dict[str, Any]) -> None:
        state = result.get("state") if "state" in result else result
        if isinstance(state, dict):
            self.state = state
            self.stepper.on_state(state)

    def hold(self, timeout: float = 5.0) -> None:
        """Hold the job as a UI: traced from its next step boundary while this server
        runs (a ``trace(live=True)`` job is traced anyway and refuses)."""
        if self.held:
            return
        try:
            self.request("arm", timeout=timeout)
        except JobError as exc:
            if "arm" not in str(exc):
                raise
        self.held = True

    def release(self) -> None:
        """Let go: the job goes dormant at its next step boundary (unless others hold it);
        this server's breakpoints and pauses go with it (and an expression it runs for this
        server is interrupted)."""
        if self.gone is None:
            with contextlib.suppress(JobError):
                self.request("disarm", timeout=1.0)
        self.held = False

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
        with self._lock:
            self.client.close()

    # -- what the tools read --------------------------------------------------------------------
    @property
    def gone(self) -> str | None:
        """Why the job cannot be reached any more, or None while it can."""
        c = self.client
        if c.ended:
            return f"{self.label} has ended"
        if c.dealer is None:
            return f"{self.label}: no longer connected"
        if not c.alive and time.monotonic() - self._last_contact > 5.0:
            return f"{self.label} stopped answering"
        return None

    @property
    def paused(self) -> dict[str, Any] | None:
        return self.stepper.paused

    @property
    def step(self) -> int | None:
        """The step the job is in: the paused step while paused, else the newest step its
        heartbeats, events and replies named (a heartbeat comes once a second: alone, it
        lags a fast job by many steps)."""
        paused = self.stepper.paused
        if paused is not None:
            step = paused.get("step", (paused.get("event") or {}).get("step"))
            if type(step) is int:
                return step
        known = [s for s in (self.client.step, self._step_seen) if type(s) is int]
        return max(known) if known else None

    def pause_marker(self) -> Any:
        return (pause_key(self.stepper.paused), self.stepper.version)

    def step_events(self, step: int) -> list[Event]:
        with self._lock:
            return [e for e in self.events if e.get("step") == step]

    def alerts(self) -> list[Event]:
        with self._lock:
            return list(self._alerts)

    def step_table_events(self) -> Iterator[Event]:
        with self._lock:
            return iter(list(self.events))

    def all_events(self) -> list[Event]:
        with self._lock:
            return list(self.events)

    def notes(self) -> list[str]:
        out = []
        tracing = self.client.tracing
        if tracing == DORMANT and not self.held:
            out.append(
                f"{self.label} is dormant: it sends no events until armed (record it for "
                "the next N steps, or set a breakpoint / pause, which hold it traced)"
            )
        lost = self.client.events_lost
        if lost:
            out.append(f"{lost} events of {self.label} were missed (read too slowly)")
        if len(self.events) == self.events.maxlen:
            out.append(f"only the newest {MAX_EVENTS} events of {self.label} are kept")
        return out

    def status(self) -> dict[str, Any]:
        c = self.client
        return {
            "job": self.label,
            "pid": self.pid,
            "rank": self.rank,
            "step": self.step,
            # A paused job is traced, whatever the last heartbeat said before the pause.
            "tracing": TRACED if self.paused is not None else c.tracing,
            "held": self.held,
            # held in a meeting of the ranks by a paused one: before what, who is paused where
            "waiting": c.waiting,
            "script": self.session.get("script"),
            "gone": self.gone,
        }


class Jobs:
    """The links of one server, by control endpoint."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._links: dict[str, JobLink] = {}

    def get(self, target: str | int | None, timeout: float = 5.0) -> JobLink:
        """The link to ``target`` (a pid, a control endpoint; None: the only running job),
        connecting on first use or when the old link's job has gone (a new run)."""
        text = None if target is None else str(target).strip() or None
        try:
            record = ep.resolve(text)
        except EndpointError as exc:
            raise JobError(self._ended(text) or _line(exc)) from None
        with self._lock:
            link = self._links.get(record.control)
        if link is not None and link.gone is None:
            return link
        if link is not None:
            link.close()
        link = JobLink(record, timeout=timeout)
        with self._lock:
            old = self._links.pop(record.control, None)
            self._links[record.control] = link
        if old is not None and old is not link:
            old.close()
        return link

    def _ended(self, target: str | None) -> str | None:
        """A job this server reached that cannot be found any more: it ended, in one line."""
        for link in self.known():
            if target in (str(link.pid), link.record.control):
                return f"{link.label} has ended"
        return None

    def known(self) -> list[JobLink]:
        with self._lock:
            return list(self._links.values())

    def close(self) -> None:
        """The server stops: every held job is let go, every link closed."""
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            if link.held or link.stepper.breakpoints:
                link.release()
            link.close()
