"""What the NaN watch knows of a loss scaler (``GradScaler``): the loss it scaled for the next
``backward()``, the scale of the step being checked, the overflows that were the scaler's own,
and the steps it skipped in a row (said once per stretch: the classic AMP failure, a NaN every
step and the scale falling towards zero)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import torch

from torchscope.tracer.ranks import speaker

# A loss scaler that skips this many steps in a row is said once (its scale is collapsing).
SKIPS_TO_SAY = 20


class LossScaling:
    """The watch's view of the job's loss scaler, step by step."""

    def __init__(self) -> None:
        # The last ``scaler.scale(loss)`` of the step: (scaled, [loss], scaler), until the
        # backward() it feeds begins.
        self._scaled: tuple[torch.Tensor, list[torch.Tensor], Any] | None = None
        self.step_scale: float | None = None  # the scale of the step being checked
        self.overflows = 0  # non-finite scaled gradients that were the scaler's
        self._skips = 0  # scaler skips in a row
        self._last_loss: float | None = None  # the unscaled loss of the last check
        self._last_scaler: weakref.ref | None = None

    def scaled(self, scaler: Any, outputs: Any, scaled: Any) -> None:
        """``scaler.scale(outputs)`` returned ``scaled``."""
        if isinstance(scaled, torch.Tensor) and isinstance(outputs, torch.Tensor):
            self._scaled = (scaled, [outputs], scaler)
        else:
            self._scaled = None  # several outputs scaled at once: read as the job passes them

    def take(self, roots: list[torch.Tensor]) -> tuple[list[torch.Tensor], Any] | None:
        """The unscaled loss and its scaler, when ``roots`` (a backward's) is what the scaler
        returned."""
        scaled, self._scaled = self._scaled, None
        if scaled is None or len(roots) != 1 or roots[0] is not scaled[0]:
            return None
        return scaled[1], scaled[2]

    def forget_pending(self) -> None:
        self._scaled = None

    def note(self, scaler: Any, values: list[torch.Tensor]) -> None:
        """What the skip line says later: the last loss and the scaler (no sync: read off
        the loss already read, when it is one value)."""
        self._last_scaler = weakref.ref(scaler)
        self._last_loss = None
        if len(values) == 1 and values[0].numel() == 1 and values[0].device.type == "cpu":
            with torch._C.DisableTorchFunction():
                self._last_loss = float(values[0])

    def step_ended(self, skipped: bool, step: int, report: Callable[[str], None]) -> None:
        """A step ended, ``skipped`` by the scaler or not; the ``SKIPS_TO_SAY``-th skip in a
        row is said."""
        if not skipped:
            self._skips = 0
            return
        self._skips += 1
        if self._skips == SKIPS_TO_SAY:
            self._say_skips(step, report)

    def _say_skips(self, step: int, report: Callable[[str], None]) -> None:
        last = self._last_loss
        loss = "" if last is None else f"; the loss is {last:.4g}"
        scale = ""
        scaler = self._last_scaler() if self._last_scaler is not None else None
        if scaler is not None:
            with contextlib.suppress(Exception):  # a scaler's own state: a figure, not needed
                scale = f" (its scale is now {scaler.get_scale():.3g})"
        with contextlib.suppress(Exception):  # the report is the job's stderr or a sink
            report(
                f"{speaker()}: the loss scaler skipped {self._skips} steps in a row{scale}"
                f"{loss} (steps {step - self._skips}-{step - 1} made no update)"
            )
