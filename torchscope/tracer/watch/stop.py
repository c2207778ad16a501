"""``WatchStop``: what the NaN watch raises under ``on_nan="stop"``. Imports no torch, so that
``torchscope`` exports it (``except torchscope.WatchStop``) to code that never traces."""

from __future__ import annotations

from typing import Any

from torchscope.protocol.policies import MAX_SKIPS, POLICIES

__all__ = ["MAX_SKIPS", "POLICIES", "STOP_EXIT_CODE", "WatchStop"]

STOP_EXIT_CODE = 3  # what `torchscope run --on-nan stop` should exit with


class WatchStop(Exception):
    """Raised from ``optimizer.step()`` (before the update) when ``on_nan="stop"`` and a step
    went bad (or ``on_spike="stop"`` and its loss spiked), or under ``on_nan="skip"`` at a bad
    step past ``max_skips`` in a row (from its closure, when it was given one; Lightning's
    Trainer lets it through); in a job that updates by hand, from the step's ``backward()``.
    ``detection`` is the report's dict; ``exit_code`` what a CLI should exit with."""

    exit_code = STOP_EXIT_CODE
    stops_the_job = True  # backward_calls lets it through to the job

    def __init__(self, detection: dict[str, Any], policy: str = "stop") -> None:
        super().__init__(detection.get("message", "torchscope: NaN watch stopped the job"))
        self.detection = detection
        self.policy = policy  # the policy that stopped it: "stop", or "skip" at its limit
        # Which option that policy was: on_spike for a loss spike, else on_nan.
        self.option = "on_spike" if detection.get("what") == "spike" else "on_nan"
