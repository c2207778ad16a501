"""Events on their way out: wait for their numbers, get checked for NaN origins, reach sinks.

The training thread appends events; at a step boundary (or when the batch is big or old) it
*seals* the batch, which starts one asynchronous device-to-host copy per dtype, and *delivers*
every sealed batch whose copy has landed. Delivery runs on the training thread on purpose: a
second Python thread doing this work would fight the training thread for the GIL at every
torch call (each one releases it), which costs more than the work itself. A watchdog thread
only steps in when the training thread has gone quiet (a long op, a hang), so the file never
falls more than about a second behind.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from collections.abc import Callable

from torchscope.protocol.events import STEP, Event
from torchscope.tracer.armed.alerts import AlertDetector
from torchscope.tracer.armed.summary import SealedBatch, Summarizer, nonfinite_made

Sink = Callable[[list[Event]], None]


class EventPipeline:
    def __init__(
        self,
        summarizer: Summarizer,
        sinks: list[Sink],
        next_seq: Callable[[], int],
        *,
        batch_summaries: int = 4096,
        seal_seconds: float = 0.5,
        on_error: Callable[[str, BaseException], None] | None = None,
        on_idle: Callable[[], None] | None = None,
    ) -> None:
        self.summarizer = summarizer
        self.sinks = sinks
        self.batch_summaries = batch_summaries
        self.seal_seconds = seal_seconds
        self.on_error = on_error or _print_error
        self._on_idle = on_idle
        # Guards the open batch, the sealed queue and delivery order; re-entrant because a
        # sink or an error report may add an event while a flush is running.
        self.lock = threading.RLock()
        self._events: list[Event] = []
        self._sealed: deque[tuple[list[Event], SealedBatch | None]] = deque()
        self.last_flush = time.monotonic()
        self.alerts = AlertDetector(next_seq)
        self._step_event: Event | None = None  # the STEP event of a step with no event yet
        # step -> how many non-finite summaries had been made when its STEP event was added:
        # while that number stands still, no event of the step can be an alert (see
        # _alerts_of), and delivery skips the checks.
        self._step_marks: dict[int, int] = {}
        self._closing = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="torchscope-flush", daemon=True)
        self._watchdog.start()

    def open_step(self, event: Event) -> None:
        """A step begins: its STEP event goes out just before the step's first event, so a
        step in which nothing is traced (the code after the loop's last update) leaves
        nothing behind. Numbered now, it stays in ``seq`` order."""
        with self.lock:
            self._step_event = event
            # What the step's alert checks may skip counts from here, not from its first event.
            self._step_marks[event["step"]] = nonfinite_made()

    def add(self, event: Event) -> None:
        """Queue an event; the caller holds ``lock`` (it just summarised the event's tensors)."""
        if self._step_event is not None:
            self._add_step()
        events = self._events
        events.append(event)
        if event["kind"] == STEP:
            self._step_marks.setdefault(event["step"], nonfinite_made())
        # Checked every 32 events: a step of a small model is a few hundred of them, and the
        # watchdog seals a batch that sits still anyway.
        if not len(events) & 31 and (
            len(self.summarizer.batch) >= self.batch_summaries
            or time.monotonic() - self.last_flush >= self.seal_seconds
        ):
            self.flush()

    @property
    def step_pending(self) -> bool:
        """The current step has no event yet (nothing traced in it so far)."""
        return self._step_event is not None

    def _add_step(self) -> None:
        step, self._step_event = self._step_event, None
        if step is not None:
            self.add(step)

    def flush(self, wait: bool = False) -> None:
        """Seal the open batch and deliver every sealed batch that is ready (all if ``wait``)."""
        with self.lock:
            self.last_flush = time.monotonic()
            self._seal()
            while self._sealed:
                events, sealed = self._sealed[0]
                if sealed is not None and not wait and not sealed.ready():
                    break
                self._sealed.popleft()
                self._deliver(events, sealed)
                if wait and not self._sealed and self._events:
                    self._seal()  # alerts held back behind the last batch (see _deliver)

    def _seal(self) -> None:
        events, self._events = self._events, []
        batch = self.summarizer.take_batch()
        if events or len(batch):
            try:
                sealed = SealedBatch(batch) if len(batch) else None
            except Exception as exc:  # never let a transfer problem reach the job
                self.on_error("sealing summaries", exc)
                sealed = None
            self._sealed.append((events, sealed))

    def close(self) -> None:
        self._closing.set()
        self._watchdog.join()
        self.flush(wait=True)
        with self.lock:
            # The consequences of the last steps: no step boundary follows them.
            tail = self.alerts.tally_updates()
            if tail:
                self._deliver(tail, None)

    def _deliver(self, events: list[Event], sealed: SealedBatch | None) -> None:
        alerts: list[Event] = []
        try:
            if sealed is not None:
                sealed.resolve()
            alerts = self._alerts_of(events)
        except Exception as exc:
            self.on_error("resolving summaries", exc)
        if alerts and (self._sealed or self._events):
            # An alert is numbered when it is found: after events still waiting for their
            # numbers (a later batch whose device copy has not landed, the open batch). It
            # goes out behind them, so files and streams stay in ``seq`` order.
            self._events.extend(alerts)
            alerts = []
        out = events + alerts if alerts else events
        for sink in self.sinks:
            try:
                sink(out)
            except Exception as exc:
                self.on_error(f"event sink {getattr(sink, '__qualname__', sink)}", exc)

    def _alerts_of(self, events: list[Event]) -> list[Event]:
        """The alerts a delivered batch raises, numbered now (after every event so far)."""
        alerts: list[Event] = []
        check = self.alerts.check
        if events and self._clean(events[0].get("step")):
            # No summary with NaN/Inf was made since the first event's step began, so no event
            # here (all of that step or later ones) can be an alert: only the step events,
            # which reset the detector's per-step state, are looked at.
            for ev in events:
                if ev["kind"] == STEP:
                    alerts.extend(check(ev))  # an origin's consequences of the steps before
            return alerts
        for ev in events:
            alerts.extend(check(ev))
        return alerts

    def _clean(self, step: int | None) -> bool:
        marks = self._step_marks
        if type(step) is not int:
            return False
        mark = marks.get(step)
        if mark is None:
            return False
        if len(marks) > 1:  # steps before this batch's first are delivered: forget them
            for old in [s for s in marks if s < step]:
                del marks[old]
        return mark == nonfinite_made()

    def _watch(self) -> None:
        while not self._closing.wait(0.25):
            try:
                if time.monotonic() - self.last_flush >= 2 * self.seal_seconds:
                    self.flush(wait=True)
                if self._on_idle is not None:
                    self._on_idle()
            except Exception as exc:
                self.on_error("background flush", exc)


def _print_error(where: str, exc: BaseException) -> None:
    print(f"torchscope: {where}: {exc}", file=sys.stderr)
