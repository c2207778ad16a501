"""What a dormant, attachable job costs, and how long attaching takes.

    python benchmarks/attach.py [--steps N] [--repeats R] [--workload mlp|transformer|all]
                                [--attach-trials K] [--no-attach]

Per-step cost (rows, interleaved in rounds with overhead.py's ``measure``, GC on: the
collector runs as it would in the user's job):
  untraced             the plain training step
  dormant (serve)      a dormant agent as ``torchscope.serve()`` / ``torchscope run`` start
                       it: step clock, backward() wrapper, control endpoint and its thread
  armed, then dormant  the same agent after a UI-like hold armed it for 2 steps and let go
                       (timed after it went dormant again)
  armed (a UI holds)   every timed step traced while a client holds the job (for scale)

Attach latency: a job started by ``torchscope run`` (dormant) trains the MLP; a client connects
as ``torchscope tui PID`` does and asks to arm. Reported: steps from the request to the first
traced step, and milliseconds from the request to the first traced event received.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import Config, assert_clean, measure, table  # noqa: E402
from workloads import WORKLOADS, Workload  # noqa: E402

from torchscope.tracer.agent import Agent, ServeOptions, current_agent  # noqa: E402


@contextlib.contextmanager
def serving(w: Workload, arm: str | None = None, **options):
    """A live agent around one block, as ``torchscope.serve(**options)`` starts it; ``arm``:
    "briefly" (2 steps, then dormant) or "held"."""
    agent = Agent(ServeOptions(quiet=True, **options)).start()
    try:
        if arm == "briefly":
            agent._cmd_arm({"next": 2}, b"bench")
            for _ in range(3):  # armed at the next boundary, 2 steps, dormant at the third
                w.step()
            assert agent.tracer is None and agent.armed_periods == 1
        elif arm == "held":
            agent._cmd_arm({"next": None}, b"bench")
            w.step()
        yield
    finally:
        agent.stop()
    assert current_agent() is None


def configs() -> list[Config]:
    return [
        Config("base", "untraced", lambda w: contextlib.nullcontext()),
        Config("dormant", "dormant (serve)", lambda w: serving(w)),
        Config("after", "armed, then dormant", lambda w: serving(w, "briefly")),
        Config("armed", "armed (a UI holds)", lambda w: serving(w, "held")),
    ]


def fixed_cost_us(n: int = 2000) -> tuple[float, float, float]:
    """Controlled: what the dormant agent adds to one step, in µs, on a step that does
    nothing else (an optimizer over one scalar, a backward of one node): (plain, dormant,
    once). The agent's first steps pay once for what it learns about the job (the optimizers
    it holds: one pass over the collector's objects): ``once``, in ms, the best of the first
    10 steps' time over 10 plain steps; the per-step figures are timed after them."""
    import gc

    p = torch.zeros((), requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.0)

    def step() -> None:
        (p * 1.0).backward()
        opt.step()

    def timed(steps: int) -> float:
        gc.collect()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        return (time.perf_counter() - t0) / steps * 1e6

    best_plain = best_dormant = best_once = float("inf")
    for _ in range(5):
        timed(10)
        best_plain = min(best_plain, timed(n))
        agent = Agent(ServeOptions(quiet=True)).start()
        try:
            best_once = min(best_once, (timed(10) - best_plain) * 10 / 1e3)
            best_dormant = min(best_dormant, timed(n))
        finally:
            agent.stop()
    return best_plain, best_dormant, best_once


JOB = """\
import sys, time
sys.path.insert(0, {bench!r})
import torch
from workloads import make_mlp
torch.set_num_threads(1)
w = make_mlp()
print("ready", flush=True)
while True:
    w.step()
"""


def attach_latency(trials: int) -> list[tuple[int, float, float]]:
    """(steps from request to first traced step, ms to first traced event, ms per step)."""
    from torchscope.protocol.client import SessionClient
    from torchscope.protocol.events import STEP

    out = []
    with tempfile.TemporaryDirectory(prefix="torchscope-attach-bench-") as tmp:
        script = os.path.join(tmp, "job.py")
        with open(script, "w") as f:
            f.write(JOB.format(bench=os.path.dirname(os.path.abspath(__file__))))
        job = subprocess.Popen(
            [sys.executable, "-m", "torchscope", "run", "--quiet", script],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert job.stdout is not None and job.stdout.readline().strip() == "ready"
            time.sleep(1.0)
            for _ in range(trials):
                with SessionClient() as client:
                    client.connect(str(job.pid), timeout=10)
                    step0, t_step0 = client.hello()["step"], time.perf_counter()
                    t0 = time.perf_counter()
                    client.request("arm", next=1)
                    first = None
                    while first is None:
                        for e in client.recv_events(100):
                            if e.get("kind") == STEP:
                                first = (e["step"], time.perf_counter())
                                break
                    step1 = client.hello()["step"]
                    per_step = (time.perf_counter() - t_step0) / max(1, step1 - step0) * 1e3
                    out.append((first[0] - step0, (first[1] - t0) * 1e3, per_step))
                    client.request("disarm")
                time.sleep(0.5)
        finally:
            job.kill()
            job.wait()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="timed steps per block (20)")
    p.add_argument("--repeats", type=int, default=10, help="rounds (10)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
    p.add_argument("--attach-trials", type=int, default=5)
    p.add_argument("--no-attach", action="store_true", help="skip the attach-latency part")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    workloads = [WORKLOADS[n]() for n in names]
    rows = configs()
    start = time.perf_counter()
    assert_clean("start")
    results = measure(workloads, rows, args.steps, args.repeats, args.warmup, record=None)
    print("## A dormant, attachable job: cost per training step\n")
    print(
        f"torch {torch.__version__}, 1 torch thread, {os.cpu_count()} CPUs; {args.repeats} "
        f"rounds x {args.steps} timed steps per row, interleaved; GC on; "
        f"{time.perf_counter() - start:.0f} s.\n"
    )
    for w in workloads:
        print(f"### {w.name}: {w.description}\n")
        print("\n".join(table(w, rows, results, args.steps)))
        print()
    print(
        "`paired ratio` is the headline (median over rounds of this row's block median over "
        "the untraced block median of the same round). `enter+exit` is starting and stopping "
        "the agent (binding its endpoint, registering), paid once per job, not per step.\n"
    )
    plain, dormant, once = fixed_cost_us()
    print(
        f"Controlled: the dormant agent's fixed cost per step (optimizer.step() hooks, the "
        f"backward() wrapper, the loss history), on an empty step: {plain:.1f} µs plain, "
        f"{dormant:.1f} µs dormant: +{dormant - plain:.1f} µs per step (best of 5 x 2000 "
        f"steps, after the agent's first 10); once, over its first 10 steps: +{once:.1f} ms.\n"
    )
    if not args.no_attach:
        lat = attach_latency(args.attach_trials)
        print(f"## Attach latency: MLP job under `torchscope run`, {len(lat)} trials\n")
        print("| trial | steps until the first traced step | ms to its first event | ms/step |")
        print("|---:|---:|---:|---:|")
        for i, (steps, ms, per) in enumerate(lat, 1):
            print(f"| {i} | {steps} | {ms:.1f} | {per:.1f} |")
        print(
            f"\nMedian: {statistics.median(s for s, _, _ in lat)} step(s), "
            f"{statistics.median(m for _, m, _ in lat):.1f} ms. Arming waits for the next step "
            "boundary by design (never mid-step), so the floor is up to one step."
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
