"""Eager checks (``eager_check``): an op event with ``compiled: true`` is one call of a
compiled module (its backward node: CompiledFunctionBackward); with ``eager_check: <seq>``, an
op of the eager re-run of the compiled call with that seq. An alert with ``what:
"eager_check"`` compares the two: a check, not a NaN/Inf origin, which the store, the replay
cursor and the alert views count apart.

No textual imports here, and no torch.
"""

from __future__ import annotations

from typing import Any

from torchscope.protocol.events import EAGER_CHECK


def is_check(alert: Any) -> bool:
    """An eager check's report (compiled against eager), not a NaN/Inf alert."""
    return isinstance(alert, dict) and alert.get("what") == EAGER_CHECK


def check_passed(alert: Any) -> bool:
    """An eager check whose every difference is within tolerance."""
    diffs = alert.get("differences")
    return (
        isinstance(diffs, list)
        and bool(diffs)
        and all(isinstance(d, dict) and d.get("within") is True for d in diffs)
    )


def eager_of(ev: Any) -> int | None:
    """The seq of the compiled call an op of an eager re-run re-ran, or None."""
    seq = ev.get(EAGER_CHECK) if isinstance(ev, dict) else None
    return seq if type(seq) is int else None
