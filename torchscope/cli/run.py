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
from typing import Any

from torchscope.cli.common import UsageError

_RUN_SYNOPSIS = "usage: torchscope run"
_RUN_ABOUT = """
Run a Python script (or module, like `python -m`) so that torchscope can trace it. Options
must come before the script; everything after it goes to the script.

With none of --record, --steps, --break-on, --wait the job runs dormant: it only counts its
steps (no tracing, near-zero cost) until a UI attaches (`torchscope tui PID`, or
`torchscope record PID --next N`), which arms it at the next step boundary; when the UI
leaves, it goes dormant again. Those four options arm it for the steps they select (all
steps unless --steps says otherwise), and it goes dormant after them.

Steps are the job's own: numbered from 0 at its start, one per optimizer.step() (or per
torchscope.step() call; in a job with neither, one per backward()).
"""
_WIDTH = 92  # --help's lines
_HELP_AT = 18  # where an option's help starts


def _run_usage() -> str:
    """``torchscope run --help``: its options and their help from their one declaration."""
    from torchscope.tracer.options import OPTIONS, POLICY_WORDS

    run = [o for o in OPTIONS if o.run]
    # A synopsis word never breaks inside its brackets (a no-break space until wrapped).
    words = [f"[{_flag_text(o, POLICY_WORDS)}]".replace(" ", "\xa0") for o in run]
    synopsis = _wrap(
        " ".join([*words, "(SCRIPT | -m MODULE) [ARGS ...]"]),
        "usage: torchscope run ",
        " " * len("usage: torchscope run "),
    )
    lines = [line.replace("\xa0", " ") for line in synopsis]
    lines += [*_RUN_ABOUT.splitlines(), ""]
    indent = " " * _HELP_AT
    for o in run:
        head = f"  {_flag_text(o)}"
        parts = o.help_text().split("\n")
        if len(head) < _HELP_AT:
            lines += _wrap(parts[0], head.ljust(_HELP_AT), indent)
        else:
            lines += [head, *_wrap(parts[0], indent, indent)]
        # an example line keeps its own spacing
        lines += [indent + part for part in parts[1:]]
    return "\n".join(lines) + "\n"


def _flag_text(option: Any, policies: str = "POLICY") -> str:
    """``--flag METAVAR`` (``--aten[=REGEX]``; a policy's words in a synopsis)."""
    takes = policies if option.metavar == "POLICY" else option.metavar
    if takes.startswith("["):
        return option.flag + takes
    return f"{option.flag} {takes}".rstrip()


def _wrap(text: str, first: str, rest: str) -> list[str]:
    import textwrap

    return textwrap.wrap(
        text,
        _WIDTH,
        initial_indent=first,
        subsequent_indent=rest,
        break_on_hyphens=False,
        break_long_words=False,
    )


@dataclass
class RunOptions:
    """``torchscope run``'s command line: the options given, and what to run."""

    given: dict[str, Any] = field(default_factory=dict)  # option name -> value, as given
    breakpoints: list[dict] = field(default_factory=list)  # --break-on, --log, --edit in order
    module: str | None = None
    script: str | None = None
    args: list[str] = field(default_factory=list)

    def __getattr__(self, name: str) -> Any:
        """An option's value: as given, else its declared default (``live``: on)."""
        if name.startswith("__"):
            raise AttributeError(name)
        from torchscope.tracer.options import DEFAULT

        if name not in DEFAULT:
            raise AttributeError(name)
        given = self.__dict__.get("given", {})
        if name in given:
            return given[name]
        return True if name == "live" else DEFAULT[name]


def parse_run(argv: Sequence[str]) -> RunOptions:
    """Options up to the script (or ``-m MODULE``); the rest belongs to the script."""
    from torchscope.tracer.options import OPTIONS

    by_flag = {o.flag: o for o in OPTIONS if o.run}
    opts = RunOptions()
    it = iter(argv)
    for tok in it:
        name, eq, inline = tok.partition("=")
        option = by_flag.get(name)
        if tok in ("-h", "--help"):
            print(_run_usage(), end="")
            raise SystemExit(0)
        if tok == "--":  # the end of torchscope's options: the script comes next
            script = next(it, None)
            if script is None:
                break
            opts.script = script
            opts.args = list(it)
            return _checked(opts)
        if name == "-m":
            value = inline if eq else next(it, None)
            if not value:
                raise UsageError("-m needs a value (see 'torchscope run --help')")
            opts.module = value
            opts.args = list(it)
            return _checked(opts)
        if option is None:
            if tok.startswith("-") and tok != "-":
                raise UsageError(
                    f"unknown option {tok!r} for run; options go before the script "
                    "(see 'torchscope run --help')"
                )
            opts.script = tok
            opts.args = list(it)
            return _checked(opts)
        if option.metavar.startswith("["):  # an optional value, only as --flag=VALUE
            opts.given[option.name] = _aten_spec(inline) if eq else True
        elif not option.metavar:  # a switch
            if eq:
                raise UsageError(f"{name} takes no value (see 'torchscope run --help')")
            opts.given[option.name] = option.flag != "--no-live"
        else:
            value = inline if eq else next(it, None)
            if value is None or value == "":
                raise UsageError(f"{name} needs a value (see 'torchscope run --help')")
            _take(opts, option, name, value, it)
    raise UsageError("run needs a script or -m MODULE (see 'torchscope run --help')")


def _take(opts: RunOptions, option: Any, flag: str, value: str, rest: Any) -> None:
    """``flag VALUE``, read as its option's metavar says."""
    if option.name == "break_on":
        opts.breakpoints.append(_break_spec(value))
    elif option.name in ("log", "edit"):
        opts.breakpoints.append(_action_spec(flag, value, next(rest, None)))
    elif option.name == "watch":
        opts.given["watch"] = _watch_spec(value)
    elif option.metavar == "POLICY":
        from torchscope.tracer.watch.stop import POLICIES

        if value not in POLICIES:
            raise UsageError(f"{flag} takes {', '.join(POLICIES)}, not {value!r}")
        opts.given[option.name] = value
    elif option.metavar == "N":
        if not (value.isascii() and value.isdigit()):
            raise UsageError(f"{flag} takes a count (a whole number, 0 or more), not {value!r}")
        opts.given[option.name] = int(value)
    elif option.metavar == "SECONDS":
        try:
            seconds = float(value)
        except ValueError:
            raise UsageError(f"{flag} takes seconds, not {value!r}") from None
        if not 0 < seconds < float("inf"):  # inf: a dead UI's pause never ends
            raise UsageError(f"{flag} must be a number of seconds above 0, not {value!r}")
        opts.given[option.name] = seconds
    else:
        opts.given[option.name] = value


def _checked(opts: RunOptions) -> RunOptions:
    """Options that only mean something together."""
    from torchscope.tracer.steps import parse_watch_spec

    if opts.on_nan != "continue" and not opts.watch:
        raise UsageError(f"--on-nan {opts.on_nan} acts on what --watch finds: add --watch nan")
    if opts.on_spike != "continue" and not (opts.watch and parse_watch_spec(opts.watch).spike):
        raise UsageError(
            f"--on-spike {opts.on_spike} acts on the spikes --watch spike finds: add --watch spike"
        )
    if "max_skips" in opts.given and "skip" not in (opts.on_nan, opts.on_spike):
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
    from torchscope.tracer.job_end import RUN_POLICY, report_stop
    from torchscope.tracer.options import Options
    from torchscope.tracer.watch.stop import WatchStop

    # `is not None`: "" is a script too, the current directory, as `python ""` runs it.
    script = os.path.abspath(opts.script) if opts.script is not None else None
    from torchscope.tracer.options import OPTIONS

    agent = Agent(
        Options(
            **{
                o.name: getattr(opts, o.name)
                for o in OPTIONS
                if o.name in opts.given and o.name != "live"
            },
            live=opts.live,
            breakpoints=opts.breakpoints,
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
            from torchscope.tracer.watch.report import watching_words

            words = watching_words(opts.watch, opts.on_nan, opts.on_spike)
            what += f", watching every step ({words})"
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
