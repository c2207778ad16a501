"""Breakpoints: conditions on ops and backward nodes, their text form, their validation.

Shared by the tracer (which evaluates them) and the UI (which lets people write them), so it
imports neither torch nor textual.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from torchscope.protocol.events import all_finite

NAN_CONDITIONS = ("nan", "inf", "anynan")


class BreakpointError(ValueError):
    """A breakpoint spec that cannot work; the text is one line for the user."""


@dataclass
class Breakpoint:
    """Conditions that all must hold (AND). Absent conditions always hold."""

    id: int
    op: str | None = None  # regex over the op or node name
    module: str | None = None  # regex over the module path
    source: str | None = None  # "file:line" (file may be a path suffix)
    nan: str | None = None  # "nan" / "inf": where it first appears; "anynan": anywhere
    grad_norm: float | None = None  # a node's gradient norm above this
    step: int | None = None  # only on this step
    from_step: int | None = None  # from this step on
    enabled: bool = True
    hits: int = 0
    _op: re.Pattern | None = field(default=None, repr=False)
    _module: re.Pattern | None = field(default=None, repr=False)

    KEYS = ("op", "module", "source", "nan", "grad_norm", "step", "from_step", "enabled")

    @classmethod
    def from_spec(cls, bp_id: int, spec: dict[str, Any]) -> Breakpoint:
        unknown = set(spec) - set(cls.KEYS)
        if unknown:
            raise BreakpointError(f"unknown breakpoint condition(s): {', '.join(sorted(unknown))}")
        bp = cls(bp_id, **{k: spec[k] for k in cls.KEYS if spec.get(k) is not None})
        if not any(getattr(bp, k) is not None for k in cls.KEYS[:-1]):
            raise BreakpointError("a breakpoint needs at least one condition")
        for name in ("op", "module"):
            pattern = getattr(bp, name)
            if pattern is not None:
                if not isinstance(pattern, str):
                    raise BreakpointError(f"{name} must be a regular expression string")
                try:
                    setattr(bp, f"_{name}", re.compile(pattern))
                except re.error as exc:
                    raise BreakpointError(f"bad {name} regex {pattern!r}: {exc}") from None
        if bp.source is not None:
            file, sep, line = str(bp.source).rpartition(":")
            if not sep or not file or not line.isdigit():
                raise BreakpointError(f"source must be FILE:LINE, not {bp.source!r}")
        if bp.nan is not None and bp.nan not in NAN_CONDITIONS:
            raise BreakpointError(f"nan must be one of {', '.join(NAN_CONDITIONS)}")
        if bp.grad_norm is not None and not isinstance(bp.grad_norm, (int, float)):
            raise BreakpointError("grad_norm must be a number")
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
        name = event.get("name") or event.get("node") or ""
        if self._op is not None and not self._op.search(name):
            return False
        if self._module is not None and not self._module.search(event.get("module") or ""):
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
    return not all_finite(event.get("outputs" if event.get("kind") == "op" else "grad_inputs"))


_BREAK_KEYS = (
    "nan",
    "inf",
    "anynan",
    "op:",
    "module:",
    "line:",
    "source:",
    "gradnorm:",
    "step:",
    "from:",
)
_BREAK_SPLIT = re.compile(r",(?=(?:" + "|".join(re.escape(k) for k in _BREAK_KEYS) + "))")


def parse_break_spec(text: str) -> dict[str, Any]:
    """``--break-on`` text to a breakpoint spec; conditions joined by "," all must hold.

    ``nan`` / ``inf`` (where it first appears), ``anynan``, ``op:REGEX``, ``module:REGEX``,
    ``line:FILE:LINE``, ``gradnorm:X``, ``step:N``, ``from:N``. A regex may contain commas;
    only a comma followed by a condition name splits.
    """
    spec: dict[str, Any] = {}
    for part in _BREAK_SPLIT.split(text.strip()):
        key, sep, value = part.partition(":")
        try:
            if part in NAN_CONDITIONS:
                spec["nan"] = part
            elif sep and key in ("op", "module"):
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
                "module:REGEX, line:FILE:LINE, gradnorm:X, step:N or from:N, joined by ','"
            ) from None
    Breakpoint.from_spec(0, spec)  # validate now, with the same rules the UI's get
    return spec


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
    once it has, with ``origin(event)`` the alert verdict for the event.
    """
    for bp in breakpoints:
        if not bp.enabled or not bp.static_match(event):
            continue
        if bp.needs_stats:
            if phase == AFTER and bp.value_match(event, origin(event)):
                bp.hits += 1
                return f"breakpoint {bp.id}"
        elif phase == BEFORE:
            bp.hits += 1
            return f"breakpoint {bp.id}"
    return None
