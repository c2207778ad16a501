"""DDP on 2 gloo ranks, 6 steps: rank 1 alone makes one bad value at step 4 (JOB_BAD_STEP),
as JOB_BAD says: ``batch`` (a NaN written into its batch), ``batch_inf`` (an Inf there: the
NaN first shows in the backward), ``param`` (a NaN written into a weight before the forward),
``collective`` (a NaN written into a tensor that an all_reduce then sums, which scales the
loss). Clips the gradients, as HF Trainer and Lightning do: a NaN total norm spreads into
every gradient."""

import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

timeout = datetime.timedelta(seconds=float(os.environ.get("JOB_PG_TIMEOUT", "30")))
dist.init_process_group("gloo", timeout=timeout)
rank, world = dist.get_rank(), dist.get_world_size()
bad = os.environ.get("JOB_BAD", "batch")
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
gen = torch.Generator().manual_seed(1 + rank)
for step in range(6):
    here = step == int(os.environ.get("JOB_BAD_STEP", "4")) and rank == 1
    x = torch.randn(8, 4, generator=gen)
    if here and bad == "batch":
        x[0, 0] = float("nan")
    elif here and bad == "batch_inf":
        x[0, 0] = float("inf")
    elif here and bad == "param":
        with torch.no_grad():
            model.module[0].weight[0, 0] = float("nan")
    scale = torch.ones(1)
    if here and bad == "collective":
        scale[0] = float("nan")
    dist.all_reduce(scale)  # world everywhere, NaN everywhere once rank 1 wrote one
    loss = model(x).pow(2).mean() * (scale / world)
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sys.stdout.write(f"rank {rank} step {step} {loss.item()!r}\n")  # one write: shared pipe
    sys.stdout.flush()
dist.destroy_process_group()
