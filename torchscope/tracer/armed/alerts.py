"""Where NaN/Inf first appears, judged on resolved events (plain numbers).

- An op or node whose inputs are all finite but whose outputs are not is where that NaN/Inf
  first appears.
- An Inf made on purpose (a call given an infinite scalar, like the ``masked_fill(mask,
  -inf)`` of causal attention) is not an alert, and its outputs count as finite for the ops
  that use them, and so on down the line (``torch.triu`` of a ``full(-inf)`` mask, the mask
  added to the scores): a fully masked row turning into NaN in ``softmax`` is reported there.
- A non-finite tensor that enters from outside the traced ops (input data, a parameter the
  optimizer wrote) is reported at its first use. A gradient the traced backward wrote
  (``param.grad``, what ``autograd.grad`` returned) is not from outside: ``clip_grad_norm_``
  reading it is downstream of the origin, like any op.
- A consequence of an earlier origin is not an alert of its own: a parameter that enters
  non-finite after the optimizer applied a non-finite gradient of a traced step is counted
  under the origin that gradient came from. Each origin alert carries an ``origin`` id; at
  each step end an alert with ``where: "consequences"`` and the same id gives that origin's
  running count and its first few consequences (a file cannot rewrite the origin's event;
  readers fold the latest count into it: see ``torchscope.analysis.trace.fold_alerts``).
- A value that arrives non-finite through a collective (finite before it on this rank; DDP's
  averaged gradient of a parameter whose local gradient was finite) was made on another
  rank: an *arrival* (``where: "arrival"``, an ``arrival`` id, no ``origin`` id), never an
  origin of this rank and never a ``nan`` breakpoint's stop; the rank checks link it to the
  origin that rank published (``rank_checks``). Its consequences here are counted under it.
- With the aten level on, an origin op or node is named down to the aten call in it that made
  the value: the first of its calls whose outputs are not finite while the inputs it knows are.
- In the backward of a loss that a loss scaler (``GradScaler``) scaled, NaN/Inf first appearing
  is most likely the scaled values overflowing fp16, which the scaler handles by skipping the
  update: an *overflow* (``where: "overflow"``, an ``overflow`` id), not an origin. A ``nan``
  or ``inf`` breakpoint still stops there, and says so.

Every op downstream of an origin also has non-finite outputs, but its inputs are not finite
either, so it is not reported.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

from torchscope.protocol.events import ALERT, ATEN, CONSEQUENCES, GRAD, OP, STEP, Event, all_finite
from torchscope.tracer.armed.calls import overwrites_first_input

FIRST_CONSEQUENCES = 5  # consequences an origin lists in words; the rest are counted
# The backward recorder's ops of the gradients the ranks averaged (one output per parameter).
SYNCED_GRADIENTS = frozenset(
    ("torch.distributed.ddp_gradient_sync", "torch.distributed.fsdp_gradient_sync")
)

# Ops whose kernel updates running statistics (buffers passed after the activations) in
# place from the activations, in training mode.
RUNNING_STATS_OPS = frozenset(
    (
        "torch.nn.functional.batch_norm",
        "torch.nn.functional.instance_norm",
        "torch.batch_norm",
        "torch.instance_norm",
    )
)
# Collectives that send from a buffer the tracer cannot read before they run (FSDP's
# all-gather sends its copy-in buffer, filled inside FSDP's copy-in op): whether the value
# was finite on this rank before them is unknown, so NaN/Inf after them is not an arrival by
# itself.
COLLECTIVES_OF_UNKNOWN_INPUT = frozenset(("torch.distributed.all_gather_single",))
INF_INTENDED = "inf_intended"  # summary flag: its Infs come from an infinite scalar argument
# Ops that only look at their input's memory another way: they compute nothing.
VIEW_OPS = frozenset(
    "Tensor.view Tensor.view_as Tensor.reshape Tensor.reshape_as Tensor.as_strided "
    "torch.as_strided Tensor.narrow torch.narrow Tensor.detach Tensor.flatten torch.flatten "
    "Tensor.unflatten Tensor.squeeze Tensor.unsqueeze Tensor.t Tensor.transpose Tensor.permute "
    "Tensor.expand Tensor.expand_as".split()
)


def _bad(summary: dict | None) -> str | None:
    """'nan', 'inf' or None for one summary (a summary without stats is never blamed)."""
    if not summary:
        return None
    stats = summary.get("stats")
    if not stats or "nan" not in stats:
        return None
    if stats["nan"]:
        return "nan"
    if stats["inf"] and not summary.get(INF_INTENDED):
        return "inf"
    return None


def _holds_inf(summaries: list) -> bool:
    """Some summary counts an Inf, intended or not."""
    return any(s and (s.get("stats") or {}).get("inf") for s in summaries)


def _worst(summaries: list) -> str | None:
    kind = None
    for s in summaries:
        bad = _bad(s)
        if bad == "nan":
            return "nan"
        kind = kind or bad
    return kind


def _sides(event: dict) -> tuple[list, list] | None:
    """(inputs, outputs) of an op; for a node, what arrives and what it sends on."""
    kind = event.get("kind")
    if kind == OP:
        return event.get("inputs") or [], event.get("outputs") or []
    if kind == GRAD:
        return event.get("grad_outputs") or [], event.get("grad_inputs") or []
    return None


def origin_kind(event: dict) -> str | None:
    """'nan' or 'inf' when this op or node is where that value first appears, else None."""
    sides = _sides(event)
    if sides is None:
        return None
    return made_here(*sides, inf_arg=bool(event.get("inf_arg")))


def made_here(ins: list, outs: list, *, inf_arg: bool = False) -> str | None:
    """'nan' or 'inf' when a call with these input and output summaries made that value: its
    outputs hold it, its inputs hold none (an Inf from an infinite argument is meant)."""
    out_bad = _worst(outs)
    if out_bad is None or _worst(ins) is not None:
        return None
    if out_bad == "inf" and inf_arg:
        return None
    return out_bad


class AlertDetector:
    """Checks each resolved event in order; keeps a little state per step."""

    def __init__(self, next_seq: Callable[[], int]) -> None:
        self.next_seq = next_seq
        # Forward ops that saw NaN/Inf this step (in or out). A backward node made by one
        # computes from those saved values: its NaN is the forward one arriving, not a new
        # origin (nor, step after step, once the weights are NaN).
        self._tainted: set[int] = set()
        self._reported_inputs: set[int] = set()  # ids of external summaries, this step
        # A NaN weight stays NaN: said once. Parameter name -> the origin id it was put down to.
        self._reported_params: dict[str, str] = {}
        # seq -> "nan"/"inf" for this step's events that were found to be origins (forward,
        # backward or where a bad input enters): what a `nan` breakpoint stops at.
        self.origins: dict[int, str] = {}
        self.overflows: set[int] = set()  # those of them in a scaled loss's backward
        self.step_origins: list[Event] = []  # this step's origin alerts, in order
        # Told of every alert made (a multi-rank job shares its origins with the other ranks).
        self.on_alert: Callable[[Event], None] | None = None
        # The aten level: this step's aten calls with non-finite outputs (they come just
        # before their op, or before their node's grad event), and the names of its ops.
        self._bad_calls: list[Event] = []
        self._op_names: dict[int, str] | None = None
        # Origin ids name an origin in the whole job ("rank:seq"), so that consequences, here
        # and (later) on other ranks, can point at it.
        self._rank = os.environ.get("RANK", "0")
        self._tallies: dict[str, _Tally] = {}  # origin id -> its consequences so far
        # The origin this step's NaN/Inf are put down to: the step's first origin, or the one
        # its first consequence came from; else the latest origin of the run.
        self._step_blame: str | None = None
        self._blame_step = -1  # the step _step_blame belongs to
        # (origin id, step) of the last step that had one: what a parameter that enters
        # non-finite right after it is put down to, when its own gradient looked finite.
        self._prev_blame: tuple[str, int] | None = None
        self._last_origin: str | None = None
        # Parameter name -> (origin id, step) of its latest traced gradient that held NaN/Inf:
        # the optimizer writes that into the parameter, which the next step reads.
        self._bad_grads: dict[str, tuple[str | None, int]] = {}
        # (module, input index) -> the origin id whose NaN/Inf a normalisation's kernel wrote
        # into those running statistics (BatchNorm's buffers stay bad, step after step).
        self._running: dict[tuple[str, int], str | None] = {}

    def check(self, event: Event) -> list[Event]:
        kind = event["kind"]
        if kind == STEP:
            if self._step_blame is not None:
                self._prev_blame = (self._step_blame, self._blame_step)
            self._tainted.clear()
            self._reported_inputs.clear()
            self.origins.clear()
            self.overflows.clear()
            self.step_origins.clear()
            self._bad_calls.clear()
            self._op_names = None
            self._step_blame = None
            return self.tally_updates()  # the steps before this one are over
        if kind == ATEN:
            if self._op_names is None:
                self._op_names = {}
            if not all_finite(event.get("outputs")) and len(self._bad_calls) < 10_000:
                self._bad_calls.append(event)
            return []
        if kind == OP:
            if self._op_names is not None:
                self._op_names[event["seq"]] = event["name"]
            if all_finite(event.get("outputs")) and all_finite(event.get("inputs")):
                return []  # nearly every op: nothing bad on either side
            inputs = event.get("inputs") or []
            if event["name"] in SYNCED_GRADIENTS:
                # The averaged gradients (what is applied): NaN/Inf there that this rank's own
                # gradient of the parameter did not hold came from another rank.
                return self._synced_gradients(event)
            if event["name"] in VIEW_OPS and inputs and inputs[0] and inputs[0].get("external"):
                # A view of memory from outside the traced ops (data, or a buffer a library
                # fills next, as FSDP's gathered parameters): nothing is computed here, so
                # the view is from outside too, and the first op that reads it says so.
                made_by = inputs[0].get("made_by")
                for out in event.get("outputs") or []:
                    if out:
                        out["external"] = True
                        if made_by:
                            out["made_by"] = made_by
                self._tainted.add(event["seq"])
                return []
            if (
                event["name"] in COLLECTIVES_OF_UNKNOWN_INPUT
                and not any((s or {}).get("stats") for s in inputs)
                and self._collective_consequence(event)
            ):
                return []
            alerts = self._external_inputs(event)
            sides = _sides(event)
            assert sides is not None
            if _worst(sides[0]) is None and (event.get("inf_arg") or _holds_inf(sides[0])):
                # An Inf made on purpose stays on purpose through the ops it flows into
                # (torch.triu of a -inf mask, the mask added to attention scores).
                for s in sides[1]:
                    if _bad(s) == "inf":
                        s[INF_INTENDED] = True
            if _worst(sides[0]) or _worst(sides[1]):
                self._tainted.add(event["seq"])
            what = origin_kind(event)
            if what is not None:
                call = self._aten_call(event)
                alerts.append(self._alert(event, what, "forward", event["name"], call))
            return alerts
        if kind == GRAD:
            if event.get("param") is not None:
                self._note_gradient(event["param"], event.get("grad_outputs"), event["step"])
            if all_finite(event.get("grad_inputs")) or event.get("op_seq") in self._tainted:
                return []
            what = origin_kind(event)
            if what is not None:
                call = self._aten_call(event)
                return [self._alert(event, what, "backward", event["node"], call)]
        return []

    def _aten_call(self, event: Event) -> Event | None:
        """With the aten level on, the aten call of an origin op or node that made the value:
        the first of its calls with non-finite outputs whose known inputs are finite."""
        if not self._bad_calls:
            return None
        if event["kind"] == OP:
            seq = event["seq"]
            calls = [c for c in self._bad_calls if c.get("op_seq") == seq]
        else:
            nid = event.get("node_id")
            calls = [
                c for c in self._bad_calls if c.get("node_id") == nid and not c.get("accumulate")
            ]
        for call in calls:
            if _worst(call.get("inputs") or []) is None:
                return call
        return None

    def _external_inputs(self, event: Event) -> list[Event]:
        out = []
        # copy_(dst, src), fill_, nn.init: the destination's old values do not matter.
        skip_first = overwrites_first_input(event["name"])
        for i, s in enumerate(event.get("inputs") or []):
            if not s or not s.get("external") or (i == 0 and skip_first):
                continue
            if s.get("made_by"):
                continue  # a gradient the traced backward wrote: downstream of its origin
            what = _bad(s)
            if what is None or id(s) in self._reported_inputs:
                continue
            self._reported_inputs.add(id(s))
            param = s.get("param")
            if param is None and self._running_stats_consequence(event, i, what):
                continue
            if param is None:
                label = f"input {i} of {event['name']} (from outside the traced ops)"
                out.append(self._alert(event, what, "input", label))
            elif param in self._reported_params:
                self._blame(self._reported_params[param], event["step"])
            elif not self._parameter_consequence(event, what, param):
                alert = self._alert(event, what, "input", f"parameter {param}")
                self._reported_params[param] = alert["origin"]
                out.append(alert)
        return out

    # -- consequences ------------------------------------------------------------------------
    def _blame(self, origin: str | None, step: int) -> None:
        """This step's NaN/Inf are put down to ``origin`` unless an earlier one was found."""
        if self._step_blame is None and origin is not None:
            self._step_blame, self._blame_step = origin, step

    def _note_gradient(self, param: str, grads: list | None, step: int) -> None:
        """AccumulateGrad of ``param`` ran: whether the gradient the optimizer will apply
        holds NaN/Inf, and which origin it came from. A finite gradient of the same step does
        not clear it: AccumulateGrad sums them (micro-batches), and NaN + 1 is NaN."""
        if not all_finite(grads):
            self._bad_grads[param] = (self._step_blame or self._last_origin, step)
        elif param in self._bad_grads and self._bad_grads[param][1] < step:
            del self._bad_grads[param]

    def _synced_gradients(self, event: Event) -> list[Event]:
        """DDP's (or FSDP's) gradients after the ranks averaged them: what is applied. A
        parameter whose local gradient of this step (its AccumulateGrad) already held NaN/Inf
        is this rank's own doing, under the step's origin; one whose local gradient was finite
        got it from another rank: one arrival for the op, which the others' origin links."""
        step = event["step"]
        bad = [
            s for s in event.get("outputs") or [] if s and s.get("param") is not None and _bad(s)
        ]
        foreign = [s for s in bad if (self._bad_grads.get(s["param"]) or (None, -1))[1] != step]
        alerts = []
        if foreign:
            alerts.append(self._alert(event, _worst(foreign) or "nan", "arrival", event["name"]))
        for s in bad:
            if s in foreign or s["param"] not in self._bad_grads:
                self._note_gradient(s["param"], [s], step)
        return alerts

    def _running_stats_consequence(self, event: Event, i: int, what: str) -> bool:
        """A normalisation's running statistics (BatchNorm's ``running_mean`` and
        ``running_var``: buffers, inputs after the activations, never parameters) that hold
        NaN/Inf because the kernel wrote them in place from non-finite activations, in this
        call or an earlier one of the same module: counted under the origin of those
        activations, as the parameters an update writes are. False when they are not such a
        consequence (NaN statistics loaded from outside are still an input alert)."""
        if i == 0 or event["name"] not in RUNNING_STATS_OPS:
            return False
        key = (event.get("module", ""), i)
        inputs = event.get("inputs") or []
        origin = self._running.get(key)
        if _bad(inputs[0]) is not None:  # written from these activations just now
            origin = self._step_blame or self._last_origin
            self._running[key] = origin
        tally = self._tallies.get(origin) if origin is not None else None
        if tally is None:
            return False
        noun = "NaN" if what == "nan" else "Inf"
        kind = "arrival" if tally.origin.get("arrival") else "origin"
        module = event.get("module") or "the model"
        tally.add(
            event,
            f"input {i} of {event['name']}",
            f"{noun} in the running statistics of {module} (input {i} of {event['name']}) "
            f"— written by the kernel from non-finite activations (consequence of the "
            f"{kind} at step {tally.origin['step']})",
        )
        self._blame(origin, event["step"])
        return True

    def _collective_consequence(self, event: Event) -> bool:
        """A collective that brings NaN/Inf in from memory this rank cannot read beforehand
        (FSDP's all-gather of the parameter shards, sent from its copy-in buffer) right after
        a step with NaN/Inf: the update wrote them into the shards on every rank, and the
        all-gather only syncs those values. Counted under that step's origin (or arrival),
        not an arrival of its own; False when it is not such a consequence."""
        blame = self._prev_blame
        if self._step_blame is not None:
            blame = (self._step_blame, self._blame_step)
        if blame is None or event["step"] - blame[1] > 1:
            return False
        origin, step = blame
        tally = self._tallies.get(origin)
        if tally is None:
            return False
        what = _worst(event.get("outputs") or []) or "nan"
        noun = "NaN" if what == "nan" else "Inf"
        kind = "arrival" if tally.origin.get("arrival") else "origin"
        tally.add(
            event,
            event["name"],
            f"{noun} comes through {event['name']} — parameters written after the NaN/Inf "
            f"of step {step} (consequence of the {kind} at step {tally.origin['step']})",
        )
        self._blame(origin, event["step"])
        return True

    def _parameter_consequence(self, event: Event, what: str, param: str) -> bool:
        """A parameter that enters non-finite right after a traced step whose gradient of it
        was not finite: the optimizer wrote that gradient into it. Counted under the origin
        of the gradient, not an alert; False when it is not such a consequence."""
        noun = "NaN" if what == "nan" else "Inf"
        found = self._bad_grads.get(param)
        found_origin = found[0] if found is not None else None
        if found is not None and found_origin is not None and event["step"] - found[1] <= 1:
            origin, grad_step = found_origin, found[1]
            how = f"written by the optimizer from the {noun} gradient of step {grad_step}"
        elif self._prev_blame is not None and event["step"] - self._prev_blame[1] <= 1:
            # Its own gradient looked finite when recorded, but the step before had NaN/Inf:
            # code after backward (clip_grad_norm_'s NaN total norm scaling every gradient)
            # or the update spread it into this parameter.
            origin, grad_step = self._prev_blame
            how = f"written after the NaN/Inf of step {grad_step}"
        else:
            return False
        tally = self._tallies[origin]
        kind = "arrival" if tally.origin.get("arrival") else "origin"
        message = (
            f"{noun} enters as parameter {param} \u2014 {how} (consequence of the {kind} at "
            f"step {tally.origin['step']})"
        )
        self._reported_params[param] = origin
        self._blame(origin, event["step"])
        tally.add(event, f"parameter {param}", message)
        return True

    def tally_updates(self) -> list[Event]:
        """One alert per origin whose consequences grew since the last call: its running
        count and its first few consequences (called at each step boundary and at the end)."""
        return [self._tally_alert(t) for t in self._tallies.values() if t.pop_changed()]

    def _tally_alert(self, tally: _Tally) -> Event:
        head = tally.origin
        noun = "NaN" if head["what"] == "nan" else "Inf"
        lo, hi = tally.steps
        steps = f"step {lo}" if lo == hi else f"steps {lo}-{hi}"
        n = tally.count
        return Event(
            kind=ALERT,
            seq=self.next_seq(),
            step=hi,
            what=head["what"],
            where=CONSEQUENCES,
            event_seq=None,
            name=head["name"],
            module=head.get("module", ""),
            source=head.get("source"),
            consequences=n,
            consequence_steps=[lo, hi],
            first_consequences=list(tally.first),
            message=(
                f"{n} consequence{'s' * (n != 1)} ({steps}) of the {noun} {tally.key} at "
                f"step {head['step']}: {head['message']}"
            ),
            **{tally.key: tally.ident},
        )

    def _alert(
        self, event: Event, what: str, where: str, label: str, call: Event | None = None
    ) -> Event:
        # The kernel's own line where it has one (a custom Function's backward), else the op's.
        source = (call.get("source") if call is not None else None) or event.get("source")
        at = f" at {source}" if source else ""
        noun = "NaN" if what == "nan" else "Inf"
        verb = "enters as" if where == "input" else "first appears in"
        # Finite here before a collective, not after it: made on another rank. Not an origin
        # (no ``origin`` id, no ``nan`` breakpoint stop): an arrival, linked to that rank's
        # origin by the rank checks.
        arrived = where == "arrival" or label.startswith("torch.distributed.")
        overflow = not arrived and where == "backward" and bool(event.get("scaled"))
        if not arrived:
            self.origins.setdefault(event["seq"], what)
        if overflow:
            self.overflows.add(event["seq"])
        named = label
        if call is not None:  # "aten.mm.default inside AddmmBackward0 (node 57, created by ...)"
            named = f"{call['name']} inside {label}"
            if event["kind"] == GRAD:
                op_seq = event.get("op_seq")
                made_by = (
                    self._op_names.get(op_seq) if self._op_names and op_seq is not None else None
                )
                by = f", created by {made_by}" if made_by else ""
                named += f" (node {event.get('node_id')}{by})"
        seq = self.next_seq()
        ident = f"{self._rank}:{seq}"
        if arrived:
            where, label = "arrival", f"{label} from another rank"
            message = f"{noun} arrives through {label}{at}"
        elif overflow:
            where = "overflow"
            message = (
                f"{noun} first appears in {named} (backward){at}: the loss scaler's overflow "
                "(it skips this step's update)"
            )
        else:
            message = f"{noun} {verb} {named} ({where}){at}"
        alert = Event(
            kind=ALERT,
            seq=seq,
            step=event["step"],
            what=what,
            where=where,
            event_seq=event["seq"],
            name=label,
            module=event.get("module", ""),
            source=source,
            node_id=event.get("node_id"),
            param=event.get("param"),
            message=message,
        )
        if arrived:
            alert["arrival"] = ident
            alert["arrived"] = True
        else:
            alert["origin"] = ident
        if call is not None:
            alert["aten"], alert["aten_seq"] = call["name"], call["seq"]
        if overflow:
            del alert["origin"]
            alert["overflow"] = ident  # nothing was written: no consequences to count
            return alert
        self._tallies[ident] = _Tally(alert)
        if not arrived:
            self.step_origins.append(alert)
        self._last_origin = ident
        self._blame(ident, event["step"])
        if self.on_alert is not None:
            with contextlib.suppress(Exception):  # sharing never costs the alert itself
                self.on_alert(alert)
        return alert


class _Tally:
    """The consequences found so far of one origin (or arrival)."""

    def __init__(self, origin: Event) -> None:
        self.origin = origin
        # "origin", or "arrival" for a value another rank made: the field naming it
        self.key = "arrival" if origin.get("arrival") else "origin"
        self.ident: str = origin[self.key]
        self.count = 0
        self.steps: list[int] = []  # [first, last] step with a consequence
        self.first: list[dict[str, Any]] = []  # the first few, in words
        self._changed = False

    def add(self, event: Event, name: str, message: str) -> None:
        step = event["step"]
        self.count += 1
        self.steps = [self.steps[0], step] if self.steps else [step, step]
        if len(self.first) < FIRST_CONSEQUENCES:
            self.first.append(
                {
                    "step": step,
                    "event_seq": event["seq"],
                    "name": name,
                    self.key: self.ident,
                    "message": message,
                }
            )
        self._changed = True

    def pop_changed(self) -> bool:
        changed, self._changed = self._changed, False
        return changed
