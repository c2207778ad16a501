"""What the aten level costs, next to the function level and PyTorch's DebugMode.

    python benchmarks/aten.py [--workload mlp|transformer|policy] [--steps N] [--repeats R]

Rows, interleaved in rounds in one process (overhead.py's harness), garbage collection on as
a user runs them, each through the public API:

  untraced                    the plain training step
  trace()                     the function level (ops and backward nodes)
  trace(aten=True)            ... and every aten call under them, each summarised
  trace(aten=<one module>)    ... scoped to one module of the model (the first block)
  DebugMode()                 PyTorch's aten log (torch.utils._debug_mode): names, no numbers
  DebugMode + norm hashes     ... with a norm per output tensor (log_tensor_hashes), its
                              nearest thing to a summary

and µs per aten call of a traced step for the aten rows.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from overhead import Config, measure, table  # noqa: E402
from torch import nn  # noqa: E402
from workloads import ALL_WORKLOADS, Workload  # noqa: E402

import torchscope  # noqa: E402


@contextlib.contextmanager
def _debug_mode(hashes: bool):
    from torch.utils._debug_mode import DebugMode

    with DebugMode() as dm:
        if hashes:
            with DebugMode.log_tensor_hashes(hash_fn="norm"):
                yield dm
        else:
            yield dm


def _first_block(w: Workload) -> str:
    """A scope of part of the model: the first eighth of the children of its longest
    Sequential or ModuleList (the MLP's Linear, GELU and LayerNorm of its first block of 8;
    the transformer's first block of 2)."""
    containers = [
        nm for nm in w.model.named_modules() if isinstance(nm[1], (nn.Sequential, nn.ModuleList))
    ]
    name, parent = max(containers, key=lambda nm: len(list(nm[1].children())))
    children = [n for n, _ in parent.named_children()]
    first = children[: max(1, len(children) // 8)]
    prefix = f"{name}." if name else ""
    return f"^{prefix.replace('.', chr(92) + '.')}({'|'.join(first)})(\\.|$)"


def rows(w: Workload) -> list[Config]:
    def as_run(config: Config) -> Config:
        config.controlled = False  # as the user runs it: the collector on, nothing frozen
        return config

    scope = _first_block(w)
    return [
        as_run(Config("base", "untraced", lambda w: contextlib.nullcontext())),
        as_run(Config("trace", "trace()", lambda w: torchscope.trace())),
        as_run(Config("aten", "trace(aten=True)", lambda w: torchscope.trace(aten=True))),
        as_run(Config("scoped", f"trace(aten={scope!r})", lambda w: torchscope.trace(aten=scope))),
        as_run(Config("dm", "DebugMode()", lambda w: _debug_mode(False))),
        as_run(Config("dmh", "DebugMode + norm hashes", lambda w: _debug_mode(True))),
    ]


def aten_calls(w: Workload, **trace_args: Any) -> int:
    """Aten events of one traced step."""
    for _ in range(2):
        w.step()
    with torchscope.trace(**trace_args) as tr:
        w.step()
    return sum(1 for e in tr.events if e.kind == "aten")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workload", choices=list(ALL_WORKLOADS), default="mlp")
    p.add_argument("--steps", type=int, default=5, help="timed steps per block (5)")
    p.add_argument("--repeats", type=int, default=10, help="rounds (10)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.repeats < 1:
        p.error("need --steps >= 1 and --repeats >= 1")
    torch.set_num_threads(1)
    w = ALL_WORKLOADS[args.workload]()
    configs = rows(w)
    start = time.perf_counter()
    results = measure([w], configs, args.steps, args.repeats, 2, record=None)
    gc.collect()
    calls = {"aten": aten_calls(w, aten=True), "scoped": aten_calls(w, aten=_first_block(w))}
    print(f"## The aten level: {w.description}\n")
    print(
        f"torch {torch.__version__}, 1 torch thread; {args.repeats} rounds x {args.steps} timed "
        f"steps per row, interleaved, wall clock, GC on; {time.perf_counter() - start:.0f} s.\n"
    )
    print("\n".join(table(w, configs, results, args.steps)))
    base = statistics.median(results[(w.name, "base")].times)
    trace = statistics.median(results[(w.name, "trace")].times)
    print()
    for key in ("aten", "scoped"):
        med = statistics.median(results[(w.name, key)].times)
        n = max(calls[key], 1)
        print(
            f"{key}: {calls[key]} aten calls per traced step; over trace(): "
            f"{(med - trace) / n * 1e6:.1f} µs per aten call; over untraced: "
            f"{(med - base) / n * 1e6:.1f} µs"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
