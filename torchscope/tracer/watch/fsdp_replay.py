"""The replay of a bad step under FSDP: every rank replays it together, or none does.

An FSDP module's forward all-gathers its parameters: a rank that replayed it alone would wait
in those collectives for ranks that never come, until the process group's timeout kills the
job. So at a detection each rank says in the job's c10d store whether it will replay the step
(:func:`agree`), and waits, for a bounded time, for every rank's word: all of them replay
together only when every rank said yes. The ranks then run the same module calls in the same
order, so the same all-gathers pair up.

What a replay on N ranks needs: every rank to find the same step bad (a NaN that reaches the
loss makes nearly every gradient non-finite, and FSDP's reduce-scatter carries it to every
rank's shard; a NaN in a few gradient elements can stay in one rank's shard), the same
top-level calls captured on each, and nothing but a store round trip per rank when they
agree. What it costs: nothing on a healthy step; at a detection, one store write and one wait
for the slowest rank's check. When a rank does not come within the wait (it found the step
finite, or its own loop code named the origin without a replay), nobody replays and each rank
says so.

The replay's forward runs under ``no_grad``: FSDP's forward then registers no backward hooks,
and no reduce-scatter can write a gradient. Forward origins are named; a backward-only origin
inside an FSDP module is not. Afterwards every FSDP module is resharded, as after a training
forward and backward (the root keeps its parameters unsharded after a forward, and the update
that follows would leave that copy stale).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

from torch import nn

from torchscope.tracer.armed.modules import is_fsdp2
from torchscope.tracer.ranks import job_store, pg_timeout_seconds

# The longest a rank waits for the others' word: well under any process group's timeout.
MAX_WAIT = 60.0


def agree(step: int, replaying: bool, say: Callable[[str], None]) -> str | None:
    """Say whether this rank replays ``step`` and wait for every rank's word. Returns None
    when every rank replays it, else why not (one clause)."""
    found = job_store()
    if found is None:
        return "there is no process group to replay it with"
    store, rank, world = found
    key = f"torchscope/fsdp-replay/{step}"
    store.set(f"{key}/{rank}", "1" if replaying else "0")
    if not replaying:
        return "this rank named it without a replay"
    timeout = pg_timeout_seconds()
    wait = min(MAX_WAIT, timeout / 2) if timeout else MAX_WAIT
    say(f"waiting up to {wait:.0f} s for every rank to replay step {step} together (FSDP)")
    keys = [f"{key}/{r}" for r in range(world)]
    try:
        store.wait(keys, datetime.timedelta(seconds=wait))
    except Exception:  # a timeout or a store gone
        return f"not every rank found step {step} bad within {wait:.0f} s"
    words = [store.get(k) for k in keys]
    if any(w != b"1" for w in words):
        return "another rank named it without a replay"
    return None


def reshard(modules: list[nn.Module]) -> None:
    """Every FSDP module in ``modules`` (and under them) back to its sharded parameters."""
    for top in modules:
        for m in top.modules():
            if is_fsdp2(m):
                m.reshard()  # type: ignore[operator]
