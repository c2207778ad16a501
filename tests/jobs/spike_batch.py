"""A 3-layer MLP classifier whose batch at one step arrives with its features x300 (a bad
batch): a loss spike at that step, from the batch, first seen at the first Linear.

    spike_batch.py [--bad STEP] [--steps N]

Prints one line per step: ``step N LOSS`` with the loss's repr (bit-for-bit comparable).
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--bad", type=int, default=40)
parser.add_argument("--steps", type=int, default=50)
args = parser.parse_args()

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
teacher = torch.randn(16, 4, generator=torch.Generator().manual_seed(7))
for step in range(args.steps):
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1000 + step))
    y = (x @ teacher).argmax(1)
    if step == args.bad:
        x = x * 300  # a bad batch
    loss = F.cross_entropy(model(x), y)  # the model call
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} {loss.item()!r}", flush=True)
