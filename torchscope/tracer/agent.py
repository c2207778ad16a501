"""The dormant agent: what runs in a job for its whole life, so a UI can attach at any time.

``torchscope run`` and ``torchscope.serve()`` start one per process. Dormant, it costs close to
nothing: no mode on the stack, no module or node hooks, no events. It keeps

- the step clock (global optimizer hooks; after ``backward()`` for jobs without an optimizer),
  so the job's steps are numbered from its start whether or not they are traced;
- the control endpoint and the registry entry (``torchscope ls``, ``tui PID``, ``record PID``),
  served by the publisher's thread, which wakes a few times a second, never per step;
- the stepper (breakpoints and pauses outlive an armed period: a breakpoint set on a dormant
  job hits in its next traced step);
- the run's history (:mod:`~torchscope.tracer.history`): every step's loss, and with the watch
  its gradient norms, traced or not, for a UI that attaches late (the ``history`` command,
  live ``history`` events while someone reads the stream and into the trace file, ``arm``
  ``when=`` conditions).

Tracing is *held* (see :mod:`~torchscope.tracer.holders`). At every step boundary, on the
training thread, the agent arms (starts a :class:`~torchscope.tracer.armed.session.Tracer`)
when someone holds tracing for the new step and disarms (stops it: no mode, no hooks, no
threads of its own left) when nobody does. Arming never starts in the middle of a step.
Multi-rank jobs are checked against the other ranks at the same boundaries
(:mod:`~torchscope.tracer.rank_checks`).

Everything the agent says goes one way, :meth:`Agent.emit`: through the armed tracer while
there is one (in order after the step's events still in flight), else straight to the sinks.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import operator
import os
import signal
import threading
import time
import weakref
from typing import Any

from torchscope.protocol.codec import MAX_MESSAGE_BYTES, pack
from torchscope.protocol.events import ARMING, DORMANT, HISTORY, TRACED, TRACING, Event
from torchscope.protocol.history import parse_condition
from torchscope.tracer.armed.aten import aten_scope
from torchscope.tracer.armed.modules import is_fsdp2
from torchscope.tracer.armed.session import DrivenBy, Tracer, current_tracer, session_event
from torchscope.tracer.clock import BY_SCALER, StepClock
from torchscope.tracer.history import HistoryCollector
from torchscope.tracer.holders import COMMAND_LINE, UI, Holders, StepHold
from torchscope.tracer.options import Options
from torchscope.tracer.outputs import Outputs
from torchscope.tracer.rank_checks import RankChecks
from torchscope.tracer.ranks import (
    AgreedPeriods,
    JobUiSignal,
    job_id,
    pg_timeout_seconds,
    say,
)
from torchscope.tracer.served_watch import ServedWatch
from torchscope.tracer.stepper import WATCH_OWNER, Stepper

_agent: Agent | None = None
STEPPING_COMMANDS = frozenset(
    "pause step next continue detach state break_list break_add break_enable break_delete "
    "inspect evaluate edit".split()
)


def current_agent() -> Agent | None:
    return _agent


def current_clock() -> StepClock | None:
    """The clock that numbers this process's steps (``torchscope.step()`` moves it): the
    agent's while there is one (its steps go on across ``trace()`` blocks), else the one of a
    ``trace()`` block running on its own."""
    if _agent is not None:
        return _agent.clock
    tracer = current_tracer()
    return tracer.clock if tracer is not None else None


# The name the options had when only the agent took them (scripts and benchmarks use it).
ServeOptions = Options


class Agent:
    """One per process (see :func:`serve`). ``start()`` on the training thread."""

    def __init__(self, options: Options | None = None) -> None:
        self.options = options or Options()
        if self.options.live is None:
            self.options.live = True  # a served job is attachable unless told otherwise
        self.next_seq = itertools.count().__next__
        self.clock = StepClock(self, backward_steps=True)
        self.tracer: Tracer | None = None
        self.outputs = Outputs()
        self.holders = Holders(lambda: self.stepper, self._say)
        self.ranks = RankChecks(self.emit, self.next_seq)
        self.started = False
        self.armed_periods = 0  # how often it armed (tests, benchmarks)
        self.traced_steps = 0
        self.last_step: str | None = None  # traced to the end: "empty" or "ran"
        self._in_job = job_id() is not None  # a torchrun rank: it shares its endpoint
        self._multi_rank = os.environ.get("WORLD_SIZE", "1") != "1"
        self._periods: AgreedPeriods | None = None  # when UI-armed ranks meet
        self._no_periods = False  # the store failed once: UI-armed ranks trace ungated
        self._blocked_said = False
        # The training thread, asked at every backward(): read without a Python call.
        self.history = HistoryCollector(functools.partial(operator.attrgetter("owner"), self.clock))
        self._history_listening: Any = None  # HistoryCollector.listen()
        self.served_watch = _served_watch(self)

    @property
    def stepper(self) -> Stepper | None:
        return self.outputs.stepper

    @stepper.setter
    def stepper(self, stepper: Stepper | None) -> None:
        self.outputs.stepper = stepper

    @property
    def publisher(self) -> Any:
        return self.outputs.publisher

    @property
    def writer(self) -> Any:
        return self.outputs.writer

    @property
    def sinks(self) -> list:
        return self.outputs.sinks

    @property
    def watch(self) -> Any:
        """The NaN watch (a NanWatch) while the job watches, else None."""
        return self.served_watch.watch

    def watch_setting(self) -> tuple[str | None, str]:
        return self.served_watch.watch_setting()

    def request_watch(self, spec: str | None, on_nan: str, now: bool = False) -> None:
        self.served_watch.request_watch(spec, on_nan, now)

    # -- lifecycle (training thread) -----------------------------------------------------------
    def start(self) -> Agent:
        global _agent
        if self.started:
            return self
        opts = self.options
        outputs = self.outputs
        held = opts.held_steps()
        if opts.live or opts.breakpoints or opts.wait:
            hint = f"attach: torchscope tui {os.getpid()}" if opts.live else "no UI can attach"
            stepper = outputs.start_stepper(
                opts.breakpoints,
                lease_seconds=opts.lease,
                wait_for_ui=opts.wait,
                hold=opts.hold,
                attach_hint=hint,
                job_ui=JobUiSignal.for_job(job_id()) if opts.wait else None,
                eval_budget=opts.eval_budget,
            )
            if job_id() is not None:
                stepper.pg_timeout = pg_timeout_seconds
            stepper.may_evaluate = self._may_evaluate
        if held is not None:
            self.holders.add(COMMAND_LINE, steps=held)
        if opts.record is not None:
            from torchscope.protocol.tracefile import per_rank_path

            opts.record = per_rank_path(opts.record)  # torchrun: one file per rank
        session = self.session_event()
        if opts.record is not None:
            outputs.open_file(opts.record, session, lambda text: self._say(text, force=True))
            outputs.writer.write([session])
            # The file reads every point of the run's history, from step 0, traced or not.
            self.history.sending = True
        if opts.live:
            self._start_publisher(session)
        self.clock.install()
        if opts.history:
            # Listeners in the wrappers the clock has just installed: no hook of their own.
            self._history_listening = self.history.listen()
        self._handle_sigterm()
        # A forked child (a DataLoader worker) is not the job: it drops what the agent holds.
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _forget_in_child(ref))
        if opts.watch:
            self.served_watch.start()  # after the clock: its optimizer hook runs first
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
        self.outputs.start_publisher(
            session,
            self.clock.step,
            lambda: self.clock.step,
            lambda t: self._say(t, force=True),
            setup=self._setup_publisher,  # before it starts: a UI may come at once
        )

    def _setup_publisher(self, publisher: Any) -> None:
        publisher.tracing_state = self._tracing_state
        publisher.commands.update(
            {
                "arm": self._cmd_arm,
                "ranks": self.ranks.cmd_ranks,
                "disarm": self._cmd_disarm,
                "detach": self._cmd_detach,
                "watch": self.served_watch.cmd_watch,
                "history": self._cmd_history,
            }
        )
        publisher.on_request = self._contact
        publisher.on_tick = self._on_tick

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

    def _on_alert(self) -> Any:
        """Where an armed tracer's alerts go besides its sinks: the other ranks' checks."""
        return self.ranks.on_alert if self._multi_rank else None

    def stop(self) -> None:
        """The job is done: the last traced events reach the file and the UIs, then bye."""
        global _agent
        if not self.started:
            return
        self.started = False
        self.served_watch.remove()
        if self._history_listening is not None:
            self._history_listening.remove()
            self._history_listening = None
        self.history.finish()
        self.ranks.last_word()
        self.served_watch.stop_listening()
        try:
            self._disarm(ended=True)
            self.clock.remove()
            # The last points after the armed period's last events, straight to the file and
            # the UIs (through the tracer they would make the step after the loop's last
            # update a traced step).
            self._send_history(every=0.0)
        finally:
            self.outputs.close()
            if _agent is self:
                _agent = None
            atexit.unregister(self.stop)  # serve()'s: a stopped agent is not kept alive
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
        if self._history_listening is not None:
            self._history_listening.remove()
            self._history_listening = None
        self.history.drop()
        self.served_watch.remove()
        self.outputs = Outputs()

    # -- step clock (training thread) ----------------------------------------------------------
    def update_begins(self, args: tuple, kwargs: dict) -> bool:
        return self.tracer is not None and self.tracer.update_begins(args, kwargs)

    def update_ends(self) -> None:
        if self.tracer is not None:
            self.tracer.update_ends()

    def boundary(self, step: int) -> None:
        """Step ``step`` begins: arm or disarm here, never inside a step."""
        ranks = self.ranks
        publisher = self.outputs.publisher
        if ranks.rank_records is None and self._in_job and publisher is not None:
            with contextlib.suppress(Exception):  # no store yet: shared later
                ranks.share_endpoint(publisher.record.to_dict())
        if ranks.arrivals:
            with contextlib.suppress(Exception):  # tried again at the next boundary
                ranks.match_arrivals()
        self._history_at_boundary(step)
        holders = self.holders
        if (
            self.tracer is None
            and self._periods is None
            and not holders.held
            and not holders.released
        ):
            # Dormant, nobody holds it and nobody let go since the last boundary: nothing to
            # arm, disarm, announce or agree on. Every step of a dormant job passes here: the
            # least work (small fast steps feel it: each call here is about a thousand
            # instructions, counted per step).
            history = self.history
            if history.sending:
                self._send_history()
            if publisher is not None:
                publisher.step = step  # what note_step() does, without the call
            history.traced_now = False
            return
        if self.tracer is not None and self.tracer.modules.has_ddp:
            with contextlib.suppress(Exception):  # no DDP roots known: none marked
                roots = self.tracer.modules.ddp_roots()
                ranks.check_replicas(step, [m for m in roots if not is_fsdp2(m)])
        try:
            # Before the new step opens: sent through an armed tracer after it opened, the
            # event would be the new step's first and make it a traced step of its own (the
            # code after the loop's last update, a step nothing else of which is traced).
            self._send_history()
            hold = self.holders.at_boundary(step)
            # Ranks armed by UIs meet in the periods they agree on (tracer/ranks.py).
            scope = self._agreed_period(step, hold.by_ui and not hold.gated)
            if scope is not None:
                hold.traced = hold.gated = True
            if self.publisher is not None:
                self.publisher.note_step(step)
            if hold.traced and self.tracer is not None and self.tracer.aten != self._aten_for(hold):
                self.tracer.stop()  # the aten level asked for changed: armed anew
                self.tracer = None
            if hold.traced and self.tracer is None:
                self._arm(step, hold)
            elif hold.traced and self.tracer is not None:
                self.tracer.boundary(step)
                if hold.released:
                    self._announce(hold.released)
            else:
                self._disarm(hold)
            self._step_opens(hold, scope or "")
        except Exception as exc:  # never into the job
            self._say(f"internal error at a step boundary: {type(exc).__name__}: {exc}")

    def _step_opens(self, hold: StepHold, scope: str) -> None:
        if self.tracer is not None:
            self.traced_steps += 1
            self.tracer.gate(hold.gated, scope)
            self.tracer.set_eager_check(self.options.eager_check or hold.eager_check)
        self.history.traced_now = self.tracer is not None

    def arm_between_cells(self) -> None:
        """Trace from now on, in the step that is open: a notebook's cell stopped before its
        update, and the kernel runs that step again in a later cell, with no boundary before
        it. Called between two cells, outside every hook of the job."""
        if self.tracer is not None:
            return
        step = self.clock.step
        try:
            hold = self.holders.at_boundary(step)
            if hold.traced:
                self._arm(step, hold)
            self._step_opens(hold, "")
        except Exception as exc:  # never into the job
            self._say(f"internal error arming between cells: {type(exc).__name__}: {exc}")

    # -- the run's history (training thread, at step boundaries) --------------------------------
    def _history_at_boundary(self, step: int) -> None:
        """The step before ``step`` gets its point; holds waiting on a condition are tested
        on the points that arrived (only here, never per op)."""
        history = self.history
        refused, spike = self.served_watch.marks(step - 1)
        skipped = self.clock.counted_by == BY_SCALER or refused  # a loss scaler's skip too
        added = (
            history.step_ends(step, skipped=skipped, spike=spike) if self.options.history else []
        )
        if not self.holders.held:
            history.eager = False
            return
        try:
            if added:
                for holder in self.holders.note(added):
                    cond = holder.condition.text if holder.condition else "?"
                    self._say(
                        f"{cond} at step {holder.fired_at}: tracing from step {step} "
                        f"(held by: {holder.label})"
                    )
            # A condition waiting on the loss: copy device values every step (still no wait).
            history.eager = self.holders.conditional()
        except Exception as exc:
            self._say(f"internal error testing a condition: {type(exc).__name__}: {exc}")

    def _send_history(self, every: float = 1.0) -> None:
        """New points as a live ``history`` event, in batches, while someone reads (a UI, a
        recording)."""
        points = self.history.take_unsent(every=every)
        if not points:
            return
        event = Event(
            kind=HISTORY,
            seq=self.next_seq(),
            # No step: the event belongs to no step (its points say which steps it covers).
            # A step would widen the file chunk's step range in the index, and a replay would
            # list a dormant step as a recorded one.
            step=None,
            points=[p.to_wire() for p in points],
        )
        tracer = self.tracer
        if tracer is not None and tracer.pipeline is not None:
            tracer.emit(event)  # in order after the step's events in flight
            return
        # Dormant, recording: the publisher would keep the event in its snapshot ring while
        # no UI reads (a long dormant run: thousands of them, module norms and all), and a UI
        # asks the agent for the whole history when it attaches anyway.
        publisher = self.publisher
        for sink in self.sinks:
            if sink is publisher and not publisher.subscribed:
                continue
            with contextlib.suppress(Exception):  # a sink reports its own failure
                sink([event])

    def steps_seen(self) -> tuple[int, int]:
        """(steps that ran, of them traced), once the job ended: every step that ended, and
        the last one if it traced something (the code after a loop's last update is no
        step); a job that never ended a step ran as one."""
        steps, traced = self.clock.step, self.traced_steps
        if self.last_step == "empty":
            traced -= 1
        elif self.last_step == "ran" or steps == 0 or self.clock.ended_unseen:
            steps += 1  # (a job that updates by hand ends its last step at its backward())
        return steps, max(traced, 0)

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

    def _aten_for(self, hold: StepHold) -> str | None:
        """The aten scope of the armed period: the command line's and the holders' together
        (None: off; "": every call)."""
        opts = self.options.aten
        asked = [*([] if opts is None or opts is False else ["" if opts is True else opts])]
        asked += hold.aten
        if not asked:
            return None
        if "" in asked:
            return ""
        return "|".join(f"(?:{a})" for a in dict.fromkeys(asked))

    def _arm(self, step: int, hold: StepHold) -> None:
        outer = current_tracer()
        if outer is not None:
            # The script's own torchscope.trace() block owns the mode now.
            if not self._blocked_said:
                self._blocked_said = True
                self._say("not arming while the script's torchscope.trace() block runs")
            return
        self._announce(hold.released, TRACED)
        opts = self.options
        tracer = Tracer(
            None,
            values=opts.values,
            keep=False,
            optimizer_ops=opts.optimizer_ops,
            aten=self._aten_for(hold),
            eager_check=opts.eager_check or hold.eager_check,
            sinks=self.sinks,
            driven=DrivenBy(self.stepper, step, self.next_seq),
            on_alert=self._on_alert(),
        )
        tracer.start()
        self.tracer = tracer
        self.armed_periods += 1
        self.served_watch.add_breakpoints()
        self._say_holders(f"tracing from step {step}")

    def _disarm(self, hold: StepHold | None = None, ended: bool = False) -> None:
        released = hold.released if hold is not None else []
        tracer, self.tracer = self.tracer, None
        self.ranks.forget_parameters()
        if tracer is not None:
            if self.stepper is not None:
                # The watch's pause points go with the tracer (added when it armed; a
                # dormant step has none to release, and pays nothing for it).
                self.stepper.release(WATCH_OWNER)
            tracer.stop()  # the armed period's last events are delivered first
            if ended:  # the last step, traced: did anything run in it?
                self.last_step = "empty" if tracer.last_step_empty else "ran"
            self._announce(released, DORMANT, ended=ended)
            if self.publisher is not None:
                # A dormant job keeps none of it: the UIs reading now get it all, one that
                # joins later starts from the next armed period.
                self.publisher.forget()
            if self.started:
                self._say_holders(f"dormant again at step {self.clock.step}", hold)
        elif released:
            self._announce(released)

    def _announce(self, released: list[int], state: str | None = None, ended: bool = False) -> None:
        """A ``tracing`` event: armed / dormant, who holds it, whose hold just ended (``ended``:
        the job itself did)."""
        if state is None:
            state = TRACED if self.tracer is not None else DORMANT
        event = Event(
            kind=TRACING,
            seq=self.next_seq(),
            step=self.clock.step,
            state=state,
            holders=self.holders.describe(),
            released=list(released),
            t=time.time(),
        )
        if ended:
            event["ended"] = True
        self.emit(event)

    def emit(self, event: Event) -> None:
        """Everything the agent says: through the armed tracer while there is one (in order
        after the step's events still in flight), else straight to the file and the UIs."""
        tracer = self.tracer
        if tracer is not None and tracer.pipeline is not None:
            tracer.emit(event)
        else:
            self.outputs.emit([event])

    def _tracing_state(self) -> str:
        if self.tracer is not None:
            return TRACED
        # A hold that waits for a condition leaves the job dormant until it holds.
        return ARMING if self.holders and self.holders.ready() else DORMANT

    # -- holders (control thread) ------------------------------------------------------------
    def _contact(self, client: bytes, cmd: str) -> None:
        """Any request renews its client's hold. Only a UI counts as a UI being there for
        the stepper (its pauses' lease, ``--wait``): a client that holds the job as a UI, or
        one that sends stepping commands; ``ls`` and ``record`` do not."""
        holder = self.holders.contact(client)
        is_ui = holder.is_ui if holder is not None else cmd in STEPPING_COMMANDS
        if is_ui and self.stepper is not None:
            self.stepper.contact(client)

    def _may_evaluate(self, client: Any) -> str | None:
        """Expressions (``evaluate``, ``edit``, a breakpoint with an action) run in the job
        only for a client that holds it (a UI attached to it, ``record PID``); the command
        line's own (client None) always."""
        if client is None or self.holders.contact(client) is not None:
            return None
        return (
            "refused: expressions run only for a client that holds this job "
            "(a UI attached to it, record PID)"
        )

    def _expire_leases(self) -> None:
        self.holders.expire(self.options.lease)

    def _on_tick(self) -> None:
        """Four times a second on the publisher's thread: leases, and the history's cadence
        (device values copied at the next boundary; points kept for events while read)."""
        self._expire_leases()
        history = self.history
        history.flush_soon = True
        history.sending = self._history_read()

    def _history_read(self) -> bool:
        """Whether live ``history`` events have a reader: a recording (``--record``,
        ``serve(record=...)``: the file carries every step's point, the steps before its
        traced ones too) or a UI subscribed to the stream."""
        writer = self.writer
        if writer is not None and writer.stopped is None:
            return True
        publisher = self.publisher
        return publisher is not None and publisher.subscribed

    def _cmd_history(self, args: dict[str, Any], client: bytes) -> dict[str, Any]:
        """The run's history (``RunHistory.to_wire()``: ``points``, ``buckets``), or the points
        after ``since``; with ``latest``, ``pending`` (values still on the device: they come
        at the next boundaries, in live ``history`` events), ``step`` and a ``seq`` for a
        recording."""
        history = self.history
        history.flush_soon = True
        reply = history.wire(args.get("since"), args.get("max_points"))
        reply.update(step=self.clock.step, seq=self.next_seq())
        return _fit_reply(reply)

    def _cmd_arm(self, args: dict[str, Any], client: bytes) -> dict[str, Any]:
        by = args.get("by") or UI
        aten = args.get("aten")
        aten_scope(aten)  # a bad pattern is refused in one line (ValueError)
        when = args.get("when")
        condition = None
        if when is not None:
            try:
                condition = parse_condition(when)
            except ValueError as exc:
                raise ValueError(f"when: {exc}") from None
            if not self.options.history:
                # Conditions are tested on the history's points: none would ever come.
                raise ValueError(
                    f"when: {when!r} is tested on the run's history, which this job does "
                    "not keep (served with history=False)"
                )
            if condition.metric == "gradnorm" and not self.served_watch.will_watch():
                raise ValueError(
                    f"when: {when!r} needs the gradient norm, which only the watch "
                    "computes (torchscope watch PID, or run --watch nan)"
                )
        holder = self.holders.add(
            by,
            client=client,
            remaining=args.get("next"),
            aten=aten,
            eager_check=bool(args.get("eager_check")),
            also=bool(args.get("also")),
            from_step=args.get("at_step"),
            condition=condition,
        )
        if by == UI and self.stepper is not None:
            self.stepper.contact(client)
        if self._periods is not None:
            self._periods.retry()
        return self._armed_reply(holder.id)

    def _cmd_disarm(self, args: dict[str, Any], client: bytes) -> dict[str, Any]:
        """This client lets go: its hold, its breakpoints, and (the last UI) its pauses."""
        return self._armed_reply(self.holders.release(client))

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
    def _say_holders(self, text: str, hold: StepHold | None = None) -> None:
        """One line when a UI or a recorder arms or leaves (the command line's own steps
        are what the user asked for: nothing to say)."""
        clients = self.holders.client_labels()
        if clients or (hold is not None and hold.client_left):
            who = ", ".join(sorted(set(clients))) or "nobody"
            self._say(f"{text} (held by: {who})")

    def _say(self, text: str, force: bool = False) -> None:
        if self.options.quiet and not force:
            return
        say(text)


def _served_watch(agent: Agent) -> ServedWatch:
    """The agent's NaN watch, given what it needs of the agent: its options, clock, holders
    and history; its tracer, stepper and sinks as they are when asked; its emit and say."""
    return ServedWatch(
        agent.options,
        agent.clock,
        agent.holders,
        agent.history,
        tracer=lambda: agent.tracer,
        stepper=lambda: agent.stepper,
        sinks=lambda: agent.sinks,
        next_seq=agent.next_seq,
        emit=agent.emit,
        on_alert=agent._on_alert,
        say=agent._say,
        arm_between_cells=agent.arm_between_cells,
        multi_rank=agent._multi_rank,
    )


def _fit_reply(reply: dict[str, Any]) -> dict[str, Any]:
    """Keep a ``history`` reply decodable by the client's limit: module norms go from the
    older points first, then the oldest points (``truncated`` says so)."""
    limit = MAX_MESSAGE_BYTES // 2
    points = reply["points"]
    if len(pack(reply)) <= limit:
        return reply
    for p in points[: max(0, len(points) - 1000)]:
        p.pop("module_norms", None)
        p.pop("update_ratios", None)
    reply["truncated"] = True
    while points and len(pack(reply)) > limit:
        points = reply["points"] = points[len(points) // 2 :]
    return reply


def _on_sigterm(signum: int, frame: Any) -> None:
    agent = _agent
    if agent is not None:
        with contextlib.suppress(Exception):  # the job is ending anyway
            agent.stop()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _forget_in_child(ref: weakref.ref[Agent]) -> None:
    global _agent
    agent = ref()
    if agent is not None:
        with contextlib.suppress(Exception):  # the job is ending anyway
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

    agent = Agent(Options(metadata={"attached": True}))
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
                    with contextlib.suppress(Exception):  # an odd optimizer state: not a step
                        best = max(best, int(step))
    return best


def serve(options: Options | None = None) -> Agent:
    """Start this process's agent, or return the running one (idempotent)."""
    if _agent is not None:
        return _agent
    return Agent(options).start()
