"""Record a small transformer's training (a NaN in step 2) and save the UI's main screen.

    python benchmarks/tui_screenshot.py                  # writes screenshot.svg (the docs'
                                                         # pictures: docs/generate.py)
    python benchmarks/tui_screenshot.py --record-only t.tsc   # just the trace, to explore:
    python -c "from torchscope.tui import run_tui, FileSource; run_tui(FileSource('t.tsc'))"

Needs torch (to record); the UI part does not.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def train(steps: int = 4, nan_step: int = 2) -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.ln = nn.LayerNorm(d)
            self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

        def forward(self, x):
            h = self.ln(x)
            a, _ = self.attn(h, h, h, need_weights=False)
            x = x + a
            return x + self.mlp(x)

    class Net(nn.Module):
        def __init__(self, d: int = 16) -> None:
            super().__init__()
            self.emb = nn.Linear(8, d)
            self.blocks = nn.ModuleList([Block(d) for _ in range(2)])
            self.head = nn.Linear(d, 1)

        def forward(self, x):
            x = self.emb(x)
            for block in self.blocks:
                x = block(x)
            return self.head(x).mean(dim=1)

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        x = torch.randn(4, 5, 8)
        y = torch.randn(4, 1)
        if step == nan_step:
            x[0, 0, 0] = float("nan")  # bad data
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def record(path: Path) -> None:
    import torchscope

    with torchscope.trace(record=path, keep=False):
        train()


async def shoot(trace: Path, out: Path, size: tuple[int, int]) -> None:
    from torchscope.tui import FileSource, TorchscopeApp

    app = TorchscopeApp(FileSource(trace))
    async with app.run_test(size=size) as pilot:
        main = app.main
        for _ in range(500):
            if len(app.store.order) >= 3 and all(i.counted for i in app.store.steps.values()):
                break
            await pilot.pause(0.02)
        main.show_step(1)
        for _ in range(500):
            if main.timeline.row_count():
                break
            await pilot.pause(0.02)
        tl = main.timeline
        # A backward node with three inputs: the gradient it got and what it sends on.
        target = next(
            i
            for i in range(tl.row_count())
            if tl.row(i).name == "AddmmBackward0" and tl.row(i).module.endswith("mlp.2")
        )
        tl.move_cursor(target, user=True, center=True)
        await pilot.pause(0.3)
        app.save_screenshot(filename=out.name, path=str(out.parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="screenshot.svg")
    ap.add_argument("--size", default="170x46", help="terminal WIDTHxHEIGHT")
    ap.add_argument("--record-only", metavar="TRACE", default=None)
    args = ap.parse_args()
    if args.record_only:
        record(Path(args.record_only))
        print(f"recorded {args.record_only}")
        return
    width, height = (int(v) for v in args.size.split("x"))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "transformer.tsc"
        cwd = os.getcwd()
        os.chdir(ROOT)  # the job's cwd: source paths show relative to the repository
        try:
            record(trace)
        finally:
            os.chdir(cwd)
        asyncio.run(shoot(trace, out, (width, height)))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
