"""FSDP2 (fully_shard per block, then the root) on 2 gloo ranks with AdamW: 8 steps, one
loss line a rank a step. With JOB_BAD=1, rank 1 takes the square root of negatives in
layers.1 at step 6 (the line that says so): one NaN, one origin in the whole job. With
JOB_BAD=loop, rank 1's own loss code takes the square root of a negative at step 6 instead.
With JOB_LEAVE_OUT=6, the job itself makes no update at step 6 (what a skipped update should
leave)."""

import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

# A short process-group timeout: a rank left waiting in a collective dies in seconds.
timeout = datetime.timedelta(seconds=float(os.environ.get("JOB_PG_TIMEOUT", "10")))
dist.init_process_group("gloo", timeout=timeout)
rank = dist.get_rank()
BAD = os.environ.get("JOB_BAD") == "1"
BAD_LOOP = os.environ.get("JOB_BAD") == "loop"
BAD_STEP = 6


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.poison = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        if self.poison:
            h = torch.sqrt(h - 2.0)  # NaN: rank 1, layers.1, step 6
        return self.norm(h) + x


class Net(nn.Module):
    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


torch.manual_seed(0)
model = Net()
for layer in model.layers:
    fully_shard(layer)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
gen = torch.Generator().manual_seed(1 + rank)
for step in range(int(os.environ.get("JOB_STEPS", "8"))):
    model.layers[1].poison = BAD and rank == 1 and step == BAD_STEP
    loss = model(torch.randn(8, 16, generator=gen)).pow(2).mean()
    if BAD_LOOP and rank == 1 and step == BAD_STEP:
        loss = torch.sqrt(loss - 100.0)  # NaN: rank 1's loop code, step 6
    opt.zero_grad()
    loss.backward()
    if os.environ.get("JOB_LEAVE_OUT") != str(step):
        opt.step()
    sys.stdout.write(f"rank {rank} step {step} {loss.item()!r}\n")  # one write: shared pipe
    sys.stdout.flush()
dist.destroy_process_group()
