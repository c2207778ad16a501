"""Render trace events for people (a text table) and for programs (JSON lines): what
``torchscope dump`` prints, and the table cells the UI shares (``compact_stat``,
``shape_text``, ``short_source``).

Imports neither torch nor textual.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import Any

from torchscope.analysis.trace import is_tally
from torchscope.protocol.events import (
    ALERT,
    ATEN,
    EDIT,
    ERROR,
    GRAD,
    GRAPH,
    LOG,
    OP,
    SESSION,
    STEP,
    TRACING,
    Event,
    number_text,
)
from torchscope.protocol.expressions import summary_text
from torchscope.protocol.jsontext import to_jsonl


def compact_stat(summary: dict | None) -> str:
    """``norm=1.23`` plus NaN/Inf flags: one cell of the table."""
    if summary is None:
        return "None"
    stats = summary.get("stats")
    if not stats:
        return summary.get("dtype") or "?"
    values = summary.get("values")
    if values is not None and len(values) == 1:
        text = number_text(values[0])
    else:
        text = f"norm={number_text(stats.get('norm'))}"
    flags = []
    if stats.get("nan"):
        flags.append(f"NaN:{stats['nan']}")
    if stats.get("inf"):
        flags.append(f"Inf:{stats['inf']}")
    return text + (" " + " ".join(flags) if flags else "")


def shape_text(summary: dict | None) -> str:
    if summary is None:
        return "-"
    shape = summary.get("shape")
    return "?" if shape is None else "[" + ",".join(map(str, shape)) + "]"


def short_source(source: str | None, cwd: str | None = None) -> str:
    if not source:
        return ""
    path, sep, line = source.rpartition(":")
    if not sep:  # no file: a notebook cell's "cell 4, line 11"
        return source
    cwd = cwd or os.getcwd()
    if os.path.isabs(path) and path.startswith(cwd + os.sep):
        path = os.path.relpath(path, cwd)
    return f"{path}:{line}"


def with_short_source(message: str, source: str | None, cwd: str | None = None) -> str:
    """``message`` with ``source`` in it as :func:`short_source` writes it (an alert's message
    keeps the full path; what shows it shortens it)."""
    if not isinstance(source, str) or not source:  # another rank's record may lack it
        return message
    return message.replace(source, short_source(source, cwd))


def text_line(ev: Event) -> str:
    kind = ev.get("kind")
    head = f"{ev.get('seq', '?'):>7} {ev.get('step', '-')!s:>5} "
    if kind == OP:
        outs = ev.get("outputs") or []
        shapes = " ".join(shape_text(s) for s in outs)
        stat = " ".join(compact_stat(s) for s in outs)
        return (
            f"{head}op    {ev.get('name', ''):<34} {ev.get('module', '') or '-':<22} "
            f"{shapes:<16} {stat:<22} {short_source(ev.get('source'))}"
        )
    if kind == GRAD:
        gi = ", ".join(compact_stat(s) for s in ev.get("grad_inputs") or [])
        go = ", ".join(compact_stat(s) for s in ev.get("grad_outputs") or [])
        made_by = f"op {ev['op_seq']}" if ev.get("op_seq") is not None else ""
        param = ev.get("param") or made_by
        return (
            f"{head}grad  {ev.get('node', ''):<34} {param:<22} "
            f"in: ({go})  out: ({gi})  {short_source(ev.get('source'))}"
        )
    if kind == ATEN:
        outs = ev.get("outputs") or []
        shapes = " ".join(shape_text(s) for s in outs)
        stat = " ".join(compact_stat(s) for s in outs)
        if ev.get("node"):
            parent = f"{'sum into' if ev.get('accumulate') else 'in'} {ev['node']}"
        else:
            parent = f"in op {ev['op_seq']}" if ev.get("op_seq") is not None else ""
        return (
            f"{head}aten    {aten_call_text(ev):<32} {parent:<22} {shapes:<16} {stat:<22} "
            f"{ev.get('module') or '-'}"
        )
    if kind == ALERT:
        if is_tally(ev):  # a running count, in a dump of every event (folded by --kind alert)
            return f"{head}      \u21b3 {ev.get('message', '')}"
        return f"{head}ALERT {ev.get('message', '')}{consequences_text(ev)}"
    if kind == GRAPH:
        nodes = ev.get("nodes") or []
        ran = sum(1 for n in nodes if n.get("executed"))
        return (
            f"{head}graph {ev.get('call', '')}: {len(nodes)} nodes, {ran} executed, "
            f"{len(nodes) - ran} not executed  {short_source(ev.get('source'))}"
        )
    if kind == STEP:
        return f"{head}step  ---- step {ev.get('step')} ----"
    if kind == SESSION:
        return (
            f"{head}session pid {ev.get('pid')} {ev.get('script') or ''} "
            f"torch {ev.get('torch')} steps {ev.get('steps')}"
        )
    if kind == ERROR:
        return f"{head}error {ev.get('where', '')}: {ev.get('message', '')}"
    if kind == TRACING:
        if ev.get("ended"):
            return f"{head}tracing ended with the job"
        by = ", ".join(_holder_text(h) for h in ev.get("holders") or []) or "nobody"
        return f"{head}tracing {ev.get('state')} (held by {by})"
    if kind == EDIT:  # a tensor changed by hand: every number after it is not the run's own
        before = (ev.get("before") or [None])[0]
        after = (ev.get("after") or [None])[0]
        at = f"at {ev['at']} " if ev.get("at") is not None else ""
        return (
            f"{head}EDIT  {ev.get('name') or '?'} {at}{ev.get('target')} <- {ev.get('expr')}"
            f"  ({summary_text(before)} -> {summary_text(after)}; by {ev.get('by')})"
        )
    if kind == LOG:
        return f"{head}log   {ev.get('name') or '?'}: {ev.get('expr')} = {ev.get('text')}"
    return f"{head}{kind}"


def consequences_text(alert: Event) -> str:
    """``  [+4 consequences, steps 3-5]`` for an origin folded with its count, then one line
    per consequence it lists in words ("" for an alert with none)."""
    n = alert.get("consequences")
    if not n:
        return ""
    lo, hi = alert.get("consequence_steps") or (None, None)
    steps = "" if lo is None else f", step {lo}" if lo == hi else f", steps {lo}-{hi}"
    text = f"  [+{n} consequence{'s' * (n != 1)}{steps}]"
    first = alert.get("first_consequences") or []
    for c in first:
        text += f"\n{'':>20}step {c.get('step')}: {c.get('message')}"
    if n > len(first):
        text += f"\n{'':>20}... and {n - len(first)} more"
    return text


def job_origin_text(origin: Event, cwd: str | None = None) -> str:
    """One origin of a multi-rank job (an item of ``job_origins``) in one line: the origin's
    own words (its source path shortened against ``cwd``), the rank that made it, the ranks
    it reached, and its consequences counted across ranks and steps. The same text wherever
    it is shown, so that every rank's view names it alike::

        Inf first appears in Tensor.__setitem__ (forward) at job.py:14 · rank 1
        · reached ranks 0, 1 · +9 consequences over steps 4-5   (one line)
    """
    words = str(origin.get("message") or "?")
    source = origin.get("source")
    if isinstance(source, str) and source:
        words = words.replace(source, short_source(source, cwd))
    rank = origin.get("rank")
    parts = [words, f"rank {rank}"]
    reached = sorted({rank, *(a.get("rank") for a in origin.get("arrivals") or ())} - {None})
    if len(reached) > 1:
        parts.append(f"reached ranks {', '.join(map(str, reached))}")
    n = int(origin.get("job_consequences") or 0)
    if n:
        lo, hi = origin.get("job_consequence_steps") or (None, None)
        steps = "" if lo is None else f" at step {lo}" if lo == hi else f" over steps {lo}-{hi}"
        parts.append(f"+{n} consequence{'s' * (n != 1)}{steps}")
    return " · ".join(parts)


def _holder_text(holder: Any) -> str:
    if not isinstance(holder, dict):
        return str(holder)
    text = str(holder.get("by", "?"))
    if holder.get("steps") is not None:
        text += f" steps {holder['steps']}"
    if holder.get("remaining") is not None:
        text += f", {holder['remaining']} more"
    return text


TEXT_HEADER = f"{'seq':>7} {'step':>5} kind  {'name':<34} {'module / param':<22} details"


def render(events: Iterable[Event], fmt: str) -> Iterator[str]:
    if fmt == "text":
        yield TEXT_HEADER
        for ev in events:
            yield text_line(ev)
    else:
        for ev in events:
            yield to_jsonl(ev)


def _outputs_text(summaries: list | None) -> str:
    return ", ".join(
        f"{shape_text(s)} {s.get('dtype', '?') if s else ''} {compact_stat(s)}".strip()
        for s in summaries or []
    )


def aten_call_text(ev: Event) -> str:
    """An aten call's name with what else it says of itself: ``aten._to_copy.default
    [autocast]``, ``_c10d_functional.all_reduce.default [group 8]``."""
    tags = [t for t in (ev.get("label"), ev.get("group_size")) if t is not None]
    if ev.get("group_size") is not None:
        tags[-1] = f"group {ev['group_size']}"
    return f"{ev.get('name', '')} [{', '.join(map(str, tags))}]" if tags else ev.get("name", "")


def aten_log(events: Iterable[Event]) -> Iterator[str]:
    """``dump --aten``: a nested log in the spirit of PyTorch's DebugMode. Module markers,
    each op with its aten calls under it, each backward node with its kernels and the
    engine's sums, each call with its output shape, dtype and stats."""
    waiting: list[Event] = []  # an op's or node's calls come just before it
    module: str | None = None
    for ev in events:
        kind = ev.get("kind")
        if kind == ATEN:
            if ev.get("accumulate"):
                yield f"    + engine sum {aten_call_text(ev)} -> {_outputs_text(ev.get('outputs'))}"
            elif ev.get("op_seq") is None and ev.get("node") is None:
                yield f"  {aten_call_text(ev)} -> {_outputs_text(ev.get('outputs'))}"
            else:
                waiting.append(ev)
            continue
        if kind == STEP:
            yield f"---- step {ev.get('step')} ----"
            module = None
            continue
        if kind == OP:
            if ev.get("module") != module:
                module = ev.get("module")
                yield f"  [module {module or '(top level)'}]"
            yield (
                f"  {ev.get('name')} -> {_outputs_text(ev.get('outputs'))}"
                f"  {short_source(ev.get('source'))}"
            )
            key, value = "op_seq", ev.get("seq")
        elif kind == GRAD:
            made_by = f", op {ev['op_seq']}" if ev.get("op_seq") is not None else ""
            yield f"  {ev.get('node')} (node {ev.get('node_id')}{made_by})"
            key, value = "node_id", ev.get("node_id")
        elif kind == GRAPH:
            yield f"  -- {ev.get('call')} --"
            continue
        elif kind == ALERT:
            yield f"  !! {ev.get('message')}"
            continue
        else:
            continue
        mine = [c for c in waiting if c.get(key) == value]
        if mine:
            waiting = [c for c in waiting if c.get(key) != value]
            for call in mine:
                yield f"    {aten_call_text(call)} -> {_outputs_text(call.get('outputs'))}"
