"""The NaN watch in a served job: the agent's side of it (:mod:`torchscope.tracer.watch` is
the watch itself). Switched on and off from outside (``torchscope watch PID``, a second
``serve()``) at the job's next ``backward()``; its replays record into the job's file and UIs;
a detection it could not place holds the next steps traced to catch it live.

The agent holds one :class:`ServedWatch`, given what it needs of the agent (its options, its
clock, holders and history, its tracer, stepper and sinks as they are, its emit and say), and
calls it.
"""

from __future__ import annotations

import contextlib
import shlex
import threading
from collections.abc import Callable
from typing import Any

from torchscope.protocol.events import Event
from torchscope.tracer import backward_calls
from torchscope.tracer.armed.session import DrivenBy, Tracer
from torchscope.tracer.clock import StepClock
from torchscope.tracer.history import HistoryCollector
from torchscope.tracer.holders import Holders
from torchscope.tracer.notebook import after_this_cell, shell
from torchscope.tracer.options import Options
from torchscope.tracer.rank_checks import rank_alert
from torchscope.tracer.ranks import say_line
from torchscope.tracer.stepper import WATCH_OWNER, Stepper
from torchscope.tracer.watch.capture import REPLAY_ATEN

# Steps traced in full after a NaN/Inf the watch could not place (it names the op and line
# when it comes back in one of them; the tracing ends then).
WATCH_TRACE_STEPS = 10


class ServedWatch:
    """The agent's NaN watch: the agent holds one, gives it what it needs and calls it."""

    def __init__(
        self,
        options: Options,
        clock: StepClock,
        holders: Holders,
        history: HistoryCollector,
        *,
        tracer: Callable[[], Tracer | None],
        stepper: Callable[[], Stepper | None],
        sinks: Callable[[], list],
        next_seq: Callable[[], int],
        emit: Callable[[Event], None],
        on_alert: Callable[[], Any],
        say: Callable[[str], None],
        arm_between_cells: Callable[[], None],
        multi_rank: bool,
    ) -> None:
        """``options``: the job's, read and switched here (``watch``, ``on_nan``, ...);
        ``tracer``, ``stepper``, ``sinks``: the agent's as they are now; ``on_alert``: where
        a replay's alerts go besides the sinks; ``say``: one line to the job's stderr."""
        self.options = options
        self.clock = clock
        self.holders = holders
        self.history = history
        self._tracer = tracer
        self._stepper = stepper
        self._sinks = sinks
        self.next_seq = next_seq
        self.emit = emit
        self._on_alert = on_alert
        self._say = say
        self._arm_between_cells = arm_between_cells
        self._multi_rank = multi_rank
        self.watch: Any = None  # NanWatch, while it watches
        # A watch switched on or off from outside, applied at the job's next backward() (the
        # watch hooks the training thread): (spec or None, on_nan).
        self._watch_request: tuple[str | None, str] | None = None
        self._watch_listening: backward_calls.Listening | None = None
        self._catching: Any = None  # the hold tracing steps until a NaN/Inf comes back

    def remove(self) -> None:
        """The watch's hooks go (the job ends; a forked child drops them)."""
        if self.watch is not None:
            with contextlib.suppress(Exception):  # hooks gone with their modules
                self.watch.remove()

    def stop_listening(self) -> None:
        """No more waiting for a ``backward()`` to switch the watch at."""
        if self._watch_listening is not None:
            self._watch_listening.remove()
            self._watch_listening = None

    def will_watch(self) -> bool:
        """Whether a watch runs, or one was asked for (it computes the gradient norm)."""
        return self.watch is not None or self._watch_request is not None

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
        request, self._watch_request = self._watch_request, None
        if request is None:
            return
        spec, on_nan = request
        try:
            if self.watch is not None:
                self.watch.remove()
                self.watch = None
            self.options.watch, self.options.on_nan = spec, on_nan
            if spec:
                self.start()
                self._say(
                    f"watching every step from step {self.clock.step} ({spec}, then {on_nan})"
                )
            else:
                self._say(f"not watching for NaN from step {self.clock.step}")
        except Exception as exc:
            self._say(f"internal error switching the NaN watch: {type(exc).__name__}: {exc}")

    def cmd_watch(self, args: dict[str, Any], client: bytes) -> dict[str, Any]:
        from torchscope.tracer.steps import parse_watch

        spec = args.get("spec")
        if spec is not None:
            parse_watch(spec)  # StepSpecError (a ValueError): refused with its one line
        if args.get("max_skips") is not None:  # read when the watch starts (on_nan="skip")
            self.options.max_skips = int(args["max_skips"])
        if args.get("on_spike") is not None:  # read when the watch starts (spec "spike")
            self.options.on_spike = str(args["on_spike"])
        self.request_watch(spec, args.get("on_nan") or "continue")
        return {"watch": spec, "step": self.clock.step}

    def request_watch(self, spec: str | None, on_nan: str, now: bool = False) -> None:
        """Switch the watch to ``spec`` (None: off) and ``on_nan`` at the job's next
        ``backward()``; with ``now`` (``serve()`` called again) at once where the caller is the
        training thread, as a first ``serve()`` installs it."""
        self._watch_request = (spec, on_nan)
        if now and threading.get_ident() == self.clock.owner:
            self._apply_watch_request()
        elif self._watch_listening is None:
            self._watch_listening = backward_calls.listen(self)

    def watch_setting(self) -> tuple[str | None, str]:
        """(spec, on_nan) of the watch, as it is or as it will be at the next ``backward()``."""
        if self._watch_request is not None:
            return self._watch_request
        return self.options.watch, self.options.on_nan

    def marks(self, step: int) -> tuple[bool, bool]:
        """What the watch did at ``step``, for its history point: (its update refused:
        ``on_nan``/``on_spike="skip"``, a loss spike caught there)."""
        watch = self.watch
        if watch is None:
            return False, False
        return watch.refusal.step == step, watch.spiked_step == step

    def start(self) -> None:
        """Watch as the options say (a first ``serve()``, ``run --watch``, a switch)."""
        from torchscope.tracer.steps import parse_watch_spec
        from torchscope.tracer.watch.nan_watch import NanWatch
        from torchscope.tracer.watch.spikes import Spikes

        spec = parse_watch_spec(self.options.watch or "nan")
        spikes = Spikes(**spec.spike_kwargs()) if spec.spike else None
        self.watch = NanWatch(
            gradnorm=spec.gradnorm,
            on_nan=self.options.on_nan,
            max_skips=self.options.max_skips,
            spikes=spikes,
            on_spike=self.options.on_spike,
            tracer_factory=self._replay_tracer,
            step_of=lambda: self.clock.step,
            report=self._watch_report,
            replay_wanted=lambda: self._tracer() is None,
            live_origin=self._live_origin,
            on_unreproduced=self._trace_after_unreproduced,
            backward_checks=True,  # a job that updates by hand is checked after backward()
        ).install()
        if self.options.history:
            self.watch.norms.sink = self.history.watch_norms

    def _replay_tracer(self, step: int) -> Tracer:
        """The tracer a watch replay records into: this job's file and UIs, its numbering."""
        tracer = Tracer(
            None,
            values=self.options.values,
            keep=False,
            optimizer_ops=True,
            aten=REPLAY_ATEN,
            sinks=self._sinks(),
            driven=DrivenBy(self._stepper(), step, self.next_seq),
            on_alert=self._on_alert(),
        ).start()
        return tracer

    def _live_origin(self) -> dict[str, Any] | None:
        """The first NaN/Inf origin the armed tracer found in the current step, or None."""
        pipeline = getattr(self._tracer(), "pipeline", None)
        if pipeline is None:
            return None
        with pipeline.lock:
            pipeline.flush(wait=True)  # the step's events so far are checked
            found = list(pipeline.alerts.step_origins)
        return dict(found[0]) if found else None

    def _watch_report(self, text: str) -> None:
        if not self.options.quiet:
            with contextlib.suppress(Exception):
                say_line(text)  # already "torchscope: ..." (with its rank)
        det = self.watch.detections[-1] if self.watch and self.watch.detections else None
        self._caught_live(det)
        if (
            det is None
            or (det.get("what") == "spike" and text != det.get("message"))
            or (det.get("reproduced") and not det.get("loop_code"))
            or det.get("last_step") != det.get("step")
            or det.get("skipped")
        ):
            # A reproduced replay recorded its own alert (the loop's code is not replayed:
            # its origin is alerted here); a "lasted" summary, a skipped
            # update (on_nan="skip"), a spike's lines after its first are notes on the
            # detection alerted already.
            return
        alert = rank_alert(
            self.next_seq(),
            det["step"],
            det["what"] if det["what"] in ("nan", "inf", "spike") else "gradnorm",
            "watch",
            "the gradients",
            text.removeprefix("torchscope: "),
        )
        if det["what"] == "spike" and isinstance(det.get("spike"), dict):
            # Its figures and what the job does about it, for the UIs and tools.
            alert["spike"] = {**det["spike"], "on_spike": getattr(self.watch, "on_spike", None)}
        self.emit(alert)

    def _trace_after_unreproduced(self, det: dict[str, Any]) -> None:
        """The replay could not say which op and line made it: most NaNs come back, so trace
        the next steps in full to catch it live (until it does, or for a few steps). A script
        that stops now gets the command that finds a one-off instead; a notebook's kernel
        lives on, and the steps its next cells run are the ones traced."""
        stops = self.watch is not None and self.watch.on_nan == "stop"
        if stops and shell() is None:
            argv = self.options.metadata.get("argv")
            script = shlex.join(map(str, argv)) if argv else "SCRIPT"
            command = f"torchscope run --record trace.tsc --steps {det['step']} {script}"
            if self._multi_rank:
                command = f"torchrun ... -m {command}"
            self._say(f"to name its op and line: {command} (the steps before it run dormant)")
            return
        if self._catching is not None and self.holders.holds(self._catching):
            return  # already tracing to catch it
        self._catching = self.holders.add("watch", remaining=WATCH_TRACE_STEPS)
        if stops:  # the stopped step runs again in a later cell: traced from the next cell
            after_this_cell(self._arm_between_cells)
        which = "the kernel runs " if stops else ""
        self._say(
            f"tracing the next {WATCH_TRACE_STEPS} steps {which}in full to catch it live (it "
            "names the op and line if it comes back)"
        )

    def _caught_live(self, det: dict[str, Any] | None) -> None:
        """The tracing that waited for a NaN/Inf to come back named it: it ends."""
        holder, self._catching = self._catching, None
        if holder is not None and det is not None and det.get("traced_live"):
            self.holders.end(holder)
        elif holder is not None:
            self._catching = holder

    def add_breakpoints(self) -> None:
        """``on_nan="pause"`` in a traced step: the live tracer stops where the NaN/Inf first
        appears, before the update, as the watch's replay would (breakpoints the watch owns,
        gone when the tracing ends)."""
        watch, stepper = self.watch, self._stepper()
        if watch is None or watch.on_nan != "pause" or stepper is None:
            return
        for what in ("nan", "inf"):
            stepper.add_breakpoint({"nan": what}, owner=WATCH_OWNER)
