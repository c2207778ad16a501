"""``serve()`` on a job that is served already: apply what can change while it runs, say what
cannot.

A notebook serves its kernel in one cell and asks for the watch in a later one; a script under
``torchscope run`` calls ``serve()`` too; a framework callback serves at the start of training.
A second call used to return the running agent unchanged, so ``serve(watch="nan",
on_nan="stop")`` in a later cell did nothing, silently.

What the call asks for: after a first ``serve()``, every option as this call states it (the
cell run again says what the job should do now: ``serve()`` with no watch turns it off); under
the command line (``torchscope run``, ``attach``), whose options hold, only the options the
call sets to something else than ``serve()``'s defaults. What applies:

- ``watch``, ``on_nan`` and ``max_skips``: at once when called on the training thread (as a
  first ``serve()`` installs the watch), else at the job's next ``backward()``; the agent
  says so itself;
- ``values``, ``optimizer_ops``, ``aten``, ``eager_check``: read when tracing starts, so from
  the next traced step; ``quiet`` and ``eval_budget`` (for the next expression asked) at once;
- the others (``record``, ``steps``, ``break_on``, ``wait``, ``hold``, ``lease``,
  ``history``) were set up when the job started: named in one line as not applied.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING

from torchscope.tracer.options import Options
from torchscope.tracer.ranks import say

if TYPE_CHECKING:
    from torchscope.tracer.agent import Agent

WATCH = ("watch", "on_nan", "on_spike", "max_skips")
AT_ARMING = ("values", "optimizer_ops", "aten", "eager_check", "quiet")
AT_ONCE = ("eval_budget",)  # the stepper's: read by each expression as it starts
FIXED = ("record", "steps", "breakpoints", "wait", "hold", "lease", "history")
KEYWORD = {"breakpoints": "break_on"}  # Options' names that are not serve()'s
FIELD = {keyword: name for name, keyword in KEYWORD.items()}


def serve_again(agent: Agent, wanted: Options, only: Iterable[str] | None = None) -> None:
    """Bring the running ``agent`` to the options of a second ``serve()`` where it can;
    ``only``: the keywords a framework callback was given (it asks for nothing else)."""
    asked = _asked(agent, wanted)
    if only is not None:
        asked &= {FIELD.get(name, name) for name in only}
    if not asked:
        return  # the same options: idempotent, nothing said
    opts = agent.options
    if asked & set(WATCH):
        running, on_nan = agent.watch_setting()
        spec = wanted.watch if "watch" in asked else running
        on_nan = wanted.on_nan if "on_nan" in asked else on_nan
        for name in ("max_skips", "on_spike"):
            if name in asked:
                setattr(opts, name, getattr(wanted, name))  # read when the watch (re)starts
        if spec is None and running is None:
            opts.on_nan = on_nan  # no watch to act on it: the policy waits for one
        else:
            agent.request_watch(spec, on_nan, now=True)
    if "eval_budget" in asked:
        opts.eval_budget = wanted.eval_budget
        if agent.stepper is not None:
            agent.stepper.eval_budget = wanted.eval_budget
    later = [name for name in AT_ARMING if name in asked]
    for name in later:
        setattr(opts, name, getattr(wanted, name))
    tracing = [name for name in later if name != "quiet"]
    fixed = [KEYWORD.get(name, name) for name in FIXED if name in asked]
    if opts.quiet or not (tracing or fixed):
        return  # the watch's switch is said by the agent, as it happens
    parts = ["this job is already served"]
    if tracing:
        parts.append(f"{', '.join(tracing)} apply from its next traced step")
    if fixed:
        parts.append(f"{', '.join(fixed)} cannot change while it runs (they stay as first served)")
    say("; ".join(parts))


def _asked(agent: Agent, wanted: Options) -> set[str]:
    """The options (Options' names) this call sets otherwise than the job has them."""
    from torchscope.protocol.tracefile import per_rank_path

    current = dataclasses.replace(agent.options)
    current.watch, current.on_nan = agent.watch_setting()
    if wanted.record is not None:
        wanted = dataclasses.replace(wanted, record=per_rank_path(wanted.record))
    defaults = Options()
    asked = set()
    for name in (*WATCH, *AT_ARMING, *AT_ONCE, *FIXED):
        value = getattr(wanted, name)
        if value == getattr(current, name):
            continue
        if not agent.options.by_serve and value == getattr(defaults, name):
            continue  # the command line's options hold where the call says nothing
        asked.add(name)
    return asked
