"""What the run's history costs per training step, in one run.

    python benchmarks/history.py [--steps N] [--repeats R] [--quick] [--workload mlp|transformer]

Rows (``benchmarks/overhead.py``'s method: one untimed warm-up block per row, then R rounds of
one N-step block per row, the row order rotating every round; GC on and nothing frozen, as in
a user's job; paired ratio = median over rounds of the row's block median / its reference
row's block median in the same round):

  untraced                          the plain training step
  dormant, no history               ``serve(history=False)``: the agent as it was before it
  dormant (serve)                   the headline: ``torchscope.serve()``, which keeps every
                                    step's loss (reference: untraced)
  watch, no history                 ``serve(watch="nan", history=False)``: the watch alone
  watch + history + module norms    ``serve(watch="nan")``: the loss, the global norm and a
                                    norm per module, in the watch's one read (reference: the
                                    watch alone)

Block ratios on a loaded machine move by a few percent either way; two controlled numbers
follow, which do not: the history's fixed cost per step (an agent with and without it, on a
step that does nothing else: one scalar's backward and update, best of interleaved blocks)
and the module norms' cost inside the watch's check (the check's reduction and read with and
without them, on each workload's own gradients), each as a share of the workload's step.
Then the history's memory per step.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import platform
import statistics
import sys
import time
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attach import serving  # noqa: E402
from overhead import Config, assert_clean, block_arguments, measure  # noqa: E402
from workloads import WORKLOADS, Workload  # noqa: E402

from torchscope.tracer.agent import Agent, ServeOptions  # noqa: E402


def rows() -> list[Config]:
    def row(key: str, label: str, make, base: str = "base", untimed: int = 0) -> Config:
        return Config(key, label, make, untimed=untimed, controlled=False, base=base)

    return [
        row("base", "untraced", lambda w: contextlib.nullcontext()),
        row("nohistory", "dormant, no history", lambda w: serving(w, history=False)),
        row("dormant", "dormant (serve): loss history", lambda w: serving(w)),
        row(
            "watch",
            "watch nan, no history",
            lambda w: serving(w, watch="nan", history=False),
            untimed=1,
        ),
        row(
            "norms",
            "watch nan + history + module norms",
            lambda w: serving(w, watch="nan"),
            base="watch",
            untimed=1,
        ),
    ]


def paired(results, w: Workload, key: str, base: str) -> float:
    res, ref = results[(w.name, key)], results[(w.name, base)]
    return statistics.median(
        m / b for m, b in zip(res.block_medians, ref.block_medians, strict=True)
    )


def fixed_cost_us(n: int = 2000, rounds: int = 7) -> tuple[float, float]:
    """What the history adds to a dormant agent's step, in µs: (without it, with it), best of
    ``rounds`` interleaved blocks of ``n`` steps that do nothing else."""
    p = torch.zeros((), requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.0)

    def step() -> None:
        (p * 1.0).backward()
        opt.step()

    best = {False: math.inf, True: math.inf}
    for r in range(rounds):
        for history in (r % 2 == 0, r % 2 == 1):
            agent = Agent(ServeOptions(quiet=True, live=False, history=history)).start()
            try:
                for _ in range(100):
                    step()
                gc.collect()
                t0 = time.perf_counter()
                for _ in range(n):
                    step()
                best[history] = min(best[history], (time.perf_counter() - t0) / n * 1e6)
            finally:
                agent.stop()
    return best[False], best[True]


def norms_cost_us(w: Workload, n: int = 300, rounds: int = 7) -> tuple[float, float]:
    """The watch's check reduction and read on ``w``'s gradients, in µs: (the watch's own,
    with the per-module norms), best of interleaved blocks."""
    from torchscope.tracer.watch.norms import ModuleNorms, total_norms

    w.step()
    w.optimizer.zero_grad(set_to_none=False)
    params = list(w.model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    norms = ModuleNorms(lambda step, g, m: None, lambda: [w.model])
    ways = {
        False: lambda: total_norms(grads, []).tolist(),
        True: lambda: norms.took(0, norms.read(params, grads, [])),
    }
    best = {False: math.inf, True: math.inf}
    with torch.no_grad():
        for r in range(rounds):
            for key in (r % 2 == 0, r % 2 == 1):
                f = ways[key]
                for _ in range(10):
                    f()
                t0 = time.perf_counter()
                for _ in range(n):
                    f()
                best[key] = min(best[key], (time.perf_counter() - t0) / n * 1e6)
    assert not norms.failed
    return best[False], best[True]


def history_check(w: Workload, steps: int = 50) -> tuple[int, int, int]:
    """(steps in the history, of them with a loss, module norms per point) after ``steps``
    steps under ``serve(watch="nan")``; the workload's step returns nothing, so the losses are
    compared with what its backward saw."""
    agent = Agent(ServeOptions(quiet=True, live=False, watch="nan")).start()
    try:
        for _ in range(steps):
            w.step()
    finally:
        agent.stop()
    assert_clean(f"{w.name}/check")
    points = list(agent.history.history.points)
    with_loss = sum(1 for p in points if p.loss is not None)
    modules = len(points[-1].module_norms or {}) if points else 0
    return len(points), with_loss, modules


def point_bytes(n: int = 10_000, modules: int = 0) -> float:
    """Bytes per step the history holds (tracemalloc), with ``modules`` module norms each."""
    import tracemalloc

    from torchscope.protocol.history import ModuleValues, RunHistory, StepPoint

    names = tuple(f"blocks.{i}.mlp" for i in range(modules))
    index = {name: i for i, name in enumerate(names)}  # shared, as the watch's plan shares it
    h = RunHistory(keep=n, module_keep=n)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(n):
        norms = ModuleValues(names, [1.0] * modules, index) if modules else None
        h.add(StepPoint(i, loss=float(i), grad_norm=1.0, module_norms=norms))
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (after - before) / n


def main(argv: list[str] | None = None) -> int:
    args = block_arguments(__doc__, [*WORKLOADS, "all"], argv)

    torch.set_num_threads(1)
    start = time.perf_counter()
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    workloads = [WORKLOADS[n]() for n in names]
    configs = rows()
    assert_clean("start")
    checks = {w.name: history_check(w) for w in workloads}
    results = measure(workloads, configs, args.steps, args.repeats, args.warmup, record=None)
    fixed = fixed_cost_us(n=300 if args.quick else 2000, rounds=3 if args.quick else 7)
    norm_costs = {w.name: norms_cost_us(w, n=30 if args.quick else 300) for w in workloads}

    print("## The run's history: cost per training step\n")
    print(
        f"torch {torch.__version__}, Python {platform.python_version()}, 1 torch thread, "
        f"{os.cpu_count()} CPUs visible; {args.repeats} rounds x {args.steps} timed steps per "
        f"row (+{args.warmup}-step warm-up block each), interleaved, GC on (nothing frozen); "
        f"whole run {time.perf_counter() - start:.0f} s.\n"
    )
    for w in workloads:
        print(f"### {w.name}: {w.description}\n")
        print("| configuration | median ms/step | paired ratio | vs |")
        print("|---|---:|---:|---|")
        for cfg in configs:
            med = statistics.median(results[(w.name, cfg.key)].times)
            ratio = paired(results, w, cfg.key, cfg.base)
            ref = next(c.label for c in configs if c.key == cfg.base)
            print(f"| {cfg.label} | {med * 1e3:.3f} | {ratio:.3f}x | {ref} |")
        history = paired(results, w, "dormant", "nohistory")
        base = statistics.median(results[(w.name, "base")].times) * 1e6
        extra = fixed[1] - fixed[0]
        plain_check, with_norms = norm_costs[w.name]
        print(f"\nThe history alone, block ratio (dormant vs dormant without it): {history:.3f}x")
        print(
            f"The history alone, controlled: {extra:.1f} µs per step ({fixed[0]:.1f} -> "
            f"{fixed[1]:.1f} µs on an empty step) = {extra / base * 100:.2f}% of this "
            "workload's untraced step"
        )
        print(
            f"Module norms in the watch's check, controlled: {plain_check:.0f} -> "
            f"{with_norms:.0f} µs per check = {(with_norms - plain_check) / base * 100:+.2f}% "
            "of the untraced step (the check's read with them against the plain total)"
        )
        n, with_loss, modules = checks[w.name]
        print(
            f"History after 50 steps under serve(watch='nan'): {n} points, {with_loss} with a "
            f"loss, {modules} module norms each.\n"
        )
    print("| memory held by the history, per step at full resolution | bytes |")
    print("|---|---:|")
    print(f"| loss and global norm | {point_bytes():.0f} |")
    print(f"| ... and 100 module norms | {point_bytes(modules=100):.0f} |")
    print(
        "\nBounds: 100k steps at full resolution (older ones folded into min/max/last buckets),"
        " module norms for the newest 10k."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
