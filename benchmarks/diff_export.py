"""How fast `torchscope diff` and `torchscope export` are on a large recording.

    python benchmarks/diff_export.py [--events 100000]

Records a training loop of an 8-block MLP until the file holds about --events events (real
tracer output), makes a second recording with the learning rate changed, and times diff
(itself, and against the other run) and every export format through the CLI.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time


def record(path: str, steps: int, lr: float) -> int:
    import torch

    import torchscope

    torch.manual_seed(0)
    layers = []
    for _ in range(8):
        layers += [torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.LayerNorm(64)]
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x, y = torch.randn(16, 64), torch.randn(16, 64)
    with torchscope.trace(record=path, keep=1):
        for _ in range(steps):
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
    return len(torchscope.load(path))


def timed(*args: str) -> float:
    t = time.perf_counter()
    res = subprocess.run(
        [sys.executable, "-m", "torchscope", *args], capture_output=True, text=True
    )
    if res.returncode not in (0, 1):
        raise SystemExit(res.stderr)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=100_000)
    args = ap.parse_args()
    d = tempfile.mkdtemp(prefix="ts-bench-")
    a, b = os.path.join(d, "a.tsc"), os.path.join(d, "b.tsc")
    per_step = record(a, 2, 0.01) - record(a, 1, 0.01)
    steps = max(1, args.events // per_step)
    n = record(a, steps, 0.01)
    record(b, steps, 0.02)
    print(f"{n} events, {os.path.getsize(a) / 1e6:.1f} MB per file")
    print(f"diff A A (same):       {timed('diff', a, a):.2f} s")
    print(f"diff A B (lr changed): {timed('diff', a, b):.2f} s")
    print(f"export perfetto:       {timed('export', a, '-o', os.path.join(d, 't.json')):.2f} s")
    for fmt in ("csv", "parquet"):
        for kind in ("op", "tensor"):
            out = os.path.join(d, f"t.{kind}.{fmt}")
            t = timed("export", a, "--format", fmt, "--kind", kind, "-o", out)
            print(f"export {fmt:<8} {kind:<7} {t:.2f} s")


if __name__ == "__main__":
    main()
