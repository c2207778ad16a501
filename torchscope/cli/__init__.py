"""The ``torchscope`` command line: every command's arguments (:func:`build_parser`) and where
each goes (:func:`main`). The command bodies live by what they act on:

- :mod:`~torchscope.cli.run`: ``run``, a script under the agent;
- :mod:`~torchscope.cli.live`: ``ls``, ``record``, ``watch``, ``attach``: a running job
  (:mod:`~torchscope.cli.attach`: how ``attach`` gets into one;
  :mod:`~torchscope.cli.history`: ``history``, its loss and gradient-norm history);
- :mod:`~torchscope.cli.ui`: ``tui``, ``replay``, ``tui --web``, ``demo``: the terminal UI
  (:mod:`~torchscope.cli.web`: its browser server);
- :mod:`~torchscope.cli.files`: ``dump``, ``diff``, ``export``: trace files;
- ``mcp``: the same for coding agents, an MCP server (:mod:`torchscope.mcp`);
- :mod:`~torchscope.cli.common`: the one-line errors they share.

Every user mistake ends in one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from torchscope import __version__
from torchscope.cli.common import Parser, UsageError, fail, seconds
from torchscope.cli.files import cmd_diff, cmd_dump, cmd_export
from torchscope.cli.history import FORMATS, cmd_history
from torchscope.cli.live import cmd_attach, cmd_ls, cmd_record, cmd_watch
from torchscope.cli.run import cmd_run, parse_run
from torchscope.cli.ui import cmd_demo, cmd_tui, cmd_tui_web
from torchscope.protocol.events import KINDS
from torchscope.protocol.policies import POLICIES

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="torchscope", description="Live step-through debugger for PyTorch.")
    parser.add_argument("--version", action="version", version=f"torchscope {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.add_parser("run", help="run a script traced (see 'torchscope run --help')", add_help=False)
    dump = sub.add_parser("dump", help="print the events of a trace file")
    dump.add_argument("file", help="trace file written by --record")
    dump.add_argument("--format", choices=("text", "jsonl"), default="text")
    dump.add_argument(
        "--kind", action="append", choices=KINDS, help="only events of this kind (repeatable)"
    )
    dump.add_argument("--step", type=int, help="only events of this step")
    dump.add_argument(
        "--aten",
        action="store_true",
        help="a nested log: each op and backward node with its aten calls (run --aten)",
    )
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
        tui.add_argument(
            "--from-start",
            action="store_true",
            help="open a recording at its first step (default: paused at its first NaN/Inf "
            "origin, when it has one)",
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
                help="serve the UI to a browser "
                "(textual-serve: pip install 'torchscope-debugger[web]')",
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
    attach.add_argument("--timeout", type=seconds, default=10.0, help="seconds to wait for it")
    watch = sub.add_parser(
        "watch", help="switch the NaN watch of a running job on or off (see 'run --watch')"
    )
    watch.add_argument("target", nargs="?", help="pid or control endpoint (default: the only one)")
    watch.add_argument(
        "--spec", default="nan", help="nan, gradnorm:X, spike or a comma list (default nan)"
    )
    watch.add_argument("--on-nan", default="continue", choices=POLICIES, help="policy")
    watch.add_argument("--on-spike", choices=POLICIES, help="policy after a loss spike")
    watch.add_argument(
        "--max-skips",
        type=int,
        metavar="N",
        help="with --on-nan skip: after N bad steps in a row the next one stops the job (5)",
    )
    watch.add_argument("--off", action="store_true", help="stop watching")
    watch.add_argument("--timeout", type=seconds, default=2.0, help="seconds to wait for the job")
    history = sub.add_parser(
        "history", help="a running job's loss (and, with the watch, gradient norm) per step"
    )
    history.add_argument(
        "target", nargs="?", help="pid or control endpoint (default: the only one)"
    )
    history.add_argument(
        "--format", choices=FORMATS, default="table", help="table (default), csv or jsonl"
    )
    history.add_argument("--since", type=int, metavar="STEP", help="only the steps after STEP")
    history.add_argument("--last", type=int, metavar="N", help="only the newest N steps")
    history.add_argument("--timeout", type=seconds, default=2.0, help="seconds to wait for the job")
    ls = sub.add_parser("ls", help="list live torchscope sessions on this machine")
    ls.add_argument("--timeout", type=seconds, default=0.5, help="seconds to wait for each session")
    record = sub.add_parser("record", help="record a live session into a trace file")
    record.add_argument("target", nargs="?", help="pid or control endpoint (default: the only one)")
    record.add_argument("-o", "--output", required=True, help="trace file to write")
    record.add_argument(
        "--next",
        type=int,
        metavar="N",
        help="arm the job for its next N steps, record them, and let it go dormant again",
    )
    record.add_argument(
        "--aten",
        nargs="?",
        const="",
        metavar="MODULE_REGEX",
        help="also record every aten call in the steps it arms (only inside matching modules)",
    )
    record.add_argument(
        "--eager-check",
        action="store_true",
        help="in the steps it arms, run each torch.compile'd module's call once more eagerly "
        "and report how its outputs and gradients differ from the compiled ones",
    )
    for action, what in (
        ("log", "print EXPR at every hit of COND without pausing (a logpoint)"),
        ("edit", "replace a tensor with EXPR at every hit of COND (an op's output, a node's "
         "grad_inputs[0])"),
    ):  # fmt: skip
        record.add_argument(
            f"--{action}",
            nargs=2,
            action="append",
            default=[],
            metavar=("COND", "EXPR"),
            help=f"{what}, in the steps it records; EXPR is Python run in the job (repeatable)",
        )
    record.add_argument("--snapshot", type=int, default=10_000, help="recent events to start with")
    record.add_argument("--timeout", type=seconds, default=2.0, help="seconds to wait for the job")
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
    diff.add_argument("--step", help="only these steps (3, 0-9, 1,4,7-8; A's numbers)")
    diff.add_argument(
        "--align",
        choices=("step", "relative"),
        default="step",
        help="pair steps by number (default), or by position in each recording: two windows "
        "of one job (steps 1290-1292 against 1298-1300)",
    )
    sub.add_parser(
        "mcp",
        help="serve the debugger to coding agents: an MCP server over stdio "
        "(pip install 'torchscope-debugger[mcp]')",
    )
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


def cmd_mcp() -> int:
    """``torchscope mcp``: the MCP server on stdin/stdout (the SDK is an optional extra)."""
    try:
        from torchscope.mcp.server import main as serve
    except ImportError as exc:
        if (exc.name or "").split(".")[0] not in ("mcp", "mcp_types", "pydantic", "anyio"):
            raise
        return fail(
            "torchscope mcp needs the MCP SDK (mcp 2.3+): pip install 'torchscope-debugger[mcp]'"
        )
    return serve()


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
                return fail(problem)
            return cmd_tui(args)
        if args.command == "demo":
            return cmd_demo(args)
        if args.command == "keys":
            from torchscope.cli.keys import cmd_keys

            return cmd_keys(args)
        if args.command == "record":
            return cmd_record(args)
        if args.command == "attach":
            return cmd_attach(args)
        if args.command == "watch":
            return cmd_watch(args)
        if args.command == "history":
            return cmd_history(args)
        if args.command == "mcp":
            return cmd_mcp()
        build_parser().print_help()
        return 0 if not argv else 2
    except UsageError as exc:
        return fail(str(exc))
