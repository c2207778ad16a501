"""Ranks that meet before collectives, so a paused rank never makes the others time out.

A rank paused at a breakpoint (or by a UI) stops in Python. The other ranks would run on into
their next collective (DDP's gradient all-reduce inside ``backward()``, an explicit
``dist.all_reduce``), block there in C++, and die at the process group's timeout. So while
the command line holds every rank traced (``--break-on``, ``--wait``, ``--record`` under
torchrun: the same steps on every rank), each rank *meets* the others in the job's c10d store
before every top-level ``backward()``, every explicit collective and every top-level module
call whose forward communicates (DDP's broadcast of buffers, FSDP's all-gathers: see
:mod:`~torchscope.tracer.forward_collectives`): it counts itself in under a key named by the
step and the meeting's number in that step, and waits, in Python, until every rank has. A
paused rank is simply late to the meeting; the others wait for it as long as it takes. A
paused rank tells the store where it stopped (:class:`RankPauses`), so a rank that waits says
at once which rank it waits for and where that one is paused, on stderr and in its stepper's
state (``waiting``). No collective starts until everybody is there.

Ranks that UIs arm (``torchscope tui`` on a torchrun job arms every rank) agree first on
the steps they meet in (:class:`AgreedPeriods`): the first rank armed proposes a start two
steps ahead in the store, every rank armed by then starts meeting at that step if all of
them are, and the first that lets go proposes an end two steps ahead, so no rank ever waits
for a meeting another rank will not attend.

Cost, paid only while traced with a gate: one store round trip per meeting plus the wait for
the slowest rank (which the collective that follows would have waited for anyway), and for
UI-armed ranks one more per traced step boundary. Nothing more while no rank is paused: the
store is asked who is paused only by a rank that waits, and told only by one that pauses. A
job where only some ranks are armed is not gated: a meeting that one rank never attends would
hang the other.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any, Protocol


def speaker() -> str:
    """Who says a line on stderr: ``torchscope``, or ``torchscope[rank N]`` under torchrun."""
    rank = os.environ.get("RANK", "")
    return f"torchscope[rank {rank}]" if rank.isdigit() else "torchscope"


def say_line(text: str) -> None:
    """One line on stderr in one write (ranks sharing a terminal must not interleave it);
    a closed or broken stderr is not the job's problem."""
    with contextlib.suppress(Exception):  # a broken stderr: not the job's problem
        sys.stderr.write(text + "\n")
        sys.stderr.flush()


def say(text: str) -> None:
    say_line(f"{speaker()}: {text}")


def env_int(name: str) -> int | None:
    """An integer environment variable (torchrun's RANK, WORLD_SIZE...), or None."""
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def job_id() -> str | None:
    """What every rank of one torchrun job shares (torchrun's run id, else the rendezvous
    address); None outside a multi-rank launch."""
    if env_int("WORLD_SIZE") is None or env_int("RANK") is None:
        return None
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        return run_id
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return f"{addr}:{port}" if addr and port else None


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
    except Exception:  # no c10d store: ranks cannot meet
        return None


def pg_timeout_seconds() -> float | None:
    """The default process group's timeout (what a rank left in a collective waits before it
    dies), or None: no process group, or a backend that does not say."""
    try:
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        pg = dist.distributed_c10d._get_default_group()
        for device in ("cuda", "cpu"):
            with contextlib.suppress(Exception):  # another backend: try the next
                return pg._get_backend(torch.device(device)).options._timeout.total_seconds()
    except Exception:  # a timeout we cannot read: none said
        pass
    return None


class RankOrigins:
    """Where a NaN/Inf was made, shared between ranks through the job's c10d store.

    A rank that finds an origin writes it under the step (its id, kind and words, as JSON:
    the other ranks name it in the same words); a rank where the value only arrived (through
    a collective) looks for the others' origins of that step at its next step boundaries,
    without waiting: the other rank may deliver its alert later. An origin of an earlier step
    counts too (a weight made NaN there, read by later collectives): each rank also keeps the
    steps it published under one key, ``origin-steps/<rank>``.
    """

    def __init__(self, store: Any, rank: int, world: int) -> None:
        self.store, self.rank, self.world = store, rank, world
        self._published: list[int] = []

    def publish(self, step: int, origin: dict[str, Any]) -> None:
        """``origin``: the origin alert's ``origin`` id, ``what``, ``message`` and ``source``."""
        if step in self._published:
            return  # the first origin of a step is the one that matters
        self._published.append(step)
        self.store.set(f"torchscope/origin/{step}/{self.rank}", json.dumps(origin))
        self.store.set(f"torchscope/origin-steps/{self.rank}", json.dumps(self._published))

    def find(self, step: int, earlier: bool = False) -> list[tuple[int, int, dict[str, Any]]]:
        """Origins other ranks published for ``step`` so far: (rank, its step, origin); with
        ``earlier``, a rank that has none for ``step`` gives its latest one before it."""
        out = []
        for r in range(self.world):
            if r == self.rank:
                continue
            at = step
            if not self.store.check([f"torchscope/origin/{step}/{r}"]):
                if not earlier:
                    continue
                before = [s for s in self._steps_of(r) if s < step]
                if not before:
                    continue
                at = max(before)
            raw = self.store.get(f"torchscope/origin/{at}/{r}").decode(errors="replace")
            try:
                origin = json.loads(raw)
            except ValueError:
                continue
            if isinstance(origin, dict) and isinstance(origin.get("message"), str):
                out.append((r, at, origin))
        return out

    def _steps_of(self, rank: int) -> list[int]:
        key = f"torchscope/origin-steps/{rank}"
        if not self.store.check([key]):
            return []
        try:
            steps = json.loads(self.store.get(key).decode(errors="replace"))
        except ValueError:
            return []
        return [s for s in steps if type(s) is int] if isinstance(steps, list) else []


class RankFingerprints:
    """Whether DDP's replicas still agree: after every traced update, each rank publishes the
    norm of each parameter (one fused reduction, one host read per step) in the store, and
    compares the other ranks' norms for the same step when they are there (never waiting).
    DDP keeps replicas bit-identical, so any difference is a divergence: a rank
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

    def publish(self, step: int, names: list[str], norms: list[float]) -> None:
        # repr: the shortest text that reads back as the same float
        self.store.set(f"torchscope/fp/{step}/{self.rank}", ",".join(map(repr, norms)))
        self._pending[step] = (names, norms)
        while len(self._pending) > 4 * self.COMPARE_EVERY:  # ranks that never publish
            self._pending.pop(next(iter(self._pending)))

    #: Steps published before they are compared, all in two store round trips: a divergence
    #: is reported up to this many steps late (always naming the step it happened in).
    COMPARE_EVERY = 4

    def compare(self, final: bool = False) -> list[tuple[int, int, list[str]]]:
        """(step, other rank, parameters that differ) for the steps every rank published;
        every ``COMPARE_EVERY`` steps (or ``final``: the job ends)."""
        if not self._pending or (len(self._pending) < self.COMPARE_EVERY and not final):
            return []
        others = [r for r in range(self.world) if r != self.rank]
        steps = list(self._pending)
        keys = [f"torchscope/fp/{step}/{r}" for step in steps for r in others]
        if not self.store.check(keys):  # some rank is late (or not traced): step by step
            steps = [
                s for s in steps if self.store.check([f"torchscope/fp/{s}/{r}" for r in others])
            ]
            keys = [f"torchscope/fp/{step}/{r}" for step in steps for r in others]
        if not steps:
            return []
        values = iter(self.store.multi_get(keys))
        out = []
        for step in steps:
            names, mine = self._pending.pop(step)
            for r in others:
                theirs = [float(v) for v in next(values).decode().split(",") if v]
                differ = [
                    n
                    for n, a, b in zip(names, mine, theirs, strict=False)
                    if a != b and not (a != a and b != b)  # NaN on both sides agrees
                ]
                if differ or len(theirs) != len(mine):
                    out.append((step, r, differ or ["(a different number of parameters)"]))
        return out


class PauseInWait(Protocol):
    """A UI's pause at a meeting of the ranks (the paused thread's side, tracer/armed)."""

    def asked(self) -> bool: ...  # a pause is pending (checked between looks, cheap)

    def hold(self) -> None: ...  # stop here until the UI lets go


class RankPauses:
    """Where each rank is paused, in the job's store: ``torchscope/paused/<rank>`` holds where
    it stopped ("" once it went on), and ``torchscope/paused/count`` how many are paused, so
    that a rank that waits asks one key while nobody is paused. A rank writes only when it
    pauses and when it goes on; a rank reads only while it waits for the others."""

    COUNT = "torchscope/paused/count"

    def __init__(self, store: Any, rank: int, world: int) -> None:
        self.store, self.rank, self.world = store, rank, world
        self._told = False

    @classmethod
    def for_job(cls) -> RankPauses | None:
        found = job_store()
        return cls(*found) if found is not None else None

    def tell(self, where: str | None) -> None:
        """This rank paused at ``where``; None: it went on (never raises)."""
        with contextlib.suppress(Exception):  # a store gone: the meeting waits on
            key = f"torchscope/paused/{self.rank}"
            if where is not None:
                self.store.set(key, where)
                if not self._told:
                    self._told = True
                    self.store.add(self.COUNT, 1)
            elif self._told:
                self._told = False
                self.store.set(key, "")
                self.store.add(self.COUNT, -1)

    def paused(self) -> dict[int, str]:
        """The other ranks paused now, and where (one round trip while none is)."""
        if self.store.add(self.COUNT, 0) <= 0:
            return {}
        out = {}
        for r in range(self.world):
            key = f"torchscope/paused/{r}"
            if r != self.rank and self.store.check([key]):
                where = self.store.get(key).decode(errors="replace")
                if where:
                    out[r] = where
        return out


#: What this process's rank waits for now (a meeting of the ranks), for its stepper's state:
#: ``before`` (the call), ``step``, ``here`` (ranks there), ``of`` (world size), ``paused``
#: (the other ranks paused, rank -> where). None while it waits for nobody.
WAITING: dict[str, Any] | None = None


def waiting() -> dict[str, Any] | None:
    return WAITING


class RankGate:
    #: Seconds between two looks at who is paused while a meeting waits.
    PAUSED_EVERY = 0.2

    def __init__(self, store: Any, rank: int, world: int, say: Callable[[str], None]) -> None:
        self.store = store
        self.rank = rank
        self.world = world
        self.say = say
        self._step = -1
        self._n = 0
        self.meetings = 0
        self.waited = 0.0  # seconds spent waiting for other ranks (tests, benchmarks)
        self.pauses = RankPauses(store, rank, world)

    @classmethod
    def for_job(cls, say: Callable[[str], None]) -> RankGate | None:
        """The gate of a multi-rank job's default process group, or None (single process,
        no process group yet, or no store to meet in)."""
        found = job_store()
        return cls(*found, say) if found is not None else None

    def meet(
        self,
        step: int,
        what: str,
        scope: str = "",
        pause: PauseInWait | None = None,
    ) -> None:
        """Wait until every rank has reached this point of step ``step`` (never raises).
        ``scope`` names the agreed period (UI-armed ranks) so its meetings are its own;
        ``pause``: a UI's pause asked while others are missing stops this rank in the wait."""
        global WAITING
        if step != self._step:
            self._step, self._n = step, 0
        key = f"torchscope/gate/{scope}{step}/{self._n}"
        self._n += 1
        self.meetings += 1
        try:
            here = self.store.add(key, 1)
            if here >= self.world:
                return
            t0 = time.monotonic()
            said = named = False
            looked = 0.0  # when the store was last asked who is paused
            sleep = 0.002
            while here < self.world:
                time.sleep(sleep)
                sleep = min(sleep * 2, 0.05)
                here = self.store.add(key, 0)
                if pause is not None and here < self.world and pause.asked():
                    here = self._paused_outside(key, pause)
                now = time.monotonic()
                if here < self.world and now - looked >= self.PAUSED_EVERY:
                    looked = now
                    paused = self._paused()
                    WAITING = {
                        "before": what, "step": step, "here": here, "of": self.world,
                        "paused": {str(r): w for r, w in paused.items()},
                    }  # fmt: skip
                    if paused and not named:
                        said = named = True  # at once: the reason is known
                        who = "; ".join(f"rank {r} is paused at {w}" for r, w in paused.items())
                        self.say(
                            f"waiting before {what} at step {step} for the other ranks "
                            f"({here} of {self.world} there): {who}"
                        )
                if not said and now - t0 > 0.5:
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
        finally:
            WAITING = None

    def _paused(self) -> dict[int, str]:
        """The other ranks paused now ({} when the store cannot say: the meeting goes on)."""
        try:
            return self.pauses.paused()
        except Exception:  # a store that cannot answer
            return {}

    def _paused_outside(self, key: str, pause: PauseInWait) -> int:
        """Pause with this rank counted out of the meeting, so that the others cannot complete
        it and run into the collective without it; counted in again after. Returns the
        count. When the last rank came since the look, the others may be gone on: no pause."""
        if self.store.add(key, -1) + 1 < self.world:
            with contextlib.suppress(Exception):  # never raises; the count comes back anyway
                pause.hold()
        return self.store.add(key, 1)


class JobUiSignal:
    """``--wait`` across ranks: the first UI that reaches any rank lets every rank go.

    torchrun hosts its c10d store before the workers start (``TORCHELASTIC_USE_AGENT_STORE``),
    so ranks still waiting before their first op, process group or not, can meet there: a
    rank whose UI came sets a key named by the job; the others poll for it while they wait.
    """

    def __init__(self, host: str, port: int, job: str) -> None:
        self.host, self.port, self.key = host, port, f"torchscope/{job}/ui-came"
        self._store: Any = None

    @classmethod
    def for_job(cls, job: str | None) -> JobUiSignal | None:
        """The signal of this torchrun job, or None (not under torchrun, or its store is not
        up before the workers)."""
        env = os.environ
        if job is None or env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
            return None
        port = env.get("MASTER_PORT", "")
        if not env.get("MASTER_ADDR") or not port.isdigit():
            return None
        return cls(env["MASTER_ADDR"], int(port), job)

    def _connected(self) -> Any:
        if self._store is None:
            import datetime

            from torch.distributed import TCPStore

            self._store = TCPStore(
                self.host,
                self.port,
                is_master=False,
                timeout=datetime.timedelta(seconds=5),
                wait_for_workers=False,
            )
        return self._store

    def came(self) -> bool:
        """Whether a UI reached some rank of the job (False when the store cannot answer)."""
        try:
            return bool(self._connected().check([self.key]))
        except Exception:  # a store that cannot answer
            return False

    def announce(self) -> None:
        with contextlib.suppress(Exception):  # a store gone: other ranks ask again
            self._connected().set(self.key, "1")


class AgreedPeriods:
    """When UI-armed ranks meet: periods of steps every rank agreed on through the store.

    Called at every step boundary of a rank that a UI holds or that is in a period
    (``at_boundary``), on the training thread. Period ``e`` lives under
    ``torchscope/period/e/``: ``start`` (the first proposal wins: the proposer's step + 2, so
    a rank one step ahead still reaches it), ``yes``/``no`` (who will be traced from
    ``start``), ``gated`` (the decision, taken once: every rank said yes), ``end`` (the first
    rank that lets go proposes its step + 2). Every rank reads the same values, so either all
    of them meet in a step or none does.
    """

    #: How long a rank at the agreed start waits for the others to say whether they come.
    JOIN_TIMEOUT = 10.0

    def __init__(self, store: Any, rank: int, world: int, say: Callable[[str], None]) -> None:
        self.store, self.rank, self.world, self.say = store, rank, world, say
        self.period = 0
        self.start: int | None = None
        self.end: int | None = None
        self.gated = False
        self.refused = False  # the last period went ungated: wait for a new arm to retry

    @classmethod
    def for_job(cls, say: Callable[[str], None]) -> AgreedPeriods | None:
        found = job_store()
        return cls(*found, say) if found is not None else None

    @property
    def scope(self) -> str:
        return f"p{self.period}/"

    def _key(self, name: str) -> str:
        return f"torchscope/period/{self.period}/{name}"

    def _agree(self, name: str, proposal: int) -> int:
        got = self.store.compare_set(self._key(name), "", str(proposal))
        return int(got.decode() if isinstance(got, bytes) else got)

    def retry(self) -> None:
        """A new UI armed this rank: worth another try after an ungated period."""
        self.refused = False

    def at_boundary(self, step: int, wanted: bool) -> bool:
        """Whether this rank meets the others during step ``step``; ``wanted``: a UI holds
        this rank traced. While this returns True the rank must stay traced."""
        if self.gated:
            return self._gated_boundary(step, wanted)
        if not wanted:
            if self.start is not None:  # it agreed to come, and nobody holds it any more
                self.store.add(self._key("no"), 1)
                self._next_period(refused=False)
            return False
        if self.refused:
            return False
        if self.start is None:
            self.start = self._agree("start", step + 2)
            if step > self.start:  # proposed while this rank was already further on
                self.store.add(self._key("no"), 1)
                self._next_period(refused=True)
                return False
        if step < self.start:
            return False
        self.store.add(self._key("yes"), 1)
        self.gated = self._decide(step) == 1
        if not self.gated:
            self._next_period(refused=True)
            return False
        self.say(f"all {self.world} ranks traced from step {step}: they meet before collectives")
        return True

    def _decide(self, step: int) -> int:
        t0 = time.monotonic()
        said = False
        # A rank that is not armed never answers, and goes on into the step's collectives:
        # waiting here must end well before they time out (that killed the job).
        pg = pg_timeout_seconds()
        limit = self.JOIN_TIMEOUT if pg is None else min(self.JOIN_TIMEOUT, pg / 3)
        while True:
            yes, no = self.store.add(self._key("yes"), 0), self.store.add(self._key("no"), 0)
            if yes + no >= self.world or time.monotonic() - t0 > limit:
                break
            if not said and time.monotonic() - t0 > 0.5:
                said = True
                self.say(f"waiting at step {step} for the other ranks to be armed too")
            time.sleep(0.01)
        return self._agree("gated", 1 if yes >= self.world else 0)

    def _gated_boundary(self, step: int, wanted: bool) -> bool:
        if self.end is None:
            if not wanted:
                self.end = self._agree("end", step + 2)
            elif self.store.check([self._key("end")]):
                self.end = int(self.store.get(self._key("end")).decode())
        if self.end is not None and step >= self.end:
            self._next_period(refused=False)
            return False
        return True

    def _next_period(self, *, refused: bool) -> None:
        self.period += 1
        self.start = self.end = None
        self.gated = False
        self.refused = refused
