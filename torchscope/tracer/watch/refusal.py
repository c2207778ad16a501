"""Under ``on_nan="skip"`` (or ``on_spike="skip"``): a bad step's update is refused, as a loss
scaler skips an overflowed step, and training goes on.

The refusal takes the gradients of the optimizer's parameters away while its ``step()`` runs:
torch's optimizers pass over a parameter with no ``.grad`` and leave its state alone
(momentum, Adam's moments and step count), as if ``step()`` had not run. The gradients are
given back when the update ends. Past ``max_skips`` bad steps in a row the next one stops the
job, as ``stop`` does; a good step starts the count again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch

from torchscope.tracer.ranks import speaker
from torchscope.tracer.watch.report import bad_words
from torchscope.tracer.watch.stop import MAX_SKIPS, WatchStop


class UpdateRefusal:
    """Which updates are refused, and the gradients held away from the one being refused."""

    def __init__(self, max_skips: int = MAX_SKIPS) -> None:
        if isinstance(max_skips, bool) or not isinstance(max_skips, int) or max_skips < 0:
            raise ValueError(f"max_skips must be a count of steps (an int >= 0), not {max_skips!r}")
        self.max_skips = max_skips
        self.step: int | None = None  # the step whose update is refused (the latest)
        self.refused = 0  # updates refused in all
        self._in_row = 0  # bad steps in a row, this one included
        self._held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._said_by_hand = False

    def decide(
        self, step: int, run: dict[str, Any] | None, report: Callable[[str], None]
    ) -> WatchStop | None:
        """A checked ``step``: ``run`` is its detection, or the bad stretch it is still in
        (None: good). A bad step's update is refused, said once per step (LBFGS checks its
        closure several times a step); past ``max_skips`` in a row, the ``WatchStop`` that
        "stop" raises is returned."""
        if run is None:
            if self.step != step:  # (a later closure call of a refused step: not good)
                self._in_row = 0
            return None
        if self.step == step:
            return None  # checked again in the same update: refused once
        n = self._in_row + 1
        in_row = f"{n} bad steps in a row since step {step - n + 1}"
        stop = None
        if n > self.max_skips:
            line = (
                f"{speaker()}: {bad_words(run)} at step {step}, {in_row} (at most "
                f"{self.max_skips} updates skipped in a row): stopped before the update"
            )
            # (not counted again: the same step run again, a notebook's cell, stops again)
            stop = WatchStop({**run, "message": line, "step": step}, policy="skip")
        else:
            self._in_row = n
            self.step = step
            self.refused += 1
            run["skipped"] = True
            line = f"{speaker()}: skipped the update of step {step}; training goes on"
            if n > 1:
                line = (
                    f"{speaker()}: skipped the update of step {step}: still {bad_words(run)} "
                    f"({in_row}; {self.max_skips + 1} in a row stop the job)"
                )
        with contextlib.suppress(Exception):  # the report is the job's stderr or a sink
            report(line)
        return stop

    @property
    def holding(self) -> bool:
        """Gradients are held away from an update being refused."""
        return bool(self._held)

    def take(self, params: Iterable[torch.Tensor]) -> None:
        """Take the gradients of ``params`` away for the update. The latest taken of each
        parameter is held (LBFGS calls its closure, checked each time, again within the
        step)."""
        for p in params:
            g = p.grad
            if g is not None:
                self._held[id(p)] = (p, g)
                p.grad = None

    def give_back(self) -> None:
        """The refused update ended: the gradients are back, as the job left them (where it
        has made none since: a later closure call's, or the next step's, are its own)."""
        held, self._held = self._held, {}
        for p, g in held.values():
            if p.grad is None:
                p.grad = g

    def say_by_hand(self, run: dict[str, Any], report: Callable[[str], None]) -> None:
        """A job that updates its weights in its own code cannot have its update refused: it
        goes on as under "continue", said once."""
        if self._said_by_hand:
            return
        self._said_by_hand = True
        option = "on_spike" if run["what"] == "spike" else "on_nan"
        with contextlib.suppress(Exception):  # the report is the job's stderr or a sink
            report(
                f'torchscope: {option}="skip" cannot refuse this update: the job makes '
                'it in its own code (no optimizer.step()); it goes on as under "continue"'
            )
