"""How a job that the NaN watch stopped (``on_nan="stop"``) ends: the same way wherever it runs.

The watch raises :class:`~torchscope.WatchStop` from
``optimizer.step()``, before the update, and the job's code lets it through (a framework's
``train()``/``fit()`` included). Then:

- under ``torchscope run``: one line, exit code 3, no traceback (``cli/run.py``);
- a plain script that called ``serve()`` (itself, or through a framework callback): the same
  line and exit code, from ``sys.excepthook`` (the job's own hook still sees every other
  error);
- a notebook (any IPython shell): the kernel must live on, and the cell ends with a one-line
  error instead of a traceback through the framework's loop; the next cell runs as usual.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, NoReturn

# How each place names the policy that stopped the job ("stop", or "skip" at its limit), and
# its option (on_nan, or on_spike for a loss spike).
RUN_POLICY = "--{dashed} {policy}"
SERVE_POLICY = '{option}="{policy}"'

_installed = False


def stopped(exc: Any, policy: str) -> str:
    """What the watch did (``exc``: a ``WatchStop``): ``stopped before the update of step 3
    (on_nan="stop")``; ``policy``: how this place spells it (``RUN_POLICY``)."""
    option = getattr(exc, "option", "on_nan")
    named = policy.format(
        option=option, dashed=option.replace("_", "-"), policy=getattr(exc, "policy", "stop")
    )
    return f"stopped before the update of step {exc.detection.get('step')} ({named})"


def report_stop(exc: Any, policy: str, quiet: bool) -> int:
    """Say the one line (unless ``quiet``); the exit code the job ends with."""
    code = int(exc.exit_code)
    if not quiet:
        print(f"torchscope: {stopped(exc, policy)}; exit code {code}", file=sys.stderr, flush=True)
    return code


def install() -> None:
    """End a stopped job as ``torchscope run`` does, from here on (idempotent): in a notebook
    with a one-line error for the cell, elsewhere with the line and exit code 3."""
    global _installed
    if _installed:
        return
    from torchscope.tracer.notebook import shell

    ip = shell()
    if ip is not None:
        _installed = _in_shell(ip)
        return
    previous = sys.excepthook

    def excepthook(etype: type[BaseException], value: BaseException, tb: Any) -> None:
        try:
            code = report_stop(value, SERVE_POLICY, _quiet()) if _is_stop(value) else None
        except Exception:  # never in the way of the job's own error report
            code = None
        if code is not None:
            _exit(code)
        previous(etype, value, tb)

    sys.excepthook = excepthook
    _installed = True


def _in_shell(ip: Any) -> bool:
    """IPython shows a custom handler's exceptions as it is told; only one such handler fits
    in a shell: one the user set stays (and shows a WatchStop as it likes)."""
    from torchscope.tracer.watch.stop import WatchStop

    if getattr(ip, "custom_exceptions", ()):
        return False

    def handler(shell: Any, etype: type, value: BaseException, tb: Any, tb_offset: Any = None):
        cell = [f"WatchStop: torchscope {stopped(value, SERVE_POLICY)}: the update was not made"]
        shell._showtraceback(etype, value, cell)  # the cell's error, as IPython shows any
        return cell

    try:
        ip.set_custom_exc((WatchStop,), handler)
    except Exception:  # an IPython without custom handlers: the plain traceback shows instead
        return False
    return True


def _is_stop(value: BaseException) -> bool:
    from torchscope.tracer.watch.stop import WatchStop

    return isinstance(value, WatchStop)


def _quiet() -> bool:
    from torchscope.tracer.agent import current_agent

    agent = current_agent()
    return agent is not None and bool(agent.options.quiet)


def _exit(code: int) -> NoReturn:
    """Python ends a job that an exception stopped with status 1, whatever hook shows it. Do
    what its exit does (wait for the job's threads, run the atexit handlers: the trace file's
    index, the registry entry, the DataLoader workers), then leave with ``code``."""
    import atexit
    import threading

    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        # Leaving the job: each part is tried, none may keep the process from exiting.
        with contextlib.suppress(Exception):
            shutdown()
    with contextlib.suppress(Exception):  # exiting regardless
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # exiting regardless
            stream.flush()
    os._exit(code)
