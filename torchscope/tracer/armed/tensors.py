"""What an armed period knows of its tensors: one summary per value, shared where it can be.

Both recorders (forward ops, backward nodes) ask :class:`TensorSummaries` for a tensor's
summary. It reuses the memo's entry when the very value was summarised before, shares one with
an alias over the same memory, defers the numbers of external inputs (data, weights) until an
op's outputs go non-finite, and marks uninitialised memory (``torch.empty`` and its views) as
meaningless rather than alarming.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from torchscope.tracer.armed.summary import Summarizer, SummaryMemo, tensor_meta

BACKWARD = "backward"  # an external summary's ``made_by``: a gradient the traced backward wrote
_MADE_BY_BACKWARD: dict = {"made_by": BACKWARD}  # the marker backward_made holds


class TensorSummaries:
    """The armed period's summaries. Callers hold the pipeline's lock with grad mode off."""

    def __init__(self, summarizer: Summarizer, param_name: Any) -> None:
        self.summarizer = summarizer
        self.memo = SummaryMemo()
        self._param_name = param_name  # ModuleTracker.param_name: a parameter's dotted name
        # Storages of this step's uninitialised outputs (torch.empty...): their views are too.
        self.uninit_storages: set[int] = set()
        # Gradients the traced backward wrote (``param.grad``, what ``autograd.grad``
        # returned), kept across steps: an op that reads one reads a value the traced step
        # made, whose NaN is the origin's, not a value coming in from outside.
        self.backward_made = SummaryMemo()

    def begin_step(self) -> None:
        """A fresh step forgets old summaries: code that updates weights through ``.data`` or
        numpy bypasses the version counter the memo trusts within a step. The gradients the
        backward wrote stay known, those gone dropped (one entry per parameter)."""
        self.memo.clear()
        self.backward_made.prune()

    def forget_uninitialized(self) -> None:
        """Buffers are a step's own: a later view is checked anew."""
        self.uninit_storages.clear()

    def summary_of(self, t: torch.Tensor, aliases: Sequence[torch.Tensor] = ()) -> dict:
        """Summary of ``t`` as it is now.

        Reused when this very value was summarised before, or shared with one of ``aliases``
        (tensors of the same event) when ``t`` is a reordering of the same memory.
        """
        memo = self.memo
        s = memo.get(t)
        if s is not None:
            return s
        if self.uninit_storages and aliases and self._views_uninitialized(t, aliases):
            return self.uninitialized(t)
        # Small tensors list their values in order, so they never share (alias_summary).
        if aliases and t.numel() > self.summarizer.value_limit:
            s = self._alias_summary(t, aliases)
        if s is None:
            s = self.summarizer.summarize(t)
        memo.put(t, s)
        return s

    def _alias_summary(self, t: torch.Tensor, aliases: Sequence[torch.Tensor]) -> dict | None:
        # Only an alias that starts at the same address can share: one data_ptr per alias
        # rules the others out (an op's output against each of its inputs, at every op).
        try:
            ptr = t.data_ptr()
        except RuntimeError:  # tensors without storage: alias_summary says no anyway
            return None
        for a in aliases:
            try:
                if a.data_ptr() != ptr:
                    continue
            except RuntimeError:
                continue
            base = self.memo.get(a)
            if base is not None:
                s = self.summarizer.alias_summary(t, a, base)  # checks the memory is shared
                if s is not None:
                    return s
        return None

    def external(self, t: torch.Tensor, deferrable: bool) -> dict:
        """Summary of an op's input that no traced op produced (the memo has none): marked
        ``external`` (input data, a parameter) and named when it is a parameter, for the
        input alerts.

        An external input whose numbers can be read at once (host memory) gets its stats
        only if the op's outputs turn out non-finite (:meth:`judge_external`): that is the one
        time they matter, and a model's weights are most of what an MLP step would reduce.
        """
        if deferrable and self.summarizer.reads_now(t):
            s = tensor_meta(t)
            s["stats"] = None
        else:
            s = self.summarizer.summarize(t)
        s["external"] = True
        if self.backward_made.get(t) is not None:
            s["made_by"] = BACKWARD
        param = self._param_name(t)
        if param is not None:
            s["param"] = param
        self.memo.put(t, s)
        return s

    def backward_wrote(self, t: torch.Tensor, same_as: dict | None = None) -> None:
        """``t`` is a gradient the traced backward wrote. ``same_as``: the summary of a tensor
        with the very same values (the gradient AccumulateGrad stored as it was): this
        step's ops then read it as that value, with its stats and no reduction."""
        if same_as is not None:
            self.memo.put(t, same_as)
        self.backward_made.put(t, _MADE_BY_BACKWARD)

    def judge_external(self, tensors: list[torch.Tensor], inputs: list[dict]) -> None:
        """Outputs went non-finite: fill in the stats of external inputs that were deferred,
        so the alerts can tell a bad weight or batch coming in from a bad op."""
        for t, s in zip(tensors, inputs, strict=True):
            if s.get("external") and s.get("stats") is None and self.summarizer.reads_now(t):
                full = self.summarizer.summarize(t)
                for key in ("stats", "stats_of", "values"):
                    if key in full:
                        s[key] = full[key]

    def written(self, t: torch.Tensor, pending: bool) -> dict:
        """A collective's output, written in place, maybe with no version bump: never the
        memo's old entry. ``pending``: not there yet (async), the first op after ``wait()``
        summarises it."""
        if pending:
            s = tensor_meta(t)
            s["stats"] = None
            s["pending"] = True
            self.memo.discard(t)
        else:
            s = self.summarizer.summarize(t)
            self.memo.put(t, s)
        with contextlib.suppress(RuntimeError):  # written now, whatever it was
            self.uninit_storages.discard(t.untyped_storage().data_ptr())
        return s

    @staticmethod
    def overwritten(t: torch.Tensor) -> dict:
        """What an op that only writes ``t`` (``uniform_``, ``copy_``) finds there: metadata,
        no numbers (they may be uninitialised memory), nothing to blame."""
        s = tensor_meta(t)
        s["stats"] = None
        return s

    def uninitialized(self, t: torch.Tensor) -> dict:
        s = self.overwritten(t)
        s["uninitialized"] = True
        self.memo.put(t, s)
        with contextlib.suppress(RuntimeError):  # no storage: nothing can view it
            self.uninit_storages.add(t.untyped_storage().data_ptr())
        return s

    def _views_uninitialized(self, t: torch.Tensor, aliases: Sequence[torch.Tensor]) -> bool:
        """Whether ``t`` is a view of an input still uninitialised (``torch.empty`` then
        ``view``, as FSDP's all-gather buffers are): its bytes mean nothing either."""
        try:
            storage = t.untyped_storage().data_ptr()
        except RuntimeError:
            return False
        if storage not in self.uninit_storages:
            return False
        for a in aliases:
            base = self.memo.get(a)  # None once written with a version bump
            if base is not None and base.get("uninitialized"):
                with contextlib.suppress(RuntimeError):
                    if a.untyped_storage().data_ptr() == storage:
                        return True
        return False
