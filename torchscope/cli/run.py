"""``torchscope run``: a script (or module) run as python runs it, with the agent around it.

Imports torch only once the options are checked; a script's own error is shown as Python
would show it, without torchscope's frames.
"""

from __future__ import annotations

import os
import sys
import traceback
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field

from torchscope.cli.common import UsageError

RUN_USAGE = r"""usage: torchscope run [--record FILE] [--steps SPEC] [--values N] [--no-live]
                      [--break-on COND] [--log COND EXPR] [--edit COND EXPR]
                      [--wait] [--hold] [--lease SECONDS] [--eval-budget SECONDS]
                      [--optimizer-ops]
                      [--aten[=MODULE_REGEX]] [--eager-check]
                      [--watch nan|gradnorm:X|spike] [--on-nan continue|pause|stop|skip]
                      [--on-spike continue|pause|stop|skip] [--max-skips N] [--quiet]
                      (SCRIPT | -m MODULE) [ARGS ...]

Run a Python script (or module, like `python -m`) so that torchscope can trace it. Options
must come before the script; everything after it goes to the script.

With none of --record, --steps, --break-on, --wait the job runs dormant: it only counts its
steps (no tracing, near-zero cost) until a UI attaches (`torchscope tui PID`, or
`torchscope record PID --next N`), which arms it at the next step boundary; when the UI
leaves, it goes dormant again. Those four options arm it for the steps they select (all
steps unless --steps says otherwise), and it goes dormant after them.

Steps are the job's own: numbered from 0 at its start, one per optimizer.step() (or per
torchscope.step() call; in a job with neither, one per backward()).

  --record FILE   write a trace file (replay it with `torchscope dump FILE`); under
                  torchrun each rank writes its own: trace.tsc -> trace.rank0.tsc, ...
  --steps SPEC    steps to trace: N, A-B, A-, every:N, or a comma list (default: all)
  --values N      keep the values of tensors with at most N elements (default 16)
  --no-live       no control endpoint: no UI can attach (`torchscope tui` finds live jobs)
  --break-on COND pause where COND holds (repeatable); conditions joined by ',' all
                  must hold: nan, inf (where it first appears), anynan, op:REGEX
                  (an op or node name), node:REGEX (a backward node's name),
                  aten:REGEX (with --aten), module:REGEX, line:FILE:LINE, gradnorm:X,
                  step:N, from:N
                  e.g. --break-on nan --break-on 'op:^Tensor.div$'
                       --break-on 'module:^blocks\.3\.,nan'
  --log COND EXPR at every hit of COND, print EXPR on stderr without pausing (a
                  logpoint; a log event in the recording); repeatable. EXPR is Python
                  run in the job, as in pdb, over the event's tensors: out, x, args,
                  kwargs (an op); grad_inputs, grad_outputs (a node); module, torch, F
                  e.g. --log 'node:^MulBackward0$' 'grad_inputs[0]'
  --edit COND EXPR at every hit of COND, replace a tensor with EXPR (same shape, dtype,
                  device): an op's output, or a node's grad_inputs[0]
                  ('grad_inputs[1] = EXPR' names another); repeatable; an edit event each
                  e.g. --edit 'op:^torch\.sqrt$' 'torch.nan_to_num(out)'
  --wait          wait before the first op until a UI connects, then run (like
                  debugpy's --wait-for-client); it says so on stderr
  --hold          a pause with no UI attached waits for one, instead of resuming
                  after the lease (a breakpoint with no UI says at once where it paused)
  --lease SECONDS a UI that stops answering for this long lets go: a pause it held
                  resumes, its breakpoints go, and the job goes dormant (default 10)
  --eval-budget SECONDS
                  an expression (p, e, the MCP evaluate, --log, --edit) running longer is
                  interrupted and answers "interrupted after N s"; a --log or --edit is
                  then disabled (default 10)
  --optimizer-ops also trace the ops inside optimizer.step()
  --aten[=REGEX]  traced steps also record every aten call under each op and backward node
                  (a TorchDispatchMode), or with =REGEX only inside the modules whose path
                  matches it; off by default (dormant and untraced steps pay nothing)
  --eager-check   in traced steps, run each call of a torch.compile'd module once more
                  eagerly (same inputs and RNG state, traced) and report how its outputs and
                  gradients differ from the compiled ones; the job keeps the compiled results
  --watch SPEC    check every step, before the update, that the gradients and the loss are
                  finite (one fused check, one host sync per step; nothing per op):
                  nan, or gradnorm:X (also a total gradient norm above X), or spike (also a
                  loss spike: the loss or the gradient norm far above the run's recent
                  steps), or a comma list (nan,spike). A bad step is replayed traced to name
                  where the NaN/Inf first appears (recorded with --record; shown to an
                  attached UI)
  --on-nan POLICY after the watch reports: continue (default), pause (hold at the origin in
                  the replay for a UI), stop (exit with code 3 before the update), or skip
                  (refuse the update, as a loss scaler skips an overflowed step: weights and
                  optimizer state stay as they were, and training goes on)
  --on-spike POLICY after a loss spike (--watch spike): the same policies (pause goes on as
                  continue); skip refuses the spiked update
  --max-skips N   with --on-nan skip: after N bad steps in a row, the next one stops the job
                  as stop does (default 5)
  --quiet         no torchscope lines on stderr
"""


@dataclass
class RunOptions:
    record: str | None = None
    steps: str | None = None
    values: int = 16
    quiet: bool = False
    live: bool = True
    optimizer_ops: bool = False
    aten: bool | str | None = None
    eager_check: bool = False
    breakpoints: list[dict] = field(default_factory=list)
    wait: bool = False
    hold: bool = False
    lease: float = 10.0
    eval_budget: float | None = None
    watch: str | None = None
    on_nan: str = "continue"
    on_spike: str = "continue"
    max_skips: int | None = None
    module: str | None = None
    script: str | None = None
    args: list[str] = field(default_factory=list)


def parse_run(argv: Sequence[str]) -> RunOptions:
    """Options up to the script (or ``-m MODULE``); the rest belongs to the script."""
    opts = RunOptions()
    it = iter(argv)
    for tok in it:
        name, eq, inline = tok.partition("=")
        if name in (
            "--record",
            "--steps",
            "--values",
            "--break-on",
            "--log",
            "--edit",
            "--lease",
            "--eval-budget",
            "--watch",
            "--on-nan",
            "--on-spike",
            "--max-skips",
            "-m",
        ):
            value = inline if eq else next(it, None)
            if value is None or value == "":
                raise UsageError(f"{name} needs a value (see 'torchscope run --help')")
            if name == "--record":
                opts.record = value
            elif name == "--steps":
                opts.steps = value
            elif name == "--break-on":
                opts.breakpoints.append(_break_spec(value))
            elif name in ("--log", "--edit"):
                opts.breakpoints.append(_action_spec(name, value, next(it, None)))
            elif name == "--watch":
                opts.watch = _watch_spec(value)
            elif name in ("--on-nan", "--on-spike"):
                from torchscope.tracer.watch.stop import POLICIES

                if value not in POLICIES:
                    raise UsageError(f"{name} takes {', '.join(POLICIES)}, not {value!r}")
                setattr(opts, name[2:].replace("-", "_"), value)
            elif name == "--max-skips":
                if not value.isdigit():
                    raise UsageError(f"--max-skips takes a count of steps, not {value!r}")
                opts.max_skips = int(value)
            elif name == "--lease":
                try:
                    opts.lease = float(value)
                except ValueError:
                    raise UsageError(f"--lease takes seconds, not {value!r}") from None
                if not 0 < opts.lease < float("inf"):  # inf: a dead UI's pause never ends
                    raise UsageError("--lease must be a number of seconds above 0")
            elif name == "--eval-budget":
                from torchscope.tracer.armed.interrupt import check_budget

                try:
                    opts.eval_budget = check_budget(float(value), name)
                except ValueError:
                    raise UsageError(f"{name} takes seconds above 0, not {value!r}") from None
            elif name == "--values":
                try:
                    opts.values = int(value)
                except ValueError:
                    raise UsageError(f"--values takes a whole number, not {value!r}") from None
                if opts.values < 0:
                    raise UsageError("--values must not be negative")
            else:
                opts.module = value
                opts.args = list(it)
                return _checked(opts)
        elif name == "--aten":
            opts.aten = _aten_spec(inline) if eq else True
        elif tok == "--quiet":
            opts.quiet = True
        elif tok == "--no-live":
            opts.live = False
        elif tok == "--wait":
            opts.wait = True
        elif tok == "--hold":
            opts.hold = True
        elif tok == "--eager-check":
            opts.eager_check = True
        elif tok == "--optimizer-ops":
            opts.optimizer_ops = True
        elif tok in ("-h", "--help"):
            print(RUN_USAGE, end="")
            raise SystemExit(0)
        elif tok == "--":  # the end of torchscope's options: the script comes next
            script = next(it, None)
            if script is None:
                break
            opts.script = script
            opts.args = list(it)
            return _checked(opts)
        elif tok.startswith("-") and tok != "-":
            raise UsageError(
                f"unknown option {tok!r} for run; options go before the script "
                "(see 'torchscope run --help')"
            )
        else:
            opts.script = tok
            opts.args = list(it)
            return _checked(opts)
    raise UsageError("run needs a script or -m MODULE (see 'torchscope run --help')")


def _checked(opts: RunOptions) -> RunOptions:
    """Options that only mean something together."""
    from torchscope.tracer.steps import parse_watch_spec

    if opts.on_nan != "continue" and not opts.watch:
        raise UsageError(f"--on-nan {opts.on_nan} acts on what --watch finds: add --watch nan")
    if opts.on_spike != "continue" and not (opts.watch and parse_watch_spec(opts.watch).spike):
        raise UsageError(
            f"--on-spike {opts.on_spike} acts on the spikes --watch spike finds: add --watch spike"
        )
    if opts.max_skips is not None and "skip" not in (opts.on_nan, opts.on_spike):
        raise UsageError("--max-skips counts the updates --on-nan skip refuses: add --on-nan skip")
    return opts


def _aten_spec(text: str) -> str:
    from torchscope.tracer.armed.aten import aten_scope

    try:
        aten_scope(text)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return text


def _break_spec(text: str) -> dict:
    from torchscope.protocol.breakpoints import BreakpointError, parse_break_spec

    try:
        return parse_break_spec(text)
    except BreakpointError as exc:
        raise UsageError(f"--break-on: {exc}") from None


def _action_spec(name: str, text: str, expr: str | None) -> dict:
    from torchscope.protocol.breakpoints import BreakpointError, action_spec

    if expr is None or not expr.strip():
        raise UsageError(f"{name} takes a condition and an expression: {name} COND EXPR")
    try:
        return action_spec(name.removeprefix("--"), text, expr)
    except BreakpointError as exc:
        raise UsageError(f"{name}: {exc}") from None


def _watch_spec(text: str) -> str:
    from torchscope.tracer.steps import StepSpecError, parse_watch

    try:
        parse_watch(text)
    except StepSpecError as exc:
        raise UsageError(f"--watch: {exc}") from None
    return text


def _check_public_bind() -> None:
    """A public TORCHSCOPE_BIND without CURVE keys refuses to start (it would expose pause and
    tensor reads to the network); other endpoint trouble only turns the live view off."""
    from torchscope.protocol import endpoints as ep
    from torchscope.protocol.runtime import EndpointError
    from torchscope.protocol.security import SecurityError

    try:
        ep.default_endpoints()
    except SecurityError as exc:
        raise UsageError(str(exc)) from None
    except EndpointError:
        pass


def cmd_run(opts: RunOptions) -> int:
    import warnings

    # torch warns at import when numpy is absent; nothing here needs numpy, so say nothing.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    from torchscope.tracer.steps import StepSpecError, parse_steps

    try:
        parse_steps(opts.steps)
    except StepSpecError as exc:
        raise UsageError(str(exc)) from None
    if opts.script is not None and not (
        os.path.isfile(opts.script) or os.path.isfile(os.path.join(opts.script, "__main__.py"))
    ):
        raise UsageError(f"no such script: {opts.script}")

    if opts.live:
        _check_public_bind()
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        raise UsageError(
            f"torchscope run needs PyTorch in this environment ({exc}); the UI and the trace "
            "readers work without it"
        ) from None

    import runpy

    from torchscope.protocol.tracefile import TraceFileError
    from torchscope.tracer.agent import Agent
    from torchscope.tracer.armed.interrupt import EVAL_BUDGET_S
    from torchscope.tracer.job_end import RUN_POLICY, report_stop
    from torchscope.tracer.options import Options
    from torchscope.tracer.watch.stop import MAX_SKIPS, WatchStop

    # `is not None`: "" is a script too, the current directory, as `python ""` runs it.
    script = os.path.abspath(opts.script) if opts.script is not None else None
    agent = Agent(
        Options(
            record=opts.record,
            steps=opts.steps,
            values=opts.values,
            live=opts.live,
            breakpoints=opts.breakpoints,
            wait=opts.wait,
            hold=opts.hold,
            lease=opts.lease,
            optimizer_ops=opts.optimizer_ops,
            aten=opts.aten,
            eager_check=opts.eager_check,
            quiet=opts.quiet,
            watch=opts.watch,
            on_nan=opts.on_nan,
            on_spike=opts.on_spike,
            max_skips=MAX_SKIPS if opts.max_skips is None else opts.max_skips,
            eval_budget=EVAL_BUDGET_S if opts.eval_budget is None else opts.eval_budget,
            metadata={
                "script": script or opts.module,
                "argv": [opts.script or opts.module, *opts.args],
            },
        )
    )
    target = opts.script or f"-m {opts.module}"
    sys.argv = [opts.script or opts.module or "", *opts.args]  # argv[0] as typed, as python
    # What python puts first on sys.path for the script (or -m), in place of what it put
    # there for torchscope (the console script's directory).
    first = os.getcwd() if script is None else os.path.dirname(script)
    if script is not None and os.path.isdir(script):
        first = script  # a directory with __main__.py: run_path puts it first itself
    if not getattr(sys.flags, "safe_path", False):  # python -P puts nothing there
        sys.path[:1] = [first]
    try:
        agent.start()
    except TraceFileError as exc:
        raise UsageError(str(exc)) from None
    if not opts.quiet:
        held = agent.options.held_steps()
        what = f"tracing {target} (steps: {held.text})" if held else f"running {target} dormant"
        if opts.watch:
            what += f", watching every step ({opts.watch}, then {opts.on_nan})"
        where = f", recording to {agent.options.record}" if opts.record else ""
        if agent.publisher is not None:
            attach = "live" if held else "attach"
            where += f"; {attach}: torchscope tui {os.getpid()}"
        print(f"torchscope: {what}{where}", file=sys.stderr)
    code = 0
    interrupted: KeyboardInterrupt | None = None
    try:
        if opts.module is not None:
            runpy.run_module(opts.module, run_name="__main__", alter_sys=True)
        elif script is not None and os.path.isfile(script) and not zipfile.is_zipfile(script):
            _run_main_script(script)
        elif opts.script is not None:  # a directory or zip archive with __main__.py
            runpy.run_path(opts.script, run_name="__main__")
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except KeyboardInterrupt as exc:  # as python: the traceback, then death by SIGINT
        _print_user_traceback(exc)
        interrupted = exc
        code = 130
    except WatchStop as exc:  # --on-nan stop (or skip's limit): reported, the update not made
        code = report_stop(exc, RUN_POLICY, opts.quiet)
    except BaseException as exc:  # the script's own error: show it as Python would
        _print_user_traceback(exc)
        code = 1
    finally:
        agent.stop()
    if not opts.quiet:
        steps, traced_steps = agent.steps_seen()
        traced = f", {traced_steps} traced" if traced_steps != steps else ""
        saved = ""
        if opts.record:
            n = agent.writer.events_written if agent.writer is not None else 0
            saved = f"; {n} events written to {agent.options.record}"
            if agent.writer is not None and agent.writer.stopped:
                saved += " (recording stopped early: see above)"
        print(f"torchscope: {steps} step(s) seen{traced}{saved}", file=sys.stderr)
    if interrupted is not None:
        # Python ends a job that Ctrl-C stopped by SIGINT, after its atexit handlers, so its
        # parent (a shell loop, a scheduler) sees a signal, not an exit code: leave the same
        # way. The traceback is shown already.
        sys.excepthook = lambda *exc_info: None
        raise interrupted.with_traceback(None)
    return code


def _run_main_script(path: str) -> None:
    """Run ``path`` as python runs its main script: in a fresh ``__main__`` module, with an
    absolute ``__file__`` and a source loader (``runpy.run_path`` sets ``sys.argv[0]`` to the
    absolute path and leaves ``__loader__`` None)."""
    import builtins
    import types
    from importlib.machinery import SourceFileLoader

    loader = SourceFileLoader("__main__", path)
    code = compile(loader.get_data(path), path, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__dict__.update(
        __file__=path, __loader__=loader, __spec__=None, __cached__=None, __builtins__=builtins
    )
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = main
    try:
        exec(code, main.__dict__)
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _print_user_traceback(exc: BaseException) -> None:
    """The script's traceback without the frames of torchscope and runpy above it."""
    tb = exc.__traceback__
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the torchscope package
    while tb is not None and (
        tb.tb_frame.f_code.co_filename.startswith(here)
        or os.path.basename(tb.tb_frame.f_code.co_filename) == "runpy.py"
        or tb.tb_frame.f_code.co_filename.startswith("<frozen runpy")
    ):
        tb = tb.tb_next
    exc.with_traceback(tb)  # the hook prints the exception's own traceback
    try:
        sys.excepthook(type(exc), exc, tb)  # the script's own hook, if it set one
    except Exception:
        traceback.print_exception(type(exc), exc, tb)
