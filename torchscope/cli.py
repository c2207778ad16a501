"""``torchscope`` command line: run a script traced, dump a trace file.

Every user mistake ends in one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torchscope import __version__
from torchscope.protocol.events import KINDS

if TYPE_CHECKING:
    from torchscope.protocol.endpoints import SessionRecord


class UsageError(Exception):
    """A mistake in how torchscope was called; its text is the one line the user sees."""


def _fail(message: str) -> int:
    print(f"torchscope: error: {message}", file=sys.stderr)
    return 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see '{self.prog} --help')")


# -- run -------------------------------------------------------------------------------------
RUN_USAGE = r"""usage: torchscope run [--record FILE] [--steps SPEC] [--values N] [--no-live]
                      [--break-on COND] [--wait] [--hold] [--lease SECONDS] [--optimizer-ops]
                      [--watch nan|gradnorm:X] [--on-nan continue|pause|stop]
                      [--quiet] (SCRIPT | -m MODULE) [ARGS ...]

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
                  must hold: nan, inf (where it first appears), anynan, op:REGEX,
                  module:REGEX, line:FILE:LINE, gradnorm:X, step:N, from:N
                  e.g. --break-on nan --break-on 'op:^Tensor.div$'
                       --break-on 'module:^blocks\.3\.,nan'
  --wait          wait before the first op until a UI connects, then run (like
                  debugpy's --wait-for-client); it says so on stderr
  --hold          a pause with no UI attached waits for one, instead of resuming
                  after the lease (a breakpoint with no UI says at once where it paused)
  --lease SECONDS a UI that stops answering for this long lets go: a pause it held
                  resumes, its breakpoints go, and the job goes dormant (default 10)
  --optimizer-ops also trace the ops inside optimizer.step()
  --watch SPEC    check every step, before the update, that the gradients and the loss are
                  finite (one fused check, one host sync per step; nothing per op):
                  nan, or gradnorm:X (also a total gradient norm above X). A bad step is
                  replayed traced to name where the NaN/Inf first appears (recorded with
                  --record; shown to an attached UI)
  --on-nan POLICY after the watch reports: continue (default), pause (hold at the origin in
                  the replay for a UI), or stop (exit with code 3 before the update)
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
    breakpoints: list[dict] = field(default_factory=list)
    wait: bool = False
    hold: bool = False
    lease: float = 10.0
    watch: str | None = None
    on_nan: str = "continue"
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
            "--lease",
            "--watch",
            "--on-nan",
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
            elif name == "--watch":
                opts.watch = _watch_spec(value)
            elif name == "--on-nan":
                from torchscope.tracer.steps import WATCH_POLICIES

                if value not in WATCH_POLICIES:
                    raise UsageError(f"--on-nan takes {', '.join(WATCH_POLICIES)}, not {value!r}")
                opts.on_nan = value
            elif name == "--lease":
                try:
                    opts.lease = float(value)
                except ValueError:
                    raise UsageError(f"--lease takes seconds, not {value!r}") from None
                if not 0 < opts.lease < float("inf"):  # inf: a dead UI's pause never ends
                    raise UsageError("--lease must be a number of seconds above 0")
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
        elif tok == "--quiet":
            opts.quiet = True
        elif tok == "--no-live":
            opts.live = False
        elif tok == "--wait":
            opts.wait = True
        elif tok == "--hold":
            opts.hold = True
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
    if opts.on_nan != "continue" and not opts.watch:
        raise UsageError(f"--on-nan {opts.on_nan} acts on what --watch finds: add --watch nan")
    return opts


def _seconds(text: str) -> float:
    """An argparse type: a number of seconds, more than 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes seconds, not {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, not {text}")
    return value


def _break_spec(text: str) -> dict:
    from torchscope.protocol.breakpoints import BreakpointError, parse_break_spec

    try:
        return parse_break_spec(text)
    except BreakpointError as exc:
        raise UsageError(f"--break-on: {exc}") from None


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
    from torchscope.protocol.security import SecurityError

    try:
        ep.default_endpoints()
    except SecurityError as exc:
        raise UsageError(str(exc)) from None
    except ep.EndpointError:
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
    from torchscope.tracer.agent import Agent, ServeOptions
    from torchscope.tracer.watch.nan_watch import WatchStop

    script = os.path.abspath(opts.script) if opts.script else None
    agent = Agent(
        ServeOptions(
            record=opts.record,
            steps=opts.steps,
            values=opts.values,
            live=opts.live,
            breakpoints=opts.breakpoints,
            wait=opts.wait,
            hold=opts.hold,
            lease=opts.lease,
            optimizer_ops=opts.optimizer_ops,
            quiet=opts.quiet,
            watch=opts.watch,
            on_nan=opts.on_nan,
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
    first = os.getcwd() if opts.script is None else os.path.dirname(script)  # type: ignore[arg-type]
    if opts.script is not None and os.path.isdir(opts.script):
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
        elif os.path.isfile(script) and not zipfile.is_zipfile(script):  # type: ignore[arg-type]
            _run_main_script(script)  # type: ignore[arg-type]
        else:  # a directory or zip archive with __main__.py
            runpy.run_path(opts.script, run_name="__main__")  # type: ignore[arg-type]
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except KeyboardInterrupt as exc:  # as python: the traceback, then death by SIGINT
        _print_user_traceback(exc)
        interrupted = exc
        code = 130
    except WatchStop as exc:  # --on-nan stop: reported, the file complete, the update not made
        code = exc.exit_code
        if not opts.quiet:
            step = exc.detection.get("step")
            print(
                f"torchscope: stopped before the update of step {step} (--on-nan stop); "
                f"exit code {code}",
                file=sys.stderr,
            )
    except BaseException as exc:  # the script's own error: show it as Python would
        _print_user_traceback(exc)
        code = 1
    finally:
        agent.stop()
    if not opts.quiet:
        steps = agent.clock.step + 1
        traced = f", {agent.traced_steps} traced" if agent.traced_steps != steps else ""
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
    here = os.path.dirname(os.path.abspath(__file__))
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


# -- dump ------------------------------------------------------------------------------------
def cmd_dump(args: argparse.Namespace) -> int:
    from torchscope.dump import render
    from torchscope.protocol.output import drop_stdout
    from torchscope.protocol.tracefile import TraceFileError, TraceReader

    try:
        reader = TraceReader(args.file)
    except TraceFileError as exc:
        return _fail(f"{args.file}: {exc}")
    with reader:
        events = reader.iter_events(step=args.step)
        if args.kind:
            wanted = set(args.kind)
            events = (e for e in events if e["kind"] in wanted)
        out = sys.stdout
        try:
            for line in render(events, args.format):
                out.write(line + "\n")
            out.flush()
        except TraceFileError as exc:
            out.flush()
            return _fail(f"{args.file}: {exc}")
        except BrokenPipeError:  # `torchscope dump t.tsc | head`
            drop_stdout()
            return 0
        except OSError as exc:  # a full disk
            drop_stdout()
            return _fail(f"cannot write the output: {exc.strerror or exc}")
        if reader.truncated:
            print(
                f"torchscope: {args.file} was cut short at byte {reader.truncated_at} "
                f"(the writer did not finish); showing the {len(reader)} events before it",
                file=sys.stderr,
            )
        if reader.damaged:
            print(f"torchscope: {args.file}: {reader.damaged}", file=sys.stderr)
    return 0


# -- ls, record ------------------------------------------------------------------------------
def cmd_ls(args: argparse.Namespace) -> int:
    """Live sessions on this machine, the ranks of a torchrun job grouped under it; each is
    asked for its step (briefly)."""
    from torchscope.protocol import endpoints as ep

    try:
        records = ep.list_sessions()
    except ep.EndpointError as exc:
        return _fail(str(exc))
    if not records:
        print("no running torchscope sessions (start one with `torchscope run SCRIPT`)")
        return 0
    print(
        f"{'PID':>7} {'RANK':>4} {'STEP':>6} {'TRACING':<8} {'STARTED':<19} {'SCRIPT':<28} "
        "ENDPOINTS"
    )
    for ranks in ep.group_by_job(records):
        if len(ranks) > 1 or ranks[0].job is not None:
            first = ranks[0]
            world = first.world_size or len(ranks)
            script = os.path.basename(first.script or "") or "?"
            print(
                f"job {first.job} · {len(ranks)} of {world} ranks here · {script} "
                f"(`torchscope tui {first.pid}` opens every rank)"
            )
        for rec in ranks:
            _ls_row(rec, args.timeout)
    return 0


def _ls_row(rec: SessionRecord, timeout: float) -> None:
    import datetime

    from torchscope.protocol import endpoints as ep
    from torchscope.protocol.client import SessionClient, SessionRefused, SessionUnreachable

    step = tracing = "?"
    try:
        with SessionClient() as client:
            hello = client.connect(rec, timeout=timeout)
            step = str(hello.get("step"))
            tracing = hello.get("tracing") or "traced"  # a trace(live=True) block
    except (SessionUnreachable, SessionRefused, ep.EndpointError):
        pass
    started = datetime.datetime.fromtimestamp(rec.started).strftime("%Y-%m-%d %H:%M:%S")
    rank = "-" if rec.rank is None else str(rec.rank)
    script = os.path.basename(rec.script or "") or "?"
    print(
        f"{rec.pid:>7} {rank:>4} {step:>6} {tracing:<8} {started:<19} {script:<28} "
        f"events {rec.events}  control {rec.control}"
    )


def cmd_record(args: argparse.Namespace) -> int:
    """Capture a live session into a trace file, headless, with a progress line.

    A dormant job is armed for the recording: for its next N steps (``--next N``), or until
    Ctrl-C / SIGTERM / the job's end; either way the file is complete.
    """
    import signal
    import time

    from torchscope.protocol import endpoints as ep
    from torchscope.protocol.client import SessionClient, SessionRefused, SessionUnreachable
    from torchscope.protocol.events import SESSION, STEP, TRACING
    from torchscope.protocol.tracefile import TraceFileError, TraceWriter

    if args.next is not None and args.next < 1:
        return _fail("--next takes a number of steps, at least 1")
    client = SessionClient()
    holder = None
    try:
        client.connect(ep.resolve(args.target), timeout=args.timeout)
        # --next records from the arming on; otherwise the recent events the job still holds
        # come first (a job traced from its start).
        snap = {"session": client.session} if args.next else client.snapshot(args.snapshot)
        try:
            armed = client.request("arm", timeout=args.timeout, next=args.next, by="record")
            holder = armed["holder"]
        except SessionRefused as exc:  # a torchscope.trace(live=True) block: always traced
            if args.next:
                raise SessionRefused(f"this job cannot be armed for --next ({exc})") from None
    except (SessionUnreachable, SessionRefused, ep.EndpointError) as exc:
        client.close()
        return _fail(str(exc))
    session = snap.get("session") or {}
    try:
        writer = TraceWriter(args.output, metadata={"session": session, "recorded_live": True})
    except TraceFileError as exc:
        client.close()
        return _fail(str(exc))
    progress = _Progress(enabled=not args.quiet)
    steps = set()
    written = 0
    done = False  # the job let go of this recording's hold (its N steps are recorded)
    last_ping = time.monotonic()
    old_term = signal.signal(signal.SIGTERM, _interrupt)
    try:
        events = snap.get("events") or []
        if session and not any(e.get("kind") == SESSION for e in events):
            writer.write([session])  # a file opens with who the job is, as --record's do
            written += 1
        while True:
            if events:
                writer.write(events)
                written += len(events)
                for e in events:
                    if e.get("kind") == STEP:
                        steps.add(e["step"])
                    elif e.get("kind") == TRACING and holder in (e.get("released") or ()):
                        done = True
                progress.show(
                    f"recording pid {session.get('pid', '?')}: {written} events, "
                    f"{len(steps)} traced steps, step {client.step}, {client.dropped} dropped"
                )
            if done or client.ended or not client.alive:
                break
            if holder is not None and time.monotonic() - last_ping >= 1.0:
                last_ping = time.monotonic()
                client.request("ping", timeout=args.timeout)  # holds the job armed (lease)
            events = client.recv_events(200)
    except (KeyboardInterrupt, SessionUnreachable):
        pass
    finally:
        signal.signal(signal.SIGTERM, old_term)
        if holder is not None and not done and not client.ended:
            with contextlib.suppress(Exception):
                client.request("disarm", timeout=1.0)  # the job goes dormant again
        writer.close()
        client.close()
    ended = "" if client.ended or done else " (stopped before the job ended)"
    lost = getattr(client, "events_lost", 0) or 0
    missed = f"; {lost} events missed (this recorder read too slowly)" if lost else ""
    progress.done(
        f"torchscope: {written} events, {len(steps)} traced steps written to {args.output}"
        f"{ended}{missed}"
    )
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


class _Progress:
    """One status line on stderr, rewritten in place at most ~10 times a second."""

    def __init__(self, enabled: bool = True) -> None:
        import time

        self._clock = time.monotonic
        self.enabled = enabled and sys.stderr.isatty()
        self._last = 0.0
        self._shown = False

    def show(self, text: str) -> None:
        if self.enabled and self._clock() - self._last >= 0.1:
            self._last = self._clock()
            sys.stderr.write("\r\033[K" + text)
            sys.stderr.flush()
            self._shown = True

    def done(self, text: str) -> None:
        if self._shown:
            sys.stderr.write("\r\033[K")
        print(text, file=sys.stderr)


def cmd_watch(args: argparse.Namespace) -> int:
    """Switch the NaN watch of a running job on or off (from its next backward)."""
    from torchscope.protocol import endpoints as ep
    from torchscope.protocol.client import SessionClient, SessionRefused, SessionUnreachable

    spec = None if args.off else args.spec
    try:
        with SessionClient() as client:
            client.connect(ep.resolve(args.target), timeout=args.timeout)
            client.request("watch", timeout=args.timeout, spec=spec, on_nan=args.on_nan)
            pid = (client.session or {}).get("pid", args.target)
    except (SessionUnreachable, SessionRefused, ep.EndpointError) as exc:
        return _fail(str(exc))
    if spec is None:
        print(f"torchscope: {pid} stops watching for NaN at its next backward()")
    else:
        print(
            f"torchscope: {pid} watches every step from its next backward() ({spec}, then "
            f"{args.on_nan}); its reports go to its stderr, its trace file and attached UIs"
        )
    return 0


def cmd_attach(args: argparse.Namespace) -> int:
    """Start the dormant agent inside a job that never imported torchscope."""
    from torchscope.attach import AttachError, attach

    try:
        control = attach(args.pid, timeout=args.timeout)
    except AttachError as exc:
        return _fail(str(exc))
    print(f"torchscope: attached to {args.pid} ({control}); look: torchscope tui {args.pid}")
    return 0


# -- tui -------------------------------------------------------------------------------------
def cmd_tui(args: argparse.Namespace) -> int:
    from torchscope.tui.app import run_tui
    from torchscope.tui.multi import follows_job, open_sources
    from torchscope.tui.sources import SourceError

    try:
        # trace files, a pid or endpoint, or the only live session; a rank: its whole job
        sources, first = open_sources(args.targets)
    except SourceError as exc:
        return _fail(str(exc))
    follow = follows_job(args.targets, sources)
    return run_tui(sources, first=first, follow_job=follow, max_events=args.max_events)


# -- diff, export, tui --web -----------------------------------------------------------------
def cmd_diff(args: argparse.Namespace) -> int:
    from torchscope.diff import main as diff_main

    return diff_main(args)


def cmd_export(args: argparse.Namespace) -> int:
    from torchscope.export import main as export_main

    return export_main(args)


def cmd_tui_web(args: argparse.Namespace) -> int:
    from torchscope.export.web import WebError, serve

    if len(args.targets) > 1:
        return _fail("--web opens one target (several side by side: the terminal UI)")
    from torchscope.tui.targets import target_problem  # the terminal UI's rules, no terminal

    problem = target_problem("tui", args.target, getattr(args, "wait", False))
    if problem:
        return _fail(problem)
    if args.target and os.path.isfile(args.target):  # a bad file fails here, not in each tab
        from torchscope.protocol.tracefile import TraceFileError, TraceReader

        try:
            TraceReader(args.target).close()
        except TraceFileError as exc:
            return _fail(f"{args.target}: {exc}")
    try:
        return serve(args.target, host=args.host, port=args.port, max_events=args.max_events)
    except WebError as exc:
        return _fail(str(exc))


def cmd_demo(args: argparse.Namespace) -> int:
    """The terminal UI on a simulated job (no torch): try every key before wiring a real one."""
    for name, stream in (("output", sys.stdout), ("input", sys.stdin)):
        try:
            tty = stream.isatty()
        except (AttributeError, ValueError):
            tty = False
        if not tty:
            return _fail(f"the demo is the terminal UI, and its {name} is not a terminal")
    from torchscope.tui.demo import run_demo

    return run_demo()


# -- entry point -----------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="torchscope", description="Live step-through debugger for PyTorch.")
    parser.add_argument("--version", action="version", version=f"torchscope {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.add_parser("run", help="run a script traced (see 'torchscope run --help')", add_help=False)
    dump = sub.add_parser("dump", help="print the events of a trace file")
    dump.add_argument("file", help="trace file written by --record")
    dump.add_argument("--format", choices=("text", "jsonl"), default="text")
    dump.add_argument(
        "--kind", action="append", choices=KINDS, help="only events of this kind (repeatable)"
    )
    dump.add_argument("--step", type=int, help="only events of this step")
    for name, target_help in (
        (
            "tui",
            "trace files (several side by side: t.rank*.tsc, A.tsc B.tsc), a pid (a torchrun "
            "rank: every rank of its job) or control endpoint (default: the only running job)",
        ),
        ("replay", "trace files"),
    ):
        tui = sub.add_parser(
            name,
            help="the terminal UI on a live session or a trace file"
            if name == "tui"
            else "the terminal UI on a trace file (same as tui FILE)",
        )
        tui.add_argument(
            "targets", nargs="*" if name == "tui" else "+", metavar="TARGET", help=target_help
        )
        tui.add_argument(
            "--max-events", type=int, default=250_000, help="events kept in memory (default 250k)"
        )
        if name == "tui":
            tui.add_argument(
                "--wait",
                action="store_true",
                help="wait for a pid or endpoint that is not (yet) a session, saying so",
            )
            tui.add_argument(
                "--web",
                action="store_true",
                help="serve the UI to a browser (textual-serve: pip install 'torchscope[web]')",
            )
            tui.add_argument("--port", type=int, default=8000, help="--web port (default 8000)")
            tui.add_argument(
                "--host", default="localhost", help="--web address (default localhost only)"
            )
    sub.add_parser("demo", help="the terminal UI on a simulated job with a NaN (no torch needed)")
    keys = sub.add_parser("keys", help="create CURVE keys, needed to bind a public address")
    keys.add_argument("--force", action="store_true", help="replace existing keys")
    attach = sub.add_parser(
        "attach",
        help="make a running Python job attachable (Python 3.14+: sys.remote_exec)",
    )
    attach.add_argument("pid", type=int, help="process id of the job")
    attach.add_argument("--timeout", type=_seconds, default=10.0, help="seconds to wait for it")
    watch = sub.add_parser(
        "watch", help="switch the NaN watch of a running job on or off (see 'run --watch')"
    )
    watch.add_argument("target", nargs="?", help="pid or control endpoint (default: the only one)")
    watch.add_argument("--spec", default="nan", help="nan or gradnorm:X (default nan)")
    watch.add_argument(
        "--on-nan", default="continue", choices=("continue", "pause", "stop"), help="policy"
    )
    watch.add_argument("--off", action="store_true", help="stop watching")
    watch.add_argument("--timeout", type=_seconds, default=2.0, help="seconds to wait for the job")
    ls = sub.add_parser("ls", help="list live torchscope sessions on this machine")
    ls.add_argument(
        "--timeout", type=_seconds, default=0.5, help="seconds to wait for each session"
    )
    record = sub.add_parser("record", help="record a live session into a trace file")
    record.add_argument("target", nargs="?", help="pid or control endpoint (default: the only one)")
    record.add_argument("-o", "--output", required=True, help="trace file to write")
    record.add_argument(
        "--next",
        type=int,
        metavar="N",
        help="arm the job for its next N steps, record them, and let it go dormant again",
    )
    record.add_argument("--snapshot", type=int, default=10_000, help="recent events to start with")
    record.add_argument("--timeout", type=_seconds, default=2.0, help="seconds to wait for the job")
    record.add_argument("--quiet", action="store_true", help="no progress line")
    diff = sub.add_parser(
        "diff", help="compare two trace files: the first op or node where they diverge"
    )
    diff.add_argument("a", help="trace file A")
    diff.add_argument("b", help="trace file B")
    diff.add_argument("--rtol", type=float, default=1e-5, help="relative tolerance (1e-5)")
    diff.add_argument("--atol", type=float, default=1e-8, help="absolute tolerance (1e-8)")
    diff.add_argument(
        "--exact", action="store_true", help="bit for bit: any difference in stats or values"
    )
    diff.add_argument(
        "--strict-dtype",
        action="store_true",
        help="a float dtype change (float32 vs bfloat16) is a divergence too",
    )
    diff.add_argument("--step", help="only these steps (3, 0-9, 1,4,7-8)")
    export = sub.add_parser(
        "export", help="write a trace file as Perfetto/Chrome trace JSON, CSV or Parquet"
    )
    export.add_argument("file", help="trace file")
    export.add_argument("--format", choices=("perfetto", "csv", "parquet"), default="perfetto")
    export.add_argument("-o", "--output", required=True, help="file to write ('-': stdout)")
    export.add_argument(
        "--kind",
        help="csv/parquet: which rows (op, grad, step, alert, ..., or tensor: one per summary; "
        "default op)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "run":
            return cmd_run(parse_run(argv[1:]))
        args = build_parser().parse_args(argv)
        if args.command in ("tui", "replay"):  # several: ranks or recordings side by side
            args.target = args.targets[0] if args.targets else None
        if args.command == "dump":
            return cmd_dump(args)
        if args.command == "ls":
            return cmd_ls(args)
        if args.command == "tui" and args.web:
            return cmd_tui_web(args)
        if args.command == "diff":
            return cmd_diff(args)
        if args.command == "export":
            return cmd_export(args)
        if args.command in ("tui", "replay"):
            from torchscope.tui.targets import check_targets  # one rule, before the screen opens

            problem = check_targets(args.command, args.targets, wait=getattr(args, "wait", False))
            if problem:
                return _fail(problem)
            return cmd_tui(args)
        if args.command == "demo":
            return cmd_demo(args)
        if args.command == "keys":
            from torchscope.protocol.security import cli_keys

            return cli_keys(args)
        if args.command == "record":
            return cmd_record(args)
        if args.command == "attach":
            return cmd_attach(args)
        if args.command == "watch":
            return cmd_watch(args)
        build_parser().print_help()
        return 0 if not argv else 2
    except UsageError as exc:
        return _fail(str(exc))
