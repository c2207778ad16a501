"""What the always-on NaN watch costs per training step, next to its peers, in one run.

    python benchmarks/watch.py [--steps N] [--repeats R] [--quick] [--workload mlp|transformer]

Rows (``benchmarks/overhead.py``'s method: one untimed warm-up block per row, then R rounds of
one N-step block per row, the row order rotating every round, GC on, objects alive after setup
frozen; paired ratio = median over rounds of row block median / untraced block median):

  untraced                    the plain training step
  serve(watch='nan')          the headline: the dormant agent with the watch, as
                              ``torchscope.serve(watch="nan")`` / ``run --watch nan`` start it
  watch nan (keep_graph=True)  ``NanWatch()``: the check, the capture, the retained graph
  watch nan, keep_graph=auto   the check and the capture; the graph is kept only after a
                              detection needed it (never here: these runs stay finite)
  watch, check only           ``NanWatch(roots=(), keep_graph=False)``: the check alone
  torchscope traced           ``torchscope.trace(keep=False)``: every step fully traced
  detect_anomaly()            ``torch.autograd.detect_anomaly()``

The watch's first step (finding the top-level modules with global module hooks) is run
untimed in each block: it is paid once per process. Then a memory table: what the watch
holds per step between ``backward()`` and the check, measured on the workload's own step.
"""

from __future__ import annotations

import contextlib
import gc
import os
import platform
import statistics
import sys
import time
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")

import torch  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_pre_hook  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attach import serving  # noqa: E402
from overhead import Config, assert_clean, block_arguments, measure, table  # noqa: E402
from workloads import WORKLOADS, Workload  # noqa: E402

import torchscope  # noqa: E402
from torchscope.tracer.watch.capture import tensors_in  # noqa: E402
from torchscope.tracer.watch.nan_watch import NanWatch, _total_norms  # noqa: E402
from torchscope.tracer.watch.replay import graph_saved_bytes  # noqa: E402


def _silent(text: str) -> None:
    raise RuntimeError(f"the benchmark workloads never go NaN, yet: {text}")


def rows() -> list[Config]:
    return [
        Config("base", "untraced", lambda w: contextlib.nullcontext()),
        Config(
            "serve",
            "serve(watch='nan'): what a user pays",
            lambda w: serving(w, watch="nan"),
            untimed=1,
        ),
        Config(
            "watch", "watch nan (keep_graph=True)", lambda w: NanWatch(report=_silent), untimed=1
        ),
        Config(
            "auto",
            "watch nan, keep_graph=auto",
            lambda w: NanWatch(report=_silent, keep_graph="auto"),
            untimed=1,
        ),
        Config(
            "check",
            "watch, check only",
            lambda w: NanWatch(report=_silent, roots=(), keep_graph=False),
        ),
        Config("traced", "torchscope traced", lambda w: torchscope.trace(keep=False)),
        Config("anomaly", "detect_anomaly()", lambda w: torch.autograd.detect_anomaly()),
    ]


# -- memory ----------------------------------------------------------------------------------
def held_per_step(w: Workload) -> dict[str, float]:
    """What the watch holds at the check (an optimizer pre-hook that runs before the watch's)."""
    seen: dict[str, float] = {}
    holder: dict[str, NanWatch] = {}

    def probe(optimizer, args, kwargs) -> None:
        watch = holder["watch"]
        kept = [b.roots for b in watch._backwards if b.roots is not None]
        inputs = [t for c in watch._calls for t in tensors_in((c.args, c.kwargs))]
        seen["graph"] = sum(graph_saved_bytes(roots, inputs) for roots in kept)
        seen["grads"] = watch._grad_bytes
        seen["rng"] = sum(
            c.rng[0].numel() + sum(s.numel() for s in (c.rng[1] or ())) for c in watch._calls
        )
        seen["calls"] = len(watch._calls)
        seen["inputs"] = sum(t.numel() * t.element_size() for t in inputs)

    hook = register_optimizer_step_pre_hook(probe)
    try:
        with NanWatch(report=_silent) as watch:
            holder["watch"] = watch
            w.step()  # finds the top-level modules
            w.step()
    finally:
        hook.remove()
    assert_clean(f"{w.name}/memory")
    seen["params"] = sum(p.numel() * p.element_size() for p in w.model.parameters())
    return seen


def check_cost(w: Workload, n: int = 200) -> float:
    """Seconds per check alone: the fused norm of every gradient and its one host read."""
    w.step()
    w.optimizer.zero_grad(set_to_none=False)
    grads = [p.grad for p in w.model.parameters() if p.grad is not None]
    with torch.no_grad():
        for _ in range(10):
            _total_norms(grads, []).tolist()
        t0 = time.perf_counter()
        for _ in range(n):
            _total_norms(grads, []).tolist()
    return (time.perf_counter() - t0) / n


def _kib(n: float) -> str:
    return f"{n / 1024:,.0f} KiB" if n < 10 * 1024 * 1024 else f"{n / 1024**2:,.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    args = block_arguments(__doc__, [*WORKLOADS, "all"], argv)

    torch.set_num_threads(1)
    start = time.perf_counter()
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    workloads = [WORKLOADS[n]() for n in names]
    configs = rows()
    assert_clean("start")
    gc.collect()
    gc.freeze()
    memory = {w.name: held_per_step(w) for w in workloads}
    checks = {w.name: check_cost(w) for w in workloads}
    results = measure(workloads, configs, args.steps, args.repeats, args.warmup, record=None)

    print("## NaN watch: cost per training step\n")
    print(
        f"torch {torch.__version__}, Python {platform.python_version()}, 1 torch thread, "
        f"{os.cpu_count()} CPUs visible; {args.repeats} rounds x {args.steps} timed steps per "
        f"row (+{args.warmup}-step warm-up block each), interleaved, GC on; whole run "
        f"{time.perf_counter() - start:.0f} s.\n"
    )
    for w in workloads:
        base = statistics.median(results[(w.name, "base")].times)
        print(f"### {w.name}: {w.description}\n")
        print("\n".join(table(w, configs, results, args.steps)))
        m = memory[w.name]
        print(
            f"\nThe check alone (fused gradient norm + one host read), timed on its own: "
            f"{checks[w.name] * 1e6:.0f} µs = {checks[w.name] / base * 100:.1f}% of the "
            "untraced step.\n"
        )
        print("| held per step by the watch, between backward() and the check | bytes |")
        print("|---|---:|")
        print(f"| retained graph (saved activations a plain backward frees) | {_kib(m['graph'])} |")
        print(f"| output gradients captured (references, cap 64 MiB) | {_kib(m['grads'])} |")
        print(f"| RNG states ({m['calls']:.0f} top-level calls) | {_kib(m['rng'])} |")
        print(f"| inputs referenced (held by the step anyway) | {_kib(m['inputs'])} |")
        print(f"| for scale: the model's parameters | {_kib(m['params'])} |")
        print()
    print("Notes:")
    print(
        "- ratio / paired ratio: as in overhead.py (paired = median over rounds of the row's "
        "block median / the untraced block median of the same round)."
    )
    print(
        "- The retained graph lives from the end of backward() to the check in "
        "optimizer.step(); after it only the job's own references keep it (here none: the "
        "workload's loss is local to its step function). A loop that keeps `loss` alive into "
        "the next step holds it until that step's forward rebinds `loss`."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
