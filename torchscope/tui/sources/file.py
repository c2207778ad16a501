"""Replaying a trace file (:class:`FileSource`).

It never loads the whole file: the step list comes from the chunk index, a step's events are
decoded when it is shown, and a background pass (:mod:`.countpass`) fills in per-step counts
and alerts chunk by chunk, and hands over the run's history (its ``history`` events) as it
finds it, so the step list and the plot show every step's loss before any step is loaded.

No textual imports here, and no torch.
"""

from __future__ import annotations

import contextlib
import os
import queue
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from typing import Any

from torchscope.protocol.events import HISTORY, SESSION, Event
from torchscope.protocol.tracefile import TraceFileError, TraceReader
from torchscope.session.countpass import count_passes, read_records
from torchscope.session.inbox import Inbox
from torchscope.session.items import (
    Counts,
    ErrorMessage,
    HistoryBatch,
    Progress,
    ProgressDone,
    StepAbort,
    StepIndex,
    WholeStep,
)
from torchscope.session.rows import NO_STEP, prepare, step_of
from torchscope.tui.sources.base import EventSource, session_status

__all__ = ["FileSource"]


class FileSource(EventSource):
    """Replays a trace file, step by step, without loading all of it.

    ``count_pass``: how per-step counts and alerts are gathered after the first screen:
    ``"process"`` (default: a child process, so decoding never competes with the UI for the
    GIL), ``"thread"`` (on this source's thread, between requests), or None (only steps that
    are shown get counted).
    """

    mode = "replay"
    can_reload = True

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        count_pass: str | bool | None = "process",
        chunk_cache: int = 4,
        pass_pause: float = 0.002,
        part_events: int = 4_000,
        part_seconds: float = 0.25,
        max_pending: int = 60_000,
    ) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.label = self.path
        self.count_pass = "thread" if count_pass is True else (count_pass or None)
        self.pass_pause = pass_pause
        self.part_events = part_events
        self.part_seconds = part_seconds
        self.max_pending = max_pending
        self._cache: OrderedDict[int, list[Event]] = OrderedDict()
        self._cache_max = max(1, chunk_cache)
        self.reader: TraceReader | None = None
        self.counter_process: subprocess.Popen[bytes] | None = None
        self._counter_lock = threading.Lock()

    # -- worker ----------------------------------------------------------------------------
    def run(self, inbox: Inbox, stop: threading.Event) -> None:
        inbox.status(mode="replay", file=self.path, state="opening")

        def progress(done: int, total: int) -> None:
            inbox.put(Progress(done, total, "scanning file (no index)"))

        try:
            reader = TraceReader(self.path, progress=progress)
        except TraceFileError as exc:
            inbox.put(ProgressDone())
            inbox.status(state="error", error=str(exc))
            inbox.put(ErrorMessage(str(exc)))
            return
        self.reader = reader
        inbox.put(ProgressDone())
        try:
            self._serve(reader, inbox, stop)
        except TraceFileError as exc:
            inbox.status(state="error", error=str(exc))
            inbox.put(ErrorMessage(str(exc)))
        finally:
            self._stop_counter()
            reader.close()

    def _serve(self, reader: TraceReader, inbox: Inbox, stop: threading.Event) -> None:
        chunks = reader.chunks
        endpoints = sorted(
            {s for c in chunks for s in (c.first_step, c.last_step) if c.first_step != NO_STEP}
        )
        inbox.put(StepIndex([(s, False) for s in endpoints]))
        session = None
        if chunks:
            first = self._chunk(reader, 0)
            session = next((e for e in first if e.get("kind") == SESSION), None)
        meta = reader.metadata.get("session")
        if session is None and isinstance(meta, dict):
            # `torchscope record` keeps the session in the file header
            session = Event({**meta, "kind": SESSION, "seq": meta.get("seq", -1), "step": 0})
        if session is not None:
            inbox.put_events(prepare([session]))
        inbox.status(
            mode="replay",
            file=self.path,
            state="ready",
            complete=reader.complete,
            truncated=reader.truncated,
            damaged=getattr(reader, "damaged", None),
            events_total=len(reader),
            chunks=len(chunks),
            metadata=reader.metadata,
            **session_status(session),
        )
        in_thread = None
        if self.count_pass == "process" and chunks and not self._start_counter(inbox):
            self.count_pass = "thread"  # no child process here: count on this thread
        if self.count_pass == "thread":
            in_thread = count_passes(reader, each_chunk=True)
        while not stop.is_set():
            requests = self._take_requests()
            for step in requests:
                if stop.is_set():
                    return
                self._load(reader, step, inbox, stop)
            if requests:
                continue
            if in_thread is not None:
                try:
                    record = next(in_thread)
                except StopIteration:
                    in_thread = None
                    continue
                if record is not None:
                    _post_record(inbox, record)
                if self.pass_pause:
                    stop.wait(self.pass_pause)  # leave the UI thread room
                continue
            try:
                step = self._requests.get(timeout=0.1)
            except queue.Empty:
                continue
            self._requests.put(step)

    # -- the counting child ----------------------------------------------------------------
    def _start_counter(self, inbox: Inbox) -> bool:
        import torchscope

        env = dict(os.environ)
        # The child must import this torchscope, wherever it was imported from.
        root = os.path.dirname(os.path.dirname(os.path.abspath(torchscope.__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "torchscope.session.countpass", self.path],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                env=env,
            )
        except OSError:
            return False
        self.counter_process = proc

        def pump() -> None:
            assert proc.stdout is not None
            try:
                for record in read_records(proc.stdout):
                    if "error" in record:
                        inbox.put(ErrorMessage(f"counting steps: {record['error']}"))
                        inbox.put(ProgressDone())
                        return
                    _post_record(inbox, record)
            except Exception as exc:  # a broken pipe or record: counts stay partial
                inbox.put(ErrorMessage(f"counting steps: {exc}"))
                inbox.put(ProgressDone())

        self._pump = threading.Thread(target=pump, name="torchscope-count", daemon=True)
        self._pump.start()
        return True

    def _stop_counter(self) -> None:
        with self._counter_lock:
            proc, self.counter_process = self.counter_process, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            if proc.poll() is None:
                proc.kill()
        with contextlib.suppress(Exception):  # killed above: a zombie only
            proc.wait(timeout=5)
        if proc.stdout is not None:
            proc.stdout.close()
        pump = getattr(self, "_pump", None)
        if pump is not None:
            pump.join(timeout=5)

    def close(self) -> None:
        self._stop_counter()

    # -- chunks ----------------------------------------------------------------------------
    def _chunk(self, reader: TraceReader, i: int, keep: bool = True) -> list[Event]:
        events = self._cache.get(i)
        if events is not None:
            self._cache.move_to_end(i)
            return events
        events = reader.read_chunk(i)
        if keep:
            self._cache[i] = events
            while len(self._cache) > self._cache_max:
                self._cache.popitem(last=False)
        return events

    def _load(
        self, reader: TraceReader, step: int, inbox: Inbox, stop: threading.Event | None = None
    ) -> None:
        """Send ``step``'s events to the inbox, part by part as its chunks are decoded: the
        first part at once (the first screen of rows), then a part every ``part_events``
        events or ``part_seconds``. Waits while the UI has more than ``max_pending`` events to
        apply; gives up (``step_abort``) when another step is asked for meanwhile."""
        wanted = [i for i, c in enumerate(reader.chunks) if c.first_step <= step <= c.last_step]
        total = len(wanted)
        if total <= 1:
            events, elsewhere = self._step_events(reader, wanted, step)
            self._post_index(inbox, elsewhere)
            inbox.put(WholeStep(step, prepare(events)))
            return
        keep = total <= self._cache_max  # a huge step would only flush the cache
        others: set[int] = set()
        buf: list = []
        first = True
        last_put = time.monotonic()
        for n, i in enumerate(wanted, 1):
            if stop is not None and stop.is_set():
                return
            if not first and self._asked_elsewhere(step):
                inbox.put(StepAbort(step))
                return
            events, more = self._step_events(reader, [i], step, keep=keep)
            others |= more
            buf.extend(prepare(events))
            last = n == total
            now = time.monotonic()
            if first or last or len(buf) >= self.part_events or now - last_put >= self.part_seconds:
                if first and not buf and not last:
                    continue  # nothing of this step yet: the first part must show rows
                inbox.put_step_part(step, buf, first, last, n, total)
                buf, first, last_put = [], False, now
            while (
                not last
                and inbox.pending_events > self.max_pending
                and not (stop is not None and stop.is_set())
            ):
                time.sleep(0.005)  # the UI applies a tick's worth at a time: let it
            if self.pass_pause and not last:
                time.sleep(self.pass_pause)  # leave the UI thread room (the GIL)
        self._post_index(inbox, others)

    def _step_events(
        self, reader: TraceReader, chunks: list[int], step: int, keep: bool = True
    ) -> tuple[list[Event], set[int]]:
        events: list[Event] = []
        others: set[int] = set()
        for i in chunks:
            for e in self._chunk(reader, i, keep):
                s = step_of(e)
                if s == step:
                    events.append(e)
                else:
                    others.add(s)
                    if e.get("kind") == HISTORY:
                        # The run's points, whatever step (or none) the event names: with
                        # no count pass, the chunks loaded are the only ones decoded.
                        events.append(e)
        return events, others

    @staticmethod
    def _post_index(inbox: Inbox, others: set[int]) -> None:
        # The index only names each chunk's first and last step; steps between them show up
        # when a chunk is decoded (here, or in the background pass).
        others.discard(NO_STEP)
        if others:
            inbox.put(StepIndex([(s, False) for s in sorted(others)]))

    def _asked_elsewhere(self, step: int) -> bool:
        """Whether a step other than ``step`` was asked for (the requests stay queued)."""
        asked = self._take_requests()  # newest first
        elsewhere = any(s != step for s in asked)
        if elsewhere:
            for s in reversed(asked):
                self._requests.put(s)
        return elsewhere


def _post_record(inbox: Inbox, record: dict[str, Any]) -> None:
    """A count pass record: its ``history`` events as the store's :class:`HistoryBatch` items
    (the step list and the plot show them at once), then its counts, if it has any."""
    for event in record.get("history") or ():
        if isinstance(event, dict):
            inbox.put(HistoryBatch(event))
    if "done" in record:
        _post_counts(inbox, record)


def _post_counts(inbox: Inbox, record: dict[str, Any]) -> None:
    """A count pass record, as the store's :class:`Counts` item plus progress."""
    by_step: dict[int, list] = {}
    for alert in record.get("alerts") or ():
        if isinstance(alert, dict):
            by_step.setdefault(step_of(alert), []).append(Event(alert))
    counts = {}
    for step, c in (record.get("counts") or {}).items():
        if type(step) is int and isinstance(c, (list, tuple)) and len(c) in (5, 7, 8):
            counts[step] = (*c[:5], by_step.get(step, []), *(c[5:] or (0.0, 0)))
    losses = {}
    for step, loss in (record.get("loss") or {}).items():
        if type(step) is int and isinstance(loss, (list, tuple)) and len(loss) == 2:
            losses[step] = tuple(loss)
    final = [s for s in record.get("final") or () if type(s) is int]
    inbox.put(Counts(counts, final, losses))
    done, total = record.get("done", 0), record.get("total", 0)
    inbox.put(Progress(done, total, "counting steps"))
    if done >= total:
        inbox.put(ProgressDone())
