"""What the NaN watch's "catch it live" costs: after a NaN/Inf it could not name (here, a NaN
record in a batch buffer that the loop refills before ``backward()``: the replay sees the next
batch, not the bad one), ``run --watch nan`` traces the next steps in full until the NaN comes
back or the window ends.

    python benchmarks/watch_catch.py [--steps N] [--bad K] [--repeats R]

The job (the 8 x (Linear 256, GELU, LayerNorm) MLP, batch 64, fp16 autocast with a
GradScaler that keeps the weights finite by skipping the bad step) makes one NaN at step K
that never comes back, so the whole window is traced. Each run is the CLI as users run it
(``torchscope run --watch nan``, GC on); the job times each of its steps itself. Rows, per
step, median over the runs of the median over the steps of:

  before       steps 2..K-1 under the watch (dormant agent + watch)
  window       the traced steps after the detection
  after        the steps after the window (dormant again)
  plain        the same steps of the same job under plain ``python`` (same run order)

and the window's whole extra time against the same steps under the watch without a NaN.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

JOB = textwrap.dedent(
    """
    import json, sys, time
    import torch
    from torch import nn
    steps, bad = int(sys.argv[1]), int(sys.argv[2])
    torch.manual_seed(0)
    torch.set_num_threads(1)
    layers = []
    for _ in range(8):
        layers += [nn.Linear(256, 256), nn.GELU(), nn.LayerNorm(256)]
    model = nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x, y = torch.randn(64, 256), torch.randn(64, 256)
    clean = x.clone()
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        if step == bad:
            x[0, 0] = float("nan")  # a corrupted record, once
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        loss = nn.functional.mse_loss(out.float(), y)
        if step == bad:
            x.copy_(clean)  # the next batch, into the same buffer, before the check
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        times.append(time.perf_counter() - t0)
    print(json.dumps(times))
    """
)

WINDOW = 10  # the agent's WATCH_TRACE_STEPS


def run(job: Path, steps: int, bad: int, watched: bool) -> list[float]:
    cmd = [sys.executable, str(job), str(steps), str(bad)]
    if watched:
        cmd = [sys.executable, "-m", "torchscope", "run", "--watch", "nan", *cmd[1:]]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
    if watched and bad >= 0 and "tracing the next" not in out.stderr:
        raise SystemExit(f"the watch did not arm after the NaN:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def median_ms(times: list[float], lo: int, hi: int) -> float:
    return statistics.median(times[lo:hi]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--bad", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    bad, steps = args.bad, args.steps
    if not 3 <= bad < steps - WINDOW - 3:
        raise SystemExit(f"--bad must leave room: 3 <= K < steps - {WINDOW + 3}")
    spans = {"before": (2, bad), "window": (bad + 1, bad + 1 + WINDOW)}
    spans["after"] = (bad + 1 + WINDOW, steps)
    rows: dict[str, list[float]] = {k: [] for k in ("plain", *spans)}
    extra: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.py"
        job.write_text(JOB)
        for _ in range(args.repeats):
            plain = run(job, steps, bad, watched=False)
            quiet = run(job, steps, -1, watched=True)
            caught = run(job, steps, bad, watched=True)
            rows["plain"].append(median_ms(plain, *spans["window"]))
            for name, (lo, hi) in spans.items():
                rows[name].append(median_ms(caught, lo, hi))
            lo, hi = spans["window"]
            extra.append(sum(caught[lo:hi]) - sum(quiet[lo:hi]))
    base = statistics.median(rows["plain"])
    print("## The watch's live catch: cost of the traced window\n")
    print(
        f"{args.repeats} runs x {steps} steps, NaN at step {bad}, window of {WINDOW} traced "
        "steps; each run the CLI as users run it, GC on\n"
    )
    print("| steps | median ms/step | ratio to plain |")
    print("|---|---:|---:|")
    for name, values in rows.items():
        ms = statistics.median(values)
        print(f"| {name} | {ms:.2f} | {ms / base:.2f}x |")
    print(
        f"\nThe window's extra time against the same steps watched without a NaN: "
        f"{statistics.median(extra) * 1e3:.0f} ms (median of {args.repeats})."
    )


if __name__ == "__main__":
    main()
