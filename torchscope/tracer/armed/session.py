"""The tracer: one object that owns the mode, the hooks, the step counter and the event flow."""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._C._autograd import _get_sequence_nr

from torchscope.protocol.breakpoints import AFTER, BEFORE
from torchscope.protocol.codec import PROTOCOL_VERSION
from torchscope.protocol.events import (
    ERROR,
    GRAD,
    GRAPH,
    OP,
    PAUSE,
    RESUME,
    SESSION,
    STEP,
    Event,
    Trace,
    all_finite,
)
from torchscope.protocol.tracefile import per_rank_path
from torchscope.tracer.armed import caller_warnings
from torchscope.tracer.armed.backward import (
    NODE_ID,
    NODE_MOD,
    NODE_OP,
    NODE_RUN,
    NODE_SRC,
    NodeHooks,
    NodeInfo,
    node_name,
    root_tensors,
)
from torchscope.tracer.armed.collectives import COLLECTIVES, group_size, is_async, written_tensors
from torchscope.tracer.armed.forward import (
    ForwardMode,
    iter_tensors,
    overwrites_first_input,
    result_tensors,
    writes_inputs,
)
from torchscope.tracer.armed.modules import ModuleTracker, is_fsdp2
from torchscope.tracer.armed.pipeline import EventPipeline, Sink
from torchscope.tracer.armed.source import thread_stack, user_frame, user_site
from torchscope.tracer.armed.summary import Summarizer, SummaryMemo, tensor_meta
from torchscope.tracer.clock import StepClock
from torchscope.tracer.ranks import env_int, job_id
from torchscope.tracer.stepper import PausePoint, Stepper, stepping_commands
from torchscope.tracer.steps import parse_steps

UNINITIALIZED_OPS = frozenset(
    {
        "torch.empty",
        "torch.empty_like",
        "torch.empty_strided",
        "torch.empty_permuted",
        "Tensor.new_empty",
        "Tensor.new_empty_strided",
        # FSDP2's all-gather buffer: this rank's shard copied into a torch.empty buffer
        # whose other shards only the collective after it fills.
        "fsdp.all_gather_copy_in",
    }
)

_current: Tracer | None = None
# Node ids live in node metadata, which outlives a tracer (a graph built under one run and
# backpropagated under the next): ids are unique per process, and op links carry their run.
_node_ids = itertools.count(1)
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
        with contextlib.suppress(Exception):
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
        breakpoints: list[dict[str, Any]] = (),  # type: ignore[assignment]
        wait: bool = False,
        lease: float = 10.0,
        stepping: bool = False,
        metadata: dict[str, Any] | None = None,
        sinks: list[Sink] = (),  # type: ignore[assignment]
        driven: DrivenBy | None = None,
    ) -> None:
        self.steps = parse_steps(steps)
        # Driven by the process-long agent (torchscope.tracer.agent): it owns the step clock,
        # the stepper, the live stream and the numbering; this tracer lives while armed.
        self.driven = driven
        self.record = per_rank_path(os.fspath(record)) if record is not None else None
        self.optimizer_steps = optimizer_steps
        self.optimizer_ops = optimizer_ops
        self.live = os.environ.get("TORCHSCOPE_LIVE") == "1" if live is None else live
        self.publisher: Any = None
        # Step-through control, whenever a UI could attach or the job was told where to stop.
        self.stepper: Stepper | None = driven.stepper if driven is not None else None
        if driven is None and (self.live or breakpoints or wait or stepping):
            self.stepper = Stepper(
                lease_seconds=lease,
                wait_for_ui=wait,
                attach_hint=f"attach: torchscope tui {os.getpid()}" if self.live else "",
            )
            for spec in breakpoints:
                self.stepper.add_breakpoint(spec)
        self.metadata = dict(metadata or {})
        max_events = None if keep is True else (int(keep) if keep else 0)
        self.trace = Trace()
        if max_events:
            self.trace.events = deque(maxlen=max_events)  # type: ignore[assignment]
        self._keep = bool(keep)
        self.summarizer = Summarizer(values)
        self.memo = SummaryMemo()
        self.modules = ModuleTracker()
        self.mode = ForwardMode(self)
        self.step_index = driven.step if driven is not None else 0
        self.step_traced = False
        self.next_seq = driven.next_seq if driven is not None else itertools.count().__next__
        self._node_ids = _node_ids
        self.run_id = next(_runs)
        self._backward_index = 0
        self._errors_seen: set[tuple[str, str]] = set()
        self._owner = threading.get_ident()
        self._owner_name = _thread_name()
        self._mode_pushed = False
        # Standalone, the tracer counts steps itself; driven, the agent's clock calls the
        # same three methods (update_begins, update_ends, boundary).
        self.clock: StepClock | None = None
        if driven is None and (optimizer_steps or not optimizer_ops):
            self.clock = StepClock(self, optimizer_steps=optimizer_steps)
        self._writer: Any = None
        # Meet the other ranks before collectives (set by the agent while the command line
        # holds every rank traced alike); the gate is found once the process group exists.
        self.gated = False
        self.gate_scope = ""  # the agreed period of UI-armed ranks (tracer/ranks.py)
        # Storages of this step's uninitialised outputs (torch.empty...): their views are too.
        self._uninit_storages: set[int] = set()
        self._gate: Any = None
        self._extra_sinks = list(sinks)
        self.pipeline: EventPipeline | None = None
        self._last_chunk = time.monotonic()
        self.started = False
        self._outer: Tracer | None = None
        self._nested_sinks: list[Sink] = []

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> Tracer:
        global _current
        if self.started:
            return self
        if _current is not None:
            return self._start_nested(_current)
        session = self._session_event() if self.driven is None else None
        sinks: list[Sink] = list(self._extra_sinks)
        if self._keep:
            sinks.insert(0, self.trace.events.extend)
        if self.record is not None:
            from torchscope.protocol.tracefile import TraceWriter

            meta = {"session": dict(session)} if session is not None else {}
            self._writer = TraceWriter(self.record, metadata=meta)
            sinks.append(self._writer.write)
        if self.live and session is not None:
            self._start_publisher(session, sinks)
        self.pipeline = EventPipeline(
            self.summarizer, sinks, self.next_seq, on_error=self.report_error, on_idle=self._tick
        )
        self._owner = self.modules.owner = threading.get_ident()
        self._owner_name = _thread_name()
        caller_warnings.install()
        _current = self
        self.started = True
        if session is not None:
            with self.pipeline.lock:
                self.pipeline.add(session)
        if self.clock is not None:
            self.clock.install()
        self._begin_step()
        return self

    def _start_publisher(self, session: Event, sinks: list[Sink]) -> None:
        """Stream events to UIs; a job whose live view cannot start still runs, traced."""
        from torchscope.tracer.publisher import EventPublisher  # pyzmq only when live

        try:
            self.publisher = EventPublisher(session, sndhwm=100).start()
        except Exception as exc:  # unsafe runtime dir, bad TORCHSCOPE_BIND, bind failure
            print(f"torchscope: live view disabled: {exc}", file=sys.stderr)
            self.publisher = None
            return
        self.publisher.note_step(self.step_index)
        sinks.append(self.publisher)
        if self.stepper is not None:
            self.publisher.commands.update(stepping_commands(self.stepper, lambda: self.step_index))
            self.publisher.on_request = lambda client, cmd: self.stepper.contact(client)

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
                f"torchscope: trace() on thread {_thread_name()!r} is not traced: "
                f"{outer._owner_name!r} is (one traced thread per process)",
                file=sys.stderr,
            )
            return self
        sinks: list[Sink] = []
        if self._keep:
            sinks.append(self.trace.events.extend)
        if self.record is not None:
            from torchscope.protocol.tracefile import TraceWriter

            self._writer = TraceWriter(self.record, metadata={"nested_in": outer.record})
            sinks.append(self._writer.write)
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
        assert outer.pipeline is not None
        with outer.pipeline.lock:
            outer.pipeline.flush(wait=True)
            for sink in self._nested_sinks:
                outer.pipeline.sinks.remove(sink)
        if self._writer is not None:
            self._writer.close()
        self._outer = None

    def abandon(self) -> None:
        """Stop tracing in a forked child without touching what the parent owns: no flush, no
        file write, no lock (another parent thread may have held one at the fork)."""
        self.started = False
        self.mode.enabled = False
        if self._mode_pushed and self._mode_on_top():
            self.mode.__exit__(None, None, None)
        self._mode_pushed = False
        if self.clock is not None:
            self.clock.remove()
        self.modules.remove()
        self._writer = None
        self.publisher = None
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
            self.modules.remove()
            assert self.pipeline is not None
            self.pipeline.close()
            if self._writer is not None:
                self._writer.close()
        finally:
            if self.publisher is not None:
                self.publisher.close()  # after the pipeline: the last events go before "bye"
                self.publisher = None
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
        """``optimizer.step()`` begins; True when the mode was left (to re-enter if it raises)."""
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        if self.optimizer_ops or closure is not None:
            return False  # a closure (LBFGS) runs the model's own forward and backward in step()
        # The update's own ops (one or more per parameter) are not the model's ops; skipping
        # them halves a small model's cost. A NaN the update writes into a weight is still
        # caught: it shows up as a non-finite parameter at its first use (an input alert).
        self.mode.enabled = False
        # Off the mode stack, the update's calls (p.grad reads, add_, several per parameter)
        # do not even reach the mode: they run exactly as they would untraced.
        if self._mode_pushed and self._mode_on_top():
            self.mode.__exit__(None, None, None)
            self._mode_pushed = False
        return True

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
            # A fresh step forgets old summaries: code that updates weights through `.data` or
            # numpy bypasses the version counter the memo trusts within a step.
            self.memo.clear()
            self.step_index = step
            if self.publisher is not None:
                self.publisher.note_step(step)  # untraced steps show progress too
            self._begin_step()
        except Exception as exc:
            self.report_error("advancing the step", exc)

    def advance_step(self) -> None:
        """End the current step and begin the next one (``torchscope.step()``)."""
        if self.clock is not None:
            self.clock.advance()
        else:
            self.boundary(self.step_index + 1)

    def _begin_step(self) -> None:
        traced = self.step_index in self.steps
        self._backward_index = 0
        self._uninit_storages.clear()  # buffers are a step's own; a later view is checked anew
        self._set_active(traced)
        if traced:
            self._emit(Event(kind=STEP, seq=self.next_seq(), step=self.step_index, t=time.time()))

    def _set_active(self, active: bool) -> None:
        """Enter or leave the traced state; untraced steps run with no mode and no hooks."""
        self.step_traced = active
        if active:
            self.modules.install()
        else:
            self.modules.remove()
        self.mode.enabled = active
        on_owner = threading.get_ident() == self._owner
        if active and not self._mode_pushed and on_owner:
            self.mode.__enter__()
            self._mode_pushed = True
        elif not active and self._mode_pushed and on_owner and self._mode_on_top():
            self.mode.__exit__(None, None, None)
            self._mode_pushed = False

    def _mode_on_top(self) -> bool:
        n = torch._C._len_torch_function_stack()
        return n > 0 and torch._C._get_function_stack_at(n - 1) is self.mode

    # -- events ----------------------------------------------------------------------------
    def _emit(self, event: Event) -> None:
        assert self.pipeline is not None
        with self.pipeline.lock:
            self.pipeline.add(event)

    def _tick(self) -> None:
        """Watchdog thread, a few times a second: buffered file events reach the disk."""
        if self._writer is not None and time.monotonic() - self._last_chunk >= 0.5:
            self._writer.flush()
            self._last_chunk = time.monotonic()

    def report_error(self, where: str, exc: BaseException) -> None:
        """An error inside the tracer: said once per place and kind, never raised to the job."""
        key = (where, type(exc).__name__)
        if key in self._errors_seen:
            return
        self._errors_seen.add(key)
        message = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
        with contextlib.suppress(Exception):  # a closed or broken stderr must not reach the job
            print(
                f"torchscope: internal error in {where}: {message} (tracing continues; "
                "reported once)",
                file=sys.stderr,
            )
        try:
            if self.pipeline is not None:
                self._emit(
                    Event(
                        kind=ERROR,
                        seq=self.next_seq(),
                        step=self.step_index,
                        where=where,
                        message=message,
                    )
                )
        except Exception:
            pass

    def _session_event(self) -> Event:
        return session_event(
            self.next_seq(),
            self.step_index,
            steps=self.steps.text,
            values=self.summarizer.value_limit,
            record=self.record,
            metadata=self.metadata,
        )

    # -- per op ----------------------------------------------------------------------------
    def summary_of(self, t: torch.Tensor, aliases: list[torch.Tensor] = ()) -> dict:  # type: ignore[assignment]
        """Summary of ``t`` as it is now.

        Reused when this very value was summarised before, or shared with one of ``aliases``
        (tensors of the same event) when ``t`` is a reordering of the same memory.
        """
        memo = self.memo
        s = memo.get(t)
        if s is not None:
            return s
        if self._uninit_storages and aliases and self._views_uninitialized(t, aliases):
            return self._uninitialized(t)
        # Small tensors list their values in order, so they never share (alias_summary).
        if aliases and t.numel() > self.summarizer.value_limit:
            s = self._alias_summary(t, aliases)
        if s is None:
            s = self.summarizer.summarize(t)
        memo.put(t, s)
        return s

    def _alias_summary(self, t: torch.Tensor, aliases: list[torch.Tensor]) -> dict | None:
        # Only an alias that starts at the same address can share: one data_ptr per alias
        # rules the others out (an op's output against each of its inputs, at every op).
        try:
            ptr = t.data_ptr()
        except RuntimeError:  # tensors without storage: alias_summary says no anyway
            return None
        for a in aliases:
            try:
                if a.data_ptr() != ptr:
                    continue
            except RuntimeError:
                continue
            base = self.memo.get(a)
            if base is not None:
                s = self.summarizer.alias_summary(t, a, base)  # checks the memory is shared
                if s is not None:
                    return s
        return None

    def external_summary(self, t: torch.Tensor, deferrable: bool) -> dict:
        """Summary of an op's input that no traced op produced (the memo has none): marked
        ``external`` (input data, a parameter) and named when it is a parameter, for the
        input alerts.

        An external input whose numbers can be read at once (host memory) gets its stats
        only if the op's outputs turn out non-finite (``_judge_external``): that is the one
        time they matter, and a model's weights are most of what an MLP step would reduce.
        """
        if deferrable and self.summarizer.reads_now(t):
            s = tensor_meta(t)
            s["stats"] = None
        else:
            s = self.summarizer.summarize(t)
        s["external"] = True
        param = self.modules.param_name(t)
        if param is not None:
            s["param"] = param
        self.memo.put(t, s)
        return s

    def _judge_external(self, tensors: list[torch.Tensor], inputs: list[dict]) -> None:
        """Outputs went non-finite: fill in the stats of external inputs that were deferred,
        so the alerts can tell a bad weight or batch coming in from a bad op."""
        for t, s in zip(tensors, inputs, strict=True):
            if s.get("external") and s.get("stats") is None and self.summarizer.reads_now(t):
                full = self.summarizer.summarize(t)
                for key in ("stats", "stats_of", "values"):
                    if key in full:
                        s[key] = full[key]

    def before_op(self, name: str, args: tuple, kwargs: dict) -> tuple:
        if self.gated and name in COLLECTIVES:
            self._meet_ranks(name)
        tensors = iter_tensors(args, kwargs)
        inputs = list(map(self.memo.get, tensors))  # map: no comprehension frame per op
        if kwargs and kwargs.get("out") is not None:
            self._destinations(kwargs["out"], tensors, inputs)
        if None in inputs:  # inputs no traced op made: data, weights
            # An op that writes into its input destroys the value the deferral would read.
            deferrable = not writes_inputs(name, kwargs)
            # uniform_(w), copy_(w, src): w's old values (maybe uninitialised) do not matter.
            overwritten = None
            if overwrites_first_input(name):  # nn.init passes its tensor as tensor=...
                overwritten = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            grad_was = _is_grad_enabled()  # as _no_grad, inlined
            if grad_was:
                _set_grad_enabled(False)
            try:
                with self.pipeline.lock:  # type: ignore[union-attr]
                    for i, t in enumerate(tensors):
                        if inputs[i] is None:
                            inputs[i] = (
                                self._overwritten(t)
                                if t is overwritten
                                else self.external_summary(t, deferrable)
                            )
            finally:
                if grad_was:
                    _set_grad_enabled(True)
        return name, tensors, inputs, _get_sequence_nr(), time.perf_counter_ns()

    def _destinations(self, out: Any, tensors: list[torch.Tensor], inputs: list) -> None:
        """``out=dst`` or ``out=[...]`` (FSDP's ``split_with_sizes_copy``): written, not read.
        Their old bytes (often garbage, or a view of it the memo holds) get no stats and
        raise no alert, whatever summary they had."""
        dests = out if isinstance(out, (list, tuple)) else (out,)
        with self.pipeline.lock:  # type: ignore[union-attr]
            for i, t in enumerate(tensors):
                if any(t is d for d in dests):
                    inputs[i] = self._overwritten(t)

    def after_op(
        self, pending: tuple, args: tuple, kwargs: dict, result: Any
    ) -> tuple[Event, list[torch.Tensor]] | None:
        """Record the op; returns its event and output tensors (for the stepper)."""
        name, in_tensors, inputs, seq_lo, t0 = pending
        t1 = time.perf_counter_ns()
        if name in COLLECTIVES:
            return self._after_collective(pending, t1, args, kwargs, result)
        outs = result_tensors(result)
        if not outs:
            # In-place calls like __setitem__ return None; their output is the first argument.
            if result is None and args and isinstance(args[0], torch.Tensor):
                outs = [args[0]]
            else:
                return None
        seq_hi = _get_sequence_nr()
        seq = self.next_seq()
        site = user_site(1)
        source, function = site if site is not None else (None, None)
        nodes: list[dict] = []
        module = self.modules.current()
        gf0 = _grad_fn(outs[0])
        if seq_hi != seq_lo:
            for i, out in enumerate(outs):
                gf = _grad_fn(out) if i else gf0
                if gf is not None:
                    self._tag_nodes(gf, seq_lo, seq_hi, seq, source, module, nodes)
        event = Event(
            kind=OP,
            seq=seq,
            step=self.step_index,
            name=name,
            module=module,
            source=source,
            function=function,
            inputs=inputs,
            outputs=None,
            grad_fn=node_name(gf0) if gf0 is not None else None,
            nodes=nodes,
            duration_us=(t1 - t0) / 1000,
            thread=_thread_name(),
        )
        if _has_inf_scalar(args, kwargs):
            event["inf_arg"] = True  # an Inf it makes is on purpose (masked_fill(m, -inf))
        # Grad mode off for the reductions (as _no_grad, inlined: this runs for every op).
        grad_was = _is_grad_enabled()
        if grad_was:
            _set_grad_enabled(False)
        try:
            with self.pipeline.lock:  # type: ignore[union-attr]
                # A view's output shares its input's stats when the input is unchanged (the
                # memo checks its version); an in-place op's output is summarised afresh.
                if name in UNINITIALIZED_OPS:
                    # Whatever bytes the allocator hands out: stats of them mean nothing, and
                    # a NaN among them is not an alert.
                    event["outputs"] = [self._uninitialized(t) for t in outs]
                else:
                    summary_of = self.summary_of
                    outputs = event["outputs"] = []
                    for t in outs:  # a loop: a comprehension costs a frame per op
                        outputs.append(summary_of(t, in_tensors))
                    if not all_finite(outputs):
                        self._judge_external(in_tensors, inputs)
                self.pipeline.add(event)  # type: ignore[union-attr]
        finally:
            if grad_was:
                _set_grad_enabled(True)
        return event, outs

    def _after_collective(
        self, pending: tuple, t1: int, args: tuple, kwargs: dict, result: Any
    ) -> tuple[Event, list[torch.Tensor]]:
        """A ``torch.distributed`` call: what it wrote, summarised after it (see collectives)."""
        name, _in_tensors, inputs, _seq_lo, t0 = pending
        outs = written_tensors(name, args, kwargs)
        pending_data = is_async(name, args, kwargs, result)
        event = self._op_stub(name, inputs, user_frame(1))
        event.update(
            seq=self.next_seq(),
            grad_fn=None,
            nodes=[],
            duration_us=(t1 - t0) / 1000,
            thread=_thread_name(),
            group_size=group_size(name, args, kwargs),
        )
        if pending_data:
            event["async_op"] = True
        with _no_grad(), self.pipeline.lock:  # type: ignore[union-attr]
            outputs = []
            for t in outs:
                if pending_data:  # not there yet: the first op after wait() summarises it
                    s = tensor_meta(t)
                    s["stats"] = None
                    s["pending"] = True
                    self.memo.discard(t)
                else:  # written in place, maybe with no version bump: never the memo's
                    s = self.summarizer.summarize(t)
                    self.memo.put(t, s)
                with contextlib.suppress(RuntimeError):  # written now, whatever it was
                    self._uninit_storages.discard(t.untyped_storage().data_ptr())
                outputs.append(s)
            event["outputs"] = outputs
            self.pipeline.add(event)  # type: ignore[union-attr]
        return event, outs

    def _overwritten(self, t: torch.Tensor) -> dict:
        """What an op that only writes ``t`` (``uniform_``, ``copy_``) finds there: metadata,
        no numbers (they may be uninitialised memory), nothing to blame."""
        s = tensor_meta(t)
        s["stats"] = None
        return s

    def _uninitialized(self, t: torch.Tensor) -> dict:
        s = self._overwritten(t)
        s["uninitialized"] = True
        self.memo.put(t, s)
        with contextlib.suppress(RuntimeError):  # no storage: nothing can view it
            self._uninit_storages.add(t.untyped_storage().data_ptr())
        return s

    def _views_uninitialized(self, t: torch.Tensor, aliases: list[torch.Tensor]) -> bool:
        """Whether ``t`` is a view of an input still uninitialised (``torch.empty`` then
        ``view``, as FSDP's all-gather buffers are): its bytes mean nothing either."""
        try:
            storage = t.untyped_storage().data_ptr()
        except RuntimeError:
            return False
        if storage not in self._uninit_storages:
            return False
        for a in aliases:
            base = self.memo.get(a)  # None once written with a version bump
            if base is not None and base.get("uninitialized"):
                with contextlib.suppress(RuntimeError):
                    if a.untyped_storage().data_ptr() == storage:
                        return True
        return False

    def node_id(self, node: Any) -> int:
        md = node.metadata
        nid = md.get(NODE_ID)
        if nid is None:
            nid = md[NODE_ID] = next(self._node_ids)
        return nid

    def _tag_nodes(
        self, root: Any, lo: int, hi: int, seq: int, source: str | None, module: str, out: list
    ) -> None:
        """Tag the nodes this call created: their sequence numbers fall in [lo, hi)."""
        todo = [root]
        run_id = self.run_id
        # The window holds hi - lo sequence numbers, one per node the call made: once that
        # many are tagged, none is left below (most calls make one node, the root, and its
        # next_functions, which build a wrapper per edge, are never read).
        left = hi - lo
        while todo:
            node = todo.pop()
            if not lo <= node._sequence_nr() < hi:
                continue
            md = node.metadata
            if NODE_OP in md:
                continue
            md[NODE_OP] = seq
            md[NODE_RUN] = run_id
            md[NODE_SRC] = source
            md[NODE_MOD] = module
            nid = md.get(NODE_ID)  # as node_id(), without fetching the metadata again
            if nid is None:
                nid = md[NODE_ID] = next(self._node_ids)
            out.append({"id": nid, "name": node_name(node)})
            left -= 1
            if left <= 0:
                break
            todo += [n for n, _ in node.next_functions if n is not None]

    # -- backward --------------------------------------------------------------------------
    def _meet_ranks(self, what: str) -> None:
        """With every rank traced alike (the command line's steps), meet the other ranks
        before a collective, so a rank paused here never makes them time out (tracer/ranks)."""
        gate = self._gate
        if gate is None:
            from torchscope.tracer.ranks import RankGate, say

            gate = self._gate = RankGate.for_job(say)
            if gate is None:
                return
        gate.meet(self.step_index, what, self.gate_scope)

    def run_backward(self, call: str, func: Any, args: tuple, kwargs: dict) -> Any:
        if self.gated and call != "torch.autograd.grad":
            self._meet_ranks(f"{call}()")
        hooks = None
        try:
            # autograd.grad(..., is_grads_batched=True) runs the backward under vmap: the
            # hooks get batched gradients, whose numbers cannot be read there.
            batched = bool(kwargs.get("is_grads_batched"))
            hooks = NodeHooks(self, call, root_tensors(call, args, kwargs), batched=batched)
            self._backward_index += 1
            frame = user_frame(1)
        except Exception as exc:
            self.report_error("installing backward hooks", exc)
            if hooks is not None:
                hooks.remove()
                hooks = None
        try:
            return func(*args, **kwargs)
        finally:
            if hooks is not None:
                try:
                    hooks.remove()
                    self._emit(
                        Event(
                            kind=GRAPH,
                            seq=self.next_seq(),
                            step=self.step_index,
                            backward=self._backward_index,
                            source=f"{frame[0]}:{frame[1]}" if frame else None,
                            **hooks.graph(),
                        )
                    )
                except Exception as exc:
                    self.report_error("removing backward hooks", exc)
            if call != "torch.autograd.grad" and self.modules.has_ddp:
                try:
                    self._ddp_synced_grads(frame)
                except Exception as exc:
                    self.report_error("recording DDP's synchronised gradients", exc)

    def _ddp_synced_grads(self, frame: tuple | None) -> None:
        """Under DDP the gradient the optimizer uses is the ranks' average, which DDP's C++
        reducer writes into ``p.grad`` by the time ``backward()`` returns; AccumulateGrad
        only ever sees this rank's local one. One event per DDP model and backward call.
        FSDP2 (``fully_shard``) likewise: ``p.grad`` is then this rank's shard of the
        reduce-scattered gradient (a DTensor), recorded as
        ``torch.distributed.fsdp_gradient_sync``."""
        for ddp in self.modules.ddp_roots():
            fsdp = is_fsdp2(ddp)
            if not fsdp and not ddp.require_backward_grad_sync:
                continue  # inside no_sync(): gradients are accumulated locally, not averaged
            outputs = []
            with _no_grad(), self.pipeline.lock:  # type: ignore[union-attr]
                for name, p in ddp.named_parameters():
                    grad = p.grad
                    if grad is None:
                        continue
                    if fsdp and hasattr(grad, "to_local"):
                        grad = grad.to_local()  # this rank's shard, as the optimizer sees it
                    s = dict(self.summarizer.summarize(grad))
                    s["param"] = self.modules.param_name(p) or name
                    outputs.append(s)
                self.pipeline.add(  # type: ignore[union-attr]
                    Event(
                        kind=OP,
                        seq=self.next_seq(),
                        step=self.step_index,
                        name="torch.distributed."
                        + ("fsdp_gradient_sync" if fsdp else "ddp_gradient_sync"),
                        module=self.modules.name_of(ddp),
                        source=f"{frame[0]}:{frame[1]}" if frame else None,
                        function=frame[2] if frame else None,
                        inputs=[],
                        outputs=outputs,
                        grad_fn=None,
                        nodes=[],
                        duration_us=0.0,
                        thread=_thread_name(),
                        group_size=_ddp_world(ddp),
                        backward=self._backward_index,
                    )
                )

    def on_grad(self, info: NodeInfo, grad_inputs: tuple, grad_outputs: tuple) -> None:
        """Post-hook of one node: runs on the thread that executes the node."""
        info["executed"] = True
        # Backward hooks run with grad mode off, unless create_graph=True.
        grad_was = _is_grad_enabled()
        if grad_was:
            _set_grad_enabled(False)
        try:
            with self.pipeline.lock:  # type: ignore[union-attr]
                # Loops, not comprehensions: a comprehension costs a frame, and this runs
                # for every node.
                summary_of = self.summary_of
                go = []
                for g in grad_outputs:
                    go.append(None if g is None else summary_of(g))
                if len(grad_inputs) == 1 and len(grad_outputs) == 1:
                    # TBackward0 and friends send on a reordered view of what they received.
                    (g,), (received,) = grad_inputs, grad_outputs
                    aliases = [received] if received is not None else ()
                    gi = [None if g is None else summary_of(g, aliases)]
                else:
                    gi = []
                    for g in grad_inputs:
                        gi.append(None if g is None else summary_of(g))
                event = self._grad_fields(info, go, gi)
                self.pipeline.add(event)  # type: ignore[union-attr]
        except Exception as exc:
            self.report_error("backward hook", exc)
            return
        finally:
            if grad_was:
                _set_grad_enabled(True)
        stepper = self.stepper
        if stepper is not None and stepper.active:
            tensors = {"grad_outputs": list(grad_outputs), "grad_inputs": list(grad_inputs)}
            self.pause_point(AFTER, event, tensors)

    def on_batched_grad(self, info: NodeInfo, grad_inputs: tuple, grad_outputs: tuple) -> None:
        """Post-hook of one node of a batched backward (``is_grads_batched=True``): each
        gradient is a vmap batch, so its shape is recorded and its numbers are not."""
        info["executed"] = True
        try:
            with self.pipeline.lock:  # type: ignore[union-attr]
                go = [_batched_summary(g) for g in grad_outputs]
                gi = [_batched_summary(g) for g in grad_inputs]
                self.pipeline.add(self._grad_fields(info, go, gi))  # type: ignore[union-attr]
        except Exception as exc:
            self.report_error("backward hook", exc)

    def on_grad_pre(self, info: NodeInfo, grad_outputs: tuple) -> None:
        """Pre-hook of one node (installed only while stepping): before the node runs."""
        stepper = self.stepper
        if stepper is None or not stepper.active:
            return
        try:
            with self.pipeline.lock:  # type: ignore[union-attr]
                go = [None if g is None else self.summary_of(g) for g in grad_outputs]
            stub = self._grad_fields(info, go, None)
        except Exception as exc:
            self.report_error("backward pre-hook", exc)
            return
        self.pause_point(BEFORE, stub, {"grad_outputs": list(grad_outputs)})

    def _grad_fields(self, info: NodeInfo, go: list, gi: list | None) -> Event:
        return Event(
            kind=GRAD,
            seq=self.next_seq() if gi is not None else None,
            step=self.step_index,
            backward=self._backward_index,
            node=info["name"],
            node_id=info["id"],
            op_seq=info["op_seq"],
            module=info["module"],
            source=info["source"],
            param=info["param"],
            grad_inputs=gi,
            grad_outputs=go,
            thread=_thread_name(),
        )

    # -- step-through ----------------------------------------------------------------------
    def _origin_of(self, event: dict) -> str | None:
        seq = event.get("seq")
        return self.pipeline.alerts.origins.get(seq) if seq is not None else None  # type: ignore[union-attr]

    def pause_before_op(self, pending: tuple) -> tuple:
        """Maybe pause before the op runs; returns ``pending`` with its clock restarted
        after a pause (an op's duration never counts the time it sat paused)."""
        name, _in_tensors, inputs, _, _ = pending
        try:
            stub = self._op_stub(name, inputs, user_frame(1))
        except Exception as exc:
            self.report_error("pausing before an op", exc)
            return pending
        if self.pause_point(BEFORE, stub, {"inputs": list(pending[1])}):
            return (*pending[:4], time.perf_counter_ns())
        return pending

    def _op_stub(self, name: str, inputs: list, frame: tuple | None) -> Event:
        """An op event's identity (what, where, from which line), before it has run."""
        return Event(
            kind=OP,
            seq=None,
            step=self.step_index,
            name=name,
            module=self.modules.current(),
            source=f"{frame[0]}:{frame[1]}" if frame else None,
            function=frame[2] if frame else None,
            inputs=inputs,
            outputs=None,
        )

    def pause_after_op(self, pending: tuple, event: Event, outs: list[torch.Tensor]) -> None:
        self.pause_point(AFTER, event, {"inputs": list(pending[1]), "outputs": outs})

    def pause_point(self, phase: str, event: Event, tensors: dict[str, list]) -> bool:
        """Ask the stepper whether to stop here; if so, block this thread until told to go.
        Returns whether it paused.

        Never raises into the job: a failure here is reported and the job runs on.
        """
        stepper = self.stepper
        pipeline = self.pipeline
        if stepper is None or pipeline is None:
            return False
        try:
            # Value conditions (NaN, gradient norm) need this event's numbers now: a sync, paid
            # only while such a breakpoint could match here.
            if phase == AFTER and stepper.needs_stats(event):
                pipeline.flush(wait=True)
            reason = stepper.should_pause(phase, event, self._origin_of)
            if reason is None:
                return False
            pipeline.flush(wait=True)  # everything up to here reaches the UI and the file
            point = PausePoint(phase, event, tensors, thread_stack(self._owner), reason)
            self._emit(
                Event(kind=PAUSE, seq=self.next_seq(), step=self.step_index, **point.describe())
            )
            pipeline.flush(wait=True)
        except Exception as exc:
            self.report_error("deciding whether to pause", exc)
            return False
        resumed_by = stepper.at_point(point)  # blocks the training thread
        try:
            self._emit(
                Event(
                    kind=RESUME,
                    seq=self.next_seq(),
                    step=self.step_index,
                    by=resumed_by,
                    t=time.time(),
                )
            )
            pipeline.flush(wait=True)
        except Exception as exc:
            self.report_error("resuming", exc)
        return True


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


def _ddp_world(ddp: Any) -> int | None:
    try:
        return int(ddp.process_group.size())
    except Exception:
        pass
    try:
        import torch.distributed as dist

        return int(dist.get_world_size())  # FSDP2: its mesh spans the default group here
    except Exception:
        return None


def _grad_fn(t: torch.Tensor) -> Any:
    """``t.grad_fn``, or None where torch refuses to say: a view made under no_grad whose
    memory was then written in place (``weight[pad].fill_(0)`` in ``nn.Embedding``)."""
    if not t.requires_grad:
        return None
    try:
        return t.grad_fn
    except RuntimeError:
        return None


_is_grad_enabled = torch._C.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled


class _no_grad:
    """Grad mode off while the tracer runs reductions (they must record no graph, nor take
    sequence numbers from the op window); cheaper than ``torch.no_grad`` on the hot path."""

    __slots__ = ("was",)

    def __enter__(self) -> None:
        self.was = torch.is_grad_enabled()
        if self.was:
            torch._C._set_grad_enabled(False)

    def __exit__(self, *exc: object) -> None:
        if self.was:
            torch._C._set_grad_enabled(True)


def _of_steps(sink: Sink, steps: Any, first: int) -> Sink:
    """``sink`` for the events of ``steps``, counted from step ``first`` (a nested trace's
    own selection); events of no step pass."""

    def of_steps(events: list[Event]) -> None:
        kept = [e for e in events if type(e.get("step")) is not int or e["step"] - first in steps]
        if kept:
            sink(kept)

    return of_steps


def _batched_summary(g: torch.Tensor | None) -> dict | None:
    if g is None:
        return None
    summary = tensor_meta(g)  # the shape of one gradient of the batch
    summary["stats"] = None
    summary["stats_of"] = "batched"
    return summary


def _has_inf_scalar(args: tuple, kwargs: dict) -> bool:
    for a in args:
        if type(a) is float and (a == math.inf or a == -math.inf):
            return True
    if kwargs:
        for a in kwargs.values():
            if type(a) is float and (a == math.inf or a == -math.inf):
                return True
    return False


_thread_local = threading.local()


def _thread_name() -> str:
    # Per-thread cache (not by ident: a new thread may reuse a dead one's ident).
    try:
        return _thread_local.name
    except AttributeError:
        _thread_local.name = threading.current_thread().name
        return _thread_local.name
