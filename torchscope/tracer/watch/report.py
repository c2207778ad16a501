"""The NaN watch's wording: the one line a detection prints (:func:`describe`)."""

from __future__ import annotations

import os
from typing import Any

from torchscope.analysis.render import short_source
from torchscope.tracer.ranks import say_line
from torchscope.tracer.watch.norms import GRADNORM, NAN
from torchscope.tracer.watch.spikes import SPIKE


def job_rank() -> int | None:
    try:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            return int(os.environ["RANK"])
    except (KeyError, ValueError):
        pass
    return None


def watching_words(watch: str, on_nan: str, on_spike: str) -> str:
    """What a job says it watches, and what it does then: ``nan,spike, then continue; on a
    spike: pause`` (the spike's policy where it differs)."""
    from torchscope.tracer.steps import parse_watch_spec

    text = f"{watch}, then {on_nan}"
    try:
        spike = parse_watch_spec(watch).spike
    except Exception:  # a spec refused earlier
        spike = False
    return f"{text}; on a spike: {on_spike}" if spike and on_spike != on_nan else text


def print_report(text: str) -> None:
    say_line(text)  # already says who (and which rank)


def describe(det: dict[str, Any], rank: int | None = None) -> str:
    """The one line a detection prints."""
    who = f"torchscope[rank {rank}]" if rank is not None else "torchscope"
    step = step_words(det)
    if det["what"] == GRADNORM:
        return f"{who}: gradient norm {det['grad_norm']:.4g} above the limit at step {step}"
    noun = "NaN" if det["what"] == NAN else "Inf"
    if det["reproduced"]:
        noun = "NaN" if det.get("origin_what", det["what"]) == NAN else "Inf"
        source = short_source(det.get("source"))
        at = f" at {source}" if source else ""
        # The module as the job's code reaches it, with its class (naming.py): model.4 (Linear)
        module = det.get("module_text") or (f"module {det['module']}" if det.get("module") else "")
        at = (f" in {module}" if module else "") + at
        if det.get("loop_code"):
            return loop_code_line(det, who, noun)
        if det.get("loop_forward"):
            return loop_forward_line(det, who, noun, "replayed")
        if det["where"] == "input":
            text = f"{who}: {noun} enters at step {step} as {det['origin']}{at}"
        else:
            origin, where = det["origin"], det["where"]
            if det.get("aten"):  # the replay ran at the aten level: the kernel, then its op
                origin = f"{det['aten']} inside {origin}"
            text = f"{who}: {noun} first appears at step {step} in {origin} ({where}){at}"
        if det.get("outside_modules"):
            site = short_source(det.get("backward_source"))
            text += " outside the module calls (training-loop code"
            text += f"; backward() at {site})" if site else ")"
        text += " — traced live" if det.get("traced_live") else " — replayed"
        if det.get("unit_gradient"):
            text += " (backward from a unit gradient: output gradients were above the capture cap)"
        return text
    if det.get("placed"):
        noun = "NaN" if det.get("origin_what", det["what"]) == NAN else "Inf"
        return placed_line(det, who, noun)
    if det.get("loop_forward"):  # no graph kept: no backward node to show it at
        return loop_forward_line(det, who, noun, "replayed")
    if det.get("outside_modules"):
        return (
            f"{who}: {noun} first appears at step {step} in the backward, outside the module "
            "calls (training-loop code between the loss and the modules' outputs: the "
            "gradients arriving at those outputs are already non-finite); not replayed there: "
            + ("; ".join(det.get("notes") or []) or "the step's graph was not kept")
        )
    where = "the loss" if det.get("in_loss") and not det.get("bad_params") else "the gradients"
    if det.get("fsdp") and det.get("in_loss"):
        return (
            f"{who}: {noun} in the loss at step {step}: this rank's own forward made it (under "
            "FSDP the step is not replayed: its collectives would run on this rank alone)"
        )
    if det.get("fsdp") and det.get("arrived"):
        return (
            f"{who}: {noun} in the gradients at step {step} came from another rank through "
            "FSDP's gradient reduce-scatter (this rank's loss is finite); linked to that rank's "
            "origin when it names it"
        )
    if det.get("arrived"):
        return (
            f"{who}: {noun} in {where} at step {step}, but the replay did not reproduce it: "
            "this rank's replay is finite, so it came from another rank through the gradient "
            "all-reduce; linked to that rank's origin when it names it"
        )
    reasons = "; ".join(det.get("notes") or []) or "no replayed op or node made it"
    return (
        f"{who}: {noun} in {where} at step {step}, but the replay did not reproduce it "
        f"({reasons}) — origin unknown"
    )


def step_words(det: dict[str, Any]) -> str:
    """``12``, or ``12 (optimizer step 5)`` when a loss scaler skipped updates before it."""
    opt = det.get("optimizer_step")
    return f"{det['step']}" if opt is None else f"{det['step']} (optimizer step {opt})"


def placed_line(det: dict[str, Any], who: str, noun: str) -> str:
    """A loop-code origin placed from the marks of the step's own backward (a compiled model
    keeps no graph to replay it over)."""
    site = short_source(det.get("backward_source"))
    at = f"; backward() at {site}" if site else ""
    how = "placed, not replayed (a compiled model keeps no graph to replay)"
    if det.get("loop_forward"):
        return loop_forward_line(det, who, noun, how)
    return (
        f"{who}: {noun} first appears at step {step_words(det)} in {det['origin']} (backward) "
        f"outside the module calls (training-loop code{at}) — {how}"
    )


def loop_code_line(det: dict[str, Any], who: str, noun: str) -> str:
    """An origin in the loop's own code between module calls (a loss function, a library's
    ``log_prob``), as the step ran it: the op, the user's line, and the library's line that
    ran the op when it is not the user's own."""
    source = short_source(det.get("source"))
    at = f" at {source}" if source else ""
    library = det.get("library")
    inside = f" ({library})" if library else ""
    step = step_words(det)
    if det.get("entered"):
        return (
            f"{who}: {noun} enters the training loop's code at step {step} in "
            f"{det['origin']}{at}{inside}: one of its inputs already held it (the batch, or a "
            "value made before the loop's code) — seen as the step ran"
        )
    unsure = (
        " (an input of it is no longer held to tell whether it came in already)"
        if det.get("unsure")
        else ""
    )
    return (
        f"{who}: {noun} first appears at step {step} in {det['origin']} (forward){at}{inside}, "
        f"in the training loop's code{unsure} — seen as the step ran"
    )


def loop_forward_line(det: dict[str, Any], who: str, noun: str, how: str) -> str:
    """A forward origin in the loop's own code (between module calls, not re-run): the loss
    is non-finite and the replayed module calls are not; the backward node where it first
    shows, when the step's graph was kept or marked."""
    site = short_source(det.get("backward_source"))
    at = f"; backward() at {site}" if site else ""
    node = det.get("backward_node")
    shows = f"; in the backward it first shows at {node}" if node else ""
    return (
        f"{who}: {noun} first appears at step {step_words(det)} in the forward, outside the "
        "module calls (training-loop code: the loss is non-finite, the replayed modules' "
        f"outputs are not{at}){shows} — {how}"
    )


def bad_words(run: dict[str, Any]) -> str:
    """What a bad stretch is, in its lines: "NaN/Inf", "a gradient norm above the limit",
    "a loss spike" (or "a gradient norm spike")."""
    if run["what"] == SPIKE:
        lead = run.get("lead", "loss")
        return "a divergence" if lead == "divergence" else f"a {lead} spike"
    return "a gradient norm above the limit" if run["what"] == GRADNORM else "NaN/Inf"
