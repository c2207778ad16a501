"""Where the UI's events come from. The screens cannot tell these apart.

An :class:`EventSource` runs on one worker thread (``run``) and hands everything to an
:class:`~torchscope.tui.store.Inbox`: event batches (already turned into store rows, so the UI
thread only appends), whole steps it was asked to load, status changes and progress. The UI
asks for a step with ``request_step`` (thread-safe); the answer arrives through the inbox.
Commands to the job (pause, step, breakpoints, inspect: ``command``) travel the same way: the
source's thread sends them and posts each reply, or the one-line refusal, to the inbox. Only a
:class:`LiveSource` reaches a job; the others refuse every command at once (CommandRefused).

- :class:`FileSource` replays a trace file. It never loads the whole file: the step list comes
  from the chunk index, a step's events are decoded when it is shown, and a background pass
  fills in per-step counts and alerts chunk by chunk, and hands over the run's history (its
  ``history`` events) as it finds it, so the step list and the plot show every step's loss
  before any step is loaded.
- :class:`LiveSource` follows a running job through ``torchscope.protocol.client.SessionClient``.
- :class:`ScriptedSource` feeds a list of events (optionally at a given rate), for tests.

No textual imports here, and no torch.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from torchscope.protocol.events import DORMANT, HISTORY, SESSION, Event
from torchscope.protocol.tracefile import TraceFileError, TraceReader
from torchscope.tui import countpass
from torchscope.tui.stepping import REPLAY_REFUSAL
from torchscope.tui.store import NO_STEP, Inbox, prepare

__all__ = [
    "CommandRefused",
    "EventSource",
    "FileSource",
    "LiveSource",
    "ScriptedSource",
    "SourceError",
    "open_source",
]

_NO_STEP = -1


class SourceError(Exception):
    """A target that names no trace file and no session."""


class CommandRefused(Exception):
    """A command this source cannot send (a replay has no job to talk to)."""


def _step_of(ev: dict) -> int:
    step = ev.get("step")
    return step if type(step) is int else NO_STEP


def _session_status(session: Any) -> dict[str, Any]:
    if not isinstance(session, dict):
        return {}
    out: dict[str, Any] = {}
    for key in ("pid", "rank", "world_size", "host", "script", "torch"):
        if session.get(key) is not None:
            out[key] = session[key]
    return out


class EventSource:
    """The interface the app talks to. Subclasses implement ``run``."""

    mode: str = "replay"  # "replay" or "live"
    label: str = ""
    #: True when a step evicted from memory can be loaded again (request_step).
    can_reload: bool = False
    #: True when ``command`` reaches a job; else it raises CommandRefused with this text.
    can_command: bool = False
    refusal: str = REPLAY_REFUSAL

    def __init__(self) -> None:
        self._requests: queue.Queue[int] = queue.Queue()
        self._commands: queue.Queue[tuple[int, str, dict[str, Any]]] = queue.Queue()
        self._tokens = itertools.count(1)

    def run(self, inbox: Inbox, stop: threading.Event) -> None:  # pragma: no cover - abstract
        """Produce into ``inbox`` until ``stop`` is set (or there is nothing more to do and
        nothing more can come). Runs on a worker thread."""
        raise NotImplementedError

    def request_step(self, step: int) -> None:
        """Ask for all events of ``step``; answered with an inbox ``("step", ...)`` item, or
        ``("unavailable", step, why)``. Thread-safe."""
        self._requests.put(step)

    def command(self, cmd: str, **fields: Any) -> int:
        """Send a control command (``pause``, ``step``, ``break_add``, ``inspect``, ...) to the
        job; returns a token (> 0) that its inbox answer carries: ``("reply", token, cmd,
        fields, result)`` or ``("refused", token, cmd, fields, message)``. Thread-safe.
        Raises CommandRefused at once when this source has no job to send it to."""
        if not self.can_command:
            raise CommandRefused(self.refusal)
        token = next(self._tokens)
        self._commands.put((token, cmd, dict(fields)))
        return token

    def _take_commands(self) -> list[tuple[int, str, dict[str, Any]]]:
        out = []
        while True:
            try:
                out.append(self._commands.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        """Release resources. Never sends anything to a job."""

    def _take_requests(self) -> list[int]:
        """Pending requests, newest first, without duplicates."""
        out: list[int] = []
        while True:
            try:
                step = self._requests.get_nowait()
            except queue.Empty:
                break
            if step in out:
                out.remove(step)
            out.insert(0, step)
        return out


# ---------------------------------------------------------------------------------------------
# Replay
# ---------------------------------------------------------------------------------------------


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
            inbox.put("progress", done, total, "scanning file (no index)")

        try:
            reader = TraceReader(self.path, progress=progress)
        except TraceFileError as exc:
            inbox.put("progress_done")
            inbox.status(state="error", error=str(exc))
            inbox.put("error", str(exc))
            return
        self.reader = reader
        inbox.put("progress_done")
        try:
            self._serve(reader, inbox, stop)
        except TraceFileError as exc:
            inbox.status(state="error", error=str(exc))
            inbox.put("error", str(exc))
        finally:
            self._stop_counter()
            reader.close()

    def _serve(self, reader: TraceReader, inbox: Inbox, stop: threading.Event) -> None:
        chunks = reader.chunks
        endpoints = sorted(
            {s for c in chunks for s in (c.first_step, c.last_step) if c.first_step != _NO_STEP}
        )
        inbox.put("index", [(s, False) for s in endpoints])
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
            **_session_status(session),
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
                [sys.executable, "-c", _COUNT_CHILD, self.path],
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
                for record in countpass.read_records(proc.stdout):
                    if "error" in record:
                        inbox.put("error", f"counting steps: {record['error']}")
                        inbox.put("progress_done")
                        return
                    _post_record(inbox, record)
            except Exception as exc:  # a broken pipe or record: counts stay partial
                inbox.put("error", f"counting steps: {exc}")
                inbox.put("progress_done")

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
        with contextlib.suppress(Exception):
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
            events, others = self._step_events(reader, wanted, step)
            self._post_index(inbox, others)
            inbox.put("step", step, prepare(events))
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
                inbox.put("step_abort", step)
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
                s = _step_of(e)
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
            inbox.put("index", [(s, False) for s in sorted(others)])

    def _asked_elsewhere(self, step: int) -> bool:
        """Whether a step other than ``step`` was asked for (the requests stay queued)."""
        asked = self._take_requests()  # newest first
        elsewhere = any(s != step for s in asked)
        if elsewhere:
            for s in reversed(asked):
                self._requests.put(s)
        return elsewhere

    def load_step(self, step: int) -> list[Event]:
        """All events of one step, read directly (tests and tools; not used by the UI)."""
        with TraceReader(self.path) as reader:
            return list(reader.iter_events(step=step))


# -- the count pass, with the run's history ---------------------------------------------------
# The child runs this module's count_main rather than countpass's: the same records, and the
# file's ``history`` events, which only a decoded chunk shows (the index says nothing of them).
_COUNT_CHILD = (
    "import sys; from torchscope.tui.sources import count_main; sys.exit(count_main(sys.argv[1:]))"
)


class _HistoryTap:
    """The reader the count pass decodes through: it keeps the ``history`` events of the
    chunks decoded, to go out with the next record (a few per chunk at most: the agent sends
    one per batch of steps or per second)."""

    def __init__(self, reader: TraceReader) -> None:
        self._reader = reader
        self.chunks = reader.chunks
        self._found: list[dict[str, Any]] = []

    def read_chunk(self, i: int) -> list[Event]:
        events = self._reader.read_chunk(i)
        self._found.extend(dict(e) for e in events if e.get("kind") == HISTORY)
        return events

    def take(self, record: dict[str, Any]) -> None:
        """Move the events found into ``record["history"]``; they leave its counts: a step
        (or the stepless -1) that only a ``history`` event names is no recorded step."""
        found, self._found = self._found, []
        record["history"] = found
        counts = record.get("counts")
        if not found or not isinstance(counts, dict):
            return
        for event in found:
            c = counts.get(_step_of(event))
            if isinstance(c, list) and len(c) > 4:
                c[4] -= 1  # the "events" count (see countpass)
        for step in [s for s, c in counts.items() if isinstance(c, list) and not any(c)]:
            del counts[step]


def count_passes(
    reader: TraceReader, *, each_chunk: bool = False
) -> Iterator[dict[str, Any] | None]:
    """:func:`countpass.passes`, each record with ``history``: the ``history`` events of the
    chunks decoded since the previous record, in file order."""
    tap = _HistoryTap(reader)
    for record in countpass.passes(tap, each_chunk=each_chunk):  # type: ignore[arg-type]
        if record is not None:
            tap.take(record)
        yield record


def count_main(argv: list[str]) -> int:
    """The counting child (``FileSource``'s ``"process"`` pass): countpass's records on
    stdout, each ``history`` event in a record of its own ahead of its counts (one event is
    within the codec's limit; the first of a ``record PID`` file holds the whole run so far)."""
    out = sys.stdout.buffer
    if len(argv) != 1:
        countpass.write_record(out, {"error": "usage: count_main FILE"})
        return 2
    try:
        with TraceReader(argv[0]) as reader:
            for record in count_passes(reader):
                if record is None:
                    continue
                for event in record.pop("history"):
                    countpass.write_record(out, {"history": [event]})
                countpass.write_record(out, record)
    except BrokenPipeError:  # the UI went away
        return 0
    except (TraceFileError, OSError) as exc:
        countpass.write_record(out, {"error": str(exc)})
        return 2
    return 0


def _post_record(inbox: Inbox, record: dict[str, Any]) -> None:
    """A count pass record: its ``history`` events as the store's ``("history", wire)`` items
    (the step list and the plot show them at once), then its counts, if it has any."""
    for event in record.get("history") or ():
        if isinstance(event, dict):
            inbox.put(HISTORY, event)
    if "done" in record:
        _post_counts(inbox, record)


def _post_counts(inbox: Inbox, record: dict[str, Any]) -> None:
    """A countpass record, as the store's ``counts`` item plus progress."""
    by_step: dict[int, list] = {}
    for alert in record.get("alerts") or ():
        if isinstance(alert, dict):
            by_step.setdefault(_step_of(alert), []).append(Event(alert))
    counts = {}
    for step, c in (record.get("counts") or {}).items():
        if type(step) is int and isinstance(c, (list, tuple)) and len(c) in (5, 7, 8):
            counts[step] = (*c[:5], by_step.get(step, []), *(c[5:] or (0.0, 0)))
    losses = {}
    for step, loss in (record.get("loss") or {}).items():
        if type(step) is int and isinstance(loss, (list, tuple)) and len(loss) == 2:
            losses[step] = tuple(loss)
    inbox.put("counts", counts, [s for s in record.get("final") or () if type(s) is int], losses)
    done, total = record.get("done", 0), record.get("total", 0)
    inbox.put("progress", done, total, "counting steps")
    if done >= total:
        inbox.put("progress_done")


class LiveOverview:
    """The Steps panel's loss and global gradient norm for events as they stream in (a live
    session, the demo): the same :class:`countpass.Counter` the count pass runs over a
    recording, fed on the source's thread. ``feed`` gives the store's ``overview`` item."""

    def __init__(self) -> None:
        self.counter = countpass.Counter()

    def feed(self, events: Iterable[Any]) -> tuple | None:
        counter = self.counter
        counter.add(e for e in events if isinstance(e, dict))
        counts, _ = counter.take()
        grads = {s: (c[5], c[6]) for s, c in counts.items() if c[6]}
        losses = {s: (v[0], v[1]) for s, v in counter.take_losses().items()}
        if counts:  # the loss of a step is settled once a later one runs: forget it
            newest = max(counts)
            counter.forget([s for s in counter.losses if s < newest - 1])
        if not grads and not losses:
            return None
        return ("overview", grads, losses)

    def put(self, inbox: Inbox, events: Iterable[Any]) -> None:
        item = self.feed(events)
        if item is not None:
            inbox.put(*item)


# ---------------------------------------------------------------------------------------------
# Live
# ---------------------------------------------------------------------------------------------


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
                inbox.put("refused", token, cmd, fields, why)
                continue
            try:
                result = client.request(cmd, timeout=self.command_timeout, **fields)
            except Exception as exc:  # SessionRefused, SessionUnreachable, a bad field, ...
                inbox.put("refused", token, cmd, fields, _one_line(exc))
            else:
                inbox.put("reply", token, cmd, fields, result)
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
        except Exception:
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
        with contextlib.suppress(Exception):
            c.request("disarm", timeout=0.5)

    def _ask_state(self, inbox: Inbox) -> None:
        """The job's stepping state (is it paused already?), posted as a reply with token 0
        (no one waits for it). A job without step-through control refuses: nothing to say."""
        try:
            result = self.client.request("state", timeout=self.timeout)
        except Exception:
            return
        inbox.put("reply", 0, "state", {}, result)

    def _close_client(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            with contextlib.suppress(Exception):
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
            inbox.put("new_session")  # a new run: the UI starts a fresh store
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
            **_session_status(session),
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
            inbox.put("unavailable", step, f"step {step} was evicted from memory")
            return
        try:
            with TraceReader(self.recording) as reader:
                events = list(reader.iter_events(step=step))
        except TraceFileError as exc:
            inbox.put("unavailable", step, f"step {step}: {exc}")
            return
        inbox.put("step", step, prepare(events))


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text


# ---------------------------------------------------------------------------------------------
# Scripted (tests, benchmarks, demos)
# ---------------------------------------------------------------------------------------------


class ScriptedSource(EventSource):
    """Feeds a fixed list of events, all at once or at ``rate`` events per second.

    Behaves like a live session (``mode="live"``) unless ``mode="replay"`` is given. ``feed``
    adds more events later (thread-safe); ``done`` is set once the initial list is delivered.
    With ``bye=True`` the session reports itself ended after the list. It keeps every event, so
    an evicted step can be loaded again unless ``reloadable=False``.
    """

    def __init__(
        self,
        events: Iterable[dict],
        rate: float | None = None,
        *,
        mode: str = "live",
        batch: int = 2000,
        bye: bool = False,
        reloadable: bool = True,
        status: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        # A list is delivered as is; any other iterable is pulled lazily (benchmarks feed
        # millions of events that never exist all at once).
        if isinstance(events, (list, tuple)):
            self.events: list[Event] | None = [
                e if isinstance(e, Event) else Event(e) for e in events
            ]
            self._iter: Iterator[dict] = iter(self.events)
        else:
            self.events = None
            self._iter = iter(events)
        self.rate = rate
        self.mode = mode
        self.batch = max(1, batch)
        self.bye = bye
        self.can_reload = reloadable
        self.label = "scripted"
        self.extra_status = dict(status or {})
        self.done = threading.Event()
        self.delivered = 0
        self._more: queue.Queue[list[dict]] = queue.Queue()
        self._all: list[dict] = list(self.events or ()) if reloadable else []
        self._lock = threading.Lock()
        # live: the Steps panel's loss and |g| as the events come (a replay's come from
        # the count pass of its file; a scripted replay has none)
        self.overview = LiveOverview() if mode == "live" else None

    def feed(self, events: Iterable[dict]) -> None:
        self._more.put([e if isinstance(e, Event) else Event(e) for e in events])

    def run(self, inbox: Inbox, stop: threading.Event) -> None:
        session = next((e for e in self.events or () if e.get("kind") == SESSION), None)
        live = self.mode == "live"
        inbox.status(
            mode=self.mode,
            connected=True if live else None,
            state="connected" if live else "ready",
            file=None if live else self.label,
            events_total=len(self.events) if self.events is not None else None,
            complete=None if live else True,
            **_session_status(session),
            **self.extra_status,
        )
        it = self._iter
        if self.rate is None:
            while not stop.is_set():
                chunk = list(itertools.islice(it, self.batch))
                if not chunk:
                    break
                self._deliver(inbox, chunk)
        else:
            start = time.perf_counter()
            sent = 0
            exhausted = False
            while not exhausted and not stop.is_set():
                due = int((time.perf_counter() - start) * self.rate)
                if due > sent:
                    # One hand-off holds at most ~50 ms of events, as a batching publisher.
                    n = min(due - sent, max(self.batch, int(self.rate * 0.05)))
                    chunk = list(itertools.islice(it, n))
                    exhausted = len(chunk) < n
                    if chunk:
                        self._deliver(inbox, chunk)
                    sent += n
                else:
                    time.sleep(0.002)
        self.done.set()
        if self.bye and live:
            inbox.status(connected=False, state="ended")
        while not stop.is_set():
            try:
                more = self._more.get(timeout=0.02)
            except queue.Empty:
                more = None
            if more:
                if self.can_reload:
                    with self._lock:
                        self._all.extend(more)
                self._deliver(inbox, more)
            for step in self._take_requests():
                self._load(step, inbox)

    def _deliver(self, inbox: Inbox, events: list[dict]) -> None:
        if self.can_reload and self.events is None:
            with self._lock:
                self._all.extend(events)
        items = prepare(events)
        if inbox.put_events(items):
            self.delivered += len(items)
            if self.overview is not None:
                self.overview.put(inbox, events)
        else:
            inbox.status(ui_dropped=inbox.dropped)

    def _load(self, step: int, inbox: Inbox) -> None:
        if not self.can_reload:
            inbox.put("unavailable", step, f"step {step} was evicted from memory")
            return
        with self._lock:
            events = [e for e in self._all if _step_of(e) == step]
        inbox.put("step", step, prepare(events))


# ---------------------------------------------------------------------------------------------


def open_source(target: str | None) -> EventSource:
    """A source for what the command line names: a trace file, a control endpoint
    (``ipc://...``, ``tcp://...``), the pid of a traced job, or None for the one running
    session. Raises SourceError for a name that is none of these."""
    if target is None or "://" in target or target.isdigit():
        return LiveSource(target)
    if os.path.exists(target):
        return FileSource(target)
    raise SourceError(f"{target}: no such trace file, endpoint or pid")
