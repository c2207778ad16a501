"""Two ranks under DDP; rank 1's batch at step 3 holds one corrupt value (an Inf), and the
NaN it makes reaches rank 0 through DDP's gradient all-reduce. Run it under the watch:

    torchrun --standalone --nproc_per_node 2 -m torchscope run --watch nan --on-nan skip \
        examples/ddp_nan.py
"""

from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank = dist.get_rank()
torch.manual_seed(0)
model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
torch.manual_seed(rank)
for step in range(8):
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    if rank == 1 and step == 3:
        x[0, 0] = float("inf")  # one corrupt value in one sample
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if rank == 0:
        print(f"step {step}: loss {loss.item():.4f}", flush=True)
dist.destroy_process_group()
