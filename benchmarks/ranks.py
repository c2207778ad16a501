"""What tracing costs per rank under torchrun + DDP, against the same workload in one process.

    python benchmarks/ranks.py            # about a minute on 2 cores
    python benchmarks/ranks.py --quick    # a smoke run (noisy numbers)
    python benchmarks/ranks.py --batchnorm  # a BatchNorm first: DDP broadcasts it every forward

Each setting runs the MLP of ``workloads.py`` (batch 64 per rank) in rounds that interleave an
untraced block and a block under the agent as ``torchscope run --steps all --no-live`` starts
it (``Agent(ServeOptions(steps="all", live=False))``, garbage collection on): one process
with no process group, then 2 ranks (gloo, CPU) under ``torchrun --standalone`` with the
model in ``DistributedDataParallel``. Under torchrun the agent also records DDP's
synchronised gradients after each backward, publishes and compares the replicas'
fingerprint after each update, and meets the other rank before each ``backward()`` and
before each forward in which DDP communicates (with ``--batchnorm``: DDP broadcasts the
running statistics at every forward; the command line holds every rank traced); those are
timed apart, per step, as controlled columns (wall time inside those functions, included in
the traced step).

Both ranks share this machine's cores, so the 2-rank rows are slower per step than the
single process whatever the tracer does: compare ratios, not milliseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def worker(steps: int, rounds: int, batchnorm: bool) -> None:
    sys.path.insert(0, str(HERE))
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from workloads import make_mlp

    from torchscope.tracer import rank_checks, ranks
    from torchscope.tracer.agent import Agent, ServeOptions
    from torchscope.tracer.armed import backward

    torch.set_num_threads(1)
    multi = "RANK" in os.environ
    if multi:
        import datetime

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    w = make_mlp()
    model = w.model
    if batchnorm:
        model = torch.nn.Sequential(torch.nn.BatchNorm1d(256), model)
    if multi:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
    opt = w.optimizer
    x, y = torch.randn(64, 256), torch.randn(64, 256)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        opt.step()

    spent = {"synced": 0.0, "fingerprint": 0.0, "meet": 0.0}

    def timed(cls: type, name: str, key: str) -> None:
        original = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(self, *args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - t0

        setattr(cls, name, wrapper)

    timed(backward.BackwardRecorder, "_ddp_synced_grads", "synced")
    timed(rank_checks.RankChecks, "check_replicas", "fingerprint")
    timed(ranks.RankGate, "meet", "meet")
    gates: list = []
    for_job = ranks.RankGate.for_job.__func__

    def gate_for_job(cls, say):
        gate = for_job(cls, say)
        if gate is not None:
            gates.append(gate)
        return gate

    ranks.RankGate.for_job = classmethod(gate_for_job)

    for _ in range(3):
        step()
    times: dict[str, list[float]] = {"untraced": [], "traced": []}
    paired: list[float] = []
    global_step = 0
    for r in range(rounds):
        block: dict[str, list[float]] = {}
        for name in ("untraced", "traced") if r % 2 == 0 else ("traced", "untraced"):
            agent = None
            if name == "traced":
                agent = Agent(ServeOptions(steps="all", live=False, quiet=True)).start()
                agent.clock.step = global_step  # fresh step numbers: fresh meetings
            ts = []
            for _ in range(steps):
                t0 = time.perf_counter()
                step()
                ts.append(time.perf_counter() - t0)
            global_step += steps + 1
            if agent is not None:
                agent.stop()
            block[name] = ts
            times[name] += ts
        paired.append(statistics.median(block["traced"]) / statistics.median(block["untraced"]))
    traced_steps = len(times["traced"])
    out = {
        "rank": dist.get_rank() if multi else None,
        "untraced_ms": statistics.median(times["untraced"]) * 1e3,
        "traced_ms": statistics.median(times["traced"]) * 1e3,
        "paired": statistics.median(paired),
        "synced_us": spent["synced"] / traced_steps * 1e6,
        "fingerprint_us": spent["fingerprint"] / traced_steps * 1e6,
        "gate_wait_ms": sum(g.waited for g in gates) / traced_steps * 1e3,
        "meet_ms": spent["meet"] / traced_steps * 1e3,
        "meetings": sum(g.meetings for g in gates) / traced_steps,
    }
    sys.stdout.write("RESULT " + json.dumps(out) + "\n")
    sys.stdout.flush()
    if multi:
        dist.destroy_process_group()


def _results(cmd: list[str]) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if res.returncode != 0:
        raise SystemExit(f"ranks.py: {' '.join(cmd[:4])} failed:\n{res.stderr[-3000:]}")
    return [json.loads(line[7:]) for line in res.stdout.splitlines() if line.startswith("RESULT ")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--batchnorm", action="store_true", help="a BatchNorm1d before the MLP")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.steps, args.rounds = 5, 2
    if args.worker:
        worker(args.steps, args.rounds, args.batchnorm)
        return 0
    me = [str(Path(__file__).resolve()), "--worker", "--steps", str(args.steps)]
    me += ["--rounds", str(args.rounds), *(["--batchnorm"] if args.batchnorm else [])]
    t0 = time.monotonic()
    single = _results([sys.executable, *me])
    multi = _results(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            *me,
        ]
    )
    bn = "BatchNorm1d(256), then " if args.batchnorm else ""
    print(
        f"{bn}MLP 8x(Linear 256, GELU, LayerNorm), batch 64 per rank, {args.rounds} rounds of "
        f"{args.steps} steps per setting; run --steps all --no-live as the traced setting\n"
    )
    print(
        "| setting | untraced ms/step | traced ms/step | traced (paired ratio) | "
        "DDP synced-grad record µs/step | replica fingerprint µs/step | "
        "meeting the other rank ms/step (meetings/step) | of which waiting ms/step |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for label, rows in (("one process", single), ("torchrun, 2 ranks, DDP", multi)):
        for row in sorted(rows, key=lambda r: r["rank"] or 0):
            who = label if row["rank"] is None else f"{label}: rank {row['rank']}"
            ddp = row["rank"] is not None
            print(
                f"| {who} | {row['untraced_ms']:.2f} | {row['traced_ms']:.2f} | "
                f"{row['paired']:.2f}x | "
                + (
                    f"{row['synced_us']:.0f} | {row['fingerprint_us']:.0f} | "
                    f"{row['meet_ms']:.2f} ({row['meetings']:.0f}) | "
                    f"{row['gate_wait_ms']:.2f} |"
                    if ddp
                    else "- | - | - | - |"
                )
            )
    print(f"\n(wall {time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
