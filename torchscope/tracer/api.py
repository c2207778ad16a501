"""What ``torchscope.trace()``, ``serve()`` and ``step()`` do, once their options are checked
(:class:`~torchscope.tracer.options.Options`): the package's top level only states the API.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchscope.tracer.agent import Agent
    from torchscope.tracer.armed.session import Tracer
    from torchscope.tracer.options import Options


def trace(options: Options) -> Tracer:
    """A tracer for a ``with`` block on this thread (not started)."""
    from torchscope.tracer.armed.session import Tracer

    return Tracer(
        options.record,
        steps=options.steps,
        values=options.values,
        keep=options.keep,
        optimizer_steps=options.optimizer_steps,
        optimizer_ops=options.optimizer_ops,
        live=options.live,
        aten=options.aten,
        eager_check=options.eager_check,
    )


def serve(options: Options) -> Agent:
    """Start this process's agent with ``options``, or bring the running one to them where it
    can (a second ``serve()``: see :mod:`~torchscope.tracer.served_again`)."""
    import atexit

    from torchscope.tracer import job_end
    from torchscope.tracer.agent import Agent, current_agent
    from torchscope.tracer.served_again import serve_again

    job_end.install()  # a stop ends the job as `torchscope run` ends it
    running = current_agent()
    if running is not None:
        serve_again(running, options)
        return running
    agent = Agent(options).start()
    atexit.register(agent.stop)
    if not options.quiet:
        held = options.held_steps()
        what = f"tracing steps {held.text}" if held else "dormant"
        if options.watch:
            from torchscope.tracer.watch.report import watching_words

            words = watching_words(options.watch, options.on_nan, options.on_spike)
            what += f", watching every step ({words})"
        attach = f"; attach: torchscope tui {os.getpid()}" if agent.publisher else ""
        print(f"torchscope: serving this job, {what}{attach}", file=sys.stderr)
    return agent


def step(n: int | None = None) -> None:
    """End the current step (``n`` None) or number it ``n``, on the clock of whatever drives
    this process's steps (see :func:`~torchscope.tracer.agent.current_clock`)."""
    from torchscope.tracer.agent import current_clock

    clock = current_clock()
    if clock is None:
        return
    if n is None:
        clock.advance()
    else:
        clock.set_step(n)
