"""The terminal UI's commands: ``tui`` (live jobs or trace files, several side by side),
``replay``, ``tui --web`` and ``demo``."""

from __future__ import annotations

import argparse
import os
import sys

from torchscope.cli.common import fail


def cmd_tui(args: argparse.Namespace) -> int:
    from torchscope.tui.app import run_tui
    from torchscope.tui.sources.base import SourceError
    from torchscope.tui.sources.open import follows_job, open_sources

    try:
        # trace files, a pid or endpoint, or the only live session; a rank: its whole job
        sources, first = open_sources(args.targets)
    except SourceError as exc:
        return fail(str(exc))
    follow = follows_job(args.targets, sources)
    return run_tui(
        sources,
        first=first,
        follow_job=follow,
        max_events=args.max_events,
        at_origin=not args.from_start,
    )


def cmd_tui_web(args: argparse.Namespace) -> int:
    from torchscope.cli.web import WebError, serve

    if len(args.targets) > 1:
        return fail("--web opens one target (several side by side: the terminal UI)")
    from torchscope.tui.targets import target_problem  # the terminal UI's rules, no terminal

    problem = target_problem("tui", args.target, getattr(args, "wait", False))
    if problem:
        return fail(problem)
    if args.target and os.path.isfile(args.target):  # a bad file fails here, not in each tab
        from torchscope.protocol.tracefile import TraceFileError, TraceReader

        try:
            TraceReader(args.target).close()
        except TraceFileError as exc:
            return fail(f"{args.target}: {exc}")
    try:
        return serve(args.target, host=args.host, port=args.port, max_events=args.max_events)
    except WebError as exc:
        return fail(str(exc))


def cmd_demo(args: argparse.Namespace) -> int:
    """The terminal UI on a simulated job (no torch): try every key before wiring a real one."""
    for name, stream in (("output", sys.stdout), ("input", sys.stdin)):
        try:
            tty = stream.isatty()
        except (AttributeError, ValueError):
            tty = False
        if not tty:
            return fail(f"the demo is the terminal UI, and its {name} is not a terminal")
    from torchscope.tui.demo.demo import run_demo

    return run_demo()
