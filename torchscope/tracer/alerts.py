"""Where NaN/Inf first appears: an op or node whose inputs are finite but whose outputs are not.

Runs on resolved events (plain numbers), off the training thread. Every op downstream of the
origin also has non-finite outputs, but its inputs are not finite, so it is not reported.
"""

from __future__ import annotations

from collections.abc import Callable

from torchscope.protocol.events import ALERT, GRAD, OP, Event
from torchscope.tracer.summary import is_finite


def _bad_kind(summaries: list) -> str | None:
    """'nan' or 'inf' when any summary holds one (NaN wins), else None."""
    kind = None
    for s in summaries:
        stats = s.get("stats") if s else None
        if stats and "nan" in stats:
            if stats["nan"]:
                return "nan"
            if stats["inf"]:
                kind = "inf"
    return kind


def _all_finite(summaries: list) -> bool:
    # A summary without stats (subclass, sparse, ...) cannot be blamed: count it as finite.
    return all(is_finite(s) is not False for s in summaries)


def origin_alert(
    event: Event, next_seq: Callable[[], int], tainted: set[int] | None = None
) -> Event | None:
    """An alert event when ``event`` is where a NaN/Inf originates, else None.

    ``tainted`` collects the seqs of forward ops that saw a NaN/Inf (in or out). A backward
    node made by such an op computes from those saved values: its NaN is the forward one
    arriving, not a new origin, so it is not reported (nor, step after step, once the
    weights are NaN).
    """
    kind = event["kind"]
    if kind == OP:
        ins, outs = event["inputs"], event["outputs"]
        where, label = "forward", event["name"]
    elif kind == GRAD:
        if tainted and event.get("op_seq") in tainted:
            return None
        ins, outs = event["grad_outputs"], event["grad_inputs"]
        where, label = "backward", event["node"]
    else:
        return None
    bad = _bad_kind(outs)
    if bad is None:
        if tainted is not None and kind == OP and not _all_finite(ins):
            tainted.add(event["seq"])
        return None
    if tainted is not None and kind == OP:
        tainted.add(event["seq"])
    if not _all_finite(ins):
        return None
    source = event.get("source")
    at = f" at {source}" if source else ""
    noun = "NaN" if bad == "nan" else "Inf"
    return Event(
        kind=ALERT,
        seq=next_seq(),
        step=event["step"],
        what=bad,
        where=where,
        event_seq=event["seq"],
        name=label,
        module=event.get("module", ""),
        source=source,
        node_id=event.get("node_id"),
        message=f"{noun} first appears in {label} ({where}){at}",
    )
