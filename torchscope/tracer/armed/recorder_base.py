"""The base of every recorder (one per tracing level): the pieces it writes through, bound
once (a recorder's methods run for every op, node or kernel)."""

from __future__ import annotations

from collections.abc import Callable

from torchscope.protocol.events import OP, Event
from torchscope.tracer.armed.modules import ModuleTracker
from torchscope.tracer.armed.pausing import Pauser
from torchscope.tracer.armed.pipeline import EventPipeline
from torchscope.tracer.armed.recorder_shared import ArmedState, ErrorReport, GradOffLocked
from torchscope.tracer.armed.tensors import TensorSummaries


class Recorder:
    def __init__(
        self,
        state: ArmedState,
        pipeline: EventPipeline,
        summaries: TensorSummaries,
        modules: ModuleTracker,
        next_seq: Callable[[], int],
        report_error: ErrorReport,
        *,
        run_id: int,
        new_node_id: Callable[[], int],
        pauser: Pauser | None,
        no_dispatch: bool = False,
    ) -> None:
        self.state = state  # read per event: the step, whether ranks meet first
        self.pipeline = pipeline
        self.summaries = summaries
        self.modules = modules
        self.next_seq = next_seq
        self.report_error = report_error
        self.run_id = run_id  # the session whose op seqs the node tags name
        self.new_node_id = new_node_id  # ids unique in the process (node metadata outlives us)
        self.pauser = pauser  # None: nobody can pause this job
        self.stepper = pauser.stepper if pauser is not None else None
        # ``with`` it around summaries; with the aten level on, they bypass dispatch modes
        self.recording = GradOffLocked(pipeline.lock, no_dispatch)
        # what a summary needs where grad mode is already off (backward hooks)
        self.locked = self.recording if no_dispatch else pipeline.lock

    def op_stub(self, name: str, inputs: list, frame: tuple | None) -> Event:
        """An op event's identity (what, where, from which line), before it has run; also
        what stands for a call that has no op event of its own (``Tensor.backward``)."""
        return Event(
            kind=OP,
            seq=None,
            step=self.state.step_index,
            name=name,
            module=self.modules.current(),
            source=f"{frame[0]}:{frame[1]}" if frame else None,
            function=frame[2] if frame else None,
            inputs=inputs,
            outputs=None,
        )
