"""The NaN watch's check: before each update, are the step's gradients and loss finite (and
the gradient norm under its limit)? One read of the norms (:mod:`.norms`), the verdict, the
replay of a bad step (:mod:`.replay`), its report (:mod:`.report`) and the policy.

:class:`StepCheck` is the part of :class:`~torchscope.tracer.watch.nan_watch.NanWatch` that
decides; the watch's hooks and captures (what it decides on) stay there.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from torchscope.tracer import scaler_calls
from torchscope.tracer.clock import StepClock
from torchscope.tracer.errors import ReportOnce
from torchscope.tracer.ranks import speaker
from torchscope.tracer.watch.capture import Backward, StepCaptures, replay_target
from torchscope.tracer.watch.growth import Growth
from torchscope.tracer.watch.naming import module_text
from torchscope.tracer.watch.norms import (
    GRADNORM,
    INF,
    NAN,
    ModuleNorms,
    confirm,
    norm_of,
    unscaled,
)
from torchscope.tracer.watch.report import bad_words, describe, job_rank
from torchscope.tracer.watch.spike_check import SpikeCheck
from torchscope.tracer.watch.spikes import SPIKE, Spike, Spikes, spike_line
from torchscope.tracer.watch.stop import WatchStop

if TYPE_CHECKING:
    from torchscope.tracer.armed.session import Tracer
    from torchscope.tracer.watch.loop_code import LoopOps
    from torchscope.tracer.watch.refusal import UpdateRefusal
    from torchscope.tracer.watch.scaling import LossScaling


class StepCheck(SpikeCheck):
    """The check, its verdict and the loss scaler's part in it (mixed into ``NanWatch``)."""

    # Set by NanWatch (its constructor says what each is).
    gradnorm: float | None
    on_nan: str
    on_spike: str
    spikes: Spikes | None  # the spike part of the watch (``spike``), when on
    spiked_step: int | None
    _said_spike_pause: bool
    report: Callable[[str], None]
    keep_graph: bool | str
    keeping: bool
    on_unreproduced: Callable[[dict[str, Any]], None] | None
    replay_wanted: Callable[[], bool]
    live_origin: Callable[[], dict[str, Any] | None]
    detections: list[dict[str, Any]]
    steps_checked: int
    last_replay: Any
    norms: ModuleNorms
    installed: bool
    _replaying: bool
    max_calls: int
    tracer_factory: Callable[[int], Tracer] | None
    _owner: int
    captured: StepCaptures
    _error: ReportOnce
    _clock: StepClock | None
    _started_at: int
    _checked_at_backward: bool
    loss_scaling: LossScaling
    _bad_run: dict[str, Any] | None
    loop: LoopOps
    _still_bad: dict[str, Any] | None
    _growth: Growth | None = None  # the last steps' loss and gradient norm (made at first)
    refusal: UpdateRefusal  # "skip": which updates are refused

    @property
    def step(self) -> int:
        raise NotImplementedError

    def _root_params(self) -> list[torch.Tensor]:
        raise NotImplementedError

    @property
    def roots(self) -> list[torch.nn.Module]:
        raise NotImplementedError

    def _watched_modules(self) -> list[torch.nn.Module]:
        raise NotImplementedError

    # -- the loss scaler (scaler_calls listener) -----------------------------------------------
    def loss_scaled(self, scaler: Any, outputs: Any, scaled: Any) -> None:
        if not self.installed or self._replaying or threading.get_ident() != self._owner:
            return
        self.loss_scaling.scaled(scaler, outputs, scaled)

    def _scaled_backward(self) -> Backward | None:
        """The step's last backward() when a loss scaler scaled its root, with its scale."""
        rec = self.captured.backwards[-1] if self.captured.backwards else None
        if rec is None or rec.scaler is None:
            return None
        if rec.scale is None:
            rec.scale = scaler_calls.scale_of(rec.scaler)
        return rec

    def _scaler_overflow(self, rec: Backward | None) -> bool:
        """Whether the step's non-finite gradients are the loss scaler's: its loss is finite
        and the same backward from the unscaled loss gives finite gradients (an fp16
        overflow of the scaled values, which the scaler skips). Without the step's graph it
        cannot be told; a scaled step is then taken to be the scaler's."""
        if rec is None:
            return False
        if rec.roots is None or not rec.unscaled:
            return True
        from torchscope.tracer.watch.replay import _Untraced, graph_leaves

        self._replaying = True  # the watch's own hooks stay out of it
        try:
            with _Untraced():
                leaves = [t for t in graph_leaves(rec.roots) if t.requires_grad]
            if not leaves:
                return True
            with torch._C.DisableTorchFunction():
                grads = torch.autograd.grad(
                    rec.unscaled, leaves, allow_unused=True, retain_graph=True
                )
                return all(bool(torch.isfinite(g).all()) for g in grads if g is not None)
        finally:
            self._replaying = False

    def _stop(self, detection: dict[str, Any] | None) -> WatchStop | None:
        """Under "stop", what to raise before the update: every bad update is refused, the
        first of a bad stretch and each one after it (a notebook that runs the stopped cell
        again makes the same NaN: it must not reach the weights this time either). Under
        "skip", see :meth:`_skip`."""
        run = detection if detection is not None else self._still_bad
        policy = self.policy_for(run)
        if policy == "skip":
            return self._skip(detection)
        if policy != "stop":
            return None
        if detection is not None:
            return WatchStop(detection)
        if run is None:
            return None
        what = bad_words(run)
        line = (
            f"{speaker()}: still {what} at step {self.step} (first at step {run['step']}): "
            "stopped before the update"
        )
        with contextlib.suppress(Exception):
            self.report(line)
        return WatchStop({**run, "message": line, "step": self.step})

    def policy_for(self, run: dict[str, Any] | None) -> str:
        """The policy of a detection (or of the bad stretch it began): ``on_spike`` for a
        spike, ``on_nan`` for the rest."""
        return self.on_spike if run is not None and run.get("what") == SPIKE else self.on_nan

    def _skip(self, detection: dict[str, Any] | None) -> WatchStop | None:
        """Under "skip": a bad step (a detection, or a check that found the stretch still
        bad: the weights stay clean, so each is the NaN made again) has its update refused
        (``refusal.step`` names it, and the caller takes the gradients away for the update);
        past ``max_skips`` bad steps in a row, what "stop" raises."""
        run = detection if detection is not None else self._still_bad
        return self.refusal.decide(self.step, run, self.report)

    def check(self, params: Iterable[torch.Tensor] | None = None) -> dict[str, Any] | None:
        """Check the current gradients of ``params`` (default: the watched modules') and the
        step's losses; on a detection replay the step, report it and return its dict.

        The optimizer pre-hook calls this; a job that updates its weights by hand can call it
        before its update. Does not end the step (the hook does, after it); never raises.
        """
        try:
            # Those with a gradient, and their gradients: one read of ``.grad`` each.
            with_grad: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            for p in params if params is not None else self._root_params():
                g = p.grad
                if g is not None:
                    with_grad.append(p)
                    grads.append(g)
            values = [v for b in self.captured.backwards for v in b.values]
            if not grads and not values:
                return None
            self.steps_checked += 1
            norms = self.norms
            scaled = self._scaled_backward()
            # The scale in the same read: the gradients are scaled, the figures not.
            scale = scaled.scale if scaled is not None else None
            with torch.no_grad(), torch._C.DisableTorchFunction():
                row = norms.read(with_grad, grads, values, scale)  # the step's one host sync
            self.loss_scaling.step_scale = None
            if scale is not None:
                self.loss_scaling.step_scale = row[-1]
                row = unscaled(row[:-1], row[-1])
            grad_norm, loss_norm = row[0], row[1]
            norms.took(self.step, row)
            growth = self._growth
            if growth is None:
                growth = self._growth = Growth()
            growth.took(self.step, loss_norm, grad_norm)
            if scaled is not None:
                self.loss_scaling.note(scaled.scaler, values)
            what = None
            bad: list[int] = []
            in_loss = False
            if not (math.isfinite(grad_norm) and math.isfinite(loss_norm)):
                what, bad, in_loss = confirm(grads, values)  # rare: a few more syncs
                if what is not None and not in_loss and self._scaler_overflow(scaled):
                    self.loss_scaling.overflows += 1
                    what = None  # the scaler's own: it skips the update and shrinks its scale
            if what is None and self.gradnorm is not None and grad_norm > self.gradnorm:
                what = GRADNORM
            spike = None
            diverging = None
            if what is None and self.spikes is not None:
                # On the figures just read (no device work); non-finite ones are not its.
                spike = self.spikes.took(self.step, loss_norm, grad_norm, norms.module_row(row))
                diverging = growth.diverging(speaker())  # (a few float comparisons)
                if spike is not None or diverging is not None:
                    what = SPIKE
                else:  # a good step: its batch's figures kept (see spike_origin)
                    self._spike_sources().took(self.captured.calls, self.step)
            self._still_bad = None
            run = self._bad_run
            if run is not None and (what is None or category(what) != category(run["what"])):
                self._end_run()
                run = None
            if what is None:
                return None
            live = None
            if run is not None and run.get("unexplained") and not self.replay_wanted():
                # Traced live since a detection it could not place: named now if this step's
                # tracer found where it comes from (a loss scaler kept the weights clean).
                live = self._live_alert(run["step"])
                if live is not None and self._written_by_update(run, with_grad):
                    live = None  # the last bad step's update wrote it: not the NaN come back
            if run is not None and live is None:
                # Still bad (NaN weights stay NaN): counted, not replayed or reported again;
                # once per step (LBFGS calls its closure, checked each time, several times).
                # A divergence is said as it shows, in the spikes' stretch too.
                if diverging is not None:
                    self._say(diverging[1])
                    run["diverging"] = diverging[0]
                if self.step != run["last_step"]:
                    run["repeats"] += 1
                    run["last_step"] = self.step
                self._still_bad = run
                return None
            if what == SPIKE:
                det = self._spiked(spike, diverging, loss_norm, grad_norm)
            else:
                det = self._detected(what, grad_norm, with_grad, bad, in_loss, live)
            self._bad_run = det
            return det
        except Exception as exc:
            self._error("checking the step", exc)
            return None

    def _detected(
        self,
        what: str,
        grad_norm: float,
        params: list,
        bad: list[int],
        in_loss: bool,
        live: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        step = self.step
        det: dict[str, Any] = {
            "step": step,
            "what": what,
            "grad_norm": grad_norm,
            "in_loss": in_loss,
            "bad_params": self._param_names([params[i] for i in bad]),
            "origin": None,
            "where": None,
            "source": None,
            "module": None,
            "outside_modules": False,
            "reproduced": None,
            "replayed": False,
            "unit_gradient": False,
            "paused": False,
            "placed": False,  # a loop-code origin placed from marks, not replayed (compiled)
            "alerts": [],
            "events": [],
            "notes": [],
            "message": "",
            "repeats": 0,
            "last_step": step,
            "scale": self.loss_scaling.step_scale,  # the loss scaler's, when one scaled the step
            "optimizer_step": self._optimizer_step(step),
        }
        if what in (NAN, INF) and not self.replay_wanted():
            self._take_live_origin(det, live)
        elif what in (NAN, INF):
            from torchscope.tracer.watch.replay import Replay

            replay = Replay(self, det)
            self.last_replay = replay
            replay.run()
            det["events"] = replay.events
            fsdp_arrival = det.get("fsdp") and not det.get("in_loss")
            if not det["reproduced"] and (
                fsdp_arrival
                or any(type(m).__name__ == "DistributedDataParallel" for m in self.roots)
            ):
                det["notes"].append(
                    "this rank's replay is finite: under DDP the NaN/Inf most likely came from "
                    "another rank through the gradient all-reduce (see that rank's report)"
                )
                from torchscope.tracer.rank_checks import note_watch_arrival

                # Linked to the origin the other rank publishes, as full tracing links it;
                # tracing the next steps here would only see it arrive again.
                det["arrived"] = note_watch_arrival(step, what)
            unplaced = det["outside_modules"] or not det["reproduced"]
            if self.keep_graph == "auto" and not self.keeping and unplaced:
                self.keeping = True
                det["notes"].append("the step's graph is kept from now on (keep_graph='auto')")
        det["module_text"] = self._module_text(det)
        det["message"] = describe(det, rank=job_rank())
        self.detections.append(det)
        try:
            self.report(det["message"])
        except Exception as exc:
            self._error("reporting", exc)
        self._say_growth(det)
        # Not named down to its op and line: the replay did not reproduce it, or it came from
        # the loop's own forward code, which is not re-run (most NaNs come back: catch it then).
        unexplained = (
            det["reproduced"] is False and not det["placed"] and not det.get("arrived")
        ) or bool(det.get("loop_forward"))
        det["unexplained"] = unexplained
        if unexplained and self.on_unreproduced is not None:
            try:
                self.on_unreproduced(det)
            except Exception as exc:
                self._error("on_unreproduced", exc)
        return det

    def _module_text(self, det: dict[str, Any]) -> str | None:
        """The detection's module as the job's code reaches it: ``model.4 (Linear)``
        (:mod:`.naming`); None where the origin is in no module or not found."""
        if not det.get("reproduced"):
            return None
        try:
            return module_text(det, *self._naming_roots())
        except Exception as exc:
            self._error("naming the module", exc)
            return None

    def _naming_roots(self) -> tuple[list[tuple[torch.nn.Module, torch.nn.Module]], list[Any]]:
        """The step's top-level modules (what the job called, what a replay runs) and the
        lines that called them, for :func:`~.naming.module_text`."""
        roots: dict[int, tuple[torch.nn.Module, torch.nn.Module]] = {}
        sites: dict[int, Any] = {}
        for c in self.captured.calls:
            roots.setdefault(id(c.target), (c.module, c.target))
            sites.setdefault(id(c.target), c.site)
        for m in self.roots:
            roots.setdefault(id(replay_target(m)), (m, replay_target(m)))
        return list(roots.values()), [sites.get(k) for k in roots]

    def _spiked(
        self,
        spike: Spike | None,
        diverging: tuple[int, str] | None,
        loss: float,
        grad_norm: float,
    ) -> dict[str, Any]:
        """A spike's detection (a loss spike, or a divergence: ``diverging``), its lines said:
        the spike's, then where it comes from (:mod:`.spike_origin`: the batch, the first
        module whose output jumped), then the divergence's. Its calls are replayed traced
        where a UI or a recording can see them, or to pause there (``on_spike="pause"``)."""
        step = self.step
        who = speaker()
        modules: list[tuple[str, float]] = []
        lines: list[str] = []
        origin: dict[str, Any] = {}
        if spike is not None:
            modules = self._jumped_modules(spike)
            lines.append(spike_line(spike, who, modules))
            origin = self._spike_origin(who, lines)
        if diverging is not None:
            lines.append(diverging[1])
        figures = (
            spike.to_dict()
            if spike is not None
            else {"loss": loss, "grad_norm": grad_norm, "lead": "divergence"}
        )
        det: dict[str, Any] = {
            "step": step,
            "what": SPIKE,
            "lead": figures["lead"],
            "grad_norm": grad_norm,
            "loss": loss,
            "spike": {**figures, "modules": [list(m) for m in modules], **origin},
            "diverging": diverging[0] if diverging is not None else None,
            "in_loss": False,
            "bad_params": [],
            "origin": None,
            "where": None,
            "source": None,
            "module": None,
            "module_text": None,
            "outside_modules": False,
            "reproduced": None,
            "replayed": False,
            "unit_gradient": False,
            "paused": False,
            "placed": False,
            "alerts": [],
            "events": [],
            "notes": [],
            "message": lines[0],
            "lines": lines,
            "repeats": 0,
            "last_step": step,
            "scale": self.loss_scaling.step_scale,
            "optimizer_step": self._optimizer_step(step),
            "growth": None,
            "unexplained": False,
        }
        self.spiked_step = step
        self.detections.append(det)
        for line in lines:
            self._say(line)
        self._replay_spike(det, (origin.get("first_module") or {}).get("path"))
        return det

    def _say(self, line: str) -> None:
        try:
            self.report(line)
        except Exception as exc:
            self._error("reporting", exc)

    def _say_growth(self, det: dict[str, Any]) -> None:
        """After a NaN/Inf that ends a run of growth, one more line says so (:mod:`.growth`)."""
        growth = self._growth
        det["growth"] = None
        if growth is None or det["what"] not in (NAN, INF):
            return
        try:
            rank = job_rank()
            who = f"torchscope[rank {rank}]" if rank is not None else "torchscope"
            det["growth"] = line = growth.line(det["step"], who)
            if line is not None:
                self.report(line)
        except Exception as exc:
            self._error("reporting", exc)

    def _written_by_update(self, run: dict[str, Any], params: list[torch.Tensor]) -> bool:
        """Whether the weights are non-finite right after the run's last bad step: its update
        wrote them (the job goes on under "continue"), and what the live tracer finds in
        this step (a parameter entering, a compiled model's output) is what the bad
        gradients did, not the NaN coming back. Asked only at a live alert: a host read."""
        if self.step != run["last_step"] + 1 or not params:
            return False
        with torch.no_grad(), torch._C.DisableTorchFunction():
            weights = [p.detach() for p in params]
            return not math.isfinite(norm_of(weights, weights[0].device).item())

    def _live_alert(self, after: int = -1) -> dict[str, Any] | None:
        """The live tracer's first origin alert of the current step, from step ``after`` on
        (the step that was bad, run again: a notebook's stopped step in a later cell, traced
        this time)."""
        try:
            alert = self.live_origin()
        except Exception as exc:
            self._error("reading the live tracer's origin", exc)
            return None
        if alert is None or alert.get("step") != self.step or self.step < after:
            return None
        return alert

    def _take_live_origin(self, det: dict[str, Any], alert: dict[str, Any] | None) -> None:
        """The step was traced live: its tracer's first origin alert is the detection's origin
        (one origin for one NaN, in the tracer's own words)."""
        if alert is None:
            alert = self._live_alert()
        if alert is None:
            det["notes"].append("the step was traced live and its tracer named no origin in it")
            det["reproduced"] = False
            return
        det.update(
            reproduced=True,
            traced_live=True,
            origin=alert.get("name"),
            where=alert.get("where"),
            source=alert.get("source"),
            module=alert.get("module") or None,
            origin_what=alert.get("what"),
            aten=alert.get("aten"),
        )

    def _end_run(self) -> None:
        """The steps after a detection are fine again (or bad in another way): say how long
        the bad stretch lasted, if it outlived its first step."""
        run, self._bad_run = self._bad_run, None
        if run is not None and run["repeats"]:
            what = bad_words(run)
            with contextlib.suppress(Exception):
                self.report(
                    f"{speaker()}: {what} from step {run['step']} lasted {run['repeats'] + 1} "
                    f"checked steps (to step {run['last_step']}; reported once)"
                )

    def _optimizer_step(self, step: int) -> int | None:
        """The optimizer's own number for ``step`` when a loss scaler has skipped updates
        (steps are the loop's iterations), else None. Known when the watch started at 0."""
        clock = self._clock
        if clock is None or not clock.skipped or self._started_at != 0:
            return None
        return step - clock.skipped

    def _param_names(self, tensors: list[torch.Tensor]) -> list[str]:
        if not tensors:
            return []
        names: dict[int, str] = {}
        for m in self._watched_modules():
            for n, p in replay_target(m).named_parameters():
                names.setdefault(id(p), n)
        return [names.get(id(t), f"<tensor {tuple(t.shape)}>") for t in tensors]


def category(what: str) -> str:
    return what if what in (GRADNORM, SPIKE) else "nonfinite"
