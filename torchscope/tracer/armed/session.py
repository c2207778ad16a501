"""The armed session: a period of tracing on one thread, from ``start()`` to ``stop()``.

``Tracer`` keeps the lifecycle, the results (``ops``, ``grads``...), the steps and the mode on
the stack, and one ``emit()``. What it records comes from one recorder per level (forward
ops: :mod:`.forward`, backward nodes: :mod:`.backward`), which share the tensor summaries
(:mod:`.tensors`), the pipeline (:mod:`.pipeline`) and the pauser (:mod:`.pausing`). Where its
events go (file, live stream, stepper) is :class:`~torchscope.tracer.outputs.Outputs`: its own
for ``trace()``, the agent's when the agent arms it (:class:`DrivenBy`).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from torchscope.analysis.trace import Trace
from torchscope.protocol.codec import PROTOCOL_VERSION
from torchscope.protocol.events import ERROR, SESSION, STEP, Event
from torchscope.protocol.tracefile import per_rank_path
from torchscope.tracer.armed import caller_warnings
from torchscope.tracer.armed.aten import (
    AtenMode,
    AtenRecorder,
    AtenScope,
    WholeNodes,
    aten_scope,
)
from torchscope.tracer.armed.backward import BackwardRecorder
from torchscope.tracer.armed.compiled import CompiledCalls, arm_compiled_functions
from torchscope.tracer.armed.forward import ForwardMode, ForwardRecorder
from torchscope.tracer.armed.interrupt import EVAL_BUDGET_S
from torchscope.tracer.armed.modules import ModuleTracker
from torchscope.tracer.armed.pausing import Pauser, WaitingPause
from torchscope.tracer.armed.pipeline import EventPipeline, Sink
from torchscope.tracer.armed.recorder_shared import THIS_THREAD
from torchscope.tracer.armed.source import user_frame
from torchscope.tracer.armed.summary import Summarizer
from torchscope.tracer.armed.tensors import TensorSummaries
from torchscope.tracer.clock import StepClock
from torchscope.tracer.errors import ReportOnce
from torchscope.tracer.in_place import modules_compiled_in_place
from torchscope.tracer.outputs import Outputs
from torchscope.tracer.ranks import env_int, job_id, say
from torchscope.tracer.stepper import Stepper
from torchscope.tracer.steps import parse_steps

_current: Tracer | None = None
# Node ids live in node metadata, which outlives a tracer (a graph built under one run and
# backpropagated under the next): ids are unique per process, and op links carry their run.
_new_node_id = itertools.count(1).__next__
_runs = itertools.count(1)


def current_tracer() -> Tracer | None:
    return _current


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker) is not the traced job: it inherits the mode on
    its stack, the global hooks and the parent's open trace file, and must use none of them.
    Without this, workers trace their own ops (slowly) and write them into the parent's file.
    """
    global _current
    tracer, _current = _current, None
    if tracer is not None:
        with contextlib.suppress(Exception):  # forked child: the parent's tracer is not ours
            tracer.abandon()


os.register_at_fork(after_in_child=_forget_in_child)


@dataclass
class DrivenBy:
    """What a tracer takes from the agent that arms it (see torchscope.tracer.agent)."""

    stepper: Stepper | None
    step: int  # the job's current step
    next_seq: Callable[[], int]  # one numbering for every armed period of the process


class Tracer:
    """Traces forward ops and backward nodes of the thread that starts it.

    Use ``torchscope.trace(...)`` rather than building one directly.
    """

    def __init__(
        self,
        record: str | os.PathLike | None = None,
        *,
        steps: str | int | None = None,
        values: int = 16,
        keep: bool | int = True,
        optimizer_steps: bool = True,
        optimizer_ops: bool = False,
        live: bool | None = None,
        breakpoints: Sequence[dict[str, Any]] = (),
        wait: bool = False,
        lease: float = 10.0,
        stepping: bool = False,
        metadata: dict[str, Any] | None = None,
        sinks: Sequence[Sink] = (),
        driven: DrivenBy | None = None,
        on_alert: Callable[[Event], None] | None = None,
        aten: bool | str | None = None,
        eager_check: bool = False,
        eval_budget: float = EVAL_BUDGET_S,
    ) -> None:
        self.steps = parse_steps(steps)
        # Each call of a compiled module also runs eagerly, compared (tracer/armed/eager_check).
        self.eager_check = eager_check
        self.aten = aten if aten is not False else None  # as asked (the agent compares it)
        self.aten_scope = aten_scope(aten)  # None: the aten level is off
        self.record = per_rank_path(os.fspath(record)) if record is not None else None
        self.optimizer_steps = optimizer_steps
        self.optimizer_ops = optimizer_ops
        self.live = os.environ.get("TORCHSCOPE_LIVE") == "1" if live is None else live
        self.metadata = dict(metadata or {})
        self._sinks = list(sinks)  # the caller's; each start adds the file and the stream
        self.outputs = Outputs()
        # Driven by the process-long agent (torchscope.tracer.agent), the tracer lives while
        # armed: the agent owns the step clock, the stepper, the live stream and the numbering.
        self.driven = driven
        self.clock: StepClock | None = None
        if driven is None:
            driven = DrivenBy(None, 0, itertools.count().__next__)
            if self.live or breakpoints or wait or stepping:
                hint = f"attach: torchscope tui {os.getpid()}" if self.live else ""
                driven.stepper = self.outputs.start_stepper(
                    breakpoints,
                    lease_seconds=lease,
                    wait_for_ui=wait,
                    attach_hint=hint,
                    eval_budget=eval_budget,
                )
            # Standalone, the tracer counts steps itself; driven, the agent's clock calls the
            # same three methods (update_begins, update_ends, boundary). Without optimizer
            # steps, and with the update's ops traced, it hooks no optimizer: it only takes
            # torchscope.step().
            self.clock = StepClock(
                self,
                optimizer_steps=optimizer_steps,
                optimizer_hooks=optimizer_steps or not optimizer_ops,
            )
        self.stepper = driven.stepper
        self.step_index = driven.step
        self.next_seq = driven.next_seq
        max_events = None if keep is True else (int(keep) if keep else 0)
        self.trace = Trace()
        if max_events:
            self.trace.events = deque(maxlen=max_events)  # keep=N: the newest N
        self._keep = bool(keep)
        self.summarizer = Summarizer(values)
        self.modules = ModuleTracker()
        self.summaries = TensorSummaries(self.summarizer, self.modules.param_name)
        self.run_id = next(_runs)
        self._report_once = ReportOnce("", "tracing continues")
        self._on_alert = on_alert
        self._owner = threading.get_ident()
        self._owner_name = THIS_THREAD.name
        self.mode: ForwardMode | None = None  # built at start(), with the recorders
        self.backward: BackwardRecorder | None = None
        self.aten_mode: AtenMode | None = None  # pushed with the function mode (everywhere)
        self.aten_scoped: AtenScope | None = None  # or pushed inside its modules only
        self._closure_hook: Any = None  # traces optimizer.step(closure)'s closure
        self.compiled_calls: CompiledCalls | None = None
        self.last_step_empty = False  # set at stop: the last step traced nothing
        self._mode_pushed = False
        self.step_traced = False
        # Meet the other ranks before collectives (set by the agent while the command line
        # holds every rank traced alike); the gate is found once the process group exists.
        self.gated = False
        self.gate_scope = ""  # the agreed period of UI-armed ranks (tracer/ranks.py)
        self._gate: Any = None
        self._forward_collectives: Any = None  # the module calls that communicate (ranks)
        self.pipeline: EventPipeline | None = None
        self._last_chunk = time.monotonic()
        self.started = False
        self._outer: Tracer | None = None
        self._nested_sinks: list[Sink] = []

    @property
    def publisher(self) -> Any:
        return self.outputs.publisher

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> Tracer:
        global _current
        if self.started:
            return self
        if _current is not None:
            return self._start_nested(_current)
        outputs = self.outputs
        session = self._session_event() if self.driven is None else None
        outputs.sinks = list(self._sinks)
        if self._keep:
            outputs.sinks.insert(0, self.trace.events.extend)
        if self.record is not None:
            outputs.open_file(self.record, session)
        if self.live and session is not None:
            outputs.start_publisher(session, self.step_index, lambda: self.step_index, say)
        pipeline = self.pipeline = EventPipeline(
            self.summarizer,
            outputs.sinks,
            self.next_seq,
            on_error=self.report_error,
            on_idle=self._tick,
        )
        if self._on_alert is not None:
            pipeline.alerts.on_alert = self._on_alert
        self._owner = self.modules.owner = threading.get_ident()
        self._owner_name = THIS_THREAD.name
        self._build_recorders(pipeline)
        try:
            arm_compiled_functions(self.compiled_calls)
            for root in modules_compiled_in_place():  # found before their first call
                self.modules.index_root(root)
        except Exception as exc:
            self.report_error("finding compiled functions", exc)
        caller_warnings.install()
        _current = self
        self.started = True
        if session is not None:
            self.emit(session)
        if self.clock is not None:
            self.clock.install()
        # After the clock's hook, which takes the update as it is.
        self._closure_hook = register_optimizer_step_pre_hook(self._trace_closure)
        self._begin_step()
        return self

    def _build_recorders(self, pipeline: EventPipeline) -> None:
        pauser = None
        if self.stepper is not None:
            pauser = Pauser(
                self.stepper,
                self,
                pipeline,
                self.emit,
                self.next_seq,
                self.report_error,
                self._owner,
            )
        parts = (self, pipeline, self.summaries, self.modules, self.next_seq, self.report_error)
        ids = {
            "run_id": self.run_id,
            "new_node_id": _new_node_id,
            "pauser": pauser,
            "no_dispatch": self.aten_scope is not None,
        }
        self.backward = BackwardRecorder(*parts, **ids)
        forward = ForwardRecorder(*parts, **ids)
        self.mode = ForwardMode(forward, self.backward)
        if self.aten_scope is not None:
            done = self.backward.done_nodes = set()
            forward.aten = aten = AtenRecorder(
                *parts, **ids, scope=self.aten_scope, done_nodes=done
            )
            mode = AtenMode(aten)
            # The nodes whose formula a dispatch mode would change run without it.
            self.backward.whole_nodes = WholeNodes(mode, aten)
            if self.aten_scope.pattern:
                self.aten_scoped = self.backward.aten_scope = AtenScope(
                    mode, self.aten_scope, self.modules
                )
            else:
                self.aten_mode = mode
        self.modules.listener = self.aten_scoped  # rides on the tracker's module hooks
        self.compiled_calls = CompiledCalls(
            forward, self._is_our_mode, self.report_error, self.emit
        )
        self.compiled_calls.eager_check = self.eager_check
        self.compiled_calls.hide_module_hooks = self.modules.hide_global_hooks
        self.modules.compiled_calls = self.compiled_calls

    def _start_nested(self, outer: Tracer) -> Tracer:
        """``trace()`` inside a traced run (``torchscope run`` of a script that calls it):
        the outer tracer keeps tracing and this one collects what it emits meanwhile, of the
        steps this one asked for (counted from its start; the events keep the outer run's
        numbers). From another thread than the traced one it collects nothing, and says so:
        one thread is traced per process, and the outer run's events are not this one's."""
        self._outer = outer
        self._nested_sinks = []
        self.started = True
        if threading.get_ident() != outer._owner:
            print(
                f"torchscope: trace() on thread {THIS_THREAD.name!r} is not traced: "
                f"{outer._owner_name!r} is (one traced thread per process)",
                file=sys.stderr,
            )
            return self
        sinks: list[Sink] = []
        if self._keep:
            sinks.append(self.trace.events.extend)
        if self.record is not None:
            from torchscope.protocol.tracefile import TraceWriter

            writer = self.outputs.writer = TraceWriter(
                self.record, metadata={"nested_in": outer.record}
            )
            sinks.append(writer.write)
        if not self.steps.all_steps:
            sinks = [_of_steps(sink, self.steps, outer.step_index) for sink in sinks]
        self._nested_sinks = sinks
        assert outer.pipeline is not None
        with outer.pipeline.lock:
            outer.pipeline.flush(wait=True)  # what came before belongs to the outer run only
            outer.pipeline.sinks.extend(sinks)
        return self

    def _stop_nested(self) -> None:
        outer = self._outer
        assert outer is not None and outer.pipeline is not None
        with outer.pipeline.lock:
            outer.pipeline.flush(wait=True)
            for sink in self._nested_sinks:
                outer.pipeline.sinks.remove(sink)
        self.outputs.close()
        self._outer = None

    def abandon(self) -> None:
        """Stop tracing in a forked child without touching what the parent owns: no flush, no
        file write, no lock (another parent thread may have held one at the fork)."""
        self.started = False
        if self.mode is not None:
            self._enable_modes(False)
            if self._mode_pushed:
                self._pop_modes()
        self._mode_pushed = False
        if self.clock is not None:
            self.clock.remove()
        self._remove_closure_hook()
        arm_compiled_functions(None)
        self.modules.remove()
        if self.aten_scoped is not None:
            self.aten_scoped.forget()
        self.outputs.writer = self.outputs.publisher = None
        if self.pipeline is not None:
            self.pipeline.sinks = []

    def stop(self) -> None:
        global _current
        if not self.started:
            return
        self.started = False
        if self._outer is not None:
            self._stop_nested()
            return
        try:
            self._set_active(False)
            if self.clock is not None:
                self.clock.remove()
            self._remove_closure_hook()
            arm_compiled_functions(None)
            self.modules.remove()
            assert self.pipeline is not None
            # Its STEP event still waiting: nothing ran in the last step (after the loop).
            self.last_step_empty = self.pipeline.step_pending
            self.pipeline.close()
        finally:
            try:
                self.outputs.close()  # after the pipeline: the last events go before "bye"
            finally:
                _current = None

    def __enter__(self) -> Tracer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- results ---------------------------------------------------------------------------
    @property
    def events(self) -> list[Event]:
        return list(self.trace.events)

    @property
    def ops(self) -> list[Event]:
        return self.trace.ops

    @property
    def grads(self) -> list[Event]:
        return self.trace.grads

    @property
    def graphs(self) -> list[Event]:
        return self.trace.graphs

    @property
    def alerts(self) -> list[Event]:
        return self.trace.alerts

    @property
    def errors(self) -> list[Event]:
        return self.trace.errors

    def grads_of(self, node: str) -> list[Event]:
        return self.trace.grads_of(node)

    # -- steps (called by the step clock, on the training thread) ---------------------------
    def update_begins(self, args: tuple, kwargs: dict) -> bool:
        """``optimizer.step()`` begins; True when the mode was left (to re-enter if it raises).
        A closure given to it is traced while it runs (``_trace_closure``)."""
        if self.optimizer_ops or self.mode is None:
            return False
        # The update's own ops (one or more per parameter) are not the model's ops; skipping
        # them halves a small model's cost. A NaN the update writes into a weight is still
        # caught: it shows up as a non-finite parameter at its first use (an input alert).
        self._enable_modes(False)
        # Off the mode stack, the update's calls (p.grad reads, add_, several per parameter)
        # do not even reach the mode: they run exactly as they would untraced.
        if self._mode_pushed:
            self._pop_modes()
        return True

    def _trace_closure(self, optimizer: Any, args: tuple, kwargs: dict) -> Any:
        """``optimizer.step(closure)`` (Lightning's automatic optimization, LBFGS): the closure
        runs the model's forward and backward inside ``step()``; it is traced while it runs,
        and the update around it is not, as without a closure."""
        if self.optimizer_ops or not self.started or threading.get_ident() != self._owner:
            return None
        in_args = len(args) > 1
        closure = args[1] if in_args else kwargs.get("closure")
        if closure is None:
            return None

        def traced_closure(*a: Any, **k: Any) -> Any:
            leave = self.step_traced and self.mode is not None and not self._mode_pushed
            if leave:
                self._set_active(True)
            try:
                return closure(*a, **k)
            finally:
                if leave and self.started:
                    self.update_begins((), {})  # the rest of step() is the update

        if in_args:
            return (args[0], traced_closure, *args[2:]), kwargs
        return args, {**kwargs, "closure": traced_closure}

    def _remove_closure_hook(self) -> None:
        if self._closure_hook is not None:
            self._closure_hook.remove()
            self._closure_hook = None

    def update_ends(self) -> None:
        """``optimizer.step()`` returned (or raised) without ending the step."""
        if self.started and threading.get_ident() == self._owner:
            self._set_active(self.step_traced)

    def boundary(self, step: int) -> None:
        """Step ``step`` begins: re-enters the mode when it is traced."""
        if not self.started:
            return
        try:
            assert self.pipeline is not None
            self.pipeline.flush()
            self.summaries.begin_step()
            self.step_index = step
            if self.outputs.publisher is not None:
                self.outputs.publisher.note_step(step)  # untraced steps show progress too
            self._begin_step()
        except Exception as exc:
            self.report_error("advancing the step", exc)

    def _begin_step(self) -> None:
        traced = self.step_index in self.steps
        backward, pipeline = self.backward, self.pipeline
        assert backward is not None and pipeline is not None  # built at start()
        backward.begin_step()
        self.summaries.forget_uninitialized()
        self._set_active(traced)
        if traced:
            step = Event(kind=STEP, seq=self.next_seq(), step=self.step_index, t=time.time())
            pipeline.open_step(step)

    def _set_active(self, active: bool) -> None:
        """Enter or leave the traced state; untraced steps run with no mode and no hooks."""
        self.step_traced = active
        if active:
            self.modules.install()
        else:
            self.modules.remove()
            if self.aten_scoped is not None:
                self.aten_scoped.forget()
        self._enable_modes(active)
        on_owner = threading.get_ident() == self._owner
        if active and not self._mode_pushed and on_owner:
            assert self.mode is not None  # built at start()
            self.mode.__enter__()
            if self.aten_mode is not None:
                self.aten_mode.__enter__()
            self._mode_pushed = True
        elif not active and self._mode_pushed and on_owner:
            self._pop_modes()

    def _enable_modes(self, enabled: bool) -> None:
        assert self.mode is not None  # built at start()
        self.mode.enabled = enabled
        if self.aten_mode is not None:
            self.aten_mode.enabled = enabled

    def _is_our_mode(self, mode: Any) -> bool:
        return mode is self.mode or isinstance(mode, AtenMode)

    def _pop_modes(self) -> None:
        """Our modes off their stacks, each only if it is on top (a mode the job pushed since
        stays, and ours under it: leaving it disabled is all that can be done)."""
        aten = self.aten_mode
        if aten is not None:
            n = torch._C._len_torch_dispatch_stack()
            if n > 0 and torch._C._get_dispatch_stack_at(n - 1) is aten:
                aten.__exit__(None, None, None)
        n = torch._C._len_torch_function_stack()
        if n > 0 and torch._C._get_function_stack_at(n - 1) is self.mode:
            self.mode.__exit__(None, None, None)
            self._mode_pushed = False

    def set_eager_check(self, on: bool) -> None:
        """Whether this step's compiled calls also run eagerly, compared (set per step)."""
        self.eager_check = on
        if self.compiled_calls is not None:
            self.compiled_calls.eager_check = on

    def gate(self, gated: bool, scope: str) -> None:
        """Whether this step's collectives meet the other ranks first, in which agreed period
        (set by the agent at each step boundary; tracer/ranks.py)."""
        self.gated = gated
        self.gate_scope = scope
        # And before a top-level module call whose forward communicates (DDP's broadcast of
        # buffers, FSDP's all-gathers): asked only while gated, at top-level calls only.
        self.modules.before_root = self._before_forward if gated else None

    def _before_forward(self, module: Any) -> None:
        calls = self._forward_collectives
        if calls is None:
            from torchscope.tracer.forward_collectives import ForwardCollectives

            calls = self._forward_collectives = ForwardCollectives()
        what = calls.before(module)
        if what is not None:
            self.meet_ranks(what)

    def meet_ranks(self, what: str) -> None:
        """With every rank traced alike (the command line's steps), meet the other ranks
        before a collective, so a rank paused here never makes them time out (tracer/ranks)."""
        gate = self._gate
        if gate is None:
            from torchscope.tracer.ranks import RankGate

            gate = self._gate = RankGate.for_job(say)
            if gate is None:
                return
        backward, pause = self.backward, None
        if backward is not None and backward.pauser is not None:
            name = what.removesuffix("()")
            pause = WaitingPause(backward.pauser, lambda: backward.op_stub(name, [], user_frame(1)))
        gate.meet(self.step_index, what, self.gate_scope, pause)

    # -- events ----------------------------------------------------------------------------
    def emit(self, event: Event) -> None:
        """Send ``event`` after every event of this period still in flight."""
        pipeline = self.pipeline
        assert pipeline is not None
        with pipeline.lock:
            pipeline.add(event)

    def _tick(self) -> None:
        """Watchdog thread, a few times a second: buffered file events reach the disk."""
        writer = self.outputs.writer
        if writer is not None and time.monotonic() - self._last_chunk >= 0.5:
            writer.flush()
            self._last_chunk = time.monotonic()

    def report_error(self, where: str, exc: BaseException) -> None:
        """An error inside the tracer: said once per place and kind, never raised to the job."""
        message = self._report_once(where, exc)
        if message is None or self.pipeline is None:
            return
        with contextlib.suppress(Exception):  # reporting the error must not raise another
            self.emit(
                Event(
                    kind=ERROR,
                    seq=self.next_seq(),
                    step=self.step_index,
                    where=where,
                    message=message,
                )
            )

    def _session_event(self) -> Event:
        return session_event(
            self.next_seq(),
            self.step_index,
            steps=self.steps.text,
            values=self.summarizer.value_limit,
            record=self.record,
            metadata=self.metadata,
        )


def session_event(
    seq: int,
    step: int,
    *,
    steps: str,
    values: int,
    record: str | None,
    metadata: dict[str, Any],
) -> Event:
    """The event that opens a trace and answers a UI's hello: who this job is."""
    main = sys.modules.get("__main__")
    fields = dict(
        kind=SESSION,
        seq=seq,
        step=step,
        protocol=list(PROTOCOL_VERSION),
        pid=os.getpid(),
        host=socket.gethostname(),
        argv=list(sys.argv),
        script=getattr(main, "__file__", None),
        cwd=os.getcwd(),
        started=time.time(),
        rank=env_int("RANK"),
        world_size=env_int("WORLD_SIZE"),
        local_rank=env_int("LOCAL_RANK"),
        job=job_id(),
        torch=str(torch.__version__),  # plain str, as it reads back from a file
        python=sys.version.split()[0],
        steps=steps,
        values=values,
        # A UI that had to drop old steps reloads them from here.
        record=os.path.abspath(record) if record else None,
    )
    fields.update(metadata)
    return Event(fields)


def _of_steps(sink: Sink, steps: Any, first: int) -> Sink:
    """``sink`` for the events of ``steps``, counted from step ``first`` (a nested trace's
    own selection); events of no step pass."""

    def of_steps(events: list[Event]) -> None:
        kept = [e for e in events if type(e.get("step")) is not int or e["step"] - first in steps]
        if kept:
            sink(kept)

    return of_steps
