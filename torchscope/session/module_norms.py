"""Per-module gradient norms of a step, for the graph's module tree (``M``).

A module's norm is the norm of the gradients its parameters received in the step: the square
root of the sum of the squared norms of the gradients the AccumulateGrad nodes of the
parameters under it (``blocks.0.attn`` holds ``blocks.0.attn.qkv.weight``) received, in every
backward call of the step. The whole model's (module ``""``) is then the step's global gradient
norm, the ``|g|`` of the step list (same events, same sum). A module without parameters has no
norm. Activation gradients (what the module's nodes passed on) are not counted: summed over
a module's nodes they would count the same gradient once per node it flows through.

No textual imports. Reads the store (never writes it), and does not touch its LRU order: the
steps' norms over the recording are read from the steps in memory as they are.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable
from typing import Any

from torchscope.protocol import codec
from torchscope.session.steps import StepData
from torchscope.session.store import EventStore

__all__ = [
    "MODEL_OWN",
    "grad_norm_of",
    "module_of_param",
    "norm_history",
    "parents",
    "resident_steps",
    "step_norms",
]

#: The key of the model's own parameters (``pos``, not in any submodule) in step_norms:
#: ``""`` is the whole model, submodules included.
MODEL_OWN = "."

# StepData -> (its version when computed, {module: norm})
_cache: weakref.WeakKeyDictionary[StepData, tuple[int, dict[str, float]]] = (
    weakref.WeakKeyDictionary()
)


def grad_norm_of(ev: dict[str, Any]) -> float | None:
    """The norm of the gradient an AccumulateGrad node received (a parameter's gradient)."""
    if ev.get("node") != "AccumulateGrad":
        return None
    go = ev.get("grad_outputs")
    if type(go) is not list or not go or type(go[0]) is not dict:
        return None
    stats = go[0].get("stats")
    norm = stats.get("norm") if type(stats) is dict else None
    return float(norm) if isinstance(norm, (int, float)) and not isinstance(norm, bool) else None


def module_of_param(param: str) -> str:
    """``blocks.0.attn.qkv.weight`` -> ``blocks.0.attn.qkv``; a parameter of the model itself
    (``pos``) -> ``""``."""
    return param.rpartition(".")[0]


def parents(module: str) -> list[str]:
    """The module and every module above it, the model (``""``) last:
    ``blocks.0.attn`` -> ``["blocks.0.attn", "blocks.0", "blocks", ""]``."""
    out = []
    while module:
        out.append(module)
        module = module.rpartition(".")[0]
    out.append("")
    return out


def step_norms(data: StepData) -> dict[str, float]:
    """{module: norm of its parameters' gradients in this step} for every module that holds a
    parameter that received one (and every module above it; ``""``: the whole model;
    MODEL_OWN: the parameters of no submodule). NaN when one of them was NaN or Inf. Cached
    until the step's data changes."""
    hit = _cache.get(data)
    if hit is not None and hit[0] == data.version:
        return hit[1]
    sq: dict[str, float] = {}
    for t in data.grads:
        row = data.view(t)
        if row.name != "AccumulateGrad" or not row.param:
            continue
        norm = grad_norm_of(codec.unpack(row.raw))
        if norm is None:
            continue
        contribution = norm * norm if math.isfinite(norm) else math.nan
        module = module_of_param(row.param)
        for m in parents(module) if module else ("", MODEL_OWN):
            sq[m] = sq.get(m, 0.0) + contribution
    norms = {m: math.sqrt(v) if math.isfinite(v) else math.nan for m, v in sq.items()}
    _cache[data] = (data.version, norms)
    return norms


def resident_steps(store: EventStore) -> dict[int, StepData]:
    """The steps in memory, by step number, read without marking them used (``store.data``
    would move each to the recent end of the eviction order)."""
    return dict(store._data)  # read only: store.data(step) would reorder the LRU


def norm_history(
    store: EventStore, step: int, modules: Iterable[str], width: int = 16
) -> tuple[list[int], dict[str, list[float | None]]]:
    """The norms of ``modules`` over at most ``width`` steps in memory around ``step`` (those
    before it first): (the steps, {module: one value per step, None where the module had no
    parameter gradient in that step}). Fewer than two steps in memory: no history."""
    resident = resident_steps(store)
    steps = sorted(resident)
    if len(steps) < 2:
        return [], {}
    if step in resident:
        at = steps.index(step)
        lo = max(0, min(at - width // 2, len(steps) - width))
        steps = steps[lo : lo + width]
    else:
        steps = steps[-width:]
    per_step = [step_norms(resident[s]) for s in steps]
    out = {m: [n.get(m) for n in per_step] for m in modules}
    return steps, out
