"""The spike watch's part of the check (mixed into :class:`~.check.StepCheck`): where a
spike comes from (:mod:`.spike_origin`: the batch, the first module whose output jumped) and
the traced replay of its step, which pauses there under ``on_spike="pause"``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from torchscope.tracer.errors import ReportOnce
from torchscope.tracer.ranks import speaker
from torchscope.tracer.watch.naming import bound_name, module_text
from torchscope.tracer.watch.norms import OTHER

if TYPE_CHECKING:
    from torchscope.tracer.armed.session import Tracer
    from torchscope.tracer.watch.capture import StepCaptures
    from torchscope.tracer.watch.spike_origin import SpikeSources
    from torchscope.tracer.watch.spikes import Spike, Spikes


class SpikeCheck:
    """Where a spike comes from, and its replay."""

    # Set by NanWatch (its constructor says what each is).
    spikes: Spikes | None
    on_spike: str
    _said_spike_pause: bool
    tracer_factory: Callable[[int], Tracer] | None
    replay_wanted: Callable[[], bool]
    captured: StepCaptures
    _error: ReportOnce
    _sources: SpikeSources | None = None  # the spike's batch figures (made at first)

    def _naming_roots(self) -> tuple[list[tuple[torch.nn.Module, torch.nn.Module]], list[Any]]:
        raise NotImplementedError

    def _say(self, line: str) -> None:
        raise NotImplementedError

    def _jumped_modules(self, spike: Spike) -> list[tuple[str, float]]:
        """The modules whose gradient norms jumped most, as the spike's line names them:
        ``(model.fc2 (Linear), ratio)``; a root model's own parameters (a positional
        embedding) as the model, ``model (TinyLM)``."""
        modules: list[tuple[str, float]] = []
        try:
            named = self._naming_roots()
            for path, ratio in spike.top_modules():
                text = None
                if path != OTHER:
                    text = module_text({"module": path}, *named) or _root_text(path, named[0])
                modules.append((text or path, ratio))
        except Exception as exc:
            self._error("naming the modules", exc)
        return modules

    def _spike_sources(self) -> SpikeSources:
        from torchscope.tracer.watch.spike_origin import SpikeSources

        sources = self._sources
        if sources is None:
            spikes = self.spikes
            assert spikes is not None
            sources = self._sources = SpikeSources(spikes.window, spikes.sigmas, spikes.min_ratio)
        return sources

    def _spike_origin(self, who: str, lines: list[str]) -> dict[str, Any]:
        """Where the spike comes from (:mod:`.spike_origin`), its lines added to ``lines``:
        the batch, when the model call's inputs are out of their usual range; the first
        module whose output jumped against the last good step's batch at the same weights."""
        out: dict[str, Any] = {}
        sources = self._spike_sources()
        calls = [c for c in self.captured.calls if not c.released]
        if not calls:
            return out
        try:
            named, _ = self._naming_roots()
            root = next((r for r in named if r[1] is calls[0].target), None)
            name = (bound_name(root) if root else None) or type(calls[0].target).__name__
            got = sources.batch_line(calls, who, name)
            if got is not None:
                lines.append(got[0])
                out["inputs"] = got[1]
        except Exception as exc:
            self._error("reading the spike's batch", exc)
        if self.captured.fsdp or not self.replay_wanted():
            return out  # (replayed by every rank together only; traced live already)
        try:
            got = sources.module_line(self, calls, who, self._name_in_call)
            if got is not None:
                lines.append(got[0])
                out["first_module"] = got[1]
        except Exception as exc:
            self._error("replaying the spike's calls", exc)
        return out

    def _name_in_call(self, index: int, path: str) -> str:
        """``model.inp (Linear)``: the module at ``path`` in the step's ``index``-th distinct
        top-level module."""
        targets: list[torch.nn.Module] = []
        for c in self.captured.calls:
            if all(c.target is not t for t in targets):
                targets.append(c.target)
        named, _ = self._naming_roots()
        root = next((r for r in named if r[1] is targets[index]), None)
        if root is None:
            return path or type(targets[index]).__name__
        if path:
            return module_text({"module": path}, [root]) or path
        name, cls = bound_name(root), type(root[1]).__name__
        return f"{name} ({cls})" if name else cls

    def _replay_spike(self, det: dict[str, Any], module_path: str | None) -> None:
        """The spiked step's calls again, traced, where it shows somewhere (a tracer factory:
        the job's file and UIs) or to pause there; said when "pause" has nowhere to."""
        pause = self.on_spike == "pause"
        if not (pause or self.tracer_factory is not None):
            return
        if not self.captured.calls or self.captured.fsdp or not self.replay_wanted():
            if pause:
                self._say_no_spike_pause()
            return
        try:
            from torchscope.tracer.watch.spike_origin import SpikeReplay

            SpikeReplay(self, det, module_path).run()
        except Exception as exc:
            self._error("replaying the spiked step", exc)
        if pause and not det["paused"]:
            self._say_no_spike_pause()

    def _say_no_spike_pause(self) -> None:
        if not self._said_spike_pause:
            self._said_spike_pause = True
            self._say(
                f'{speaker()}: on_spike="pause" has no UI or stepper to pause for: the job goes '
                'on as under "continue"'
            )


def _root_text(path: str, roots: list[tuple[torch.nn.Module, torch.nn.Module]]) -> str | None:
    """``model (TinyLM)``: the top-level module whose own parameters the module norms name
    by its class (``path``), or None where no root has that class."""
    for root in roots:
        if type(root[1]).__name__ == path:
            name = bound_name(root)
            return f"{name} ({path})" if name else None
    return None
