"""What a logpoint costs, per hit, measured against the same traced run.

    python benchmarks/logpoints.py [--workload mlp|policy|transformer] [--steps N] [--repeats R]
                                   [--clock cpu|wall]

Rows, all with ``torchscope.trace(keep=False)`` around the same training step
(``benchmarks/workloads.py``), timed in one run (rounds rotate the order, so drift hits every
row alike); the ratio column is each row's median step time over the first row's:

  traced                      no breakpoint at all
  logpoint, no hit            ``--log 'op:^no such op$' x`` : every op and node asks
                              whether the breakpoint matches, none does
  logpoint on one op          ``--log 'op:^torch.nn.functional.mse_loss$' x.item()``: one
                              hit per step
  logpoint on every node      ``--log 'node:.' 'grad_outputs[0].norm()'``: a hit per node

Steps are timed by this thread's CPU time by default (``--clock cpu``: a host shared with
other jobs slows the wall clock of every row, not its CPU time); ``--clock wall`` for the
wall clock. "per hit" is (row - "logpoint, no hit") / hits per step: what evaluating the expression,
formatting its line, writing it and its ``log`` event cost. Logpoint lines go to /dev/null
(written, as a job writes them). Nothing is paid while no logpoint is set: that is the
"traced" row, whose instructions per op ``benchmarks/instructions.py`` counts.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

ROWS = {
    "traced": [],
    "logpoint, no hit": [{"op": r"^no such op$", "log": "x"}],
    "logpoint on one op": [{"op": r"^torch\.nn\.functional\.mse_loss$", "log": "x.item()"}],
    "logpoint on every node": [{"node": ".", "log": "grad_outputs[0].norm()"}],
}


@contextlib.contextmanager
def stderr_to_devnull():
    """Logpoint lines are written (the cost is real) where they do not flood the table."""
    sys.stderr.flush()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(null)
        os.close(saved)


def block(
    make, breakpoints: list[dict], steps: int, clock=time.thread_time
) -> tuple[list[float], int]:
    """Median-ready step times of one block, and the logpoint hits per step."""
    from torchscope.tracer.armed.session import Tracer

    work = make()
    work.step()  # warm-up, untraced
    times = []
    with stderr_to_devnull(), Tracer(live=False, keep=False, breakpoints=breakpoints) as tr:
        for _ in range(steps):
            t0 = clock()
            work.step()
            times.append(clock() - t0)
        hits = sum(bp.hits for bp in tr.stepper.breakpoints.values()) if tr.stepper else 0
    return times, hits // steps if steps else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", default="mlp", choices=("mlp", "policy", "transformer"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--clock", default="cpu", choices=("cpu", "wall"))
    args = p.parse_args()

    import torch

    torch.set_num_threads(1)
    from workloads import make_mlp, make_policy, make_transformer

    make = {"mlp": make_mlp, "policy": make_policy, "transformer": make_transformer}[args.workload]
    names = list(ROWS)
    times: dict[str, list[float]] = {n: [] for n in names}
    hits: dict[str, int] = {}
    for r in range(args.repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            clock = time.thread_time if args.clock == "cpu" else time.perf_counter
            t, h = block(make, ROWS[name], args.steps, clock)
            times[name] += t
            hits[name] = h
    med = {n: statistics.median(times[n]) for n in names}
    base = med["traced"]
    none = med["logpoint, no hit"]
    print(
        f"workload {args.workload}: {args.steps} steps x {args.repeats} rounds, 1 thread, "
        f"{args.clock} clock (median step)"
    )
    print(f"| {'row':<24} | {'step (ms)':>9} | {'ratio':>6} | {'hits/step':>9} | per hit (µs) |")
    print(f"|{'-' * 26}|{'-' * 11}|{'-' * 8}|{'-' * 11}|--------------|")
    for n in names:
        per_hit = "-"
        if hits.get(n) and n != "logpoint, no hit":
            per_hit = f"{(med[n] - none) / hits[n] * 1e6:,.0f}"
        print(
            f"| {n:<24} | {med[n] * 1e3:>9.2f} | {med[n] / base:>5.2f}x | {hits.get(n, 0):>9} "
            f"| {per_hit:>12} |"
        )


if __name__ == "__main__":
    main()
