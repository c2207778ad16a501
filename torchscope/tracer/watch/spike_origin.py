"""Where a loss spike comes from, said under its line: the batch, and the first module whose
output jumped.

**The batch.** Each good step, the watch takes the L2 norm of the float inputs of each call
of the step's first top-level module (the model call: ``model(x)``): one reduction per call,
kept on the device (no host read) for the last ``window`` steps. At a spike they are read
once, and the spiked step's own are judged by the spike rule (above ``median + sigmas *
1.4826 * MAD`` and at least ``min_ratio`` times the median, or as far below): then the line

    torchscope: the inputs of the model call at train.py:61 have norm 4.85e3 vs 16 ± 0.7:
    samples 0-31

names the samples (rows of the first input) out of the range of the previous batch's rows.

**The first module.** The watch keeps the previous good step's top-level calls (their inputs,
by reference, detached; their RNG and autocast state) until the next good step: a batch held
one step longer, nothing computed. At a spike, both steps' calls run again at the same
weights (the spiked step's, before its update), untraced and without grad, with a forward
hook that reads each module's output norm; the first module to finish (innermost first,
in the forward's order) whose output norm is ``JUMP`` (4) times the previous batch's or more
is named:

    torchscope: the first module whose output jumped: model.inp (Linear), norm 4.8e3 vs 16
    with step 79's batch at the same weights

Where none jumped, the batch did not do it: the weights did (they grew over the last steps),
and the line says so. The watch keeps no per-module figures of earlier steps: they would
need a hook and a norm at every module call of every step, where the watch otherwise hooks
only the top-level calls; replaying a kept batch costs nothing until a spike.

Buffers (BatchNorm statistics) and RNG states are restored after the replays, the calls run
with the watch's hooks off: the job goes on as if nothing happened.
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchscope.analysis.render import short_source
from torchscope.tracer.eager import RngState, rng_state, set_rng_state
from torchscope.tracer.in_place import running_eagerly
from torchscope.tracer.watch.capture import tensors_in, versions_of
from torchscope.tracer.watch.growth import figure
from torchscope.tracer.watch.replay import (
    Replay,
    _Untraced,
    isolated_optimizer_hooks,
    map_tensors,
)
from torchscope.tracer.watch.spikes import MAD_SIGMA, _median_sorted

if TYPE_CHECKING:
    from torchscope.tracer.watch.capture import Call

JUMP = 4.0  # a module's output norm this many times the previous batch's: it jumped
MAX_SAMPLES_SAID = 8  # ranges of samples named in the line


class Kept:
    """One top-level call of the last good step, as a replay needs it."""

    __slots__ = ("args", "autocast", "kwargs", "rng", "site", "target", "versions")

    def __init__(self, call: Call) -> None:
        self.target = call.target
        self.args = _detached(call.args)
        self.kwargs = _detached(call.kwargs or {})
        self.rng: RngState | None = call.rng
        self.autocast = call.autocast
        self.site = call.site
        self.versions = versions_of(self.args, self.kwargs)


class SpikeSources:
    """The figures the spike's second and third lines are read from (see the module)."""

    def __init__(self, window: int, sigmas: float, min_ratio: float) -> None:
        self.sigmas = sigmas
        self.min_ratio = min_ratio
        self.inputs: deque[torch.Tensor] = deque(maxlen=window)
        self.kept: list[Kept] = []
        self.kept_step: int | None = None

    def took(self, calls: Sequence[Call], step: int) -> None:
        """A good step: its model calls' input norms join the window, its calls are kept."""
        if not calls:
            return
        model = calls[0].target
        with torch.no_grad(), torch._C.DisableTorchFunction():
            for c in calls:
                if c.target is model and not c.released:
                    norm = input_norm(c.args, c.kwargs)
                    if norm is not None:
                        self.inputs.append(norm)
        self.kept = [Kept(c) for c in calls if not c.released and c.rng is not None]
        self.kept_step = step

    def clear(self) -> None:
        self.kept = []
        self.inputs.clear()

    # -- at a spike ---------------------------------------------------------------------------
    def batch_line(self, calls: Sequence[Call], who: str, name: str) -> tuple[str, dict] | None:
        """The line on the batch, when a model call's inputs are out of their usual range."""
        if len(self.inputs) < 2 or not calls:
            return None
        model = calls[0].target
        mine = [c for c in calls if c.target is model and not c.released]
        with torch.no_grad(), torch._C.DisableTorchFunction():
            window = sorted(torch.stack([t.float().cpu() for t in self.inputs]).tolist())
            norms = [input_norm(c.args, c.kwargs) for c in mine]
            now = [math.nan if n is None else float(n) for n in norms]
        m = _median_sorted(window)
        s = MAD_SIGMA * _median_sorted(sorted(abs(v - m) for v in window))
        for i, (c, x) in enumerate(zip(mine, now, strict=True)):
            if not self._out(x, m, s):
                continue
            site = _site(c.site)
            which = f" (call {i + 1} of {len(mine)})" if len(mine) > 1 else ""
            text = (
                f"{who}: the inputs of the {name} call{which}{site} have norm {figure(x)} vs "
                f"{figure(m)} ± {figure(s)}"
            )
            samples = self._samples(c)
            if samples:
                text += f": samples {_ranges(samples)}"
            return text, {"norm": x, "median": m, "sigma": s, "samples": samples}
        return None

    def _out(self, x: float, m: float, s: float) -> bool:
        if not math.isfinite(x):
            return True
        if x > m + self.sigmas * s and x >= self.min_ratio * m:
            return True
        return x < m - self.sigmas * s and x * self.min_ratio <= m

    def _samples(self, call: Call) -> list[int]:
        """The samples (rows of the call's first float input) out of the range of the same
        input's rows in the kept batch."""
        ref = next((k for k in self.kept if k.target is call.target), None)
        if ref is None:
            return []
        with torch.no_grad(), torch._C.DisableTorchFunction():
            now = _first_rows(call.args, call.kwargs)
            before = _first_rows(ref.args, ref.kwargs)
            if now is None or before is None:
                return []
            rows = now.tolist()
            past = sorted(before.tolist())
        m = _median_sorted(past)
        s = MAD_SIGMA * _median_sorted(sorted(abs(v - m) for v in past))
        return [i for i, r in enumerate(rows) if self._out(r, m, s)]

    def module_line(
        self, watch: Any, calls: Sequence[Call], who: str, naming: Any
    ) -> tuple[str, dict] | None:
        """The first module whose output jumped against the kept batch's at the same weights
        (see the module); the line that says none did; None where it cannot be told."""
        kept = self.kept
        if not kept or not calls or [k.target for k in kept] != [c.target for c in calls]:
            return None
        if any(versions_of(k.args, k.kwargs) != k.versions for k in kept):
            return None  # the kept batch was written since (a reused buffer)
        before = outputs_of(watch, kept)
        now = outputs_of(watch, calls)
        if before is None or now is None:
            return None
        ref = dict(before)
        for key, x in now:
            r = ref.get(key)
            if r is None or not (x >= JUMP * r or not math.isfinite(x)) or not r > 0:
                continue
            index, path = key[0], key[1]
            text = naming(index, path)
            return (
                f"{who}: the first module whose output jumped: {text}, norm {figure(x)} vs "
                f"{figure(r)} with step {self.kept_step}'s batch at the same weights",
                {"module": text, "path": path, "norm": x, "before": r},
            )
        return (
            f"{who}: no module's output jumped against step {self.kept_step}'s batch at the "
            "same weights: the weights did it, not the batch",
            {"module": None},
        )


def input_norm(args: Any, kwargs: Any) -> torch.Tensor | None:
    """The L2 norm of a call's float inputs together (a 0-d float32 tensor on their device,
    no host read), or None where it has none."""
    ts = [t for t in tensors_in((args, kwargs or {})) if t.is_floating_point()]
    if not ts:
        return None
    norms = [torch.linalg.vector_norm(t.detach(), dtype=torch.float32) for t in ts]
    if len(norms) == 1:
        return norms[0]
    device = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]))


def _first_rows(args: Any, kwargs: Any) -> torch.Tensor | None:
    """Each sample's L2 norm in a call's first float input of two dimensions or more."""
    for t in tensors_in((args, kwargs or {})):
        if t.is_floating_point() and t.dim() >= 2 and t.shape[0] > 0:
            flat = t.detach().reshape(t.shape[0], -1)
            return torch.linalg.vector_norm(flat, dim=1, dtype=torch.float32).cpu()
    return None


def outputs_of(watch: Any, calls: Sequence[Any]) -> list[tuple[tuple, float]] | None:
    """Run ``calls`` again (untraced, without grad, the watch's hooks off) and read each
    module's output norm, in the order the modules finish: ``((call target index, path,
    occurrence), norm)``. Buffers and RNG states are as they were after it."""
    targets: list[nn.Module] = []
    for c in calls:
        if all(c.target is not t for t in targets):
            targets.append(c.target)
    paths: dict[int, tuple[int, str]] = {}
    for i, t in enumerate(targets):
        for path, m in t.named_modules():
            paths.setdefault(id(m), (i, path))
    seen: dict[tuple[int, str], int] = {}
    keys: list[tuple] = []
    norms: list[torch.Tensor] = []

    def hook(module: nn.Module, _args: Any, output: Any) -> None:
        where = paths.get(id(module))
        if where is None:
            return
        ts = [t for t in tensors_in(output) if t.is_floating_point()]
        if not ts:
            return
        with torch._C.DisableTorchFunction():
            n = seen[where] = seen.get(where, -1) + 1
            keys.append((*where, n))
            parts = [torch.linalg.vector_norm(t.detach(), dtype=torch.float32) for t in ts]
            norms.append(
                parts[0] if len(parts) == 1 else torch.linalg.vector_norm(torch.stack(parts))
            )

    with _Untraced():
        saved_rng = rng_state()
        buffers = [(b, b.clone()) for t in targets for b in t.buffers()]
    watch._replaying = True
    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        for c in calls:
            if c.rng is None:
                return None
            with _Untraced():  # no grad, no mode (a live tracer's) sees it
                set_rng_state(c.rng)
                with running_eagerly(c.target), _autocast(c.autocast):
                    c.target(*c.args, **(c.kwargs or {}))
        with torch._C.DisableTorchFunction():
            values = torch.stack([n.float().cpu() for n in norms]).tolist() if norms else []
    finally:
        handle.remove()
        watch._replaying = False
        with _Untraced():
            for b, old in buffers:
                if b.shape == old.shape and not torch.equal(b, old):
                    b.copy_(old)
            set_rng_state(saved_rng)
    return list(zip(keys, values, strict=True))


class _autocast:
    def __init__(self, state: Sequence[tuple[str, torch.dtype]]) -> None:
        self.ctxs = [torch.autocast(dev, dtype=dtype) for dev, dtype in state]

    def __enter__(self) -> None:
        for c in self.ctxs:
            c.__enter__()

    def __exit__(self, *exc: Any) -> None:
        for c in reversed(self.ctxs):
            c.__exit__(*exc)


def _detached(obj: Any) -> Any:
    """``obj`` with its tensors detached (the same storage: nothing copied, no graph held)."""
    return map_tensors(obj, torch.Tensor.detach)


def _site(site: tuple[str, int, str] | None) -> str:
    from torchscope.tracer.armed.source import site_text

    if not site:
        return ""
    return f" at {short_source(site_text(site[0], site[1]))}"


def _ranges(samples: list[int]) -> str:
    """``0-31``, ``3, 7, 12-15`` (the first few ranges, then how many more)."""
    spans: list[list[int]] = []
    for i in samples:
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    said = [f"{a}" if a == b else f"{a}-{b}" for a, b in spans[:MAX_SAMPLES_SAID]]
    more = len(spans) - MAX_SAMPLES_SAID
    return ", ".join(said) + (f" and {more} more ranges" if more > 0 else "")


class SpikeReplay(Replay):
    """The spiked step's calls again under the replay's tracer (its file and UIs see the step
    as a NaN's replay shows it); under ``on_spike="pause"`` it holds the job there, at the
    first op of the module whose output jumped (else at the step's first op), for a UI or an
    agent, as ``on_nan="pause"`` holds it at a NaN's origin."""

    def __init__(self, watch: Any, det: dict[str, Any], module_path: str | None) -> None:
        super().__init__(watch, det)
        self.module_path = module_path

    def _pause_breakpoint(self, tracer: Any) -> list[int]:
        if self.watch.on_spike != "pause":
            return []
        stepper = getattr(tracer, "stepper", None)
        if stepper is None:
            self.det["notes"].append("on_spike=pause: no UI or stepper to pause for")
            return []
        spec: dict[str, Any] = {"step": self.step}
        if self.module_path:
            spec["module"] = re.escape(self.module_path) + "$"
        self.det["paused"] = True
        return [stepper.add_breakpoint(spec)["id"]]

    def run(self) -> None:
        watch = self.watch
        with _Untraced():
            saved_rng = rng_state()
            buffers = self._save_buffers()
        watch._replaying = True
        try:
            with isolated_optimizer_hooks(), self._traced():
                self._forward()
                self._flush()
        finally:
            self.replayed, self.calls, self.tracer = [], [], None
            try:
                with _Untraced():
                    self._restore_buffers(buffers)
                    set_rng_state(saved_rng)
            finally:
                watch._replaying = False
        self.det["events"] = self.events
        self.det["replayed"] = True
