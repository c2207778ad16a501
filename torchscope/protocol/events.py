"""Event schema: the plain-data records the tracer emits and every reader consumes.

Each event is a msgpack map with at least ``kind``, ``seq`` and ``step``. Readers ignore keys
they do not know, so adding a key is a minor protocol change.
"""

from __future__ import annotations

import math
from typing import Any

SESSION = "session"
STEP = "step"
OP = "op"
GRAD = "grad"
GRAPH = "graph"
ALERT = "alert"
ERROR = "error"
PAUSE = "pause"  # the job stopped at an op or node (step-through)
RESUME = "resume"  # ... and went on: "by" says what let it go (continue, step, lease, ...)
TRACING = "tracing"  # an attached job armed or went dormant: "state", who holds it
ATEN = "aten"  # one aten call under an op or a backward node (the aten level, when asked)
# The run's loss and gradient norms, traced or not: new ``points`` (and folded ``buckets``) of
# a torchscope.protocol.history.RunHistory.
HISTORY = "history"
# A tensor of an op or node changed by hand (``e`` at a pause, ``--edit``): ``at`` the edited
# event's seq, ``target``, ``expr``, the summaries ``before`` and ``after``.
EDIT = "edit"
# A logpoint's hit (``--log``): ``at``, ``expr``, its answer (``text``, ``summary``).
LOG = "log"
KINDS = (
    SESSION, STEP, OP, GRAD, GRAPH, ALERT, ERROR, PAUSE, RESUME, TRACING, ATEN, HISTORY, EDIT, LOG
)  # fmt: skip

# What an attached job is doing (session events, hello, heartbeats, ``ls``).
DORMANT = "dormant"  # counting steps only: no mode, no hooks
ARMING = "arming"  # asked to trace; starts at the next step boundary
TRACED = "traced"


class Event(dict):
    """One event: a dict that also allows attribute access (``ev.name`` is ``ev["name"]``)."""

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def kind(self) -> str:
        return self["kind"]


def number_text(x: Any, digits: int = 4) -> str:
    """A stat for people: ``digits`` significant digits, ``nan``/``inf``/``-inf`` spelled
    out, ``-`` for a missing value."""
    if x is None:
        return "-"
    if isinstance(x, float) and not isinstance(x, bool):
        if math.isnan(x):
            return "nan"
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        return f"{x:.{digits}g}"
    return str(x)


def all_finite(summaries: list | None) -> bool:
    """No tensor summary in the list counts NaN or Inf (one without stats counts as fine)."""
    for s in summaries or ():
        stats = s.get("stats") if s else None
        if stats and (stats.get("nan") or stats.get("inf")):
            return False
    return True


def as_event(obj: Any) -> Event:
    """Validate the envelope of a decoded record and wrap it (``kind`` and ``seq`` only: the
    live stream's check). Files are read through ``check_event``, the full schema."""
    from torchscope.protocol.codec import ProtocolError

    if not isinstance(obj, dict):
        raise ProtocolError(f"event is a {type(obj).__name__}, expected a map")
    kind = obj.get("kind")
    if not isinstance(kind, str):
        raise ProtocolError("event has no 'kind'")
    if not isinstance(obj.get("seq"), int):
        raise ProtocolError(f"{kind} event has no integer 'seq'")
    return obj if isinstance(obj, Event) else Event(obj)


# -- the event schema ------------------------------------------------------------------------
# One schema for every reader of stored events (``dump``, ``torchscope.load()``, the UI's file
# source), so what one accepts the others can render, walk and index without type errors or
# deep recursion. Every event needs a string ``kind`` and an integer ``seq``; ``step`` is an
# integer or null. Known kinds get their documented fields checked: a field may be absent
# (readers use defaults), but when present it has the documented type. Unknown kinds and
# unknown keys are accepted, so adding them stays a minor protocol change; only their nesting
# is bounded. Nothing is converted: an accepted event is the decoded map, wrapped.

# Containers inside one event, the event map counting as one. The tracer's deepest is ~6 (a
# pause event's op stub: pause > event > inputs > [ ] > summary > stats); json, repr and the UI
# recurse once per level, so a crafted depth of 1,000 would blow Python's recursion limit.
MAX_EVENT_DEPTH = 32

_NONE = type(None)
# Exact types (``type(v) in``), so bool, an int subclass, is only accepted where listed:
# step=True is not step 1.
_INT_OR_NONE = frozenset((int, _NONE))
_NUM_OR_NONE = frozenset((int, float, _NONE))
_STR = frozenset((str,))
_STR_OR_NONE = frozenset((str, _NONE))
_BOOL_OR_NONE = frozenset((bool, _NONE))
_LIST_OR_NONE = frozenset((list, _NONE))
_SUMMARIES = "a list of tensor summaries"  # markers for the two structured field types
_MAPS = "a list of maps"

# kind -> {field: accepted types, or a marker}. ``step`` is in every kind.
_SCHEMA: dict[str, dict[str, Any]] = {}


def _kind(kind: str, **fields: Any) -> None:
    _SCHEMA[kind] = {"step": _INT_OR_NONE, **fields}


_kind(
    SESSION,
    pid=_INT_OR_NONE,
    host=_STR_OR_NONE,
    argv=_LIST_OR_NONE,
    script=_STR_OR_NONE,
    rank=_INT_OR_NONE,
    world_size=_INT_OR_NONE,
)
_kind(STEP, t=_NUM_OR_NONE)
_kind(
    OP,
    name=_STR,
    module=_STR_OR_NONE,
    source=_STR_OR_NONE,
    function=_STR_OR_NONE,
    inputs=_SUMMARIES,
    outputs=_SUMMARIES,
    grad_fn=_STR_OR_NONE,
    nodes=_MAPS,
    duration_us=_NUM_OR_NONE,
    thread=_STR_OR_NONE,
)
_kind(
    GRAD,
    node=_STR,
    node_id=_INT_OR_NONE,
    op_seq=_INT_OR_NONE,
    module=_STR_OR_NONE,
    source=_STR_OR_NONE,
    param=_STR_OR_NONE,
    grad_inputs=_SUMMARIES,
    grad_outputs=_SUMMARIES,
    backward=_INT_OR_NONE,
    thread=_STR_OR_NONE,
)
_kind(
    GRAPH,
    call=_STR_OR_NONE,
    roots=_LIST_OR_NONE,
    nodes=_MAPS,
    backward=_INT_OR_NONE,
    source=_STR_OR_NONE,
)
_kind(
    ALERT,
    what=_STR_OR_NONE,
    where=_STR_OR_NONE,
    event_seq=_INT_OR_NONE,
    name=_STR_OR_NONE,
    module=_STR_OR_NONE,
    source=_STR_OR_NONE,
    node_id=_INT_OR_NONE,
    param=_STR_OR_NONE,
    message=_STR,
)
_kind(
    ATEN,
    name=_STR,
    module=_STR_OR_NONE,
    source=_STR_OR_NONE,
    function=_STR_OR_NONE,
    op_seq=_INT_OR_NONE,
    node_id=_INT_OR_NONE,
    node=_STR_OR_NONE,
    accumulate=_BOOL_OR_NONE,
    label=_STR_OR_NONE,
    group_size=_INT_OR_NONE,
    inputs=_SUMMARIES,
    outputs=_SUMMARIES,
    duration_us=_NUM_OR_NONE,
    thread=_STR_OR_NONE,
)
_kind(ERROR, where=_STR_OR_NONE, message=_STR_OR_NONE)
_kind(PAUSE)
_kind(RESUME)
_kind(TRACING, state=_STR_OR_NONE, holders=_LIST_OR_NONE, released=_LIST_OR_NONE)
_kind(HISTORY, points=_MAPS, buckets=_MAPS)
_kind(
    EDIT,
    at=_INT_OR_NONE,
    name=_STR_OR_NONE,
    node_id=_INT_OR_NONE,
    phase=_STR_OR_NONE,
    target=_STR_OR_NONE,
    expr=_STR_OR_NONE,
    before=_SUMMARIES,
    after=_SUMMARIES,
    by=_STR_OR_NONE,
    bp=_INT_OR_NONE,
)
_kind(
    LOG,
    at=_INT_OR_NONE,
    name=_STR_OR_NONE,
    node_id=_INT_OR_NONE,
    expr=_STR_OR_NONE,
    text=_STR_OR_NONE,
    bp=_INT_OR_NONE,
)

# A tensor summary: shape (integers or null), dtype, device, stats {min, max, mean, std, norm,
# nan, inf} (numbers or null), values (numbers), and a few flags.
_SUMMARY_TYPES: dict[str, frozenset] = {
    "dtype": _STR_OR_NONE,
    "device": _STR_OR_NONE,
    "stats_of": _STR_OR_NONE,
    "placement": _STR_OR_NONE,
    "layout": _STR_OR_NONE,
    "type": _STR_OR_NONE,
    "param": _STR_OR_NONE,
    "external": _BOOL_OR_NONE,
    "nested": _BOOL_OR_NONE,
}
# A tensor summary's ``stats``: its float figures, then its counts of NaN and Inf elements.
VALUE_STATS = ("min", "max", "mean", "std", "norm")
STAT_KEYS = (*VALUE_STATS, "nan", "inf")
_STAT_FIELDS = frozenset(STAT_KEYS)
# ``where`` of an alert that updates the count of an earlier origin's consequences (the
# tracer's step-end tally), not an alert of its own.
CONSEQUENCES = "consequences"
# ``what`` of an alert that compares a compiled call with its eager re-run (an eager check),
# and the field of an op of that re-run naming the compiled call's seq.
EAGER_CHECK = "eager_check"
_NUMBER = frozenset((int, float, bool, _NONE))  # bool: values of a bool tensor


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _expected(types: frozenset) -> str:
    return " or ".join(sorted("null" if t is _NONE else t.__name__ for t in types))


def _depth_ok(obj: Any, budget: int) -> bool:
    """Whether container ``obj`` holds containers at most ``budget`` levels deep, itself
    included."""
    if budget <= 0:
        return False
    for v in obj.values() if type(obj) is dict else obj:
        t = type(v)
        if (t is dict or t is list) and not _depth_ok(v, budget - 1):
            return False
    return True


def _summary_problem(s: Any) -> str | None:
    """Why ``s``, at depth 3 of an event, is not a tensor summary; None when it is one.
    Runs for every summary of every event read: keep it lean."""
    if type(s) is not dict:
        return f"is a {_type_name(s)}, expected a tensor summary (a map)"
    for key, value in s.items():
        t = type(value)
        if key == "stats":
            if value is None:
                continue
            if t is not dict:
                return f"has a {_type_name(value)} 'stats', expected a map"
            for k, v in value.items():
                if type(v) not in _NUMBER:
                    if k in _STAT_FIELDS:
                        return f"has a {_type_name(v)} 'stats.{k}', expected a number"
                    if type(v) in (dict, list) and not _depth_ok(v, MAX_EVENT_DEPTH - 4):
                        return f"nests deeper than {MAX_EVENT_DEPTH} levels"
        elif key == "shape" or key == "values":
            if value is None:
                continue
            if t is not list:
                return f"has a {_type_name(value)} '{key}', expected a list"
            if key == "shape":
                for d in value:
                    if type(d) is not int:
                        return f"has a 'shape' holding a {_type_name(d)}, expected integers"
            else:
                for v in value:
                    if type(v) not in _NUMBER:
                        return f"has 'values' holding a {_type_name(v)}, expected numbers"
        else:
            allowed = _SUMMARY_TYPES.get(key)
            if allowed is not None:
                if t not in allowed:
                    return f"has a {_type_name(value)} '{key}', expected {_expected(allowed)}"
            elif (t is dict or t is list) and not _depth_ok(value, MAX_EVENT_DEPTH - 3):
                return f"nests deeper than {MAX_EVENT_DEPTH} levels"
    return None


def _list_problem(value: Any, marker: str) -> str | None:
    """Why a field that holds summaries or maps (at depth 2) does not; None when it does."""
    if type(value) is not list:
        return f"is a {_type_name(value)}, expected {marker}"
    if marker is _SUMMARIES:
        for i, s in enumerate(value):
            if s is not None:
                why = _summary_problem(s)
                if why is not None:
                    return f"[{i}] {why}"
        return None
    for i, m in enumerate(value):
        if type(m) is not dict:
            return f"[{i}] is a {_type_name(m)}, expected a map"
        if not _depth_ok(m, MAX_EVENT_DEPTH - 2):
            return f"[{i}] nests deeper than {MAX_EVENT_DEPTH} levels"
    return None


def event_problem(obj: Any) -> str | None:
    """Why ``obj`` is not a valid event, in one line; None when it is one."""
    if not isinstance(obj, dict):
        return f"event is a {_type_name(obj)}, expected a map"
    kind = obj.get("kind")
    if type(kind) is not str:
        return "event has no string 'kind'"
    seq = obj.get("seq")
    if type(seq) is not int:
        return f"{kind} event has no integer 'seq'"
    fields = _SCHEMA.get(kind)
    if fields is None:  # a kind from a newer torchscope: its step, if any, and its depth
        step = obj.get("step")
        if type(step) not in _INT_OR_NONE:
            return f"{kind} event {seq}: 'step' is a {_type_name(step)}, expected int or null"
        if not _depth_ok(obj, MAX_EVENT_DEPTH):
            return f"{kind} event {seq} nests deeper than {MAX_EVENT_DEPTH} levels"
        return None
    for key, value in obj.items():
        allowed = fields.get(key)
        t = type(value)
        if allowed is None:  # kind, seq, and keys this schema does not know
            if (t is dict or t is list) and not _depth_ok(value, MAX_EVENT_DEPTH - 1):
                return f"{kind} event {seq}: '{key}' nests deeper than {MAX_EVENT_DEPTH} levels"
        elif type(allowed) is str:
            if value is not None:
                why = _list_problem(value, allowed)
                if why is not None:
                    return f"{kind} event {seq}: '{key}' {why}"
        elif t not in allowed:
            return (
                f"{kind} event {seq}: '{key}' is a {_type_name(value)}, "
                f"expected {_expected(allowed)}"
            )
        elif t is list and not _depth_ok(value, MAX_EVENT_DEPTH - 1):
            return f"{kind} event {seq}: '{key}' nests deeper than {MAX_EVENT_DEPTH} levels"
    return None


def check_event(obj: Any) -> Event:
    """Validate a decoded record against the event schema and wrap it; raises ProtocolError
    with a one-line reason. The one check shared by every reader of stored events."""
    why = event_problem(obj)
    if why is not None:
        from torchscope.protocol.codec import ProtocolError

        raise ProtocolError(why)
    return obj if isinstance(obj, Event) else Event(obj)
