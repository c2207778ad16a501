"""Breakpoints: conditions on ops and backward nodes, their text form, their validation.

Shared by the tracer (which evaluates them) and the UI (which lets people write them), so it
imports neither torch nor textual.

Name conditions run on the training thread for every op and node, so a pattern must never be
able to stall the job (``^(.|.)*X$`` backtracks for minutes on a 30-character op name, holding
the GIL, so control replies stall too). Three rules make that so:

* patterns are at most :data:`MAX_PATTERN_CHARS` long (longer: a one-line BreakpointError);
* they are evaluated by :class:`SafePattern`, a Thompson-NFA simulation over Python's own
  parse of the pattern: time linear in the text times the pattern's size, whatever the
  pattern (no backtracking); the constructs that need backtracking (backreferences,
  lookarounds, atomic groups, possessive repeats) are refused with one line;
* each breakpoint remembers its verdict per distinct op name and module path (at most
  :data:`MAX_CACHED_VERDICTS` each), so a pattern is matched against a name once.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from torchscope.protocol.events import all_finite

NAN_CONDITIONS = ("nan", "inf", "anynan")
_ORIGIN_CONDITIONS = ("nan", "inf")  # where the value first appears
MAX_PATTERN_CHARS = 256  # longer op/module patterns are refused
MAX_PATTERN_STATES = 2000  # the matcher's size once repeats are expanded (a{1000}{1000}: refused)
MAX_CACHED_VERDICTS = 16_384  # per breakpoint and condition; then the cache starts over

# A version check rather than try/except ImportError: mypy then checks the 3.10 branch
# against typeshed's sre_* stubs (it has none for re._compiler and friends, the same modules
# under their 3.11 names; the sre_* aliases warn on import there).
if sys.version_info >= (3, 11):
    from re import _compiler as _sre_compile
    from re import _constants as _sre_c
    from re import _parser as _sre_parse
else:  # pragma: no cover - Python 3.10
    import sre_compile as _sre_compile
    import sre_constants as _sre_c
    import sre_parse as _sre_parse


class BreakpointError(ValueError):
    """A breakpoint spec that cannot work; the text is one line for the user."""


@dataclass
class Breakpoint:
    """Conditions that all must hold (AND). Absent conditions always hold."""

    id: int
    op: str | None = None  # regex over the op or node name
    node: str | None = None  # regex over a backward node's name (backward nodes only)
    aten: str | None = None  # regex over an aten call's name (the aten level: only its calls)
    module: str | None = None  # regex over the module path
    source: str | None = None  # "file:line" (file may be a path suffix)
    nan: str | None = None  # "nan" / "inf": where it first appears; "anynan": anywhere
    grad_norm: float | None = None  # a node's gradient norm above this
    step: int | None = None  # only on this step
    from_step: int | None = None  # from this step on
    # An action instead of a pause (see ``first_hit`` / ``action_hits``): at every hit, after
    # the op or node has run, ``log`` prints an expression, ``edit`` replaces a tensor.
    log: str | None = None
    edit: str | None = None
    enabled: bool = True
    hits: int = 0
    _op: SafePattern | None = field(default=None, repr=False)
    _aten: SafePattern | None = field(default=None, repr=False)
    _module: SafePattern | None = field(default=None, repr=False)
    _node: SafePattern | None = field(default=None, repr=False)

    CONDITIONS = (
        "op", "node", "aten", "module", "source", "nan", "grad_norm", "step", "from_step"
    )  # fmt: skip
    ACTIONS = ("log", "edit")
    KEYS = (*CONDITIONS, *ACTIONS, "enabled")

    @classmethod
    def from_spec(cls, bp_id: int, spec: dict[str, Any]) -> Breakpoint:
        unknown = set(spec) - set(cls.KEYS)
        if unknown:
            raise BreakpointError(f"unknown breakpoint condition(s): {', '.join(sorted(unknown))}")
        bp = cls(bp_id, **{k: spec[k] for k in cls.KEYS if spec.get(k) is not None})
        if not any(getattr(bp, k) is not None for k in cls.CONDITIONS):
            raise BreakpointError("a breakpoint needs at least one condition")
        if bp.log is not None and bp.edit is not None:
            raise BreakpointError("a breakpoint either logs or edits, not both")
        for name in cls.ACTIONS:
            text = getattr(bp, name)
            if text is not None:
                from torchscope.protocol.expressions import ExpressionError, check_expression

                try:
                    check_expression(text, edit=name == "edit")
                except ExpressionError as exc:
                    raise BreakpointError(f"{name}: {exc}") from None
        for name in ("op", "node", "aten", "module"):
            pattern = getattr(bp, name)
            if pattern is not None:
                if not isinstance(pattern, str):
                    raise BreakpointError(f"{name} must be a regular expression string")
                setattr(bp, f"_{name}", SafePattern(pattern, what=name))
        if bp.source is not None:
            file, sep, line = str(bp.source).rpartition(":")
            if not sep or not file or not (line.isascii() and line.isdigit()):
                raise BreakpointError(f"source must be FILE:LINE, not {bp.source!r}")
        if bp.nan is not None and bp.nan not in NAN_CONDITIONS:
            raise BreakpointError(f"nan must be one of {', '.join(NAN_CONDITIONS)}")
        if bp.grad_norm is not None and not (
            isinstance(bp.grad_norm, (int, float))
            and not isinstance(bp.grad_norm, bool)
            and bp.grad_norm > 0  # NaN too; 0 or less fires at every node
        ):
            raise BreakpointError("gradnorm must be a number above 0")
        for name in ("step", "from_step"):
            value = getattr(bp, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise BreakpointError(f"{name} must be a step number")
        return bp

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.KEYS if getattr(self, k) is not None}
        out["id"] = self.id
        out["hits"] = self.hits
        return out

    @property
    def action(self) -> str | None:
        """Its action, "log" or "edit", for a breakpoint that acts instead of pausing; else None."""
        return "log" if self.log is not None else "edit" if self.edit is not None else None

    @property
    def needs_stats(self) -> bool:
        """Conditions on values can only be judged once the outputs exist (the after point)."""
        return self.nan is not None or self.grad_norm is not None

    def static_match(self, event: dict[str, Any]) -> bool:
        """Conditions that need no tensor values: name, module, source line, step."""
        step = event.get("step", 0)
        if self.step is not None and step != self.step:
            return False
        if self.from_step is not None and step < self.from_step:
            return False
        # An aten: breakpoint stops at aten calls only; at aten calls only it and a nan/inf
        # breakpoint stop (at the call where the value first appears).
        if self._aten is not None:
            if event.get("kind") != "aten" or not self._aten.search(str(event.get("name") or "")):
                return False
        elif event.get("kind") == "aten" and self.nan not in _ORIGIN_CONDITIONS:
            return False
        if self._op is not None:
            name = event.get("name") or event.get("node") or ""
            if not self._op.search(name if isinstance(name, str) else str(name)):
                return False
        if self._node is not None:
            node = event.get("node") if event.get("kind") == "grad" else None
            if not isinstance(node, str) or not self._node.search(node):
                return False
        if self._module is not None:
            module = event.get("module") or ""
            if not self._module.search(module if isinstance(module, str) else str(module)):
                return False
        if self.source is not None:
            src = event.get("source") or ""
            if not (src == self.source or src.endswith("/" + self.source)):
                return False
        return True

    def value_match(self, event: dict[str, Any], origin: str | None) -> bool:
        """Conditions on resolved stats (the event's summaries must be resolved). ``origin`` is
        the alert verdict for this event: "nan"/"inf" where that value first appears."""
        if self.nan is not None:
            if self.nan == "anynan":
                if not _any_bad(event):
                    return False
            elif origin != self.nan:
                return False
        if self.grad_norm is not None:
            if event.get("kind") != "grad":
                return False
            norms = [
                s["stats"].get("norm", 0.0)
                for s in (event.get("grad_inputs") or []) + (event.get("grad_outputs") or [])
                if s and s.get("stats")
            ]
            if not any(n > self.grad_norm or n != n for n in norms):
                return False
        return True


def _any_bad(event: dict[str, Any]) -> bool:
    return not all_finite(event.get("grad_inputs" if event.get("kind") == "grad" else "outputs"))


_BREAK_KEYS = (
    "nan",
    "inf",
    "anynan",
    "op:",
    "node:",
    "aten:",
    "module:",
    "line:",
    "source:",
    "gradnorm:",
    "step:",
    "from:",
)
_BREAK_SPLIT = re.compile(r",(?=(?:" + "|".join(re.escape(k) for k in _BREAK_KEYS) + "))")


_ACTION_SPLIT = re.compile(r"(?:^|,)(log|edit):")


def parse_break_spec(text: str) -> dict[str, Any]:
    """``--break-on`` text to a breakpoint spec; conditions joined by "," all must hold.

    ``nan`` / ``inf`` (where it first appears), ``anynan``, ``op:REGEX`` (an op's or a
    backward node's name), ``node:REGEX`` (a backward node's name only), ``aten:REGEX`` (an
    aten call's name, with the aten level on), ``module:REGEX``,
    ``line:FILE:LINE``, ``gradnorm:X``, ``step:N``, ``from:N``. A regex may contain commas;
    only a comma followed by a condition name splits. Last, ``,log:EXPR`` or ``,edit:EXPR``
    makes it a breakpoint with an action (everything after it is the expression).
    """
    spec: dict[str, Any] = {}
    conditions, *action = _ACTION_SPLIT.split(text.strip(), maxsplit=1)
    if action:
        spec[action[0]] = action[1].strip()
    for part in _BREAK_SPLIT.split(conditions) if conditions or not action else ():
        key, sep, value = part.partition(":")
        try:
            if part in NAN_CONDITIONS:
                spec["nan"] = part
            elif sep and key in ("op", "node", "aten", "module"):
                spec[key] = value
            elif sep and key in ("line", "source"):
                spec["source"] = value
            elif sep and key == "gradnorm":
                spec["grad_norm"] = float(value)
            elif sep and key in ("step", "from"):
                spec["step" if key == "step" else "from_step"] = int(value)
            else:
                raise ValueError
        except ValueError:
            raise BreakpointError(
                f"bad breakpoint condition {part!r}: use nan, inf, anynan, op:REGEX, "
                "node:REGEX, aten:REGEX, module:REGEX, line:FILE:LINE, gradnorm:X, step:N or "
                "from:N, joined by ','"
            ) from None
    Breakpoint.from_spec(0, spec)  # validate now, with the same rules the UI's get
    return spec


def action_spec(action: str, text: str, expr: str) -> dict[str, Any]:
    """``--log SPEC EXPR`` / ``--edit SPEC EXPR``: the breakpoint spec of SPEC with the
    action; refused in one line as ``--break-on`` is."""
    if action not in Breakpoint.ACTIONS:
        raise BreakpointError(f"no action {action!r}: log or edit")
    spec = parse_break_spec(text)
    if any(spec.get(a) is not None for a in Breakpoint.ACTIONS):
        raise BreakpointError(f"{text!r}: the expression goes in its own argument")
    spec[action] = expr
    Breakpoint.from_spec(0, spec)
    return spec


def action_specs(action: str, given: Any) -> list[dict[str, Any]]:
    """``serve(log=...)``: a (SPEC, EXPR) pair, a list of them, or a {SPEC: EXPR} dict."""
    if not given:
        return []
    if isinstance(given, dict):
        pairs = list(given.items())
    elif isinstance(given, tuple) and len(given) == 2 and all(isinstance(g, str) for g in given):
        pairs = [given]
    else:
        pairs = list(given)
    out = []
    for pair in pairs:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise BreakpointError(f"{action}= takes (SPEC, EXPR) pairs, not {pair!r}")
        out.append(action_spec(action, str(pair[0]), str(pair[1])))
    return out


BEFORE = "before"  # an op about to run, or a node before it runs (its grad_outputs known)
AFTER = "after"  # the op has run / the node has computed its grad_inputs


def first_hit(
    breakpoints: Iterable[Breakpoint],
    phase: str,
    event: dict[str, Any],
    origin: Callable[[dict[str, Any]], str | None],
) -> str | None:
    """The reason the first matching breakpoint gives to pause here, counting its hit.

    Name and line conditions stop before the op or node runs; value conditions (NaN, norm)
    once it has, with ``origin(event)`` the alert verdict for the event. Breakpoints with
    an action never stop (see :func:`action_hits`).
    """
    for bp in breakpoints:
        if not bp.enabled or bp.action is not None or not bp.static_match(event):
            continue
        if bp.needs_stats:
            if phase == AFTER and bp.value_match(event, origin(event)):
                bp.hits += 1
                return f"breakpoint {bp.id}"
        elif phase == BEFORE:
            bp.hits += 1
            return f"breakpoint {bp.id}"
    return None


def action_hits(
    breakpoints: Iterable[Breakpoint],
    event: dict[str, Any],
    origin: Callable[[dict[str, Any]], str | None],
) -> list[Breakpoint]:
    """The breakpoints with an action (log, edit) that hold at this event, counting their
    hits. Asked once the op or node has run (its outputs, its grad_inputs exist)."""
    hits = []
    for bp in breakpoints:
        if not bp.enabled or bp.action is None or not bp.static_match(event):
            continue
        if bp.needs_stats and not bp.value_match(event, origin(event)):
            continue
        bp.hits += 1
        hits.append(bp)
    return hits


# -- a regex matcher that cannot stall ------------------------------------------------------------
_CHAR, _ZERO, _SPLIT, _MATCH = 0, 1, 2, 3
_REFUSED = {
    "GROUPREF": "backreferences",
    "GROUPREF_EXISTS": "conditional groups",
    "ASSERT": "lookahead/lookbehind",
    "ASSERT_NOT": "lookahead/lookbehind",
    "ATOMIC_GROUP": "atomic groups",
    "POSSESSIVE_REPEAT": "possessive repeats",
}


class _TooBig(Exception):
    pass


class SafePattern:
    """``search()`` with Python ``re`` syntax and meaning, in time linear in the text.

    The pattern is parsed by Python's own parser (so it means what ``re`` says it means);
    each single character test (literal, class, ``.``, ``\\d``...) and each anchor (``^``,
    ``$``, ``\\b``...) is compiled alone by ``re``, where it cannot backtrack, and the rest
    (sequence, ``|``, repeats, groups) becomes a Thompson NFA that is simulated position by
    position: O(len(text) x states), whatever the pattern. Only whether it matches is
    computed. Verdicts are cached per text (bounded). Raises BreakpointError (one line) for
    a pattern that is too long, invalid, too big once expanded, or needs backtracking.
    Thread-safe: the cache is a dict written one entry at a time and cleared when full.
    """

    def __init__(self, pattern: str, *, what: str = "pattern") -> None:
        if len(pattern) > MAX_PATTERN_CHARS:
            raise BreakpointError(
                f"{what} regex is {len(pattern)} characters long; the limit is {MAX_PATTERN_CHARS}"
            )
        try:
            parsed = _sre_parse.parse(pattern, 0)
        except (re.error, RecursionError, OverflowError) as exc:
            raise BreakpointError(f"bad {what} regex {pattern!r}: {exc}") from None
        self.pattern = pattern
        self._kind: list[int] = []
        self._test: list[Any] = []  # _CHAR/_ZERO: a compiled one-node re; else None
        self._a: list[int] = []
        self._b: list[int] = []
        self._atoms: dict[tuple, Any] = {}
        try:
            match = self._new(_MATCH, None)
            self.start = self._seq(parsed.data, parsed.state.flags, match)
        except _TooBig:
            raise BreakpointError(
                f"{what} regex {pattern!r} is too complex (more than {MAX_PATTERN_STATES} "
                f"states once its repeats are expanded)"
            ) from None
        except (re.error, RecursionError, OverflowError, ValueError, TypeError) as exc:
            raise BreakpointError(f"bad {what} regex {pattern!r}: {exc}") from None
        del self._atoms
        self._cache: dict[str, bool] = {}

    # -- building ----------------------------------------------------------------------------
    def _new(self, kind: int, test: Any, a: int = -1, b: int = -1) -> int:
        if len(self._kind) >= MAX_PATTERN_STATES:
            raise _TooBig
        self._kind.append(kind)
        self._test.append(test)
        self._a.append(a)
        self._b.append(b)
        return len(self._kind) - 1

    def _atom(self, node: tuple, flags: int) -> Any:
        key = (repr(node), flags)
        atom = self._atoms.get(key)
        if atom is None:
            state = _sre_parse.State()
            state.flags = flags
            atom = _sre_compile.compile(_sre_parse.SubPattern(state, [node]), flags)
            self._atoms[key] = atom
        return atom

    def _seq(self, items: list, flags: int, nxt: int) -> int:
        for node in reversed(items):
            nxt = self._node(node, flags, nxt)
        return nxt

    def _node(self, node: tuple, flags: int, nxt: int) -> int:
        op, av = node
        name = str(op)
        if name in _REFUSED:
            raise BreakpointError(f"{_REFUSED[name]} are not supported in breakpoint patterns")
        if op in (_sre_c.LITERAL, _sre_c.NOT_LITERAL, _sre_c.ANY, _sre_c.IN):
            return self._new(_CHAR, self._atom(node, flags), nxt)
        if op is _sre_c.AT:
            return self._new(_ZERO, self._atom(node, flags), nxt)
        if op is _sre_c.SUBPATTERN:
            _group, add, remove, sub = av
            return self._seq(list(sub), (flags | add) & ~remove, nxt)
        if op is _sre_c.BRANCH:
            alternatives = [self._seq(list(alt), flags, nxt) for alt in av[1]]
            start = alternatives[-1]
            for alt in reversed(alternatives[:-1]):
                start = self._new(_SPLIT, None, alt, start)
            return start
        if op in (_sre_c.MAX_REPEAT, _sre_c.MIN_REPEAT):
            lo, hi, sub = av
            body = list(sub)
            if hi == _sre_c.MAXREPEAT:
                loop = self._new(_SPLIT, None, -1, nxt)
                self._a[loop] = self._seq(body, flags, loop)
                nxt = loop
            else:
                for _ in range(hi - lo):
                    nxt = self._new(_SPLIT, None, self._seq(body, flags, nxt), nxt)
            for _ in range(lo):
                nxt = self._seq(body, flags, nxt)
            return nxt
        raise BreakpointError(f"{name.lower()} is not supported in breakpoint patterns")

    # -- matching ----------------------------------------------------------------------------
    def search(self, text: str) -> bool:
        """Whether the pattern matches anywhere in ``text`` (like ``re.search``), cached."""
        verdict = self._cache.get(text)
        if verdict is None:
            verdict = self._run(text)
            if len(self._cache) >= MAX_CACHED_VERDICTS:
                self._cache.clear()
            self._cache[text] = verdict
        return verdict

    def _run(self, text: str) -> bool:
        kind, test, a, b = self._kind, self._test, self._a, self._b
        seen = [-1] * len(kind)
        n = len(text)
        current: list[int] = []
        for pos in range(n + 1):
            # Unanchored search: a new thread starts at every position.
            stack = [*reversed(current), self.start] if current else [self.start]
            current = []
            # Depth-first from the new start last, then the surviving threads; order does not
            # matter for a yes/no answer.
            while stack:
                s = stack.pop()
                if seen[s] == pos:
                    continue
                seen[s] = pos
                k = kind[s]
                if k == _CHAR:
                    current.append(s)
                elif k == _SPLIT:
                    stack.append(b[s])
                    stack.append(a[s])
                elif k == _ZERO:
                    if test[s].match(text, pos) is not None:
                        stack.append(a[s])
                else:  # _MATCH
                    return True
            if pos == n:
                break
            nxt = []
            for s in current:
                if test[s].match(text, pos) is not None:
                    nxt.append(a[s])
            current = nxt
        return False
