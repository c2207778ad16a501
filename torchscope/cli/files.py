"""The commands on trace files: ``dump``, ``diff``, ``export``.

The work is the libraries' (:mod:`torchscope.analysis`, :mod:`torchscope.export`); here are
the arguments, what goes to stdout and stderr, and the exit codes.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from torchscope.cli.common import fail

if TYPE_CHECKING:
    from torchscope.protocol.events import Event


# -- dump ------------------------------------------------------------------------------------
def cmd_dump(args: argparse.Namespace) -> int:
    from torchscope.analysis.render import aten_log
    from torchscope.protocol.output import drop_stdout
    from torchscope.protocol.tracefile import TraceFileError, TraceReader

    try:
        reader = TraceReader(args.file)
    except TraceFileError as exc:
        return fail(f"{args.file}: {exc}")
    with reader:
        events = reader.iter_events(step=args.step)
        if args.kind:
            wanted = set(args.kind)
            events = (e for e in events if e["kind"] in wanted)
            if wanted == {"alert"} and not args.aten:
                # One line per origin, its consequences counted under it (alerts are few).
                from torchscope.analysis.trace import fold_alerts

                events = iter(fold_alerts(events))
        out = sys.stdout
        try:
            if args.aten:
                lines = aten_log(events)
            elif args.kind and set(args.kind) == {"history"} and args.format == "text":
                lines = _history_table(events)  # one line per step, as `history PID`
            else:
                lines = _render(events, args.format)
            for line in lines:
                out.write(line + "\n")
            out.flush()
        except TraceFileError as exc:
            out.flush()
            return fail(f"{args.file}: {exc}")
        except BrokenPipeError:  # `torchscope dump t.tsc | head`
            drop_stdout()
            return 0
        except OSError as exc:  # a full disk
            drop_stdout()
            return fail(f"cannot write the output: {exc.strerror or exc}")
        if reader.truncated:
            print(
                f"torchscope: {args.file} was cut short at byte {reader.truncated_at} "
                f"(the writer did not finish); showing the {len(reader)} events before it",
                file=sys.stderr,
            )
        if reader.damaged:
            print(f"torchscope: {args.file}: {reader.damaged}", file=sys.stderr)
    return 0


def _render(events: Iterable[Event], fmt: str) -> Iterator[str]:
    """``render``'s lines, with ``history`` events (the run's loss per step) in words."""
    from torchscope.analysis.render import TEXT_HEADER, render, text_line
    from torchscope.cli.history import history_event_text
    from torchscope.protocol.events import HISTORY

    if fmt != "text":
        yield from render(events, fmt)
        return
    yield TEXT_HEADER
    for ev in events:
        yield history_event_text(ev) if ev.get("kind") == HISTORY else text_line(ev)


def _history_table(events: Iterable[Event]) -> Iterator[str]:
    """The recording's ``history`` events (batches of steps, written as they were taken) as
    one table, one line per step: what ``torchscope history PID`` prints for a live job."""
    from torchscope.cli.history import render_history

    points: dict[Any, dict] = {}
    buckets: dict[tuple, dict] = {}
    for ev in events:
        for p in ev.get("points") or ():
            if isinstance(p, dict):
                points[p.get("step")] = p  # a later batch restates a step: it wins
        for b in ev.get("buckets") or ():
            if isinstance(b, dict):
                buckets[(b.get("first"), b.get("last"))] = b

    def order(x: Any) -> tuple:
        return (0, x) if isinstance(x, int) else (1, 0)

    merged = {
        "points": [points[s] for s in sorted(points, key=order)],
        "buckets": [buckets[k] for k in sorted(buckets, key=lambda k: order(k[0]))],
    }
    yield from render_history(merged, "table")


# -- diff ------------------------------------------------------------------------------------
def cmd_diff(args: argparse.Namespace) -> int:
    """``torchscope diff``: 0 same, 1 diverged, 2 bad input."""
    from torchscope.analysis.diff import DiffError, Options, diff_files
    from torchscope.protocol.output import drop_stdout

    if not (args.rtol >= 0 and args.atol >= 0):  # NaN too: it would call every event divergent
        return fail("--rtol and --atol must be numbers >= 0")
    try:
        opts = Options(
            rtol=args.rtol,
            atol=args.atol,
            exact=args.exact,
            strict_dtype=args.strict_dtype,
            steps=parse_step_list(args.step),
            align=args.align,
        )
        res, notes, lines = diff_files(args.a, args.b, opts)
    except (DiffError, ValueError) as exc:
        return fail(str(exc))
    if opts.steps is not None and not res.matched and not res.only_a and not res.only_b:
        return fail(f"neither recording has step {args.step}")
    for n in notes:
        print(f"torchscope: {n}", file=sys.stderr)
    try:
        sys.stdout.write("\n".join(lines) + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        drop_stdout()
    except OSError as exc:  # a full disk: not "diverged" (1)
        drop_stdout()
        return fail(f"cannot write the output: {exc.strerror or exc}")
    return 0 if res.same else 1


def parse_step_list(spec: str | None) -> set[int] | None:
    """``--step``: ``"3"``, ``"0-9"``, ``"1,4,7-8"`` -> a set of steps; None for all."""
    if not spec:
        return None
    out: set[int] = set()
    for part in spec.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            first = int(lo)
            last = int(hi) if sep else first
        except ValueError:
            first = last = -1
        if first < 0 or last < first:
            raise ValueError(f"bad step list {spec!r} (expected e.g. 3, 0-9, 1,4,7-8)")
        out.update(range(first, last + 1))
    return out


# -- export ----------------------------------------------------------------------------------
def cmd_export(args: argparse.Namespace) -> int:
    """``torchscope export``: 0 written, 2 bad input (one line on stderr)."""
    from torchscope.export.tables import (
        TABLE_KINDS,
        TableError,
        check_extras,
        to_pandas,
        write_table,
    )
    from torchscope.protocol.codec import ProtocolError
    from torchscope.protocol.output import replacing, same_file
    from torchscope.protocol.tracefile import TraceReader

    fmt, out = args.format, args.output
    if fmt == "perfetto" and args.kind is not None:
        return fail("--kind picks the rows of a table: it goes with --format csv or parquet")
    if args.kind is None:
        args.kind = "op"
    if fmt != "perfetto" and args.kind not in TABLE_KINDS:
        return fail(f"--kind must be one of {', '.join(TABLE_KINDS)}, not {args.kind!r}")
    if fmt != "perfetto":
        try:  # before reading anything: a missing extra is one line, at once
            check_extras(fmt)
        except TableError as exc:
            return fail(str(exc))
    if out != "-" and same_file(out, args.file):
        return fail(f"-o {out} is the recording being exported: give another path")
    try:
        with TraceReader(args.file) as reader:
            if fmt == "perfetto":
                from torchscope.export.perfetto import write

                meta = {"source": os.path.basename(args.file)}
                if out == "-":
                    n = write(reader.iter_events(), sys.stdout, meta)
                else:
                    with replacing(out) as f:
                        n = write(reader.iter_events(), f, meta)
                what = f"{n} trace events"
            else:
                df = to_pandas(reader.iter_events(), args.kind)
                if out == "-" and fmt == "csv":
                    write_table(df, sys.stdout, fmt)
                else:
                    with replacing(out, "wb") as f:
                        write_table(df, f, fmt)
                what = f"{len(df)} rows of kind {args.kind}"
            if reader.truncated:
                print(
                    f"torchscope: {args.file} was cut short at byte {reader.truncated_at}; "
                    "exported the events before it",
                    file=sys.stderr,
                )
    except (ProtocolError, TableError) as exc:
        return fail(f"{args.file}: {exc}" if isinstance(exc, ProtocolError) else str(exc))
    except OSError as exc:
        return fail(f"cannot write {out}: {exc.strerror or exc}")
    if out != "-":
        print(f"torchscope: wrote {what} to {out}", file=sys.stderr)
    return 0
