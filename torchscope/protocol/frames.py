"""Live-stream messages: frames on the events socket, requests and replies on the control socket.

Everything is msgpack (``codec.pack``/``unpack``), never pickle, and everything that arrives is
validated field by field before anyone uses it.

Events socket (tracer PUB → UI SUB), one msgpack map per ZeroMQ message::

    {"v": [1, 0], "type": "events", "frame": 17, "rank": 0, "dropped": 0, "events": [...]}
    {"v": [1, 0], "type": "heartbeat", "frame": 18, "rank": 0, "dropped": 0, "step": 3,
     "events_total": 5120, "pid": 4242, "t": 1718000000.0}
    {"v": [1, 0], "type": "bye", ...same keys as heartbeat...}

``frame`` counts every message the publisher sends (+1 each), so a gap in ``frame`` is a lost
message; ``dropped`` is the total number of events that never reached the socket.

Control socket (UI DEALER → tracer ROUTER)::

    request  {"v": [1, 0], "id": 7, "cmd": "snapshot", "max_events": 1000}
    reply    {"v": [1, 0], "id": 7, "ok": True, "result": {...}}
             {"v": [1, 0], "id": 7, "ok": False, "error": "one line"}

Commands live in a registry (:func:`register_command`) of name → argument validator, so
pause/step/breakpoints add one entry each, with their own field rules. Requests are strict
(an unknown field is an error: a tracer must not silently ignore, say, a breakpoint condition
it does not understand); replies and frames are lenient about extra keys (minor versions add
keys), strict about the ones they know.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

from torchscope.protocol.codec import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    ProtocolError,
    check_version,
    pack,
    unpack,
)
from torchscope.protocol.events import Event, as_event
from torchscope.protocol.policies import POLICIES

VERSION = list(PROTOCOL_VERSION)

# Frame types on the events socket.
EVENTS = "events"
HEARTBEAT = "heartbeat"
BYE = "bye"
FRAME_TYPES = (EVENTS, HEARTBEAT, BYE)

# A control request is a handful of small fields; anything bigger is refused before decoding.
MAX_REQUEST_BYTES = 64 * 1024
# Limits on what we accept; the publisher sends at most 1000 events a frame.
MAX_FRAME_EVENTS = 100_000
MAX_SNAPSHOT_EVENTS = 100_000
MAX_ID = 2**63 - 1
MAX_ERROR_CHARS = 300

# Subscription tokens a client uses to learn that its subscription reached the publisher.
TOKEN_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")


class RequestError(ProtocolError):
    """An invalid control request. ``request_id`` is its id when that much could be read, so
    the error reply reaches the right caller."""

    def __init__(self, message: str, request_id: int | None = None) -> None:
        super().__init__(one_line(message))
        self.request_id = request_id


def one_line(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``text`` on one line and at most ``limit`` characters: it is shown to a user."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _short(value: Any) -> str:
    """A value for an error message: type name, plus a bounded repr for scalars only (a
    nested garbage structure must not turn into a megabyte of text)."""
    if isinstance(value, (bool, int, float)) or value is None:
        return one_line(repr(value), 40)
    if isinstance(value, (str, bytes)):
        r = repr(value if len(value) <= 40 else value[:40])
        return f"{type(value).__name__} {r}" + ("..." if len(value) > 40 else "")
    return f"a {type(value).__name__}"


def _is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


# -- field rules ------------------------------------------------------------------------------
_REQUIRED: Any = object()


class Field:
    """Rule for one field. ``check`` returns the (possibly normalised) value or raises
    ValueError with the end of a sentence that starts "'name' ..."."""

    def __init__(self, *, default: Any = _REQUIRED, nullable: bool = False) -> None:
        self.default = default
        self.nullable = nullable

    @property
    def required(self) -> bool:
        return self.default is _REQUIRED

    def check(self, value: Any) -> Any:
        raise NotImplementedError


class Int(Field):
    def __init__(self, lo: int = 0, hi: int = MAX_ID, **kw: Any) -> None:
        super().__init__(**kw)
        self.lo, self.hi = lo, hi

    def check(self, value: Any) -> int:
        if not _is_int(value) or not self.lo <= value <= self.hi:
            raise ValueError(f"must be an integer in {self.lo}..{self.hi}, not {_short(value)}")
        return value


class Float(Field):
    def check(self, value: Any) -> float:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
            raise ValueError(f"must be a number, not {_short(value)}")
        return float(value)


class Bool(Field):
    def check(self, value: Any) -> bool:
        if not isinstance(value, bool):
            raise ValueError(f"must be true or false, not {_short(value)}")
        return value


class Str(Field):
    def __init__(
        self, max_len: int = 4096, pattern: re.Pattern[str] | None = None, **kw: Any
    ) -> None:
        super().__init__(**kw)
        self.max_len, self.pattern = max_len, pattern

    def check(self, value: Any) -> str:
        if not isinstance(value, str) or len(value) > self.max_len:
            raise ValueError(f"must be a string of at most {self.max_len} characters")
        if self.pattern is not None and not self.pattern.fullmatch(value):
            raise ValueError(f"has a bad format: {_short(value)}")
        return value


class Map(Field):
    def check(self, value: Any) -> dict:
        if not isinstance(value, dict):
            raise ValueError(f"must be a map, not {_short(value)}")
        return value


class EventMap(Field):
    def check(self, value: Any) -> Event:
        try:
            return as_event(value)
        except ProtocolError as exc:
            raise ValueError(f"is not an event ({exc})") from None


class EventList(Field):
    def __init__(self, max_len: int = MAX_FRAME_EVENTS, **kw: Any) -> None:
        super().__init__(**kw)
        self.max_len = max_len

    def check(self, value: Any) -> list[Event]:
        if not isinstance(value, list) or len(value) > self.max_len:
            raise ValueError(f"must be a list of at most {self.max_len} events")
        out = []
        for i, ev in enumerate(value):
            try:
                out.append(as_event(ev))
            except ProtocolError as exc:
                raise ValueError(f"item {i} is not an event ({exc})") from None
        return out


Validator = Callable[[dict[str, Any]], dict[str, Any]]


def fields(spec: Mapping[str, Field] | None = None, *, extra: bool = False) -> Validator:
    """A validator for a map of named fields.

    Missing required fields, bad values, and (unless ``extra``) unknown fields raise
    ProtocolError with one line. Returns the map with defaults filled in; with ``extra``,
    unknown keys are passed through untouched (for forward-compatible replies).
    """
    rules = dict(spec or {})

    def validate(args: dict[str, Any]) -> dict[str, Any]:
        if not extra:
            for key in args:
                if key not in rules:
                    known = ", ".join(sorted(rules)) or "none"
                    raise ProtocolError(f"unknown field {_short(key)} (known: {known})")
        out = dict(args) if extra else {}
        for name, rule in rules.items():
            if name not in args:
                if rule.required:
                    raise ProtocolError(f"missing field '{name}'")
                out[name] = rule.default
                continue
            value = args[name]
            if value is None and rule.nullable:
                out[name] = None
                continue
            try:
                out[name] = rule.check(value)
            except ValueError as exc:
                raise ProtocolError(f"'{name}' {exc}") from None
        return out

    return validate


# -- control requests -------------------------------------------------------------------------
COMMANDS: dict[str, Validator] = {}
RESULTS: dict[str, Validator] = {}


def register_command(
    name: str, args: Validator, result: Validator | None = None, *, replace: bool = False
) -> None:
    """Make ``name`` a known command. ``args`` validates the request's fields (everything but
    v/id/cmd); ``result`` validates the reply's result on the client side."""
    if not replace and name in COMMANDS:
        raise ValueError(f"command {name!r} is already registered")
    COMMANDS[name] = args
    RESULTS[name] = result or fields(extra=True)


_SESSION = EventMap()
_TRACING = Str(16, re.compile(r"[a-z]+"), default=None, nullable=True)
_COUNTERS = {
    "step": Int(nullable=True),
    "frame": Int(),
    "dropped": Int(),
    "events_total": Int(),
    "tracing": _TRACING,  # dormant / arming / traced (jobs served by an agent)
}

register_command(
    "hello",
    # ``sub``: the client's subscription token; the reply says whether the publisher has seen
    # that subscription yet (see client.SessionClient.connect).
    fields({"sub": Str(64, TOKEN_RE, default=None, nullable=True)}),
    fields(
        {
            "session": _SESSION,
            "events_endpoint": Str(nullable=True),
            "pid": Int(default=0),
            "rank": Int(default=None, nullable=True),
            "subscribed": Bool(default=None, nullable=True),
            **_COUNTERS,
        },
        extra=True,
    ),
)
register_command(
    "snapshot",
    fields({"max_events": Int(0, MAX_SNAPSHOT_EVENTS, default=10_000)}),
    fields(
        {
            "session": _SESSION,
            "events": EventList(MAX_SNAPSHOT_EVENTS),
            "truncated": Bool(default=False),
            **_COUNTERS,
        },
        extra=True,
    ),
)
register_command("ping", fields(), fields({"t": Float()}, extra=True))


# Step-through control (the tracer answers these only when it runs a stepper). Every reply
# carries the stepper's state, so the UI never has to guess whether the job is paused.
_STATE = fields({"state": Map()}, extra=True)
for _name in ("pause", "step", "continue", "detach", "state", "break_list"):
    register_command(_name, fields(), _STATE)
register_command("next", fields(), _STATE)

# Arming an attached job (torchscope.tracer.agent): the asking client holds it traced from the
# next step boundary, for ``next`` steps or, without it, while the client keeps talking (its
# lease). ``disarm`` (or the lease ending) lets go and deletes the client's breakpoints.
_ARMED = fields({"holder": Int(), "tracing": _TRACING, "state": Map(default=None)}, extra=True)
register_command(
    "arm",
    fields(
        {
            "next": Int(1, 2**31, default=None, nullable=True),
            # A recorder only records: its contact does not count as a UI's (no --wait
            # release, no say over pauses).
            "by": Str(16, re.compile(r"ui|record"), default="ui"),
            # The aten level in the steps it holds: "" every aten call, else a module regex.
            "aten": Str(1000, default=None, nullable=True),
            # Each compiled module's call also runs eagerly, compared (--eager-check).
            "eager_check": Bool(default=False),
            # A hold beside the client's own (a UI asking one step at the aten level, or
            # eager-checked) instead of one that replaces it.
            "also": Bool(default=False),
            # Hold from this step on (a point picked in the UI's plot); dormant before it.
            "at_step": Int(0, 2**62, default=None, nullable=True),
            # Hold from the first step boundary after this holds on the run's history:
            # gradnorm>X, loss>X, loss<X, nonfinite (protocol/history.parse_condition).
            "when": Str(64, default=None, nullable=True),
        }
    ),
    _ARMED,
)
# The run's history (protocol/history.py, tracer/history.py): every point and bucket, or the
# points after ``since`` (no buckets), at most ``max_points`` of the newest (0: ``latest`` only).
register_command(
    "history",
    fields(
        {
            "since": Int(-1, 2**62, default=None, nullable=True),
            "max_points": Int(0, 2**31, default=None, nullable=True),
        }
    ),
)
register_command("disarm", fields(), _ARMED)
# Every rank of a torchrun job, as its ranks registered themselves in the job's c10d store:
# session records (the registry's format; the client validates each with SessionRecord).
register_command("ranks", fields(), fields(extra=True))
# The always-on NaN watch, switched on (spec "nan", "gradnorm:X") or off (spec null) from
# outside; it starts or stops at the job's next step boundary.
register_command(
    "watch",
    fields(
        {
            "spec": Str(64, default="nan", nullable=True),
            "on_nan": Str(16, re.compile("|".join(POLICIES)), default="continue"),
            # Under "skip": bad steps in a row refused before the next one stops the job
            # (absent: the job's own setting; sent only when given, which older jobs refuse).
            "max_skips": Int(0, 2**31, default=None, nullable=True),
            # After a loss spike (spec "spike"): absent, the job's own setting (sent only
            # when given, as max_skips).
            "on_spike": Str(16, re.compile("|".join(POLICIES)), default=None, nullable=True),
        }
    ),
    fields({"watch": Str(64, default=None, nullable=True)}, extra=True),
)
register_command(
    "break_add",
    fields(
        {
            "op": Str(1000, default=None, nullable=True),
            "node": Str(1000, default=None, nullable=True),
            "aten": Str(1000, default=None, nullable=True),
            "module": Str(1000, default=None, nullable=True),
            "source": Str(4096, default=None, nullable=True),
            "nan": Str(16, re.compile(r"nan|inf|anynan"), default=None, nullable=True),
            "grad_norm": Float(default=None, nullable=True),
            "step": Int(0, 2**62, default=None, nullable=True),
            "from_step": Int(0, 2**62, default=None, nullable=True),
            # A breakpoint with an action: at each hit it logs or edits instead of pausing.
            "log": Str(1000, default=None, nullable=True),
            "edit": Str(1000, default=None, nullable=True),
            "enabled": Bool(default=True),
        }
    ),
    _STATE,
)
# An expression run by the job at its pause (torchscope.tracer.armed.evaluate), only for a
# client that holds the job: ``expr`` over the paused event's tensors, ``x`` being
# ``group[index]``; or ``poll`` the answer of one still running (a reply said "pending").
register_command(
    "evaluate",
    fields(
        {
            "expr": Str(1000, default=None, nullable=True),
            "group": Str(32, re.compile(r"[a-z_]+"), default=None, nullable=True),
            "index": Int(0, 100_000, default=None, nullable=True),
            "count": Int(0, 1000, default=16),
            "poll": Int(1, 2**62, default=None, nullable=True),
            # Seconds it may run before it is interrupted (absent: the job's own budget);
            # ``cancel``: interrupt the one a "pending" reply named.
            "budget": Float(default=None, nullable=True),
            "cancel": Int(1, 2**62, default=None, nullable=True),
        }
    ),
    fields(extra=True),
)
# An edit of a tensor of the paused event (applied when the job goes on): ``expr`` replaces
# ``group[index]`` (or the target ``TARGET = EXPR`` names).
register_command(
    "edit",
    fields(
        {
            "expr": Str(1000, default=None, nullable=True),  # None: a cancel
            "group": Str(32, re.compile(r"[a-z_]+"), default=None, nullable=True),
            "index": Int(0, 100_000, default=None, nullable=True),
            "poll": Int(1, 2**62, default=None, nullable=True),
            "budget": Float(default=None, nullable=True),
            "cancel": Int(1, 2**62, default=None, nullable=True),
        }
    ),
    fields(extra=True),
)
register_command("break_enable", fields({"bp": Int(1, 2**31), "enabled": Bool()}), _STATE)
register_command("break_delete", fields({"bp": Int(1, 2**31)}), _STATE)
register_command(
    "inspect",
    fields(
        {
            "group": Str(32, re.compile(r"[a-z_]+")),
            "index": Int(0, 100_000),
            "start": Int(0, 2**62, default=0),
            "count": Int(0, 100_000, default=1000),
        }
    ),
    fields(extra=True),
)


@dataclass(frozen=True)
class Request:
    id: int
    cmd: str
    args: dict[str, Any]


def build_request(request_id: int, cmd: str, **args: Any) -> bytes:
    """Encode a request, checking it with the same rules the tracer applies."""
    msg = {"v": VERSION, "id": request_id, "cmd": cmd, **args}
    try:
        raw = pack(msg)
    except (OverflowError, TypeError, ValueError) as exc:  # 2**64, an object, a deep nest
        bad = next((k for k, v in args.items() if not _packs(v)), None)
        what = f"{bad!r} ({_short(args[bad])})" if bad is not None else "the request"
        raise RequestError(f"{cmd}: {what} cannot be sent: {exc}", request_id) from None
    parse_request(raw)  # fail here, with the same one line, rather than in a round trip
    return raw


def _packs(value: Any) -> bool:
    try:
        pack(value)
    except (OverflowError, TypeError, ValueError):
        return False
    return True


def parse_request(raw: bytes) -> Request:
    """Decode and validate one control request. Raises RequestError (a ProtocolError) and
    nothing else, whatever ``raw`` holds."""
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise RequestError(f"request must be bytes, not {type(raw).__name__}")
    try:
        msg = unpack(bytes(raw), MAX_REQUEST_BYTES)
    except ProtocolError as exc:
        raise RequestError(str(exc)) from None
    if not isinstance(msg, dict):
        raise RequestError(f"request must be a map, not {_short(msg)}")
    rid = msg.get("id")
    rid = rid if _is_int(rid) and 0 <= rid <= MAX_ID else None
    try:
        for key in msg:
            if not isinstance(key, str):
                raise ProtocolError(f"field names must be strings, not {_short(key)}")
        check_version(msg.get("v"))
        if not _is_int(msg.get("id")):
            raise ProtocolError(f"'id' must be an integer, not {_short(msg.get('id'))}")
        if rid is None:
            raise ProtocolError(f"'id' must be in 0..{MAX_ID}")
        cmd = msg.get("cmd")
        if not isinstance(cmd, str):
            raise ProtocolError(f"'cmd' must be a string, not {_short(cmd)}")
        validator = COMMANDS.get(cmd)
        if validator is None:
            known = ", ".join(sorted(COMMANDS))
            raise ProtocolError(f"unknown command {_short(cmd)} (known: {known})")
        body = {k: v for k, v in msg.items() if k not in ("v", "id", "cmd")}
        try:
            args = validator(body)
        except ProtocolError as exc:
            raise ProtocolError(f"{cmd}: {exc}") from None
        return Request(rid, cmd, args)
    except RequestError:
        raise
    except ProtocolError as exc:
        raise RequestError(str(exc), rid) from None
    except Exception as exc:  # a validator bug must still come out as a refusal, not a crash
        raise RequestError(f"invalid request ({type(exc).__name__})", rid) from None


def ok_reply(request_id: int, result: dict[str, Any]) -> dict[str, Any]:
    return {"v": VERSION, "id": request_id, "ok": True, "result": result}


def error_reply(request_id: int | None, message: str) -> dict[str, Any]:
    return {"v": VERSION, "id": request_id, "ok": False, "error": one_line(message)}


@dataclass(frozen=True)
class Reply:
    id: int | None
    ok: bool
    result: dict[str, Any] | None
    error: str | None


def parse_reply(raw: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> Reply:
    """Decode and check a reply envelope (its result is checked by :func:`check_result`)."""
    msg = unpack(raw, max_bytes)
    if not isinstance(msg, dict):
        raise ProtocolError(f"reply must be a map, not {_short(msg)}")
    check_version(msg.get("v"))
    rid = msg.get("id")
    if rid is not None and not _is_int(rid):
        raise ProtocolError(f"reply 'id' must be an integer, not {_short(rid)}")
    ok = msg.get("ok")
    if not isinstance(ok, bool):
        raise ProtocolError("reply has no boolean 'ok'")
    if ok:
        result = msg.get("result")
        if not isinstance(result, dict):
            raise ProtocolError("reply has no 'result' map")
        return Reply(rid, True, result, None)
    error = msg.get("error")
    return Reply(rid, False, None, one_line(error if isinstance(error, str) else "unknown error"))


def check_result(cmd: str, result: dict[str, Any]) -> dict[str, Any]:
    """Validate the result of ``cmd`` as the client receives it."""
    validator = RESULTS.get(cmd)
    if validator is None:
        return result
    try:
        return validator(result)
    except ProtocolError as exc:
        raise ProtocolError(f"bad '{cmd}' reply: {exc}") from None


# -- frames on the events socket --------------------------------------------------------------
def events_frame(
    *, frame: int, rank: int | None, dropped: int, events: list[Any]
) -> dict[str, Any]:
    return {
        "v": VERSION,
        "type": EVENTS,
        "frame": frame,
        "rank": rank,
        "dropped": dropped,
        "events": events,
    }


def status_frame(
    kind: str,
    *,
    frame: int,
    rank: int | None,
    dropped: int,
    step: int | None,
    events_total: int,
    pid: int,
    t: float,
    tracing: str | None = None,
    waiting: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A heartbeat or bye frame; ``waiting``: the meeting of the ranks this rank is held in."""
    out: dict[str, Any] = {
        "tracing": tracing,
        "v": VERSION,
        "type": kind,
        "frame": frame,
        "rank": rank,
        "dropped": dropped,
        "step": step,
        "events_total": events_total,
        "pid": pid,
        "t": t,
    }
    if waiting is not None:
        out["waiting"] = waiting
    return out


_FRAME_COMMON = fields(
    {
        "type": Str(64),
        "frame": Int(),
        "rank": Int(default=None, nullable=True),
        "dropped": Int(default=0),
    },
    extra=True,
)
_FRAME_RULES: dict[str, Validator] = {
    EVENTS: fields({"events": EventList()}, extra=True),
    HEARTBEAT: fields(
        {
            "step": Int(default=None, nullable=True),
            "events_total": Int(default=0),
            "pid": Int(default=0),
            "t": Float(default=None, nullable=True),
            "tracing": _TRACING,
        },
        extra=True,
    ),
}
_FRAME_RULES[BYE] = _FRAME_RULES[HEARTBEAT]


def parse_frame(raw: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> dict[str, Any]:
    """Decode and validate one events-socket message; ProtocolError if it is not valid.

    A frame of a type this version does not know is returned with only its envelope checked:
    newer tracers may add types, and the caller skips what it does not use.
    """
    msg = unpack(raw, max_bytes)
    if not isinstance(msg, dict):
        raise ProtocolError(f"frame must be a map, not {_short(msg)}")
    check_version(msg.get("v"))
    msg = _FRAME_COMMON(msg)
    rule = _FRAME_RULES.get(msg["type"])
    return rule(msg) if rule is not None else msg
