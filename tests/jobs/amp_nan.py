"""Mixed precision as large runs train: autocast and a GradScaler whose scale starts high, so
that several early steps overflow in fp16 and are skipped (normal AMP), and a bug that can be
switched on in a submodule from one step on.

    amp_nan.py [--dtype fp16|bf16] [--no-scaler] [--bad STEP] [--persist]
               [--bug log|sqrt|loop|prefetch]
               [--steps N]

Prints one JSON line per step: the loss as the job computed it, the scale, whether the scaler
skipped the update, and a checksum of the weights.
"""

import argparse
import json
import sys

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--dtype", default="fp16", choices=("fp16", "bf16"))
parser.add_argument("--no-scaler", action="store_true")
parser.add_argument("--bad", type=int, default=-1)
parser.add_argument("--persist", action="store_true")
parser.add_argument("--bug", default="log", choices=("log", "sqrt", "loop", "prefetch"))
parser.add_argument("--steps", type=int, default=24)
args = parser.parse_args()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.bug: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.bug == "log":
            h = torch.log(h)  # NaN origin: log of negative pre-activations
        elif self.bug == "sqrt":
            h = h + torch.sqrt(h - h.detach())  # Inf origin: sqrt's gradient at 0
        return torch.relu(h)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.blocks = nn.Sequential(Block(), Block())
        self.out = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.inp(x)))


torch.manual_seed(0)
model = MLP()
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
scaler = torch.amp.GradScaler(
    "cpu", init_scale=2.0**24, growth_interval=4, enabled=not args.no_scaler
)
gen = torch.Generator().manual_seed(1)
for step in range(args.steps):
    x = torch.randn(64, 16, generator=gen) * 10
    y = torch.randn(64, 1, generator=gen)
    on = step == args.bad or (args.persist and 0 <= args.bad <= step)
    model.blocks[1].bug = args.bug if on and args.bug not in ("loop", "prefetch") else None
    if on and args.bug == "prefetch":
        x[0, 0] = float("nan")  # a corrupted record in a batch buffer the loop reuses
    with torch.autocast("cpu", dtype=dtype):
        loss = nn.functional.mse_loss(model(x).float(), y)
    if on and args.bug == "loop":
        loss = torch.sqrt(loss - 2.0)  # NaN origin in the loop's own code
    opt.zero_grad()
    scale = scaler.get_scale()
    if args.bug == "prefetch":  # the next batch, into the same buffer, before the backward
        x.copy_(torch.randn(64, 16, generator=gen) * 10)
    scaler.scale(loss).backward()
    before = sum(p.sum().item() for p in model.parameters())
    scaler.step(opt)
    scaler.update()
    weights = sum(p.sum().item() for p in model.parameters())
    line = {"step": step, "loss": loss.item(), "scale": scale, "skipped": weights == before}
    line["weights"] = weights
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()
