"""``WatchStop``: what the NaN watch raises under ``on_nan="stop"``. Imports no torch, so that
``torchscope`` exports it (``except torchscope.WatchStop``) to code that never traces."""

from __future__ import annotations

from typing import Any

STOP_EXIT_CODE = 3  # what `torchscope run --on-nan stop` should exit with


class WatchStop(Exception):
    """Raised from ``optimizer.step()`` (before the update) when ``on_nan="stop"`` and a step
    went bad (from its closure, when it was given one; Lightning's Trainer lets it through);
    in a job that updates by hand, from the step's ``backward()``. ``detection`` is
    the report's dict; ``exit_code`` what a CLI should exit with."""

    exit_code = STOP_EXIT_CODE
    stops_the_job = True  # backward_calls lets it through to the job

    def __init__(self, detection: dict[str, Any]) -> None:
        super().__init__(detection.get("message", "torchscope: NaN watch stopped the job"))
        self.detection = detection
