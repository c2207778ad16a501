"""What the tools answer, shaped from events: small, bounded, paginated, in the UI's words.

Pure functions over events (no SDK, no sockets, no files), so a recording and a live job
answer alike. The timeline's rows, search and filter are the UI model's own
(:mod:`torchscope.session`: ``StepData.haystack``, ``compile_filter``, ``CallHits``), so a
pattern that finds a row in the UI finds it here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

from torchscope.analysis.render import compact_stat, shape_text
from torchscope.analysis.trace import fold_alerts, is_tally, job_origins
from torchscope.analysis.updates import recorded_history
from torchscope.protocol.events import ALERT, GRAD, GRAPH, OP, Event, number_text
from torchscope.session.countpass import Counter
from torchscope.session.format import short_name, source_cell
from torchscope.session.rows import KIND, SEQ
from torchscope.session.search import CallHits, compile_filter
from torchscope.session.stepper_view import bad_kind, event_name, pause_story, spec_text
from torchscope.session.steps import StepData
from torchscope.session.store import EventStore

__all__ = [
    "MAX_LIMIT",
    "ViewError",
    "alerts_view",
    "event_view",
    "graph_view",
    "history_view",
    "page",
    "pause_view",
    "recorded_history",
    "rows_view",
    "steps_view",
    "summary_view",
]

MAX_LIMIT = 200  # rows, alerts or steps in one answer
MAX_VALUES = 16  # tensor values shown per summary (the `values` tool pages through more)
MAX_GRAPH_NODES = 80
# A step's events are held while a tool shapes them; more than this is refused in one line
# rather than held (a recording's step is usually far smaller).
MAX_STEP_EVENTS = 2_000_000

_SIDES = {OP: ("inputs", "outputs"), GRAD: ("grad_outputs", "grad_inputs")}
_STATS = ("min", "max", "mean", "std", "norm", "nan", "inf")


class ViewError(ValueError):
    """A request the data cannot answer; its text is the one line the agent sees."""


# -- pagination --------------------------------------------------------------------------------
def page(items: Sequence[Any], offset: int, limit: int, key: str = "items") -> dict[str, Any]:
    """``items[offset:offset+limit]`` with where the next page starts (None at the end)."""
    offset = max(0, offset)
    chosen = list(items[offset : offset + limit])
    end = offset + len(chosen)
    return {
        "total": len(items),
        "offset": offset,
        key: chosen,
        "next_offset": end if end < len(items) else None,
    }


# -- tensors -----------------------------------------------------------------------------------
def _num(x: Any) -> Any:
    """A stat as JSON can carry it: NaN and Inf spelled out (JSON has no such numbers)."""
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return number_text(x)
    return x


def summary_view(s: Any) -> dict[str, Any] | None:
    """One tensor summary: shape, dtype, stats, the first values, and the UI's cell text."""
    if not isinstance(s, dict):
        return None
    out: dict[str, Any] = {"text": compact_stat(s), "shape": shape_text(s)}
    for key in ("dtype", "device", "param", "placement", "stats_of"):
        if s.get(key) is not None:
            out[key] = s[key]
    stats = s.get("stats")
    if isinstance(stats, dict):
        out["stats"] = {k: _num(stats.get(k)) for k in _STATS if k in stats}
    values = s.get("values")
    if isinstance(values, list):
        out["values"] = [_num(v) for v in values[:MAX_VALUES]]
        if len(values) > MAX_VALUES:
            out["values_shown"] = f"{MAX_VALUES} of {len(values)}"
    return out


def _first_text(summaries: Any) -> str:
    if isinstance(summaries, list) and summaries:
        return compact_stat(summaries[0]) if isinstance(summaries[0], dict) else "None"
    return ""


# -- the timeline: rows of a step, search and filter ------------------------------------------
def _step_store(events: list[Event], step: int) -> tuple[EventStore, StepData]:
    """The step's data, and the store that decodes its rows (``store.event(t)``)."""
    if len(events) > MAX_STEP_EVENTS:
        raise ViewError(f"step {step} has {len(events)} events: too many to read at once")
    store = EventStore(max_events=len(events) + 1)
    store.ingest(events)
    data = store.data(step)
    if data is None or not data.rows:
        raise ViewError(f"step {step} has no traced ops or backward nodes here")
    return store, data


def _row(store: EventStore, data: StepData, t: tuple, index: int) -> dict[str, Any]:
    """A timeline row: the op or backward node, its module (a node: its op's, or the
    parameter), where it ran, what came out, and NaN/Inf in and out."""
    ev = store.event(t)
    ins, outs = _SIDES.get(t[KIND], ("inputs", "outputs"))
    row: dict[str, Any] = {
        "i": index,
        "seq": t[SEQ],
        "kind": t[KIND],
        "name": short_name(event_name(ev)),
        "module": ev.get("param") or data.module_of(t) or "",
        "source": source_cell(ev.get("source")),
        "out": _first_text(ev.get(outs)),
    }
    if t[KIND] == OP:
        row["shape"] = " ".join(shape_text(s) for s in ev.get(outs) or ())
    else:
        row["in"] = _first_text(ev.get(ins))
    bad_in, bad_out = bad_kind(ev.get(ins)), bad_kind(ev.get(outs))
    if bad_in or bad_out:
        row["bad"] = f"{bad_out} made here" if bad_out and not bad_in else f"{bad_in or bad_out} in"
    return row


def rows_view(
    events: list[Event],
    step: int,
    *,
    search: str | None = None,
    filter: str | None = None,
    kind: str | None = None,
    offset: int | None = None,
    limit: int = 50,
) -> dict[str, Any]:
    """The step's timeline (its ops, then its backward nodes, in order), a page of it.

    ``filter`` keeps only the rows it matches (the UI's ``|``); ``search`` keeps every row,
    marks the matches and, without ``offset``, starts the page at the first one (the UI's
    ``/``). Both are the UI's: a case-insensitive regex over each field a row shows on its
    own (name as shown and in full, module, parameter, source as shown and in full), and a
    row also matches through its aten calls' names."""
    store, data = _step_store(events, step)
    rows = data.rows
    if kind is not None:
        rows = [t for t in rows if t[KIND] == kind]
    indexed = list(enumerate(rows))
    out: dict[str, Any] = {"step": step}
    if filter:
        keep = _matcher(data, filter, "filter")
        indexed = [(i, t) for i, t in indexed if keep(t)]
        out["filter"] = filter
    hits: list[int] = []
    if search:
        found = _matcher(data, search, "search")
        hits = [n for n, (_, t) in enumerate(indexed) if found(t)]
        out["search"] = search
        out["matches"] = len(hits)
        out["match_seqs"] = [indexed[n][1][SEQ] for n in hits[:MAX_LIMIT]]
        if offset is None and hits:
            offset = hits[0]
    chosen = page(indexed, offset or 0, limit, "rows")
    shown = []
    hit_set = set(hits)
    start = chosen["offset"]
    for n, (i, t) in enumerate(chosen["rows"], start):
        r = _row(store, data, t, i)
        if n in hit_set:
            r["match"] = True
        shown.append(r)
    chosen["rows"] = shown
    out.update(chosen)
    return out


def _matcher(data: StepData, text: str, what: str) -> Any:
    try:
        pattern = compile_filter(text)
    except re.error as exc:
        raise ViewError(f"{what}: {text!r} is not a regular expression: {exc}") from None
    if pattern is None:
        return lambda t: True
    calls = CallHits(data, pattern)
    calls.update()
    through_calls = set(calls.by_row)
    return lambda t: bool(pattern.search(data.haystack(t))) or t[SEQ] in through_calls


# -- one event in full ---------------------------------------------------------------------------
def event_view(events: list[Event], seq: int) -> dict[str, Any]:
    """One event with both sides: an op's inputs and outputs and the backward nodes it
    created; a node's ``grad_outputs`` (what arrived) and ``grad_inputs`` (what it sends on,
    each to the node it goes to) and the op that created it."""
    ev = next((e for e in events if e.get("seq") == seq), None)
    if ev is None:
        raise ViewError(f"no event {seq} here (it may be in another step, or not recorded)")
    kind = ev.get("kind")
    out: dict[str, Any] = {
        "seq": seq,
        "kind": kind,
        "step": ev.get("step"),
        "name": event_name(ev),
    }
    for key in ("module", "param", "source", "function", "where", "what", "message", "call"):
        if ev.get(key):
            out[key] = ev[key]
    if kind == OP:
        out["inputs"] = [summary_view(s) for s in ev.get("inputs") or ()]
        out["outputs"] = [summary_view(s) for s in ev.get("outputs") or ()]
        out["nodes"] = [n for n in ev.get("nodes") or () if isinstance(n, dict)]
        if ev.get("grad_fn"):
            out["grad_fn"] = ev["grad_fn"]
    elif kind == GRAD:
        out["node_id"] = ev.get("node_id")
        out["grad_outputs (what arrived)"] = [summary_view(s) for s in ev.get("grad_outputs") or ()]
        targets = _next_of(events, ev)
        sends = []
        for i, s in enumerate(ev.get("grad_inputs") or ()):
            item = summary_view(s) or {"text": "None"}
            if i < len(targets) and targets[i] is not None:
                item["to"] = targets[i]
            sends.append(item)
        out["grad_inputs (what it sends on)"] = sends
        op = next((e for e in events if e.get("seq") == ev.get("op_seq")), None)
        if op is not None:
            out["made_by"] = {
                "seq": op["seq"],
                "op": short_name(event_name(op)),
                "module": op.get("module") or "",
                "source": op.get("source"),
            }
    elif kind == GRAPH:
        nodes = [n for n in ev.get("nodes") or () if isinstance(n, dict)]
        out["nodes"] = len(nodes)
        out["executed"] = sum(1 for n in nodes if n.get("executed"))
        out["hint"] = "the graph tool shows the nodes around one of them"
    else:
        rest = {k: v for k, v in ev.items() if k not in out and k not in ("kind", "seq", "step")}
        out.update(_bounded(rest))
    return out


def _bounded(d: dict[str, Any], max_items: int = 20) -> dict[str, Any]:
    """An unknown event's other fields, lists cut to ``max_items``."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, list) and len(v) > max_items:
            out[k] = v[:max_items]
            out[f"{k}_shown"] = f"{max_items} of {len(v)}"
        else:
            out[k] = v
    return out


def _graph_nodes(events: Iterable[Event]) -> dict[int, dict[str, Any]]:
    nodes: dict[int, dict[str, Any]] = {}
    for e in events:
        if e.get("kind") == GRAPH:
            for n in e.get("nodes") or ():
                if isinstance(n, dict) and type(n.get("id")) is int:
                    nodes[n["id"]] = n
    return nodes


def _next_of(events: list[Event], grad: Event) -> list[str | None]:
    """For each of a node's grad_inputs, the node it goes to, as ``Name #id``."""
    nodes = _graph_nodes(events)
    node_id = grad.get("node_id")
    node = nodes.get(node_id) if isinstance(node_id, int) else None
    out: list[str | None] = []
    for link in (node or {}).get("next") or ():
        target = nodes.get(link[0]) if isinstance(link, list) and link else None
        out.append(f"{target.get('name')} #{target['id']}" if target else None)
    return out


# -- the backward graph around an event ---------------------------------------------------------
def graph_view(
    events: list[Event], *, seq: int | None = None, node: int | None = None, depth: int = 2
) -> dict[str, Any]:
    """The backward nodes within ``depth`` links of one node (``node``, or the node of the
    event ``seq``: a grad event's, an op's first), toward the loss (``from``: the nodes whose
    gradient it receives) and toward the parameters (``to``: where it sends gradients), each
    with the gradient that arrived and what it sent on, and whether it ran."""
    nodes = _graph_nodes(events)
    if not nodes:
        raise ViewError("no backward graph here (no backward ran in a traced step)")
    if node is None:
        ev = next((e for e in events if e.get("seq") == seq), None)
        if ev is None:
            raise ViewError(f"no event {seq} here")
        if ev.get("kind") == GRAD:
            node = ev.get("node_id")
        elif ev.get("kind") == OP:
            made = [n.get("id") for n in ev.get("nodes") or () if isinstance(n, dict)]
            node = made[0] if made else None
        if node is None:
            raise ViewError(f"event {seq} is not a backward node nor an op that created one")
    if node not in nodes:
        raise ViewError(f"no backward node {node} in this step's graph")
    grads: dict[int, Event] = {}
    for e in events:
        if e.get("kind") == GRAD and type(e.get("node_id")) is int:
            grads.setdefault(e["node_id"], e)
    consumers: dict[int, list[int]] = {}
    for n in nodes.values():
        for link in n.get("next") or ():
            if isinstance(link, list) and link and type(link[0]) is int:
                consumers.setdefault(link[0], []).append(n["id"])
    around: dict[int, int] = {node: 0}  # id -> distance (negative: toward the loss)
    for sign, step_of in ((1, _nexts), (-1, lambda n, _nodes: consumers.get(n["id"], []))):
        frontier = [node]
        for d in range(1, depth + 1):
            following = []
            for nid in frontier:
                for other in step_of(nodes[nid], nodes):
                    if other in nodes and other not in around and len(around) < MAX_GRAPH_NODES:
                        around[other] = sign * d
                        following.append(other)
            frontier = following
    out_nodes = []
    for nid, dist in sorted(around.items(), key=lambda kv: (kv[1], kv[0])):
        n = nodes[nid]
        item: dict[str, Any] = {
            "id": nid,
            "name": n.get("name"),
            "distance": dist,
            "module": n.get("param") or n.get("module") or "",
            "source": source_cell(n.get("source")),
            "executed": bool(n.get("executed")),
            "to": [link[0] for link in n.get("next") or () if isinstance(link, list) and link],
            "from": consumers.get(nid, []),
        }
        if n.get("op_seq") is not None:
            item["op_seq"] = n["op_seq"]
        g = grads.get(nid)
        if g is not None:
            item["grad_seq"] = g["seq"]
            item["arrived"] = _first_text(g.get("grad_outputs"))
            item["sends"] = [compact_stat(s) if s else "None" for s in g.get("grad_inputs") or ()]
            bad_in, bad_out = bad_kind(g.get("grad_outputs")), bad_kind(g.get("grad_inputs"))
            if bad_out and not bad_in:
                item["bad"] = f"{bad_out} made here"
            elif bad_in:
                item["bad"] = f"{bad_in} arrived"
        elif not n.get("executed"):
            item["note"] = "not executed"
        out_nodes.append(item)
    return {
        "node": node,
        "depth": depth,
        "nodes": out_nodes,
        "shown": f"{len(out_nodes)} of {len(nodes)} nodes",
        "reading": "distance < 0: toward the loss (gradient comes from there); > 0: toward "
        "the parameters (gradient goes there); to/from: node ids",
    }


def _nexts(n: dict[str, Any], nodes: dict[int, dict[str, Any]]) -> list[int]:
    return [link[0] for link in n.get("next") or () if isinstance(link, list) and link]


# -- alerts ---------------------------------------------------------------------------------------
def _alert_item(a: Event, rank: int | None) -> dict[str, Any]:
    item: dict[str, Any] = {
        "seq": a.get("seq"),
        "step": a.get("step"),
        "rank": a.get("rank", rank),
        "message": a.get("message"),
    }
    for key in ("what", "where", "module", "source", "param", "node_id", "event_seq"):
        if a.get(key) not in (None, ""):
            item[key] = a[key]
    if isinstance(a.get("spike"), dict):  # a loss spike's figures, and what the job did
        item["spike"] = dict(a["spike"])
    if a.get("name"):
        item["op"] = short_name(str(a["name"]))
    item["origin"] = a.get("origin") is not None
    if a.get("consequences"):
        item["consequences"] = a["consequences"]
        item["consequence_steps"] = a.get("consequence_steps")
    for key in ("from_rank", "origin_step", "arrivals", "job_consequences"):
        if a.get(key):
            item[key] = a[key]
    return item


def history_view(
    reply: dict[str, Any], lines: dict[int, str], last: int
) -> tuple[list[dict[str, Any]], str | None]:
    """The newest ``last`` points of a history reply, each with its 3 largest module norms
    (not all of them), and a spike's ``line`` where the watch flagged one; and a note on the
    folded older steps (None when none)."""
    points = [dict(p) for p in reply.get("points") or () if isinstance(p, dict)][-last:]
    for p in points:
        norms = p.pop("module_norms", None)
        if isinstance(norms, dict) and norms:
            top = sorted(norms.items(), key=lambda kv: -_mag(kv[1]))[:3]
            p["top_module_norms"] = dict(top)
        p.pop("update_ratios", None)
        step = p.get("step")
        line = lines.get(step) if p.get("spike") and type(step) is int else None
        if line:
            p["line"] = line
    buckets = reply.get("buckets") or ()
    older = f"{len(buckets)} folded buckets of older steps not shown" if buckets else None
    return points, older


def _mag(x: Any) -> float:
    """A norm's size for ordering: a non-finite one first (where to look)."""
    if not isinstance(x, (int, float)):
        return -1.0
    return abs(x) if math.isfinite(x) else math.inf


def alerts_view(
    alerts_by_rank: dict[int | None, list[Event]],
    *,
    step: int | None = None,
    offset: int = 0,
    limit: int = 50,
) -> dict[str, Any]:
    """Where NaN/Inf first appeared, one alert per origin with its consequences counted
    (``fold_alerts``); over several ranks' recordings, the job's origins (``job_origins``),
    each with the ranks it reached. Origins first, in step order."""
    if len(alerts_by_rank) > 1:
        ranked = {r if r is not None else -1: a for r, a in alerts_by_rank.items()}
        items = [_alert_item(a, a.get("rank")) for a in job_origins(ranked)]
    else:
        ((rank, alerts),) = alerts_by_rank.items() or ((None, []),)
        items = [_alert_item(a, rank) for a in fold_alerts(alerts) if not is_tally(a)]
    if step is not None:
        items = [a for a in items if a.get("step") == step]
    items.sort(key=lambda a: (not a["origin"], _int(a.get("step")), _int(a.get("seq"))))
    return page(items, offset, limit, "alerts")


def _int(x: Any) -> int:
    return x if type(x) is int else -1


# -- the step list -------------------------------------------------------------------------------
def steps_view(events: Iterable[Event], *, offset: int = 0, limit: int = 50) -> dict[str, Any]:
    """Each traced step: its ops, backward nodes and alerts, its loss and global gradient
    norm (the UI's Steps panel, from the same count)."""
    counter = Counter()
    counter.add(events)
    counts, _ = counter.take()
    losses = counter.take_losses()
    items = []
    for step in sorted(s for s in counts if s >= 0):
        c = counts[step]
        ops, grads, graph_nodes, alerts, n_events = c[:5]
        if not (ops or grads or alerts):
            continue
        item: dict[str, Any] = {
            "step": step,
            "ops": ops,
            "nodes": graph_nodes or grads,
            "alerts": alerts,
            "events": n_events,
        }
        loss = losses.get(step)
        if loss is not None and loss[1] >= 2:
            item["loss"] = _num(loss[0])
        if len(c) > 6 and c[6]:
            item["grad_norm"] = _num(c[5] ** 0.5)
        items.append(item)
    return page(items, offset, limit, "steps")


def is_alert(ev: Event) -> bool:
    return ev.get("kind") == ALERT


# -- a pause -----------------------------------------------------------------------------------
def pause_view(
    state: dict[str, Any] | None, paused: dict[str, Any] | None, stepper: Any = None
) -> dict[str, Any]:
    """The job's stepper: where it is paused (in the UI's status words), its mode and
    breakpoints."""
    state = state or {}
    out: dict[str, Any] = {"paused": None}
    if paused:
        ev = paused.get("event") or {}
        out["paused"] = {
            "story": pause_story(paused, stepper),
            "phase": paused.get("phase"),
            "reason": paused.get("reason"),
            "step": paused.get("step", ev.get("step")),
            "seq": ev.get("seq"),
            "kind": ev.get("kind"),
            "name": event_name(ev),
            "module": ev.get("module") or "",
            "source": ev.get("source"),
            "stack": [f"{f[0]}:{f[1]} in {f[2]}" for f in (paused.get("stack") or ())[-8:]],
        }
    if state.get("mode"):
        out["mode"] = state["mode"]
    bps = state.get("breakpoints")
    if isinstance(bps, list):
        out["breakpoints"] = [
            {
                "id": b.get("id"),
                "spec": spec_text(b),
                "hits": b.get("hits", 0),
                "enabled": b.get("enabled", True),
            }
            for b in bps
            if isinstance(b, dict)
        ]
    if state.get("lease_s"):
        out["lease_s"] = state["lease_s"]
    return out
