"""The commands that reach a running job: ``ls``, ``record``, ``watch``, ``attach``."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from torchscope.cli.common import fail

if TYPE_CHECKING:
    from torchscope.protocol.endpoints import SessionRecord


def cmd_ls(args: argparse.Namespace) -> int:
    """Live sessions on this machine, the ranks of a torchrun job grouped under it; each is
    asked for its step and its latest loss (briefly)."""
    from torchscope.protocol import endpoints as ep
    from torchscope.protocol.runtime import EndpointError

    try:
        records = ep.list_sessions()
    except EndpointError as exc:
        return fail(str(exc))
    if not records:
        print("no running torchscope sessions (start one with `torchscope run SCRIPT`)")
        return 0
    # Every line fits 80 columns: each job's row, then the control endpoint `tui` takes.
    print(
        f"{'PID':>7} {'RANK':>4} {'STEP':>6} {'TRACING':<8} {'LOSS':>11} {'STARTED':<8} "
        f"{'SCRIPT':<{SCRIPT_WIDTH}}".rstrip()
    )
    for ranks in ep.group_by_job(records):
        if len(ranks) > 1 or ranks[0].job is not None:
            first = ranks[0]
            world = first.world_size or len(ranks)
            script = os.path.basename(first.script or "") or "?"
            head = f"job {first.job} · {len(ranks)} of {world} ranks here · {script}"
            hint = f" (`torchscope tui {first.pid}` opens every rank)"
            print(head + hint if len(head + hint) <= LS_WIDTH else _cut(head, LS_WIDTH))
        for rec in ranks:
            _ls_row(rec, args.timeout)
    return 0


LS_WIDTH = 80
SCRIPT_WIDTH = 29  # what the columns before it leave of 80


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _started(t: float) -> str:
    """``14:03:59`` today, ``Dec 02`` before: 8 columns."""
    import datetime

    when = datetime.datetime.fromtimestamp(t)
    if when.date() == datetime.date.today():
        return when.strftime("%H:%M:%S")
    return when.strftime("%b %d")


def _ls_row(rec: SessionRecord, timeout: float) -> None:
    from torchscope.cli.history import latest_loss
    from torchscope.protocol.client import SessionClient, SessionRefused, SessionUnreachable
    from torchscope.protocol.runtime import EndpointError

    step = tracing = "?"
    loss = "-"
    try:
        with SessionClient() as client:
            hello = client.connect(rec, timeout=timeout)
            step = str(hello.get("step"))
            tracing = hello.get("tracing") or "traced"  # a trace(live=True) block
            loss = latest_loss(client, timeout)
    except (SessionUnreachable, SessionRefused, EndpointError):
        pass
    rank = "-" if rec.rank is None else str(rec.rank)
    script = _cut(os.path.basename(rec.script or "") or "?", SCRIPT_WIDTH)
    print(
        f"{rec.pid:>7} {rank:>4} {step:>6} {tracing:<8} {loss:>11} {_started(rec.started):<8} "
        f"{script:<{SCRIPT_WIDTH}}"
    )
    # The endpoint a UI or recorder takes (`tui ENDPOINT`); the events endpoint comes with it.
    print(f"{'':>7} control {rec.control}")


def cmd_record(args: argparse.Namespace) -> int:
    """Capture a live session into a trace file, headless, with a progress line.

    A dormant job is armed for the recording: for its next N steps (``--next N``), or until
    Ctrl-C / SIGTERM / the job's end; either way the file is complete.
    """
    import signal
    import time

    from torchscope.protocol import endpoints as ep
    from torchscope.protocol.breakpoints import BreakpointError, action_spec
    from torchscope.protocol.client import SessionClient, SessionRefused, SessionUnreachable
    from torchscope.protocol.events import SESSION, STEP, TRACING
    from torchscope.protocol.runtime import EndpointError
    from torchscope.protocol.tracefile import TraceFileError, TraceWriter

    if args.next is not None and args.next < 1:
        return fail("--next takes a number of steps, at least 1")
    try:  # logpoints and edits: breakpoints with an action, this recorder's own
        actions = [
            action_spec(name, cond, expr)
            for name in ("log", "edit")
            for cond, expr in getattr(args, name, None) or ()
        ]
    except BreakpointError as exc:
        return fail(f"--log/--edit: {exc}")
    if args.aten:
        try:
            re.compile(args.aten)
        except re.error as exc:
            return fail(f"--aten: {args.aten!r} is not a regular expression: {exc}")
    client = SessionClient()
    holder = None
    try:
        client.connect(ep.resolve(args.target), timeout=args.timeout)
        # --next records from the arming on; otherwise the recent events the job still holds
        # come first (a job traced from its start).
        snap: dict[str, Any] = (
            {"session": client.session} if args.next else client.snapshot(args.snapshot)
        )
        try:
            armed = client.request(
                "arm",
                timeout=args.timeout,
                next=args.next,
                by="record",
                aten=args.aten,
                eager_check=args.eager_check,
            )
            holder = armed["holder"]
            for spec in actions:  # they go with this recorder's hold
                client.request("break_add", timeout=args.timeout, **spec)
        except SessionRefused as exc:  # a torchscope.trace(live=True) block: always traced
            if args.next:
                raise SessionRefused(f"this job cannot be armed for --next ({exc})") from None
    except (SessionUnreachable, SessionRefused, EndpointError) as exc:
        client.close()
        return fail(str(exc))
    session = snap.get("session") or {}
    try:
        writer = TraceWriter(args.output, metadata={"session": session, "recorded_live": True})
    except TraceFileError as exc:
        client.close()
        return fail(str(exc))
    progress = _Progress(enabled=not args.quiet)
    steps = set()
    written = 0
    # The run's history so far (steps before the recording included), then its new points
    # as the job sends them, then what came after the last one: a replay shows the whole run.
    seen = _RunHistoryEvents(client, args.timeout)
    done = False  # the job let go of this recording's hold (its N steps are recorded)
    last_ping = time.monotonic()
    old_term = signal.signal(signal.SIGTERM, _interrupt)
    try:
        events = snap.get("events") or []
        if session and not any(e.get("kind") == SESSION for e in events):
            writer.write([session])  # a file opens with who the job is, as --record's do
            written += 1
        events = [*events, *seen.ask()]
        while True:
            if events:
                seen.note(events)
                writer.write(events)
                written += len(events)
                for e in events:
                    if e.get("kind") == STEP:
                        steps.add(e["step"])
                    elif e.get("kind") == TRACING and holder in (e.get("released") or ()):
                        done = True
                progress.show(
                    f"recording pid {session.get('pid', '?')}: {written} events, "
                    f"{len(steps)} traced steps, step {client.step}, {client.dropped} dropped"
                )
            if done or client.ended or not client.alive:
                break
            if holder is not None and time.monotonic() - last_ping >= 1.0:
                last_ping = time.monotonic()
                client.request("ping", timeout=args.timeout)  # holds the job armed (lease)
            events = client.recv_events(200)
    except (KeyboardInterrupt, SessionUnreachable):
        pass
    finally:
        signal.signal(signal.SIGTERM, old_term)
        if not client.ended:
            with contextlib.suppress(Exception):  # the job may be gone: what was written stays
                tail = seen.ask()
                if tail:
                    writer.write(tail)
                    written += len(tail)
        if holder is not None and not done and not client.ended:
            with contextlib.suppress(Exception):  # a gone job needs no disarm; the lease does it
                client.request("disarm", timeout=1.0)  # the job goes dormant again
        writer.close()
        client.close()
    ended = "" if client.ended or done else " (stopped before the job ended)"
    lost = getattr(client, "events_lost", 0) or 0
    missed = f"; {lost} events missed (this recorder read too slowly)" if lost else ""
    progress.done(
        f"torchscope: {written} events, {len(steps)} traced steps written to {args.output}"
        f"{ended}{missed}"
    )
    return 0


class _RunHistoryEvents:
    """The job's ``history`` (the command) as events for a recording: everything at first;
    at the end, the steps since then that no live ``history`` event brought (a point closed
    before the job saw this recorder subscribe is sent to nobody)."""

    def __init__(self, client: Any, timeout: float) -> None:
        self._client = client
        self._timeout = max(timeout, 10.0)
        self._asked = False
        self._since: int | None = None  # the newest step of the first reply
        self._written: set[int] = set()  # steps written after it

    def ask(self) -> list[dict[str, Any]]:
        from torchscope.protocol.client import SessionRefused, SessionUnreachable
        from torchscope.protocol.events import HISTORY, Event

        first, self._asked = not self._asked, True
        try:
            reply = self._client.request("history", timeout=self._timeout, since=self._since)
        except (SessionRefused, SessionUnreachable):  # a job that keeps no history
            return []
        points = [p for p in reply.get("points") or () if p.get("step") not in self._written]
        buckets = reply.get("buckets") or []
        if first:
            self._since = points[-1]["step"] if points else -1
        else:
            self.note_points(points)
        if not points and not buckets:
            return []
        # no step: a history event is not one of a step's events (a step number would make the
        # replay's step list show an empty traced step)
        event = Event(kind=HISTORY, seq=reply.get("seq", 0), step=None, points=points)
        if buckets:
            event["buckets"] = buckets
        return [event]

    def note(self, events: Iterable[dict[str, Any]]) -> None:
        from torchscope.protocol.events import HISTORY

        for e in events:
            if e.get("kind") == HISTORY and self._since is not None:
                self.note_points(e.get("points") or ())

    def note_points(self, points: Any) -> None:
        for p in points:
            step = p.get("step") if isinstance(p, dict) else None
            if isinstance(step, int) and step > (self._since or -1):
                self._written.add(step)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


class _Progress:
    """One status line on stderr, rewritten in place at most ~10 times a second."""

    def __init__(self, enabled: bool = True) -> None:
        import time

        self._clock = time.monotonic
        self.enabled = enabled and sys.stderr.isatty()
        self._last = 0.0
        self._shown = False

    def show(self, text: str) -> None:
        if self.enabled and self._clock() - self._last >= 0.1:
            self._last = self._clock()
            sys.stderr.write("\r\033[K" + text)
            sys.stderr.flush()
            self._shown = True

    def done(self, text: str) -> None:
        if self._shown:
            sys.stderr.write("\r\033[K")
        print(text, file=sys.stderr)


def cmd_watch(args: argparse.Namespace) -> int:
    """Switch the NaN watch of a running job on or off (from its next backward)."""
    from torchscope.protocol import endpoints as ep
    from torchscope.protocol.client import SessionClient, SessionRefused, SessionUnreachable
    from torchscope.protocol.runtime import EndpointError

    spec = None if args.off else args.spec
    if args.max_skips is not None and (args.on_nan != "skip" or args.max_skips < 0):
        return fail("--max-skips takes a count of steps (>= 0), with --on-nan skip")
    try:
        with SessionClient() as client:
            client.connect(ep.resolve(args.target), timeout=args.timeout)
            client.request(
                "watch",
                timeout=args.timeout,
                spec=spec,
                on_nan=args.on_nan,
                **({} if args.max_skips is None else {"max_skips": args.max_skips}),
                **({} if args.on_spike is None else {"on_spike": args.on_spike}),
            )
            pid = (client.session or {}).get("pid", args.target)
    except (SessionUnreachable, SessionRefused, EndpointError) as exc:
        return fail(str(exc))
    if spec is None:
        print(f"torchscope: {pid} stops watching for NaN at its next backward()")
    else:
        print(
            f"torchscope: {pid} watches every step from its next backward() ({spec}, then "
            f"{args.on_nan}); its reports go to its stderr, its trace file and attached UIs"
        )
    return 0


def cmd_attach(args: argparse.Namespace) -> int:
    """Start the dormant agent inside a job that never imported torchscope."""
    from torchscope.cli.attach import AttachError, attach

    try:
        control = attach(args.pid, timeout=args.timeout)
    except AttachError as exc:
        return fail(str(exc))
    print(f"torchscope: attached to {args.pid} ({control}); look: torchscope tui {args.pid}")
    return 0
