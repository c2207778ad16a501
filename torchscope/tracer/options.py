"""The one options type of the in-process side: what ``trace()``, ``serve()``, ``torchscope run``
and the framework callbacks take, each option declared once.

:data:`OPTIONS` declares every option once: its name (the keyword of ``trace()``/``serve()``
and the field of :class:`Options`), its default, the entry points that take it, its
command-line flag and its help. The command line's parser and ``--help`` and the docs' option
table are made from it; the public signatures take their defaults from it, and
``tests/test_options.py`` checks that the signatures, :class:`TraceKeywords`,
:class:`ServeKeywords` and :class:`Options` agree with it. Adding an option: its entry here,
its field in :class:`Options` (checked in :meth:`Options._check`), its keyword in the
signatures that take it, and where it is read (the agent, the tracer).

Imports no torch: ``torchscope`` exports :class:`Options`, and the UI runs without torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypedDict

from torchscope.tracer.armed.interrupt import EVAL_BUDGET_S, check_budget
from torchscope.tracer.steps import ALL_STEPS, StepSelection, parse_steps
from torchscope.tracer.watch.stop import MAX_SKIPS, POLICIES


@dataclass(frozen=True)
class Option:
    """One option, as every entry point knows it."""

    name: str  # the keyword of trace()/serve(), the field of Options
    default: Any
    help: str  # the command line's words ("\n" starts a line of its own)
    flag: str = ""  # its command-line flag ("": none)
    # What the flag takes: N (a count), SECONDS, POLICY (one of POLICIES), other words a
    # string; "": a switch.
    metavar: str = ""
    trace: bool = False  # a keyword of trace()
    serve: bool = True  # a keyword of serve() and of the framework callbacks
    run: bool = True  # an option of `torchscope run` (through its flag)

    def help_text(self) -> str:
        """The help, its ``{default}`` filled in."""
        return self.help.replace(
            "{default}",
            f"{self.default:g}" if isinstance(self.default, float) else str(self.default),
        )


_POLICY_WORDS = "|".join(POLICIES)
OPTIONS: tuple[Option, ...] = (
    Option(
        "record", None, "write a trace file (replay it with `torchscope dump FILE`); under "
        "torchrun each rank writes its own: trace.tsc -> trace.rank0.tsc, ...",
        "--record", "FILE", trace=True,
    ),
    Option(
        "steps", None, "steps to trace: N, A-B, A-, every:N, or a comma list (default: all)",
        "--steps", "SPEC", trace=True,
    ),
    Option(
        "values", 16, "keep the values of tensors with at most N elements (default {default})",
        "--values", "N", trace=True,
    ),
    Option(
        "live", None, "no control endpoint: no UI can attach (`torchscope tui` finds live "
        "jobs)", "--no-live", trace=True, serve=False,
    ),
    Option(
        "keep", True, "trace(): keep events in memory (tr.ops, tr.grads); an int keeps only "
        "the newest N", trace=True, serve=False, run=False,
    ),
    Option(
        "optimizer_steps", True, "trace(): advance the step index at every optimizer.step()",
        trace=True, serve=False, run=False,
    ),
    Option(
        "break_on", (), "pause where COND holds (repeatable); conditions joined by ',' all "
        "must hold: nan, inf (where it first appears), anynan, op:REGEX (an op or node name), "
        "node:REGEX (a backward node's name), aten:REGEX (with --aten), module:REGEX, "
        "line:FILE:LINE, gradnorm:X, step:N, from:N"
        "\ne.g. --break-on nan --break-on 'op:^Tensor.div$'"
        "\n     --break-on 'module:^blocks\\.3\\.,nan'",
        "--break-on", "COND",
    ),
    Option(
        "log", None, "at every hit of COND, print EXPR on stderr without pausing (a "
        "logpoint; a log event in the recording); repeatable. EXPR is Python run in the job, "
        "as in pdb, over the event's tensors: out, x, args, kwargs (an op); grad_inputs, "
        "grad_outputs (a node); module, torch, F"
        "\ne.g. --log 'node:^MulBackward0$' 'grad_inputs[0]'",
        "--log", "COND EXPR",
    ),
    Option(
        "edit", None, "at every hit of COND, replace a tensor with EXPR (same shape, dtype, "
        "device): an op's output, or a node's grad_inputs[0] ('grad_inputs[1] = EXPR' names "
        "another); repeatable; an edit event each"
        "\ne.g. --edit 'op:^torch\\.sqrt$' 'torch.nan_to_num(out)'",
        "--edit", "COND EXPR",
    ),
    Option(
        "wait", False, "wait before the first op until a UI connects, then run (like "
        "debugpy's --wait-for-client); it says so on stderr", "--wait",
    ),
    Option(
        "hold", False, "a pause with no UI attached waits for one, instead of resuming after "
        "the lease (a breakpoint with no UI says at once where it paused)", "--hold",
    ),
    Option(
        "lease", 10.0, "a UI that stops answering for this long lets go: a pause it held "
        "resumes, its breakpoints go, and the job goes dormant (default {default})",
        "--lease", "SECONDS",
    ),
    Option(
        "eval_budget", EVAL_BUDGET_S, "an expression (p, e, the MCP evaluate, --log, --edit) "
        "running longer is interrupted and answers \"interrupted after N s\"; a --log or "
        "--edit is then disabled (default {default})", "--eval-budget", "SECONDS",
    ),
    Option(
        "optimizer_ops", False, "also trace the ops inside optimizer.step()", "--optimizer-ops",
        trace=True,
    ),
    Option(
        "aten", None, "traced steps also record every aten call under each op and backward "
        "node (a TorchDispatchMode), or with =REGEX only inside the modules whose path matches "
        "it; off by default (dormant and untraced steps pay nothing)", "--aten", "[=REGEX]",
        trace=True,
    ),
    Option(
        "eager_check", False, "in traced steps, run each call of a torch.compile'd module once "
        "more eagerly (same inputs and RNG state, traced) and report how its outputs and "
        "gradients differ from the compiled ones; the job keeps the compiled results",
        "--eager-check", trace=True,
    ),
    Option(
        "watch", None, "check every step, before the update, that the gradients and the loss "
        "are finite (one fused check, one host sync per step; nothing per op): nan, or "
        "gradnorm:X (also a total gradient norm above X), or spike (also a loss spike: the "
        "loss or the gradient norm far above the run's recent steps), or a comma list "
        "(nan,spike). A bad step is replayed traced to name where the NaN/Inf first appears "
        "(recorded with --record; shown to an attached UI)", "--watch", "SPEC",
    ),
    Option(
        "on_nan", "continue", "after the watch reports: continue (default), pause (hold at "
        "the origin in the replay for a UI), stop (exit with code 3 before the update), or "
        "skip (refuse the update, as a loss scaler skips an overflowed step: weights and "
        "optimizer state stay as they were, and training goes on)", "--on-nan", "POLICY",
    ),
    Option(
        "on_spike", "continue", "after a loss spike (--watch spike): the same policies; skip "
        "refuses the spiked update", "--on-spike", "POLICY",
    ),
    Option(
        "max_skips", MAX_SKIPS, "with --on-nan skip: after N bad steps in a row, the next one "
        "stops the job as stop does (default {default})", "--max-skips", "N",
    ),
    Option(
        "history", True, "serve(): keep the run's loss history (and with the watch its "
        "gradient norms per module)", run=False,
    ),
    Option("quiet", False, "no torchscope lines on stderr", "--quiet"),
)  # fmt: skip
OPTION = {option.name: option for option in OPTIONS}
# Each option's default (none is mutable: a list default would be shared by every call).
DEFAULT = MappingProxyType({option.name: option.default for option in OPTIONS})
POLICY_WORDS = _POLICY_WORDS


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
TRACE_KEYWORDS = tuple(option.name for option in OPTIONS if option.trace)
SERVE_KEYWORDS = tuple(option.name for option in OPTIONS if option.serve)
# Switches (``keep`` is True, False or a count).
_BOOLS = tuple(o.name for o in OPTIONS if type(o.default) is bool and o.name != "keep")


@dataclass
class Options:
    """What a traced or served job asks for; nothing of it arms a served job by default.

    ``trace()`` and ``serve()`` document each option; ``torchscope run --help`` too.
    """

    record: str | None = DEFAULT["record"]
    steps: str | int | None = DEFAULT["steps"]
    values: int = DEFAULT["values"]
    keep: bool | int = DEFAULT["keep"]  # trace(): events kept in memory (an int: the newest N)
    optimizer_steps: bool = DEFAULT["optimizer_steps"]  # trace(): optimizer.step() ends a step
    optimizer_ops: bool = DEFAULT["optimizer_ops"]
    # None: trace() streams when TORCHSCOPE_LIVE=1; a served job always does.
    live: bool | None = DEFAULT["live"]
    breakpoints: list[dict[str, Any]] = field(default_factory=list)  # parsed break_on, log, edit
    wait: bool = DEFAULT["wait"]
    hold: bool = DEFAULT["hold"]
    lease: float = DEFAULT["lease"]
    aten: bool | str | None = DEFAULT["aten"]  # the aten level (tracer/armed/aten.py)
    eager_check: bool = DEFAULT["eager_check"]  # compiled calls also run eagerly, compared
    quiet: bool = DEFAULT["quiet"]
    watch: str | None = DEFAULT["watch"]  # "nan", "gradnorm:X", "spike" (tracer/watch/)
    on_nan: str = DEFAULT["on_nan"]  # what the watch does after a detection: one of POLICIES
    on_spike: str = DEFAULT["on_spike"]  # after a loss spike (watch "spike")
    max_skips: int = DEFAULT["max_skips"]  # under "skip": refused updates before it stops
    # The run's loss history (tracer/history.py) and, with the watch, its norms per module.
    history: bool = DEFAULT["history"]
    # Seconds an expression (p, e, evaluate, --log, --edit) runs before it is interrupted.
    eval_budget: float = DEFAULT["eval_budget"]
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
        from torchscope.tracer.notebook import kernel_script

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
