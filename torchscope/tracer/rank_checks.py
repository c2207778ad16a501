"""What the agent of one rank checks against the other ranks, through the job's c10d store.

- Endpoints: every rank puts its session record there once; a UI that reaches one rank finds
  the others through it (``ranks``).
- NaN/Inf origins: an origin found here is published; a value that *arrived* here through a
  collective is matched with the origin another rank published for that step.
- DDP replicas: at traced step boundaries each rank publishes a fingerprint of its parameters;
  ranks that differ are reported.

Nothing here blocks: each check asks the store once at a step boundary and tries again at the
next ones. Nothing is asked of the store in a single-process job.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from torchscope.analysis.render import with_short_source
from torchscope.protocol.events import ALERT, CONSEQUENCES, Event
from torchscope.tracer.ranks import RankFingerprints, RankOrigins, job_store, say_line, speaker

ORIGIN_LOOKUPS = 20  # step boundaries to look for another rank's origin of an arrival

# The agent's checks (one agent per process): the NaN watch, which reports outside any
# tracer, tells it of a NaN/Inf that arrived from another rank (``note_watch_arrival``).
_current: RankChecks | None = None


def note_watch_arrival(step: int, what: str) -> bool:
    """The watch found NaN/Inf at ``step`` that this rank's replay does not make: linked to
    the origin another rank publishes, as full tracing links it. False outside a job."""
    checks = _current
    if checks is None or checks._rank_origins() is None:
        return False
    checks.note_arrival(step, what, None, say=True)
    return True


def rank_alert(seq: int, step: int, what: str, where: str, name: str, message: str) -> Event:
    """An alert about the job as a whole (no event of this rank to point at)."""
    return Event(
        kind=ALERT,
        seq=seq,
        step=step,
        what=what,
        where=where,
        event_seq=None,
        name=name,
        source=None,
        message=message,
    )


def link_alert(
    seq: int,
    step: int,
    what: str,
    rank: int,
    at: int,
    origin: dict[str, Any],
    arrival: str | None,
) -> Event:
    """A NaN/Inf that arrived here at ``step`` (``arrival``: this rank's arrival alert),
    linked to the origin ``rank`` published (made at its step ``at``): named in that rank's
    own words, never as an origin of this rank. Readers fold it into the arrival
    (``torchscope.analysis.trace.fold_alerts``)."""
    noun = "NaN" if what == "nan" else "Inf"
    return Event(
        kind=ALERT,
        seq=seq,
        step=step,
        what=what,
        where="arrival",
        event_seq=None,
        name=f"rank {rank}",
        source=None,
        message=f"{noun} arrived from rank {rank}: {origin['message']}",
        arrival=arrival,
        from_rank=rank,
        linked_origin=origin.get("origin"),
        origin_step=at,
    )


class RankChecks:
    def __init__(self, emit: Callable[[Event], None], next_seq: Callable[[], int]) -> None:
        self._emit = emit
        self._next_seq = next_seq
        self._lock = threading.Lock()  # arrivals: the pipeline's thread and the boundary
        self._origins: RankOrigins | None = None  # shared NaN/Inf origins
        self._fingerprints: RankFingerprints | None = None  # DDP replicas compared
        self._fp_params: tuple[list, list] | None = None  # (DDP roots, their parameters)
        self._endpoint_shared = False
        self.rank_records: list[str] | None = None  # every rank's session record (JSON)
        # step -> (what, lookups left, arrival alert id, say it): NaN/Inf that arrived here
        self.arrivals: dict[int, tuple[str, int, str | None, bool]] = {}
        global _current
        _current = self

    # -- endpoints ---------------------------------------------------------------------------
    def share_endpoint(self, record: dict[str, Any]) -> None:
        """Under torchrun every rank puts its session record (endpoints, pid, host) in the
        job's c10d store once, and reads the others' back when all are there: a UI that
        reaches one rank, on any host, finds every rank through it (``ranks``)."""
        found = job_store()
        if found is None:
            return
        store, rank, world = found
        if not self._endpoint_shared:
            store.set(f"torchscope/endpoint/{rank}", json.dumps(record))
            self._endpoint_shared = True
        keys = [f"torchscope/endpoint/{r}" for r in range(world)]
        if store.check(keys):  # one round trip per step until every rank is there
            self.rank_records = [bytes(v).decode() for v in store.multi_get(keys)]

    def cmd_ranks(self, args: dict[str, Any], client: bytes) -> dict[str, Any]:
        if self.rank_records is None:
            raise ValueError(
                "this job's ranks are not all known yet (each rank registers at its first "
                "step boundary after the process group exists)"
            )
        return {"ranks": [json.loads(r) for r in self.rank_records]}

    # -- origins -------------------------------------------------------------------------------
    def _rank_origins(self) -> RankOrigins | None:
        if self._origins is None:
            found = job_store()
            if found is not None:
                self._origins = RankOrigins(*found)
        return self._origins

    def on_alert(self, alert: Event) -> None:
        """An alert of this rank: an origin is published for the other ranks; a value that
        arrived through a collective is matched with theirs at the next step boundaries."""
        if alert.get("where") == CONSEQUENCES:
            return
        origins = self._rank_origins()
        if origins is None:
            return
        if alert.get("arrived"):
            self.note_arrival(alert["step"], alert["what"], alert.get("arrival"))
        elif alert.get("origin") is not None:
            origins.publish(
                alert["step"],
                {
                    "origin": alert["origin"],
                    "what": alert["what"],
                    "message": alert["message"],
                    "source": alert.get("source"),
                },
            )

    def note_arrival(
        self, step: int, what: str, arrival: str | None = None, say: bool = False
    ) -> None:
        """NaN/Inf arrived here at ``step`` from another rank (``arrival``: the id of this
        rank's arrival alert, which the link names; ``say``: the link also goes to stderr,
        as the watch reports there): linked to that rank's origin at the next boundaries."""
        with self._lock:
            self.arrivals.setdefault(step, (what, ORIGIN_LOOKUPS, arrival, say))

    def match_arrivals(self) -> None:
        """At a step boundary: the origins other ranks have published for the steps where a
        NaN/Inf arrived here, as one link alert each (no waiting: asked again at later steps;
        the last time, an origin of an earlier step on that rank counts)."""
        if not self.arrivals:
            return
        origins = self._rank_origins()
        with self._lock:
            pending = dict(self.arrivals)
        for step, (what, left, arrival, say) in pending.items():
            found = origins.find(step, earlier=left <= 1) if origins is not None else []
            with self._lock:
                if found or left <= 1:
                    self.arrivals.pop(step, None)
                else:
                    self.arrivals[step] = (what, left - 1, arrival, say)
            for rank, at, origin in found[:1]:  # one origin per arrival: the lowest rank's
                alert = link_alert(self._next_seq(), step, what, rank, at, origin, arrival)
                self._emit(alert)
                if say:
                    said = with_short_source(alert["message"], origin.get("source"))
                    say_line(f"{speaker()}: {said}")

    # -- DDP replicas --------------------------------------------------------------------------
    def check_replicas(self, step: int, roots: list[Any]) -> None:
        """Traced DDP steps: publish this rank's parameter fingerprint and compare the other
        ranks' (see ranks.RankFingerprints); a difference is one alert per parameter set.
        ``roots``: the DDP-wrapped modules (FSDP2 ranks hold different shards by design)."""
        import torch

        if self._fingerprints is None:
            found = job_store()
            if found is None:
                return
            self._fingerprints = RankFingerprints(*found)
        fp = self._fingerprints
        cached = self._fp_params
        if cached is None or [r() for r in cached[0]] != roots:
            # Walking the modules for their parameters costs more than summing them: once per
            # armed period and set of DDP models (known by weak reference: a new model is seen).
            refs = [weakref.ref(ddp) for ddp in roots]
            cached = self._fp_params = (
                refs,
                [(n, p) for d in roots for n, p in d.named_parameters()],
            )
        named = cached[1]
        if not named:
            return
        with torch.no_grad(), torch._C.DisableTorchFunction():
            # One fused call for every parameter's norm (bit-identical replicas have
            # bit-identical norms), one host read.
            norms = torch._foreach_norm([p for _, p in named])
            try:
                values = torch.stack(norms).tolist()
            except RuntimeError:  # parameters of several dtypes
                values = [float(n) for n in norms]
        fp.publish(step, [n for n, _ in named], values)
        self.report_divergence()

    def forget_parameters(self) -> None:
        """Disarmed: the parameter lists are walked again when next armed."""
        self._fp_params = None

    def report_divergence(self, final: bool = False) -> None:
        fp = self._fingerprints
        if fp is None:
            return
        for at, rank, differ in fp.compare(final):
            shown = ", ".join(differ[:5]) + (
                f" and {len(differ) - 5} more" if len(differ) > 5 else ""
            )
            self._emit(
                rank_alert(
                    self._next_seq(),
                    at,
                    "diverged",
                    "ranks",
                    f"rank {rank}",
                    f"DDP replicas differ at the start of step {at}: {shown} "
                    f"on this rank (rank {fp.rank}) and rank {rank}",
                )
            )

    # -- the end of the job --------------------------------------------------------------------
    def last_word(self, seconds: float = 2.0) -> None:
        """At the end of the job, the other ranks' origins and fingerprints of the last steps
        get a short while to arrive."""
        fp = self._fingerprints
        deadline = time.monotonic() + seconds
        while (self.arrivals or (fp is not None and fp.pending)) and time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                self.match_arrivals()
                self.report_divergence(final=True)
            time.sleep(0.05)
