"""The dormant agent: what runs in a job for its whole life, so a UI can attach at any time.

``torchscope run`` and ``torchscope.serve()`` start one per process. Dormant, it costs close to
nothing: no mode on the stack, no module or node hooks, no events. It keeps

- the step clock (global optimizer hooks; after ``backward()`` for jobs without an optimizer),
  so the job's steps are numbered from its start whether or not they are traced;
- the control endpoint and the registry entry (``torchscope ls``, ``tui PID``, ``record PID``),
  served by the publisher's thread, which wakes a few times a second, never per step;
- the stepper (breakpoints and pauses outlive an armed period: a breakpoint set on a dormant
  job hits in its next traced step).

Tracing is *held*: by the command line (``--record``, ``--steps``, ``--break-on``, ``--wait``:
the steps they select), by a UI (while its lease lasts: any request renews it), or by
``record --next N`` (N steps). At every step boundary, on the training thread, the agent arms
(starts a :class:`~torchscope.tracer.armed.session.Tracer`) when someone holds tracing for the new
step and disarms (stops it: no mode, no hooks, no threads of its own left) when nobody does.
Arming never starts in the middle of a step. A holder that goes (``disarm``, ``q`` in the UI,
or its lease running out) takes its breakpoints with it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from torchscope.protocol.events import ALERT, ARMING, DORMANT, TRACED, TRACING, Event
from torchscope.tracer import backward_calls
from torchscope.tracer.armed.modules import is_fsdp2
from torchscope.tracer.armed.pipeline import Sink
from torchscope.tracer.armed.session import DrivenBy, Tracer, current_tracer, session_event
from torchscope.tracer.clock import StepClock
from torchscope.tracer.ranks import (
    AgreedPeriods,
    JobUiSignal,
    RankFingerprints,
    RankOrigins,
    job_id,
    job_store,
    pg_timeout_seconds,
    say,
    say_line,
)
from torchscope.tracer.stepper import Stepper, stepping_commands
from torchscope.tracer.steps import ALL_STEPS, StepSelection, parse_steps

_agent: Agent | None = None
ORIGIN_LOOKUPS = 20  # step boundaries to look for another rank's origin of an arrival
WATCH_TRACE_STEPS = 3  # steps traced in full after a NaN the replay could not reproduce
STEPPING_COMMANDS = frozenset(
    "pause step next continue detach state break_list break_add break_enable break_delete "
    "inspect".split()
)


def current_agent() -> Agent | None:
    return _agent


@dataclass
class ServeOptions:
    """What the command line (or ``serve()``) asks for; nothing of it arms a job by default."""

    record: str | None = None
    steps: str | int | None = None
    values: int = 16
    live: bool = True
    breakpoints: list[dict[str, Any]] = field(default_factory=list)
    wait: bool = False
    hold: bool = False
    lease: float = 10.0
    optimizer_ops: bool = False
    quiet: bool = False
    watch: str | None = None  # "nan", "gradnorm:X": the always-on NaN watch (tracer/watch/)
    on_nan: str = "continue"  # what the watch does after a detection: continue, pause, stop
    metadata: dict[str, Any] = field(default_factory=dict)

    def held_steps(self) -> StepSelection | None:
        """The steps the command line holds traced (None: it holds none: dormant)."""
        if self.steps is not None:
            return parse_steps(self.steps)
        if self.record is not None or self.breakpoints or self.wait:
            # --record with --watch records what the watch finds, not every step.
            return None if self.watch and not self.breakpoints and not self.wait else ALL_STEPS
        return None


@dataclass
class Holder:
    """Someone who wants the job traced."""

    id: int
    label: str  # "command line", "ui", "record"
    client: bytes | None = None  # the UI's connection; None: the command line
    steps: StepSelection | None = None  # absolute steps (command line)
    remaining: int | None = None  # the next N steps (record --next N)
    last_contact: float = field(default_factory=time.monotonic)

    @property
    def is_ui(self) -> bool:
        """A UI: what pauses and says continue (a recorder does neither)."""
        return self.client is not None and self.label == "ui"

    def takes(self, step: int) -> bool | None:
        """Whether it holds ``step`` traced; None when it is done and goes."""
        if self.steps is not None:
            if step in self.steps:
                return True
            last = self.steps.last()
            return None if last is not None and step > last else False
        if self.remaining is not None:
            if self.remaining <= 0:
                return None
            self.remaining -= 1
        return True

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "by": self.label}
        if self.steps is not None:
            out["steps"] = self.steps.text
        if self.remaining is not None:
            out["remaining"] = self.remaining
        return out


class Agent:
    """One per process (see :func:`serve`). ``start()`` on the training thread."""

    def __init__(self, options: ServeOptions | None = None) -> None:
        self.options = options or ServeOptions()
        self.next_seq = itertools.count().__next__
        self.clock = StepClock(self, backward_steps=True)
        self.tracer: Tracer | None = None
        self.watch: Any = None  # NanWatch, with --watch
        self.stepper: Stepper | None = None
        self.publisher: Any = None
        self.writer: Any = None
        self.sinks: list[Sink] = []
        self.started = False
        self.armed_periods = 0  # how often it armed (tests, benchmarks)
        self.traced_steps = 0
        self._lock = threading.Lock()  # holders: control thread and training thread
        self._holders: dict[int, Holder] = {}
        self._ids = itertools.count(1)
        self._released: list[int] = []  # holders gone since the last boundary (to announce)
        # A watch switched on or off from outside, applied at the next step boundary (the
        # watch hooks the training thread): (spec or None, on_nan).
        self._watch_request: tuple[str | None, str] | None = None
        self._origins: RankOrigins | None = None  # shared NaN/Inf origins (multi-rank jobs)
        self._fingerprints: RankFingerprints | None = None  # DDP replicas compared
        self._fp_params: tuple[list, list] | None = None  # (DDP roots, their parameters)
        self._endpoint_shared = False
        self._in_job = job_id() is not None  # a torchrun rank: it shares its endpoint
        self._rank_records: list[str] | None = None  # every rank's session record (JSON)
        self._periods: AgreedPeriods | None = None  # when UI-armed ranks meet
        self._no_periods = False  # the store failed once: UI-armed ranks trace ungated
        # step -> (what, lookups left): NaN/Inf that arrived here through a collective
        self._arrivals: dict[int, tuple[str, int]] = {}
        self._watch_listening: backward_calls.Listening | None = None
        self._client_holders_gone: set[int] = set()
        self._blocked_said = False

    # -- lifecycle (training thread) -----------------------------------------------------------
    def start(self) -> Agent:
        global _agent
        if self.started:
            return self
        opts = self.options
        held = opts.held_steps()
        if opts.live or opts.breakpoints or opts.wait:
            hint = f"attach: torchscope tui {os.getpid()}" if opts.live else "no UI can attach"
            self.stepper = Stepper(
                lease_seconds=opts.lease,
                wait_for_ui=opts.wait,
                hold=opts.hold,
                attach_hint=hint,
                job_ui=JobUiSignal.for_job(job_id()) if opts.wait else None,
            )
            if job_id() is not None:
                self.stepper.pg_timeout = pg_timeout_seconds
            for spec in opts.breakpoints:
                self.stepper.add_breakpoint(spec)
        if held is not None:
            self._add_holder(Holder(next(self._ids), "command line", steps=held))
        if opts.record is not None:
            from torchscope.protocol.tracefile import TraceWriter, per_rank_path

            opts.record = per_rank_path(opts.record)  # torchrun: one file per rank
        session = self.session_event()
        if opts.record is not None:
            self.writer = TraceWriter(
                opts.record,
                metadata={"session": dict(session)},
                on_stop=lambda message: self._say(message, force=True),
            )
            self.sinks.append(self.writer.write)
            self.writer.write([session])
        if opts.live:
            self._start_publisher(session)
        self.clock.install()
        self._handle_sigterm()
        # A forked child (a DataLoader worker) is not the job: it drops what the agent holds.
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _forget_in_child(ref))
        if opts.watch:
            self._start_watch()  # after the clock: its optimizer hook runs first
        self.started = True
        _agent = self
        self.boundary(self.clock.step)  # step 0 begins now: the command line may hold it
        return self

    def session_event(self) -> Event:
        held = self.options.held_steps()
        return session_event(
            self.next_seq(),
            self.clock.step,
            steps=held.text if held is not None else "none",
            values=self.options.values,
            record=self.options.record,
            metadata={
                "agent": True,
                "tracing": DORMANT,
                # Without an optimizer step, a top-level backward() ends a step (see clock).
                "steps_by": "optimizer.step(), torchscope.step(), else backward()",
                **self.options.metadata,
            },
        )

    def _start_publisher(self, session: Event) -> None:
        """A job whose live view cannot start still runs (and records, when asked)."""
        from torchscope.tracer.publisher import EventPublisher  # pyzmq only when live

        try:
            publisher = EventPublisher(session, sndhwm=100).start()
        except Exception as exc:  # unsafe runtime dir, bad TORCHSCOPE_BIND, bind failure
            self._say(f"live view disabled: {exc}", force=True)
            return
        self.publisher = publisher
        publisher.note_step(self.clock.step)
        publisher.tracing = self._tracing_state()
        self.sinks.append(publisher)
        assert self.stepper is not None
        publisher.commands.update(stepping_commands(self.stepper, lambda: self.clock.step))
        publisher.commands.update(
            {
                "arm": self._cmd_arm,
                "ranks": self._cmd_ranks,
                "disarm": self._cmd_disarm,
                "detach": self._cmd_detach,
                "watch": self._cmd_watch,
            }
        )
        publisher.on_request = self._contact
        publisher.on_tick = self._expire_leases

    def _handle_sigterm(self) -> None:
        """SIGTERM (schedulers, ``timeout``) would kill the job with no cleanup: the trace
        file without its index, the registry entry and sockets left behind. Stop first, then
        die of the same signal, as the job would have. A handler the job set is left alone
        (it decides how to exit; exiting runs our cleanup)."""
        if threading.current_thread() is not threading.main_thread():
            return
        try:
            if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
                return
            signal.signal(signal.SIGTERM, _on_sigterm)
        except (ValueError, OSError):
            pass

    # The switch happens at the job's next backward(): not at a step boundary, which may run
    # inside torch's loop over the optimizer hooks (installing the watch adds some), nor in a
    # module call (the watch finds the top-level calls from a step's start: it begins looking
    # at the next step).
    def backward_begins(self, kwargs: dict[str, Any]) -> None:
        if threading.get_ident() != self.clock.owner:
            return None
        listening, self._watch_listening = self._watch_listening, None
        if listening is not None:
            listening.remove()
        if self._watch_request is not None:
            self._apply_watch_request()
        return None

    def backward_ends(self, ok: bool) -> None:
        pass

    def _apply_watch_request(self) -> None:
        (spec, on_nan), self._watch_request = self._watch_request, None  # type: ignore[misc]
        try:
            if self.watch is not None:
                self.watch.remove()
                self.watch = None
            self.options.watch, self.options.on_nan = spec, on_nan
            if spec:
                self._start_watch()
                self._say(
                    f"watching every step from step {self.clock.step} ({spec}, then {on_nan})"
                )
            else:
                self._say(f"not watching for NaN from step {self.clock.step}")
        except Exception as exc:
            self._say(f"internal error switching the NaN watch: {type(exc).__name__}: {exc}")

    def _cmd_watch(self, args: dict[str, Any], client: bytes) -> dict[str, Any]:
        from torchscope.tracer.steps import parse_watch

        spec = args.get("spec")
        if spec is not None:
            parse_watch(spec)  # StepSpecError (a ValueError): refused with its one line
        self._watch_request = (spec, args.get("on_nan") or "continue")
        if self._watch_listening is None:
            self._watch_listening = backward_calls.listen(self)
        return {"watch": spec, "step": self.clock.step}

    def _start_watch(self) -> None:
        from torchscope.tracer.steps import parse_watch
        from torchscope.tracer.watch.nan_watch import NanWatch

        self.watch = NanWatch(
            gradnorm=parse_watch(self.options.watch or "nan"),
            on_nan=self.options.on_nan,
            tracer_factory=self._replay_tracer,
            step_of=lambda: self.clock.step,
            report=self._watch_report,
            replay_wanted=lambda: self.tracer is None,
            on_unreproduced=self._trace_after_unreproduced,
            backward_checks=True,  # a job that updates by hand is checked after backward()
        ).install()

    def _replay_tracer(self, step: int) -> Tracer:
        """The tracer a watch replay records into: this job's file and UIs, its numbering."""
        tracer = Tracer(
            None,
            values=self.options.values,
            keep=False,
            optimizer_ops=True,
            sinks=self.sinks,
            driven=DrivenBy(self.stepper, step, self.next_seq),
        ).start()
        self._share_alerts(tracer)
        return tracer

    # -- origins shared between ranks -----------------------------------------------------------
    def _share_alerts(self, tracer: Tracer) -> None:
        if tracer.pipeline is not None and os.environ.get("WORLD_SIZE", "1") != "1":
            tracer.pipeline.alerts.on_alert = self._on_alert

    def _rank_origins(self) -> RankOrigins | None:
        if self._origins is None:
            found = job_store()
            if found is not None:
                self._origins = RankOrigins(*found)
        return self._origins

    def _on_alert(self, alert: Event) -> None:
        """An alert of this rank: an origin is published for the other ranks; a value that
        arrived through a collective is matched with theirs at the next step boundaries."""
        origins = self._rank_origins()
        if origins is None:
            return
        if alert.get("arrived"):
            with self._lock:
                self._arrivals.setdefault(alert["step"], (alert["what"], ORIGIN_LOOKUPS))
        else:
            origins.publish(alert["step"], alert["message"])

    def _match_arrivals(self) -> None:
        """At a step boundary: the origins other ranks have published for the steps where a
        NaN/Inf arrived here, as one alert each (no waiting: asked again at later steps)."""
        origins = self._rank_origins()
        with self._lock:
            pending = dict(self._arrivals)
        for step, (what, left) in pending.items():
            found = origins.find(step) if origins is not None else []
            with self._lock:
                if found or left <= 1:
                    self._arrivals.pop(step, None)
                else:
                    self._arrivals[step] = (what, left - 1)
            for rank, message in found:
                self._emit_alert(
                    Event(
                        kind=ALERT,
                        seq=self.next_seq(),
                        step=step,
                        what=what,
                        where="rank",
                        event_seq=None,
                        name=f"rank {rank}",
                        source=None,
                        message=f"the {'NaN' if what == 'nan' else 'Inf'} that arrived here "
                        f"at step {step} was made on rank {rank}: {message}",
                    )
                )

    def _last_word_of_other_ranks(self, seconds: float = 2.0) -> None:
        """At the end of the job, the other ranks' origins and fingerprints of the last steps
        get a short while to arrive."""
        fp = self._fingerprints
        deadline = time.monotonic() + seconds
        while (self._arrivals or (fp is not None and fp.pending)) and time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                self._match_arrivals()
                self._report_divergence(final=True)
            time.sleep(0.05)

    def _share_endpoint(self) -> None:
        """Under torchrun every rank puts its session record (endpoints, pid, host) in the
        job's c10d store once, and reads the others' back when all are there: a UI that
        reaches one rank, on any host, finds every rank through it (``ranks``)."""
        found = job_store()
        if found is None:
            return
        store, rank, world = found
        if not self._endpoint_shared:
            import json

            store.set(f"torchscope/endpoint/{rank}", json.dumps(self.publisher.record.to_dict()))
            self._endpoint_shared = True
        keys = [f"torchscope/endpoint/{r}" for r in range(world)]
        if store.check(keys):  # one round trip per step until every rank is there
            self._rank_records = [bytes(v).decode() for v in store.multi_get(keys)]

    def _cmd_ranks(self, args: dict[str, Any], client: bytes) -> dict[str, Any]:
        import json

        if self._rank_records is None:
            raise ValueError(
                "this job's ranks are not all known yet (each rank registers at its first "
                "step boundary after the process group exists)"
            )
        return {"ranks": [json.loads(r) for r in self._rank_records]}

    def _check_replicas(self, step: int) -> None:
        """Traced DDP steps: publish this rank's parameter fingerprint and compare the other
        ranks' (see ranks.RankFingerprints); a difference is one alert per parameter set."""
        import torch

        if self._fingerprints is None:
            found = job_store()
            if found is None:
                return
            self._fingerprints = RankFingerprints(*found)
        fp = self._fingerprints
        # DDP replicas only: FSDP2 ranks hold different shards by design.
        roots = [m for m in self.tracer.modules.ddp_roots() if not is_fsdp2(m)]  # type: ignore[union-attr]
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
        self._report_divergence()

    def _report_divergence(self, final: bool = False) -> None:
        fp = self._fingerprints
        if fp is None:
            return
        for at, rank, differ in fp.compare(final):
            shown = ", ".join(differ[:5]) + (
                f" and {len(differ) - 5} more" if len(differ) > 5 else ""
            )
            self._emit_alert(
                Event(
                    kind=ALERT,
                    seq=self.next_seq(),
                    step=at,
                    what="diverged",
                    where="ranks",
                    event_seq=None,
                    name=f"rank {rank}",
                    source=None,
                    message=f"DDP replicas differ at the start of step {at}: {shown} "
                    f"on this rank (rank {fp.rank}) and rank {rank}",
                )
            )

    def _emit_alert(self, event: Event) -> None:
        if self.tracer is not None and self.tracer.pipeline is not None:
            self.tracer._emit(event)
            return
        for sink in self.sinks:
            with contextlib.suppress(Exception):
                sink([event])

    def _watch_report(self, text: str) -> None:
        if not self.options.quiet:
            with contextlib.suppress(Exception):
                say_line(text)  # already "torchscope: ..." (with its rank)
        det = self.watch.detections[-1] if self.watch and self.watch.detections else None
        if det is None or det.get("reproduced") or det.get("last_step") != det.get("step"):
            return  # a reproduced replay recorded its own alert; a "lasted" summary is a note
        event = Event(
            kind=ALERT,
            seq=self.next_seq(),
            step=det["step"],
            what=det["what"] if det["what"] in ("nan", "inf") else "gradnorm",
            where="watch",
            event_seq=None,
            name="the gradients",
            source=None,
            message=text.removeprefix("torchscope: "),
        )
        for sink in self.sinks:
            with contextlib.suppress(Exception):
                sink([event])

    def _trace_after_unreproduced(self, det: dict[str, Any]) -> None:
        """The replay could not say where it came from: trace the next steps in full."""
        with self._lock:
            self._add_holder(Holder(next(self._ids), "watch", remaining=WATCH_TRACE_STEPS))
        self._say(f"tracing the next {WATCH_TRACE_STEPS} steps in full to catch it live")

    def stop(self) -> None:
        """The job is done: the last traced events reach the file and the UIs, then bye."""
        global _agent
        if not self.started:
            return
        self.started = False
        if self.watch is not None:
            with contextlib.suppress(Exception):
                self.watch.remove()
        self._last_word_of_other_ranks()
        if self._watch_listening is not None:
            self._watch_listening.remove()
            self._watch_listening = None
        try:
            self._disarm()
            self.clock.remove()
            if self.writer is not None:
                self.writer.close()
        finally:
            if self.publisher is not None:
                self.publisher.close()
            if _agent is self:
                _agent = None
            with contextlib.suppress(ValueError, OSError):
                if signal.getsignal(signal.SIGTERM) is _on_sigterm:
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def abandon(self) -> None:
        """In a forked child: drop everything the parent owns without touching it."""
        self.started = False
        if self.tracer is not None:
            self.tracer.abandon()
        self.tracer = None
        self.clock.remove()
        if self.watch is not None:
            with contextlib.suppress(Exception):
                self.watch.remove()
        self.sinks = []
        self.writer = self.publisher = None

    # -- step clock (training thread) ----------------------------------------------------------
    def update_begins(self, args: tuple, kwargs: dict) -> bool:
        return self.tracer is not None and self.tracer.update_begins(args, kwargs)

    def update_ends(self) -> None:
        if self.tracer is not None:
            self.tracer.update_ends()

    def boundary(self, step: int) -> None:
        """Step ``step`` begins: arm or disarm here, never inside a step."""
        if self._rank_records is None and self._in_job and self.publisher is not None:
            with contextlib.suppress(Exception):
                self._share_endpoint()
        if self._arrivals:
            with contextlib.suppress(Exception):
                self._match_arrivals()
        if self.tracer is not None and self.tracer.modules.has_ddp:
            with contextlib.suppress(Exception):
                self._check_replicas(step)
        try:
            with self._lock:
                want = gated = by_ui = False
                for holder in list(self._holders.values()):
                    takes = holder.takes(step)
                    if takes is None:
                        self._drop_holder(holder)
                    else:
                        want = want or takes
                        # The command line arms every rank at the same steps: they can meet.
                        gated = gated or (takes and holder.client is None and holder.steps)
                        # A recorder never pauses: it needs no meeting of the ranks.
                        by_ui = by_ui or (takes and holder.is_ui)
                released, self._released = self._released, []
            # Ranks armed by UIs meet in the periods they agree on (tracer/ranks.py).
            scope = self._agreed_period(step, by_ui and not gated)
            if scope is not None:
                want = gated = True
            if self.publisher is not None:
                self.publisher.note_step(step)
            if want and self.tracer is None:
                self._arm(step, released)
            elif want:
                self.tracer.boundary(step)  # type: ignore[union-attr]
                if released:
                    self._announce(released)
            else:
                self._disarm(released)
            if self.tracer is not None:
                self.traced_steps += 1
                self.tracer.gated = bool(gated)
                self.tracer.gate_scope = scope or ""
        except Exception as exc:  # never into the job
            self._say(f"internal error at a step boundary: {type(exc).__name__}: {exc}")
        finally:
            if self.publisher is not None:
                self.publisher.tracing = self._tracing_state()

    def _agreed_period(self, step: int, wanted: bool) -> str | None:
        """The agreed period's scope when this rank meets the others in ``step``, else None.
        Nothing is asked of the store until a UI arms a rank of a multi-rank job."""
        periods = self._periods
        if periods is None:
            if not wanted or self._no_periods:
                return None
            periods = self._periods = AgreedPeriods.for_job(say)
            if periods is None:  # one process, or no process group yet
                return None
        try:
            return periods.scope if periods.at_boundary(step, wanted) else None
        except Exception as exc:  # the store went away (the job is ending): trace ungated
            self._say(f"ranks could not agree on when to meet: {type(exc).__name__}: {exc}")
            self._periods, self._no_periods = None, True
            return None

    def _arm(self, step: int, released: list[int]) -> None:
        outer = current_tracer()
        if outer is not None:
            # The script's own torchscope.trace() block owns the mode now.
            if not self._blocked_said:
                self._blocked_said = True
                self._say("not arming while the script's torchscope.trace() block runs")
            return
        self._announce(released, TRACED)
        opts = self.options
        tracer = Tracer(
            None,
            values=opts.values,
            keep=False,
            optimizer_ops=opts.optimizer_ops,
            sinks=self.sinks,
            driven=DrivenBy(self.stepper, step, self.next_seq),
        )
        tracer.start()
        self._share_alerts(tracer)
        self.tracer = tracer
        self.armed_periods += 1
        self._say_holders(f"tracing from step {step}")

    def _disarm(self, released: list[int] = ()) -> None:  # type: ignore[assignment]
        tracer, self.tracer = self.tracer, None
        self._fp_params = None
        if tracer is not None:
            tracer.stop()  # the armed period's last events are delivered first
            self._announce(released, DORMANT)
            if self.started:
                self._say_holders(f"dormant again at step {self.clock.step}", released)
        elif released:
            self._announce(released)

    def _announce(self, released: list[int], state: str | None = None) -> None:
        """A ``tracing`` event: armed / dormant, who holds it, whose hold just ended."""
        if state is None:
            state = TRACED if self.tracer is not None else DORMANT
        with self._lock:
            holders = [h.describe() for h in self._holders.values()]
        event = Event(
            kind=TRACING,
            seq=self.next_seq(),
            step=self.clock.step,
            state=state,
            holders=holders,
            released=list(released),
            t=time.time(),
        )
        if self.tracer is not None and self.tracer.pipeline is not None:
            self.tracer._emit(event)  # in order after the step's events still in flight
            return
        for sink in self.sinks:
            with contextlib.suppress(Exception):
                sink([event])

    def _tracing_state(self) -> str:
        if self.tracer is not None:
            return TRACED
        return ARMING if self._holders else DORMANT

    # -- holders (control thread, and the boundary) ---------------------------------------------
    def _add_holder(self, holder: Holder) -> None:
        self._holders[holder.id] = holder

    def _drop_holder(self, holder: Holder) -> None:
        """Called with the lock held."""
        if self._holders.pop(holder.id, None) is None:
            return
        self._released.append(holder.id)
        if holder.client is not None:
            self._client_holders_gone.add(holder.id)
        if holder.client is not None and self.stepper is not None:
            self.stepper.release(holder.client)
            if holder.is_ui and not self._a_ui_holds():
                # No UI left: nobody will say continue. A pause held for a UI ends now.
                # (A recorder never says continue, nor is it what --wait waits for.)
                self.stepper.detach_uis()

    def _a_ui_holds(self) -> bool:
        return any(h.is_ui for h in self._holders.values())

    def _client_holder(self, client: bytes) -> Holder | None:
        return next((h for h in self._holders.values() if h.client == client), None)

    def _contact(self, client: bytes, cmd: str) -> None:
        """Any request renews its client's hold. Only a UI counts as a UI being there for
        the stepper (its pauses' lease, ``--wait``): a client that holds the job as a UI, or
        one that sends stepping commands; ``ls`` and ``record`` do not."""
        with self._lock:
            holder = self._client_holder(client)
            if holder is not None:
                holder.last_contact = time.monotonic()
        is_ui = holder.is_ui if holder is not None else cmd in STEPPING_COMMANDS
        if is_ui and self.stepper is not None:
            self.stepper.contact(client)

    def _expire_leases(self) -> None:
        lease = self.options.lease
        now = time.monotonic()
        with self._lock:
            for holder in list(self._holders.values()):
                if holder.client is not None and now - holder.last_contact > lease:
                    self._say(f"a {holder.label} stopped responding; its hold on tracing ended")
                    self._drop_holder(holder)
        if self.publisher is not None:
            self.publisher.tracing = self._tracing_state()

    def _cmd_arm(self, args: dict[str, Any], client: bytes) -> dict[str, Any]:
        by = args.get("by") or "ui"
        with self._lock:
            old = self._client_holder(client)
            if old is not None:
                del self._holders[old.id]  # a new request replaces the client's old one
            holder = Holder(next(self._ids), by, client=client, remaining=args.get("next"))
            self._add_holder(holder)
        if by == "ui" and self.stepper is not None:
            self.stepper.contact(client)
        if self._periods is not None:
            self._periods.retry()
        if self.publisher is not None:
            self.publisher.tracing = self._tracing_state()
        return self._armed_reply(holder.id)

    def _cmd_disarm(self, args: dict[str, Any], client: bytes) -> dict[str, Any]:
        """This client lets go: its hold, its breakpoints, and (the last UI) its pauses."""
        with self._lock:
            holder = self._client_holder(client)
            if holder is not None:
                self._drop_holder(holder)
            elif self.stepper is not None:
                self.stepper.release(client)
                if not self._a_ui_holds():
                    self.stepper.detach_uis()
        if self.publisher is not None:
            self.publisher.tracing = self._tracing_state()
        return self._armed_reply(holder.id if holder is not None else 0)

    def _cmd_detach(self, args: dict[str, Any], client: bytes) -> dict[str, Any]:
        """Let the job run free: every breakpoint goes, the command line's too."""
        reply = self._cmd_disarm(args, client)
        if self.stepper is not None:
            self.stepper.detach()
        return {"state": self.stepper.state() if self.stepper is not None else {}, **reply}

    def _armed_reply(self, holder: int) -> dict[str, Any]:
        return {
            "holder": holder,
            "tracing": self._tracing_state(),
            "state": self.stepper.state() if self.stepper is not None else None,
        }

    # -- reporting -----------------------------------------------------------------------------
    def _say_holders(self, text: str, released: list[int] = ()) -> None:  # type: ignore[assignment]
        """One line when a UI or a recorder arms or leaves (the command line's own steps
        are what the user asked for: nothing to say)."""
        with self._lock:
            clients = [h.label for h in self._holders.values() if h.client is not None]
        if clients or any(i in self._client_holders_gone for i in released):
            who = ", ".join(sorted(set(clients))) or "nobody"
            self._say(f"{text} (held by: {who})")

    def _say(self, text: str, force: bool = False) -> None:
        if self.options.quiet and not force:
            return
        say(text)


def _on_sigterm(signum: int, frame: Any) -> None:
    agent = _agent
    if agent is not None:
        with contextlib.suppress(Exception):
            agent.stop()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _forget_in_child(ref: weakref.ref[Agent]) -> None:
    global _agent
    agent = ref()
    if agent is not None:
        with contextlib.suppress(Exception):
            agent.abandon()
    _agent = None


def attach_here() -> Agent:
    """What ``torchscope attach PID`` runs inside the job (on its main thread, between two
    bytecodes, maybe in the middle of a step): a dormant agent, which arms only at a step
    boundary. Steps are numbered from the optimizers' own count where they keep one."""
    agent = _agent
    if agent is not None:
        return agent
    import atexit

    agent = Agent(ServeOptions(metadata={"attached": True}))
    agent.clock.step = optimizer_step_count()
    agent.start()
    atexit.register(agent.stop)
    agent._say(f"attached; this job is served dormant (torchscope tui {os.getpid()})")
    return agent


def optimizer_step_count() -> int:
    """The most updates any live optimizer has counted (Adam's ``state[p]["step"]``), or 0.
    One pass over the heap, once, at attach time."""
    import gc

    from torch.optim import Optimizer

    best = 0
    for obj in gc.get_objects():
        if isinstance(obj, Optimizer):
            for state in obj.state.values():
                step = state.get("step") if isinstance(state, dict) else None
                if step is not None:
                    with contextlib.suppress(Exception):
                        best = max(best, int(step))
    return best


def serve(options: ServeOptions | None = None) -> Agent:
    """Start this process's agent, or return the running one (idempotent)."""
    if _agent is not None:
        return _agent
    return Agent(options).start()
