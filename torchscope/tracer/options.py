"""The one options type of the in-process side: what ``trace()``, ``serve()``, ``torchscope run``
and the framework callbacks take.

Each entry point takes the keywords that mean something to it (:data:`TRACE_KEYWORDS`,
:data:`SERVE_KEYWORDS`) and checks them here, each bad one refused in one line. Adding an
option: a field here, its check in :meth:`Options._check`, its keyword in the lists of the
entry points that take it, and where it is read (the agent, the tracer).

Imports no torch: ``torchscope`` exports :class:`Options`, and the UI runs without torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, TypedDict

from torchscope.tracer.armed.interrupt import EVAL_BUDGET_S, check_budget
from torchscope.tracer.steps import ALL_STEPS, StepSelection, parse_steps
from torchscope.tracer.watch.stop import MAX_SKIPS, POLICIES


class TraceKeywords(TypedDict, total=False):
    """``trace()``'s keywords besides ``record`` (for type checkers; the checks are
    :class:`Options`')."""

    steps: str | int | None
    values: int
    keep: bool | int
    optimizer_steps: bool
    optimizer_ops: bool
    live: bool | None
    aten: bool | str | None
    eager_check: bool


class ServeKeywords(TypedDict, total=False):
    """``serve()``'s keywords, which the framework callbacks take too."""

    steps: str | int | None
    record: str | os.PathLike | None
    break_on: str | list[str] | tuple[str, ...]
    wait: bool
    hold: bool
    lease: float
    values: int
    optimizer_ops: bool
    aten: bool | str | None
    eager_check: bool
    quiet: bool
    watch: str | None
    on_nan: str
    on_spike: str
    max_skips: int
    history: bool
    log: Any  # (spec, expression) logpoints: see serve()
    edit: Any  # (spec, expression) edits at every hit: see serve()
    eval_budget: float


# The keywords (as users spell them) each entry point takes; ``break_on``, ``log`` and ``edit``
# become ``breakpoints``.
TRACE_KEYWORDS = ("record", *TraceKeywords.__annotations__)
SERVE_KEYWORDS = tuple(ServeKeywords.__annotations__)
_BOOLS = ("optimizer_steps", "optimizer_ops", "eager_check", "wait", "hold", "quiet", "history")


@dataclass
class Options:
    """What a traced or served job asks for; nothing of it arms a served job by default.

    ``trace()`` and ``serve()`` document each option; ``torchscope run --help`` too.
    """

    record: str | None = None
    steps: str | int | None = None
    values: int = 16
    keep: bool | int = True  # trace(): events kept in memory (an int: the newest N)
    optimizer_steps: bool = True  # trace(): optimizer.step() ends a step
    optimizer_ops: bool = False
    # None: trace() streams when TORCHSCOPE_LIVE=1; a served job always does.
    live: bool | None = None
    breakpoints: list[dict[str, Any]] = field(default_factory=list)  # parsed break_on, log, edit
    wait: bool = False
    hold: bool = False
    lease: float = 10.0
    aten: bool | str | None = None  # the aten level in traced steps (tracer/armed/aten.py)
    eager_check: bool = False  # compiled calls also run eagerly, compared (armed/eager_check)
    quiet: bool = False
    watch: str | None = None  # "nan", "gradnorm:X", "spike": the always-on watch (tracer/watch/)
    on_nan: str = "continue"  # what the watch does after a detection: one of POLICIES
    on_spike: str = "continue"  # after a loss spike (watch "spike"): one of POLICIES
    max_skips: int = MAX_SKIPS  # under "skip": updates refused in a row before it stops
    # The run's loss history (tracer/history.py) and, with the watch, its norms per module.
    history: bool = True
    # Seconds an expression (p, e, evaluate, --log, --edit) runs before it is interrupted.
    eval_budget: float = EVAL_BUDGET_S
    metadata: dict[str, Any] = field(default_factory=dict)
    # Started by serve() (not the command line): a second serve() states the options anew.
    by_serve: bool = False

    @classmethod
    def from_keywords(
        cls, caller: str, takes: tuple[str, ...], hint: str = "", **keywords: Any
    ) -> Options:
        """``caller``'s keywords (the users' spelling), checked: an unknown one is a
        ``TypeError``, a bad value a ``ValueError`` (or ``TypeError``), each in one line."""
        unknown = sorted(keywords.keys() - set(takes))
        if unknown:
            name = unknown[0]
            if not hint and name in (*TRACE_KEYWORDS, *SERVE_KEYWORDS):
                hint = f"it is an option of {'serve()' if name in SERVE_KEYWORDS else 'trace()'}"
            hint = f" ({hint})" if hint else ""
            raise TypeError(f"{caller} got an unexpected keyword argument {name!r}{hint}")
        from torchscope.protocol.breakpoints import action_specs, parse_break_spec

        # Logpoints and edits (log=, edit=) are breakpoints with an action.
        actions = [s for a in ("log", "edit") for s in action_specs(a, keywords.pop(a, None))]
        specs = keywords.pop("break_on", ())
        if isinstance(specs, str):
            specs = [specs]
        elif not isinstance(specs, (list, tuple)):
            raise TypeError(f"break_on takes a spec or a list of them, not {specs!r}")
        record = keywords.pop("record", None)
        opts = cls(
            record=os.fspath(record) if record is not None else None,
            breakpoints=[parse_break_spec(b) for b in specs] + actions,
            **keywords,
        )
        opts._check()
        return opts

    @classmethod
    def for_trace(cls, **keywords: Any) -> Options:
        return cls.from_keywords("trace()", TRACE_KEYWORDS, **keywords)

    @classmethod
    def for_serve(cls, caller: str = "serve()", hint: str = "", **keywords: Any) -> Options:
        from torchscope.tracer.kernel import kernel_script

        opts = cls.from_keywords(caller, SERVE_KEYWORDS, hint, **keywords)
        opts.by_serve = True
        opts.live = True
        notebook = kernel_script()
        if notebook:
            opts.metadata = {"script": notebook}  # what `torchscope ls` shows for the kernel
        return opts

    def _check(self) -> None:
        parse_steps(self.steps)  # a bad spec fails here, with its one line
        if type(self.values) is not int or self.values < 0:
            raise ValueError(
                f"values must be a count of elements (an int >= 0), not {self.values!r}"
            )
        if not isinstance(self.keep, int) or self.keep < 0:
            raise ValueError(f"keep must be True, False or a count of events, not {self.keep!r}")
        if self.live is not None and not isinstance(self.live, bool):
            raise TypeError(f"live must be True, False or None, not {self.live!r}")
        for name in _BOOLS:
            value = getattr(self, name)
            if not isinstance(value, (bool, int)):
                raise TypeError(f"{name} must be True or False, not {value!r}")
            setattr(self, name, bool(value))
        if isinstance(self.lease, bool) or not isinstance(self.lease, (int, float)):
            raise TypeError(f"lease must be a number of seconds, not {self.lease!r}")
        if not self.lease > 0:
            raise ValueError(f"lease must be a positive number of seconds, not {self.lease!r}")
        if not isinstance(self.aten, (bool, str, type(None))):
            raise TypeError(f"aten must be True, False or a regular expression, not {self.aten!r}")
        if isinstance(self.aten, str):
            import re

            try:
                re.compile(self.aten)
            except re.error as exc:
                # The command line's wording (tracer/armed/aten.py), which needs no torch here.
                raise ValueError(
                    f"--aten: {self.aten!r} is not a regular expression: {exc}"
                ) from None
        if self.watch is not None:
            from torchscope.tracer.steps import parse_watch

            parse_watch(self.watch)
        for name in ("on_nan", "on_spike"):
            if getattr(self, name) not in POLICIES:
                raise ValueError(
                    f"{name} must be one of {', '.join(POLICIES)}, not {getattr(self, name)!r}"
                )
        check_budget(self.eval_budget)
        if type(self.max_skips) is not int or self.max_skips < 0:
            raise ValueError(
                f"max_skips must be a count of steps (an int >= 0), not {self.max_skips!r}"
            )

    def held_steps(self) -> StepSelection | None:
        """The steps a served job holds traced from its start (None: it holds none: dormant)."""
        if self.steps is not None:
            return parse_steps(self.steps)
        if self.record is not None or self.breakpoints or self.wait:
            # --record with --watch records what the watch finds, not every step.
            return None if self.watch and not self.breakpoints and not self.wait else ALL_STEPS
        return None
