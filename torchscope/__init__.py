"""torchscope: see every forward op and the gradient through every backward node, live.

Importing ``torchscope`` does not import torch; the tracer is loaded on first use so the UI
and the file readers run on machines without torch.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from torchscope.tracer.options import DEFAULT, Options
from torchscope.tracer.watch.stop import WatchStop

__version__ = "0.1.0"

if TYPE_CHECKING:
    from torchscope.analysis.trace import Trace
    from torchscope.tracer.agent import Agent
    from torchscope.tracer.armed.session import Tracer


def trace(
    record: str | os.PathLike | None = DEFAULT["record"],
    *,
    steps: str | int | None = DEFAULT["steps"],
    values: int = DEFAULT["values"],
    keep: bool | int = DEFAULT["keep"],
    optimizer_steps: bool = DEFAULT["optimizer_steps"],
    optimizer_ops: bool = DEFAULT["optimizer_ops"],
    live: bool | None = DEFAULT["live"],
    aten: bool | str | None = DEFAULT["aten"],
    eager_check: bool = DEFAULT["eager_check"],
) -> Tracer:
    """Trace the code in a ``with`` block on this thread.

    record: write a trace file there (nothing touches the disk without it).
    steps: which training steps to trace (``"0-9"``, ``5``, ``"every:100"``); default all.
    values: tensors with at most this many elements keep their values in the summary.
    keep: keep events in memory (``tr.ops``, ``tr.grads``); an int keeps only the newest N.
    optimizer_steps: advance the step index at every ``optimizer.step()``.
    optimizer_ops: also trace the ops inside ``optimizer.step()`` (off by default: they are
        many and rarely what you look for; a NaN the update writes into a weight is still
        reported, at the weight's next use). A step given a closure (LBFGS) is always
        traced: the closure runs the model.
    live: also stream to UIs (``torchscope ls``, ``torchscope tui PID``) and take their
        pause, step and breakpoint commands while the block runs (default: the
        ``TORCHSCOPE_LIVE=1`` environment variable). To make a whole job attachable instead,
        see ``serve()``.
    aten: also record every aten call under the ops and backward nodes (``True``), or only
        those inside modules whose path matches this regular expression; off by default.
    eager_check: run each call of a ``torch.compile``'d module once more eagerly (same
        inputs and RNG state, traced) and report how its outputs and gradients differ from
        the compiled ones; the job keeps the compiled results.
    """
    from torchscope.tracer import api

    options = Options.for_trace(
        record=record,
        steps=steps,
        values=values,
        keep=keep,
        optimizer_steps=optimizer_steps,
        optimizer_ops=optimizer_ops,
        live=live,
        aten=aten,
        eager_check=eager_check,
    )
    return api.trace(options)


def step(n: int | None = None) -> None:
    """Mark the end of a training step, for loops that do not call ``optimizer.step()``.

    ``step(n)`` instead numbers the current step ``n`` (a job resumed from a checkpoint at
    step n), and the count goes on from there (works with optimizer steps too). Once a
    script calls ``step()``, a ``backward()`` no longer ends a step by itself.
    """
    from torchscope.tracer import api

    api.step(n)


def serve(
    *,
    steps: str | int | None = DEFAULT["steps"],
    record: str | os.PathLike | None = DEFAULT["record"],
    break_on: str | list[str] | tuple[str, ...] = DEFAULT["break_on"],
    wait: bool = DEFAULT["wait"],
    hold: bool = DEFAULT["hold"],
    lease: float = DEFAULT["lease"],
    values: int = DEFAULT["values"],
    optimizer_ops: bool = DEFAULT["optimizer_ops"],
    aten: bool | str | None = DEFAULT["aten"],
    eager_check: bool = DEFAULT["eager_check"],
    quiet: bool = DEFAULT["quiet"],
    watch: str | None = DEFAULT["watch"],
    on_nan: str = DEFAULT["on_nan"],
    on_spike: str = DEFAULT["on_spike"],
    max_skips: int = DEFAULT["max_skips"],
    history: bool = DEFAULT["history"],
    log: Any = DEFAULT["log"],
    edit: Any = DEFAULT["edit"],
    eval_budget: float = DEFAULT["eval_budget"],
) -> Agent:
    """Make this job attachable: ``torchscope tui PID`` or ``torchscope record PID`` can arm it.

    One line at the top of a training script, for jobs started by any launcher. Dormant, it
    only counts steps (no mode, no hooks, near-zero cost) and serves a private control
    endpoint (see ``torchscope ls``). The options are those of ``torchscope run``: with
    ``steps``, ``record``, ``break_on`` or ``wait`` the job is armed for those steps, then goes
    dormant again. The agent stops when the interpreter exits.

    A second call (a notebook's later cell) returns the running agent and applies what can
    change while it runs: ``watch``, ``on_nan``, ``on_spike`` and ``max_skips`` at once
    (turned on, off, or another policy), ``eval_budget`` for the next expression, the
    tracing options (``values``, ``aten``...) from the next traced step; it says in one
    line on stderr which options cannot change (``record``, ``steps``, ``break_on``...).
    Under ``torchscope run`` the command line's options hold; only the options this call sets
    apply. The same options again change nothing.

    ``watch="nan"`` (or ``"gradnorm:X"``) checks every step before the update for NaN/Inf
    gradients and loss, for about one fused reduction and one host sync per step, and
    replays a bad step traced to name its origin; ``on_nan`` is then ``"continue"``,
    ``"pause"``, ``"stop"`` (raises ``torchscope.WatchStop`` from
    ``optimizer.step()``, before the update) or ``"skip"`` (refuses the bad update, as a
    ``GradScaler`` skips an overflowed step: weights and optimizer state stay as they were,
    training goes on; after ``max_skips`` bad steps in a row the next one stops the job as
    ``"stop"`` does). ``watch="nan,spike"`` also catches a loss spike (the loss or the gradient
    norm far above the run's recent steps, from the same read: no extra sync) before the
    update; ``on_spike`` is then one of the same policies (``"pause"`` goes on as
    ``"continue"``). A stop that nothing catches ends the job as
    ``torchscope run`` does: one line, exit code 3, no traceback; in a notebook the cell ends
    with a one-line ``WatchStop`` error and the kernel goes on (the update was not made).

    ``history`` (on by default) keeps the run's history: every step's loss (the root of the
    step's top-level ``backward()``), traced or not, and with ``watch`` the global and
    per-module gradient norms, in bounded memory and with no host sync per step. A UI that
    attaches late shows the whole run (its step list, the ``H`` plot), ``torchscope history
    PID`` prints it, ``arm`` conditions (``when="loss>X"``) test it, and a ``record`` file
    carries it as ``history`` events (``torchscope dump FILE --kind history``).
    ``history=False`` keeps none of it: no loss is read at all.

    ``log=(SPEC, EXPR)`` (or a list of pairs) prints EXPR at every hit of the breakpoint
    SPEC without pausing (a logpoint: one stderr line and a ``log`` event per hit);
    ``edit=(SPEC, EXPR)`` replaces a tensor at every hit (an op's output, a node's
    ``grad_inputs[0]``; ``"grad_inputs[1] = EXPR"`` names another). EXPR is Python run in the
    job, as in pdb: ``edit=("node:^DivBackward0$", "grad_inputs[0] * 2")``.
    ``eval_budget`` is how many seconds such an expression (and one a UI or an agent asks
    at a pause) may run before it is interrupted: the job is then as it was before it.
    """
    from torchscope.tracer import api

    options = Options.for_serve(
        steps=steps,
        record=record,
        break_on=break_on,
        wait=wait,
        hold=hold,
        lease=lease,
        values=values,
        optimizer_ops=optimizer_ops,
        aten=aten,
        eager_check=eager_check,
        quiet=quiet,
        watch=watch,
        on_nan=on_nan,
        on_spike=on_spike,
        max_skips=max_skips,
        history=history,
        log=log,
        edit=edit,
        eval_budget=eval_budget,
    )
    return api.serve(options)


def load(path: str | os.PathLike) -> Trace:
    """Read a trace file back as the same ``Event`` records ``trace()`` produces."""
    from torchscope.analysis.trace import load_trace

    return load_trace(path)


def __getattr__(name: str) -> Any:
    if name == "Tracer":
        from torchscope.tracer.armed.session import Tracer

        return Tracer
    raise AttributeError(f"module 'torchscope' has no attribute {name!r}")


__all__ = ["Options", "WatchStop", "__version__", "load", "serve", "step", "trace"]
