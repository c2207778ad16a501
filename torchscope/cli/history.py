"""``torchscope history PID``: a running job's loss and gradient-norm history, printed
(``torchscope history FILE.tsc``: a recording's, from its ``history`` events).

The job's agent keeps every step's loss (and with the watch, the global gradient norm and a
norm per module) whether or not the step was traced (:mod:`torchscope.tracer.history`); this
asks for it with the ``history`` control command and prints it as a table (default), CSV or
JSON lines. Steps older than the agent's full-resolution window come first, folded into
buckets (min, max and last of each series over a range of steps). A step the watch flagged
as a loss spike says ``spike`` in the UPDATE column (``spk,skip`` when its update was
skipped); a recording also holds the spike's line (its alert), printed under the table.

Also here: how ``dump`` shows a ``history`` event and how ``ls`` shows a loss.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any

from torchscope.cli.common import fail
from torchscope.protocol.events import number_text

FORMATS = ("table", "csv", "jsonl")


def cmd_history(args: argparse.Namespace) -> int:
    from torchscope.protocol import endpoints as ep
    from torchscope.protocol.client import SessionClient, SessionRefused, SessionUnreachable
    from torchscope.protocol.output import drop_stdout
    from torchscope.protocol.runtime import EndpointError

    if args.last is not None and args.last < 0:
        return fail("--last takes a number of steps, 0 or more")
    lines: dict[int, str] = {}
    if args.target and os.path.isfile(args.target):  # a recording: its history events
        try:
            reply, lines = _recorded(args.target, args.since, args.last)
        except ValueError as exc:
            return fail(str(exc))
    else:
        try:
            with SessionClient() as client:
                client.connect(ep.resolve(args.target), timeout=args.timeout)
                reply = client.request(
                    "history",
                    timeout=max(args.timeout, 10.0),
                    since=args.since,
                    max_points=args.last,
                )
        except (SessionUnreachable, SessionRefused, EndpointError) as exc:
            return fail(str(exc))
    try:
        for line in render_history(reply, args.format, lines):
            sys.stdout.write(line + "\n")
        sys.stdout.flush()
    except BrokenPipeError:  # `torchscope history PID | head`
        drop_stdout()
    if args.format == "table" and reply.get("pending"):
        n = reply["pending"]
        print(
            f"torchscope: {n} more step{'s' * (n != 1)} still on the device (read at the job's "
            "next step boundaries)",
            file=sys.stderr,
        )
    return 0


def _recorded(path: str, since: int | None, last: int | None) -> tuple[dict, dict[int, str]]:
    """A recording's history as a ``history`` reply, and its spikes' lines (ValueError with
    one line when the file cannot be read)."""
    from torchscope.analysis.updates import recorded_history
    from torchscope.protocol.codec import ProtocolError
    from torchscope.protocol.tracefile import TraceReader

    try:
        with TraceReader(path) as reader:
            reply, lines = recorded_history(reader.iter_events())
    except (ProtocolError, OSError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    points = reply["points"]
    if since is not None:
        points = [p for p in points if p["step"] > since]
        reply["buckets"] = []
    if last is not None:
        points = points[len(points) - last :] if last else []
    reply["points"] = points
    return reply, lines


def render_history(
    reply: dict[str, Any], fmt: str, lines: dict[int, str] | None = None
) -> Iterator[str]:
    """Lines of a ``history`` reply (or event): ``table``, ``csv`` or ``jsonl``; ``lines``:
    the line of each step the watch flagged as a spike (its alert's), by step: under the
    table, and as the point's ``line`` in JSON lines."""
    points = [p for p in reply.get("points") or () if isinstance(p, dict)]
    buckets = [b for b in reply.get("buckets") or () if isinstance(b, dict)]
    lines = lines or {}
    if fmt == "jsonl":
        points = [{**p, "line": lines[p["step"]]} if p.get("step") in lines else p for p in points]
        yield from _jsonl(points, buckets)
    elif fmt == "csv":
        yield from _csv(points, buckets)
    else:
        yield from _table(points, buckets)
        spiked = [p["step"] for p in points if p.get("spike") and p.get("step") in lines]
        if spiked:
            yield ""
            yield "spikes the watch caught:"
            for step in spiked:
                skipped = " (its update skipped)" if _point(points, step).get("skipped") else ""
                yield f"  {lines[step]}{skipped}"


def _point(points: list[dict[str, Any]], step: int) -> dict[str, Any]:
    return next(p for p in points if p.get("step") == step)


def _num(x: Any) -> str:
    return number_text(x if isinstance(x, (int, float)) and not isinstance(x, bool) else None, 6)


def _series(s: Any) -> tuple[Any, Any, Any]:
    return tuple(s) if isinstance(s, (list, tuple)) and len(s) == 3 else (None, None, None)


def _top_module(p: dict[str, Any]) -> str:
    """The module with the largest gradient norm (a non-finite one first): where to look."""
    norms = p.get("module_norms")
    if not isinstance(norms, dict) or not norms:
        return ""

    def rank(item: tuple[str, Any]) -> float:
        v = item[1]
        if not isinstance(v, (int, float)):
            return -1.0
        return math.inf if not math.isfinite(v) else float(v)

    name, value = max(norms.items(), key=rank)
    return f"{name}: {_num(value)}"


def _table(points: list[dict[str, Any]], buckets: list[dict[str, Any]]) -> Iterator[str]:
    # A loss scaler's column only in a job that has one: the scale; the update's (skipped by
    # the scaler or the watch's on_nan="skip") where one was.
    scaler = any(p.get("scale") is not None for p in points)
    updates = scaler or any(p.get("skipped") or p.get("spike") for p in points)
    head = f"{'SCALE':>10} " if scaler else ""
    head += f"{'UPDATE':<8} " if updates else ""
    yield f"{'STEP':>12} {'LOSS':>13} {'GRAD NORM':>13} {head}{'TRACED':<6} LARGEST MODULE NORM"
    for b in buckets:
        lo, hi, last = _series(b.get("loss"))
        glo, ghi, glast = _series(b.get("grad_norm"))
        steps = f"{b.get('first')}-{b.get('last')}"
        grad = f"  |g| {_num(glo)}..{_num(ghi)} (last {_num(glast)})" if glast is not None else ""
        skips = f"  {b['skipped']} updates skipped" if b.get("skipped") else ""
        yield f"{steps:>12} loss {_num(lo)}..{_num(hi)} (last {_num(last)}){grad}{skips}"
    for p in points:
        traced = "yes" if p.get("traced") else ""
        cols = ""
        if scaler:
            cols = f"{_num(p.get('scale')):>10} "
        if updates:
            update = "skipped" if p.get("skipped") else ""
            if p.get("spike"):  # a loss spike the watch caught (watch="spike")
                update = "spk,skip" if update else "spike"
            cols += f"{update:<8} "
        yield (
            f"{p.get('step')!s:>12} {_num(p.get('loss')):>13} {_num(p.get('grad_norm')):>13} "
            f"{cols}{traced:<6} {_top_module(p)}".rstrip()
        )
    if not points and not buckets:
        yield "(no steps yet)"


def _jsonl(points: list[dict[str, Any]], buckets: list[dict[str, Any]]) -> Iterator[str]:
    from torchscope.protocol.jsontext import json_safe

    for b in buckets:
        yield json.dumps(json_safe({"bucket": True, **b}), separators=(",", ":"))
    for p in points:
        yield json.dumps(json_safe(p), separators=(",", ":"))


class _Lines:
    """A file for csv.writer that hands each row back as one line."""

    def __init__(self) -> None:
        self.text = ""

    def write(self, s: str) -> None:
        self.text += s


def _csv(points: list[dict[str, Any]], buckets: list[dict[str, Any]]) -> Iterator[str]:
    modules: dict[str, None] = {}
    for p in points:
        norms = p.get("module_norms")
        if isinstance(norms, dict):
            modules.update(dict.fromkeys(map(str, norms)))
    head = ["step", "last_step", "loss", "loss_min", "loss_max", "grad_norm"]
    head += ["grad_norm_min", "grad_norm_max", "traced", "scale", "skipped"]
    head += [f"norm:{m}" for m in modules]
    buf = _Lines()
    out = csv.writer(buf, lineterminator="")

    def row(values: Iterable[Any]) -> str:
        buf.text = ""
        out.writerow(["" if v is None else v for v in values])
        return buf.text

    yield row(head)
    for b in buckets:
        lo, hi, last = _series(b.get("loss"))
        glo, ghi, glast = _series(b.get("grad_norm"))
        yield row(
            [b.get("first"), b.get("last"), last, lo, hi, glast, glo, ghi, "", "", b.get("skipped")]
        )
    for p in points:
        norms = p.get("module_norms")
        norms = norms if isinstance(norms, dict) else {}
        yield row(
            [p.get("step"), p.get("step"), p.get("loss"), None, None, p.get("grad_norm")]
            + [None, None, int(bool(p.get("traced"))), p.get("scale"), int(bool(p.get("skipped")))]
            + [norms.get(m) for m in modules]
        )


def history_event_text(ev: dict[str, Any]) -> str:
    """One ``dump`` line for a ``history`` event."""
    step = ev.get("step")
    head = f"{ev.get('seq', '?'):>7} {'-' if step is None else step!s:>5} "
    points = [p for p in ev.get("points") or () if isinstance(p, dict)]
    buckets = [b for b in ev.get("buckets") or () if isinstance(b, dict)]
    parts = []
    if buckets:
        first, last_step = buckets[0].get("first"), buckets[-1].get("last")
        parts.append(f"{len(buckets)} buckets, steps {first}-{last_step}")
    if points:
        last = points[-1]
        grad = f", |g| {_num(last.get('grad_norm'))}" if last.get("grad_norm") is not None else ""
        parts.append(
            f"{len(points)} steps {points[0].get('step')}-{last.get('step')}, last loss "
            f"{_num(last.get('loss'))}{grad}"
        )
    return f"{head}history {'; '.join(parts) or 'empty'}"


def latest_loss(client: Any, timeout: float) -> str:
    """The job's newest loss, for ``ls`` ("-": none yet, or a job that keeps no history)."""
    try:
        reply = client.request("history", timeout=timeout, max_points=0)
    except Exception:  # an old or busy job: ls shows none
        return "-"
    latest = reply.get("latest")
    return _num(latest.get("loss")) if isinstance(latest, dict) else "-"
