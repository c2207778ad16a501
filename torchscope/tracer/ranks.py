"""Ranks that meet before collectives, so a paused rank never makes the others time out.

A rank paused at a breakpoint (or by a UI) stops in Python. The other ranks would run on into
their next collective (DDP's gradient all-reduce inside ``backward()``, an explicit
``dist.all_reduce``), block there in C++, and die at the process group's timeout. So while
the command line holds every rank traced (``--break-on``, ``--wait``, ``--record`` under
torchrun: the same steps on every rank), each rank *meets* the others in the job's c10d store
before every top-level ``backward()`` and every explicit collective: it counts itself in
under a key named by the step and the meeting's number in that step, and waits, in Python,
until every rank has. A paused rank is simply late to the meeting; the others wait for it as
long as it takes, and say so on stderr. No collective starts until everybody is there.

Cost, paid only while traced with a gate: one store round trip per meeting plus the wait for
the slowest rank (which the collective that follows would have waited for anyway). Ranks
that a UI arms one by one are not gated: they may be traced at different steps, and a
meeting that one rank never attends would hang the other.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable
from typing import Any


def speaker() -> str:
    """Who says a line on stderr: ``torchscope``, or ``torchscope[rank N]`` under torchrun."""
    rank = os.environ.get("RANK", "")
    return f"torchscope[rank {rank}]" if rank.isdigit() else "torchscope"


def say_line(text: str) -> None:
    """One line on stderr in one write (ranks sharing a terminal must not interleave it);
    a closed or broken stderr is not the job's problem."""
    with contextlib.suppress(Exception):
        sys.stderr.write(text + "\n")
        sys.stderr.flush()


def say(text: str) -> None:
    say_line(f"{speaker()}: {text}")


def job_store() -> tuple[Any, int, int] | None:
    """(store, rank, world size) of a multi-rank job's default process group, or None
    (a single process, no process group yet, no store)."""
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        world = dist.get_world_size()
        if world < 2:
            return None
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store(), dist.get_rank(), world
    except Exception:
        return None


class RankOrigins:
    """Where a NaN/Inf was made, shared between ranks through the job's c10d store.

    A rank that finds an origin writes it under the step; a rank where the value only
    arrived (through a collective) looks for the others' origins of that step at its next
    step boundaries, without waiting: the other rank may deliver its alert later.
    """

    def __init__(self, store: Any, rank: int, world: int) -> None:
        self.store, self.rank, self.world = store, rank, world
        self._published: set[int] = set()

    def publish(self, step: int, message: str) -> None:
        if step in self._published:
            return  # the first origin of a step is the one that matters
        self._published.add(step)
        self.store.set(f"torchscope/origin/{step}/{self.rank}", message)

    def find(self, step: int) -> list[tuple[int, str]]:
        """Origins other ranks published for ``step`` so far: (rank, message)."""
        out = []
        for r in range(self.world):
            key = f"torchscope/origin/{step}/{r}"
            if r != self.rank and self.store.check([key]):
                out.append((r, self.store.get(key).decode(errors="replace")))
        return out


class RankFingerprints:
    """Whether DDP's replicas still agree: after every traced update, each rank publishes the
    sum of each parameter (one reduction per parameter, one host read per step) in the
    store, and compares the other ranks' sums for the same step when they are there (never
    waiting). DDP keeps replicas bit-identical, so any difference is a divergence: a rank
    that skipped an update, changed a weight by itself, or ran another code path.
    """

    def __init__(self, store: Any, rank: int, world: int) -> None:
        self.store, self.rank, self.world = store, rank, world
        # step -> (parameter names, own sums), not yet compared with every other rank's
        self._pending: dict[int, tuple[list[str], list[float]]] = {}
        self.reported = False

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def publish(self, step: int, names: list[str], sums: list[float]) -> None:
        import json

        self.store.set(f"torchscope/fp/{step}/{self.rank}", json.dumps(sums))
        self._pending[step] = (names, sums)
        while len(self._pending) > 16:  # ranks that never publish do not grow this
            self._pending.pop(next(iter(self._pending)))

    def compare(self) -> list[tuple[int, int, list[str]]]:
        """(step, other rank, parameters that differ) for the steps every rank published."""
        import json

        out = []
        for step, (names, mine) in list(self._pending.items()):
            keys = [f"torchscope/fp/{step}/{r}" for r in range(self.world) if r != self.rank]
            if not self.store.check(keys):
                continue
            del self._pending[step]
            for r in (r for r in range(self.world) if r != self.rank):
                theirs = json.loads(self.store.get(f"torchscope/fp/{step}/{r}"))
                differ = [n for n, a, b in zip(names, mine, theirs, strict=False) if a != b]
                if differ or len(theirs) != len(mine):
                    out.append((step, r, differ or ["(a different number of parameters)"]))
        return out


class RankGate:
    def __init__(self, store: Any, rank: int, world: int, say: Callable[[str], None]) -> None:
        self.store = store
        self.rank = rank
        self.world = world
        self.say = say
        self._step = -1
        self._n = 0
        self.meetings = 0
        self.waited = 0.0  # seconds spent waiting for other ranks (tests, benchmarks)

    @classmethod
    def for_job(cls, say: Callable[[str], None]) -> RankGate | None:
        """The gate of a multi-rank job's default process group, or None (single process,
        no process group yet, or no store to meet in)."""
        found = job_store()
        return cls(*found, say) if found is not None else None

    def meet(self, step: int, what: str) -> None:
        """Wait until every rank has reached this point of step ``step`` (never raises)."""
        if step != self._step:
            self._step, self._n = step, 0
        key = f"torchscope/gate/{step}/{self._n}"
        self._n += 1
        self.meetings += 1
        try:
            here = self.store.add(key, 1)
            if here >= self.world:
                return
            t0 = time.monotonic()
            said = False
            pause = 0.002
            while here < self.world:
                time.sleep(pause)
                pause = min(pause * 2, 0.05)
                here = self.store.add(key, 0)
                if not said and time.monotonic() - t0 > 0.5:
                    said = True
                    self.say(
                        f"waiting before {what} at step {step} for the other ranks "
                        f"({here} of {self.world} there; one may be paused)"
                    )
            self.waited += time.monotonic() - t0
            if said:
                self.say(f"all {self.world} ranks reached {what} at step {step}; going on")
        except Exception as exc:  # the store went away (the job is ending): do not hang
            with contextlib.suppress(Exception):
                self.say(f"rank meeting before {what} skipped: {type(exc).__name__}: {exc}")
