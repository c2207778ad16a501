"""What the tracer's design costs before any bookkeeping: a floor under ``overhead.py``'s rows.

    python benchmarks/floor.py [--workload mlp|transformer|policy] [--steps N] [--repeats R]

torchscope's design is a ``TorchFunctionMode`` that sees every forward call, a post-hook on every
autograd node of every backward call, and min/max/sum/sum-of-squares of every tensor that
either produces. This script builds that design out of nothing else, in layers, and times
each layer next to the untraced step and next to torchscope itself, in one run:

  untraced          the plain training step
  mode              a TorchFunctionMode that calls through (left during ``optimizer.step``,
                    as torchscope does)
  + forward stats   ... and reduces every floating output of the calls torchscope traces:
                    aminmax, sum, dot, read to the host
  + node hooks      ... and walks the graph at ``backward`` and hooks every node (empty hooks)
  + grad stats      ... and the hooks reduce every gradient a node sends on
  + event records   ... and each call and node leaves the least record a debugger shows: a
                    dict with its name, source line and the summaries (shape, dtype, the
                    stats dict) of what went in and came out, kept until the step ends
  torchscope        ``torchscope.trace(keep=False)``
  torchscope, trace() defaults   ``torchscope.trace()`` (events kept in memory)

"+ grad stats" does nothing torchscope can skip and none of what it adds (events, source
lines, module paths, node ids, alerts, dedup of tensors seen twice), so the gap between it
and the untraced step is the floor of any tracer built this way in Python. "+ event records"
adds only what any tracer that shows its events must build; the gap between it and
torchscope is torchscope's own bookkeeping (module paths, node ids and op links, the memo,
alerts, the event pipeline).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import itertools
import math
import os
import sys
import time
import warnings
from typing import Any

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402
from torch.optim.optimizer import (  # noqa: E402
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.overrides import TorchFunctionMode  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import CLOCK, CLOCKS, Config, event_counts, measure, table  # noqa: E402
from workloads import ALL_WORKLOADS as WORKLOADS  # noqa: E402

import torchscope  # noqa: E402
from torchscope.tracer.armed.calls import op_name  # noqa: E402
from torchscope.tracer.armed.source import user_site  # noqa: E402
from torchscope.tracer.armed.summary import _dense_view  # noqa: E402


def reduce_to_host(t: torch.Tensor) -> tuple[float, float, float, float]:
    """The four numbers every summary needs, the cheapest way found (see summary.py)."""
    flat = _dense_view(t.detach()).reshape(-1)
    mn, mx = torch.aminmax(flat)
    return mn.item(), mx.item(), flat.sum().item(), torch.dot(flat, flat).item()


_text: dict[Any, str] = {}  # str() of each dtype and device, made once


def _str(x: Any) -> str:
    text = _text.get(x)
    if text is None:
        text = _text[x] = str(x)
    return text


def meta(t: torch.Tensor) -> dict[str, Any]:
    return {"shape": list(t.shape), "dtype": _str(t.dtype), "device": _str(t.device)}


def summary(t: torch.Tensor, numbers: tuple[float, float, float, float]) -> dict[str, Any]:
    """The least summary a reader is shown: shape, dtype, device and the stats dict."""
    mn, mx, total, sq = numbers
    n = t.numel()
    mean = total / n
    return {
        "shape": list(t.shape),
        "dtype": _str(t.dtype),
        "device": _str(t.device),
        "stats": {
            "min": mn,
            "max": mx,
            "mean": mean,
            "std": math.sqrt(max(sq - total * mean, 0.0) / max(n - 1, 1)),
            "norm": math.sqrt(sq),
            "nan": 0,
            "inf": 0,
        },
    }


class FloorMode(TorchFunctionMode):
    """The design with nothing else: ``level`` 0 = mode, 1 = + forward stats, 2 = + node hooks,
    3 = + grad stats, 4 = + event records."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level
        self.records: list[dict[str, Any]] = []  # this step's (cleared by floor()'s hooks)
        self.seq = itertools.count()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func is torch.Tensor.backward and self.level >= 2:
            return self._backward(func, args, kwargs)
        result = func(*args, **kwargs)
        name = op_name(func) if self.level >= 1 else None
        if (
            name is not None  # the calls torchscope traces (not `p.grad` reads)
            and isinstance(result, torch.Tensor)
            and result.is_floating_point()
            and result.numel()
        ):
            with torch.no_grad():
                numbers = reduce_to_host(result)
            if self.level >= 4:
                site = user_site(2)  # the frame above this one
                self.records.append(
                    {
                        "kind": "op",
                        "seq": next(self.seq),
                        "name": name,
                        "source": site[0] if site is not None else None,
                        "inputs": [meta(a) for a in args if isinstance(a, torch.Tensor)],
                        "outputs": [summary(result, numbers)],
                    }
                )
        return result

    def _backward(self, func: Any, args: tuple, kwargs: dict) -> Any:
        seen: set[Any] = set()
        todo = [args[0].grad_fn]
        handles = []
        while todo:
            node = todo.pop()
            if node in seen:
                continue
            seen.add(node)
            # The records' node name rides in a partial; lower levels keep the bare hook.
            hook = functools.partial(self._record, node.name()) if self.level >= 4 else self._hook
            handles.append(node.register_hook(hook))
            todo.extend(n for n, _ in node.next_functions if n is not None)
        try:
            return func(*args, **kwargs)
        finally:
            for h in handles:
                h.remove()

    def _hook(self, grad_inputs: tuple, grad_outputs: tuple) -> None:
        if self.level >= 3:
            for g in grad_inputs:
                if g is not None and g.is_floating_point() and g.numel():
                    reduce_to_host(g)

    def _record(self, node: str, grad_inputs: tuple, grad_outputs: tuple) -> None:
        sent = [
            summary(g, reduce_to_host(g))
            for g in grad_inputs
            if g is not None and g.is_floating_point() and g.numel()
        ]
        self.records.append(
            {
                "kind": "grad",
                "seq": next(self.seq),
                "node": node,
                "grad_inputs": sent,
                "grad_outputs": [meta(g) for g in grad_outputs if g is not None],
            }
        )


@contextlib.contextmanager
def floor(level: int):
    mode = FloorMode(level)

    def leave(*_: Any) -> None:
        mode.__exit__(None, None, None)
        mode.records.clear()  # the step ends: a tracer hands its records on

    def enter(*_: Any) -> None:
        mode.__enter__()

    mode.__enter__()
    pre = register_optimizer_step_pre_hook(leave)
    post = register_optimizer_step_post_hook(enter)
    try:
        yield mode
    finally:
        pre.remove()
        post.remove()
        mode.__exit__(None, None, None)


def rows() -> list[Config]:
    # "base" is what overhead.py's table divides by.
    return [
        Config("base", "untraced", lambda w: contextlib.nullcontext()),
        Config("mode", "mode", lambda w: floor(0)),
        Config("fwd", "+ forward stats", lambda w: floor(1)),
        Config("hooks", "+ node hooks", lambda w: floor(2)),
        Config("grads", "+ grad stats", lambda w: floor(3)),
        Config("records", "+ event records", lambda w: floor(4)),
        Config("traced", "torchscope", lambda w: torchscope.trace(keep=False)),
        # The public API as most users call it: events kept in memory.
        Config("trace", "torchscope, trace() defaults", lambda w: torchscope.trace()),
    ]


def paired(results: dict, w: Any, key: str) -> float:
    """Median over rounds of (row's block median / untraced block median), as in table()."""
    import statistics

    rows, base = results[(w.name, key)], results[(w.name, "base")]
    return statistics.median(
        m / b for m, b in zip(rows.block_medians, base.block_medians, strict=True)
    )


def per_event(w: Any, results: dict) -> None:
    """Each row's cost per event of a traced step: what the design alone costs per event next
    to what torchscope costs (the tiny-op policy net makes this the whole story)."""
    import statistics

    counts = event_counts(w)
    events = max(counts["ops"] + counts["grads"], 1)
    base = statistics.median(results[(w.name, "base")].times)
    rows = (
        ("grads", "floor"),
        ("records", "floor + event records"),
        ("traced", "trace(keep=False)"),
        ("trace", "trace()"),
    )
    cells = [
        f"{label} {(statistics.median(results[(w.name, key)].times) - base) / events * 1e6:.1f}"
        for key, label in rows
    ]
    print(
        f"\nµs per event ((row median - untraced median) / {events} ops + grads per step): "
        + ", ".join(cells)
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workload", choices=list(WORKLOADS), default="mlp")
    p.add_argument("--steps", type=int, default=8, help="timed steps per block (8)")
    p.add_argument("--repeats", type=int, default=20, help="rounds (20)")
    p.add_argument(
        "--clock",
        choices=list(CLOCKS),
        default="wall",
        help="wall clock (default) or this thread's CPU time (steadier on a busy host)",
    )
    args = p.parse_args(argv)
    CLOCK[0] = CLOCKS[args.clock]
    if args.steps < 1 or args.repeats < 1:
        p.error("need --steps >= 1 and --repeats >= 1")
    torch.set_num_threads(1)
    w = WORKLOADS[args.workload]()
    configs = rows()
    gc.collect()
    gc.freeze()
    start = time.perf_counter()
    # The same interleaved rounds (and warm-up block per row) as overhead.py.
    results = measure([w], configs, args.steps, args.repeats, 2, record=None)
    print(f"## Design floor: {w.description}\n")
    print(
        f"torch {torch.__version__}, 1 torch thread; {args.repeats} rounds x {args.steps} "
        f"timed steps per row, interleaved, {args.clock} clock; "
        f"{time.perf_counter() - start:.0f} s.\n"
    )
    print("\n".join(table(w, configs, results, args.steps)))
    print(
        "\npaired ratio = median over rounds of (row's block median / untraced block median of "
        "the same round); the other columns as in overhead.py."
    )
    per_event(w, results)
    floor_ratio = paired(results, w, "grads")
    for key, label in (("traced", "trace(keep=False)"), ("trace", "trace()")):
        print(
            f"\ntorchscope {label} / floor (`+ grad stats`), paired ratios: "
            f"{paired(results, w, key):.2f} / {floor_ratio:.2f} = "
            f"{paired(results, w, key) / floor_ratio:.2f}"
        )
    records_ratio = paired(results, w, "records")
    print(
        f"\nevent records alone / floor: {records_ratio:.2f} / {floor_ratio:.2f} = "
        f"{records_ratio / floor_ratio:.2f}; torchscope trace(keep=False) / event records: "
        f"{paired(results, w, 'traced') / records_ratio:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
