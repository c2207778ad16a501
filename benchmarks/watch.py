"""What the always-on NaN watch costs per training step, next to its peers, in one run.

    python benchmarks/watch.py [--steps N] [--repeats R] [--quick]
                               [--workload mlp|transformer|amp|fsdp2|all]

``amp``: the MLP under fp16 autocast with a GradScaler. ``fsdp2``: the same MLP
``fully_shard``ed per block and at the root, AdamW, on 2 gloo ranks (spawned processes): the
untraced step against the watch (``NanWatch``, as ``run --watch nan`` starts it) in blocks
alternating on both ranks, each rank timing its own; the figures are the watch's per rank.

Rows (``benchmarks/overhead.py``'s method: one untimed warm-up block per row, then R rounds of
one N-step block per row, the row order rotating every round, GC on, objects alive after setup
frozen; paired ratio = median over rounds of row block median / untraced block median):

  untraced                    the plain training step
  serve(watch='nan')          the headline: the dormant agent with the watch, as
                              ``torchscope.serve(watch="nan")`` / ``run --watch nan`` start it
  serve(watch='nan,spike')    the same with the loss spike watch too (its window and rule on
                              the figures the check read: no extra read)
  ..., its check skipped      the same with the check made a no-op (a diagnostic: what the
                              hooks, the capture for a replay and the history cost)
  ..., loop code unrecorded   the same with the loop's code between module calls not recorded
                              (the watch before it named loop-code origins: the row to compare
                              the headline with for what that coverage costs)
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
from collections.abc import Iterator
from pathlib import Path

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")

import torch  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_pre_hook  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attach import serving  # noqa: E402
from overhead import Config, assert_clean, block_arguments, measure, table  # noqa: E402
from workloads import MLP, WATCH_WORKLOADS, Workload  # noqa: E402

import torchscope  # noqa: E402
from torchscope.tracer.watch.capture import tensors_in  # noqa: E402
from torchscope.tracer.watch.loop_code import LoopOps  # noqa: E402
from torchscope.tracer.watch.nan_watch import NanWatch  # noqa: E402
from torchscope.tracer.watch.norms import ModuleNorms  # noqa: E402
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
            "spike",
            "serve(watch='nan,spike'): the loss spike watch too",
            lambda w: serving(w, watch="nan,spike"),
            untimed=1,
        ),
        Config(
            "skipped",
            "serve(watch='nan'), its check skipped (diagnostic)",
            check_skipped,
            untimed=1,
        ),
        Config(
            "noloop",
            "serve(watch='nan'), loop code unrecorded (diagnostic)",
            loop_unrecorded,
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
        kept = [b.roots for b in watch.captured.backwards if b.roots is not None]
        inputs = [t for c in watch.captured.calls for t in tensors_in((c.args, c.kwargs))]
        seen["graph"] = sum(graph_saved_bytes(roots, inputs) for roots in kept)
        seen["grads"] = watch.captured.grad_bytes
        seen["rng"] = sum(
            c.rng[0].numel() + sum(s.numel() for s in (c.rng[1] or ()))
            for c in watch.captured.calls
        )
        seen["calls"] = len(watch.captured.calls)
        seen["inputs"] = sum(t.numel() * t.element_size() for t in inputs)
        seen["loop_ops"] = len(watch.loop.ops)
        seen["loop_bytes"] = watch.loop.held_bytes

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
    """Seconds per check's read alone: every gradient's, each module's and the loss's norm
    and the one host read (``ModuleNorms.read``, as the check calls it)."""
    w.step()
    w.optimizer.zero_grad(set_to_none=False)
    params = [p for p in w.model.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    loss = torch.ones(())
    norms = ModuleNorms(None, lambda: [w.model])
    with torch.no_grad():
        for _ in range(10):
            norms.read(params, grads, [loss])
        t0 = time.perf_counter()
        for _ in range(n):
            norms.read(params, grads, [loss])
    return (time.perf_counter() - t0) / n


@contextlib.contextmanager
def check_skipped(w: Workload) -> Iterator[None]:
    """``serve(watch='nan')`` with the watch's check made a no-op: what everything else the
    watch does costs (its hooks, the capture for a replay, the history). A diagnostic row."""
    check = NanWatch.check
    NanWatch.check = lambda self, params=None: None  # type: ignore[method-assign]
    try:
        with serving(w, watch="nan"):
            yield
    finally:
        NanWatch.check = check  # type: ignore[method-assign]


@contextlib.contextmanager
def loop_unrecorded(w: Workload) -> Iterator[None]:
    """``serve(watch='nan')`` with the loop's code between module calls left unrecorded: the
    watch as it was before it named loop-code origins. A diagnostic row."""
    resume = LoopOps.resume
    LoopOps.resume = lambda self: None  # type: ignore[method-assign]
    try:
        with serving(w, watch="nan"):
            yield
    finally:
        LoopOps.resume = resume  # type: ignore[method-assign]


def _kib(n: float) -> str:
    return f"{n / 1024:,.0f} KiB" if n < 10 * 1024 * 1024 else f"{n / 1024**2:,.1f} MiB"


def _fsdp2_rank(rank: int, port: int, steps: int, repeats: int, out: str) -> None:
    """One rank of the FSDP2 workload: R rounds of an untraced and a watched N-step block
    (order alternating by round, the same on both ranks: FSDP's collectives pair up)."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    os.environ["WORLD_SIZE"] = "2"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(60))
    torch.manual_seed(0)
    # The MLP's layers, one block (Linear, GELU, LayerNorm) per fully_shard, then the root.
    layers = list(MLP(256, 8).net)
    blocks = [torch.nn.Sequential(*layers[i : i + 3]) for i in range(0, len(layers), 3)]
    model = torch.nn.Sequential(*blocks)
    for b in blocks:
        fully_shard(b)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 256), torch.randn(64, 256)

    def block(watched: bool) -> float:
        watch = NanWatch(report=_silent).install() if watched else None
        try:
            t0 = time.perf_counter()
            for _ in range(steps):
                opt.zero_grad(set_to_none=True)
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
            return (time.perf_counter() - t0) / steps
        finally:
            if watch is not None:
                watch.remove()

    block(False), block(True)  # warm-up (the watch's first step finds the modules)
    ratios, base = [], []
    for r in range(repeats):
        order = (False, True) if r % 2 == 0 else (True, False)
        times = dict(zip(order, (block(w) for w in order), strict=True))
        ratios.append(times[True] / times[False])
        base.append(times[False])
    with open(f"{out}.{rank}", "w") as f:
        f.write(f"{statistics.median(base)} {statistics.median(ratios)}\n")
    dist.destroy_process_group()


def fsdp2_table(steps: int, repeats: int) -> list[str]:
    """The FSDP2 workload's rows, from 2 spawned gloo ranks."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank")
        mp.spawn(_fsdp2_rank, args=(port, steps, repeats, out), nprocs=2, join=True)
        rows = [Path(f"{out}.{r}").read_text().split() for r in (0, 1)]
    lines = ["| rank | untraced step | watch nan: paired ratio |", "|---|---:|---:|"]
    for r, (base, ratio) in enumerate(rows):
        lines.append(f"| {r} | {float(base) * 1e3:.2f} ms | {float(ratio):.3f}x |")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = block_arguments(__doc__, [*WATCH_WORKLOADS, "fsdp2", "all"], argv)

    torch.set_num_threads(1)
    start = time.perf_counter()
    if args.workload == "fsdp2":
        print("### fsdp2: MLP 8x(Linear 256, GELU, LayerNorm) fully_shard per block + root, ")
        print("AdamW, batch 64, 2 gloo ranks (median over rounds of watched / untraced block)\n")
        print("\n".join(fsdp2_table(args.steps, args.repeats)))
        print(f"\nwhole run {time.perf_counter() - start:.0f} s")
        return 0
    names = list(WATCH_WORKLOADS) if args.workload == "all" else [args.workload]
    workloads = [WATCH_WORKLOADS[n]() for n in names]
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
            f"\nThe check's read alone (every gradient's, module's and the loss's norm + one "
            "host read), timed on its own: "
            f"{checks[w.name] * 1e6:.0f} µs = {checks[w.name] / base * 100:.1f}% of the "
            "untraced step.\n"
        )
        print("| held per step by the watch, between backward() and the check | bytes |")
        print("|---|---:|")
        print(f"| retained graph (saved activations a plain backward frees) | {_kib(m['graph'])} |")
        print(f"| output gradients captured (references, cap 64 MiB) | {_kib(m['grads'])} |")
        print(f"| RNG states ({m['calls']:.0f} top-level calls) | {_kib(m['rng'])} |")
        print(f"| inputs referenced (held by the step anyway) | {_kib(m['inputs'])} |")
        print(
            f"| the loop's code: {m['loop_ops']:.0f} ops recorded, their tensors referenced "
            f"(most held by the step anyway; cap 64 MiB) | {_kib(m['loop_bytes'])} |"
        )
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
