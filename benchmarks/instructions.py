"""Instructions per training step, counted by valgrind: the tracer's cost without the noise.

    python benchmarks/instructions.py [--workload policy|mlp|transformer] [--steps N]

Timings on a shared host swing by a fifth from one run to the next, which hides any change
to the tracer's bookkeeping smaller than that. Instruction counts do not swing: the same
steps execute the same instructions, run after run. This script runs each configuration in
its own process under ``valgrind --tool=callgrind``, counting only inside the timed loop (the
import of torch and the warm-up steps are not counted), and prints instructions per step:

  untraced          the plain training step
  floor             floor.py's ``+ grad stats`` layer: a mode, a hook on every node, and the
                    four reductions of every tensor, nothing else
  trace(keep=False) torchscope's controlled configuration
  trace()           the public API's defaults (events kept in memory)

with each row's ratio to the untraced step, the instructions it adds per event (ops + grads
of a traced step), and torchscope's ratio over the floor's, as floor.py prints it from time.

A controlled column, not what a user pays: an instruction is not a fixed time (the
reductions of large tensors are memory-bound, Python's bookkeeping is not), so read it
beside ``overhead.py`` and ``floor.py``, never instead. Each process takes about three
minutes (valgrind runs torch's import too, uncounted); two run at a time. Without valgrind
it says so in one line and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
ROWS = {
    "base": "untraced",
    "floor": "floor (mode + node hooks + reductions)",
    "traced": "torchscope trace(keep=False)",
    "trace": "torchscope trace()",
    "dormant": "torchscope run (dormant, live, nobody attached)",
    "watch": "torchscope run --watch nan",
    "watch_noloop": "torchscope run --watch nan, loop code unrecorded (diagnostic)",
    "watch_spike": "torchscope run --watch nan,spike",
}
TRACING_ROWS = ("floor", "traced", "trace")
WARMUP = 5


def inner(row: str, workload: str, steps: int) -> None:
    """One configuration's loop, counted from inside ``sys.call_tracing`` only."""
    sys.path.insert(0, HERE)
    import torch

    torch.set_num_threads(1)
    from floor import floor
    from workloads import ALL_WORKLOADS

    import torchscope

    w = ALL_WORKLOADS[workload]()
    make = {
        "base": contextlib.nullcontext,
        "floor": lambda: floor(3),
        "traced": lambda: torchscope.trace(keep=False),
        "trace": torchscope.trace,
        "dormant": lambda: served(),
        "watch": lambda: served(watch="nan"),
        "watch_noloop": lambda: loop_unrecorded(served(watch="nan")),
        "watch_spike": lambda: served(watch="nan,spike"),
    }[row]

    def loop(n: int) -> None:
        for _ in range(n):
            w.step()

    with make():
        loop(WARMUP)
        # valgrind counts while this C function runs (--toggle-collect): the timed loop alone.
        sys.call_tracing(loop, (steps,))


@contextlib.contextmanager
def loop_unrecorded(inner: contextlib.AbstractContextManager) -> Iterator[None]:
    """The watch before it recorded the loop's code between module calls: the row beside
    ``watch`` that says what naming loop-code origins costs."""
    from torchscope.tracer.watch.loop_code import LoopOps

    resume = LoopOps.resume
    LoopOps.resume = lambda self: None  # type: ignore[method-assign]
    try:
        with inner:
            yield
    finally:
        LoopOps.resume = resume  # type: ignore[method-assign]


@contextlib.contextmanager
def served(**options: object) -> Iterator[None]:
    """The agent as ``torchscope run`` starts it around a script (dormant, live stream on)."""
    from torchscope.tracer.agent import Agent, ServeOptions

    agent = Agent(ServeOptions(quiet=True, **options)).start()  # type: ignore[arg-type]
    try:
        yield
    finally:
        agent.stop()


def count(row: str, workload: str, steps: int, tmpdir: str) -> int:
    out = os.path.join(tmpdir, f"callgrind.{row}.out")
    cmd = [
        "valgrind",
        "--tool=callgrind",
        "--collect-atstart=no",
        "--toggle-collect=sys_call_tracing",
        f"--callgrind-out-file={out}",
        sys.executable,
        os.path.abspath(__file__),
        "--inner",
        row,
        "--workload",
        workload,
        "--steps",
        str(steps),
    ]
    # The same hash seed in every process: dict and set layouts, hence instructions, repeat.
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"instructions.py: {row} failed under valgrind: {proc.stderr[-500:]}")
    with open(out) as f:
        for line in f:
            m = re.match(r"(?:summary|totals): (\d+)", line)
            if m:
                return int(m.group(1))
    raise SystemExit(f"instructions.py: no instruction total in {out}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workload", choices=["policy", "mlp", "transformer", "tiny"], default="policy")
    p.add_argument("--steps", type=int, default=50, help="counted steps per row (50)")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated ({','.join(ROWS)})")
    p.add_argument("--inner", choices=list(ROWS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("need --steps >= 1")
    if args.inner:
        inner(args.inner, args.workload, args.steps)
        return 0
    rows = ["base", *(r for r in args.rows.split(",") if r != "base")]
    unknown = set(rows) - set(ROWS)
    if unknown:
        p.error(f"--rows: unknown {', '.join(sorted(unknown))}")
    if shutil.which("valgrind") is None:
        print("instructions.py: valgrind not found (apt-get install valgrind); nothing counted")
        return 0

    sys.path.insert(0, HERE)
    from overhead import event_counts
    from workloads import ALL_WORKLOADS

    w = ALL_WORKLOADS[args.workload]()
    c = event_counts(w)
    events = c["ops"] + c["grads"]
    with (
        tempfile.TemporaryDirectory(prefix="torchscope-callgrind-") as tmpdir,
        ThreadPoolExecutor(max_workers=2) as pool,
    ):
        counted = pool.map(lambda r: count(r, args.workload, args.steps, tmpdir), rows)
        totals = dict(zip(rows, counted, strict=True))
    per_step = {r: totals[r] / args.steps for r in rows}
    base = per_step["base"]
    print(f"## Instructions per step: {w.description}\n")
    print(
        f"valgrind callgrind, {args.steps} counted steps per row after {WARMUP} uncounted; "
        f"{c['ops']} ops + {c['grads']} grads = {events} events per traced step.\n"
    )
    print("| row | instructions per step | ratio | added per step | added per event |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        added = per_step[r] - base
        # Per event only where events are made: dormant and watched steps trace nothing.
        per_event = f"{added / events / 1e3:,.1f}k" if r in TRACING_ROWS else "-"
        print(
            f"| {ROWS[r]} | {per_step[r] / 1e3:,.0f}k | {per_step[r] / base:.3f}x "
            f"| {added / 1e3:,.1f}k | {per_event} |"
        )
    if "floor" in per_step:
        for r in ("traced", "trace"):
            if r in per_step:
                print(
                    f"\n{ROWS[r]} / floor: {per_step[r] / base:.3f} / "
                    f"{per_step['floor'] / base:.3f} = {per_step[r] / per_step['floor']:.3f}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
