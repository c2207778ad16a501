import datetime
import json
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
gen = torch.Generator().manual_seed(10 + rank)
for step in range(3):
    loss = model(torch.randn(8, 4, generator=gen)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    truth = {n: p.grad.mean().item() for n, p in model.named_parameters()}
    opt.step()
    if step == 1 and rank == 1:
        with torch.no_grad():
            model.module[0].weight[0, 0] += 1.0  # rank 1's replica drifts from rank 0's
    t = torch.full((5,), float(rank + 1)) * 1.0
    u = torch.full((2,), 1.0) * 1.0
    if step == 1 and rank == 1:
        u[0] = float("nan")  # made on rank 1 only
    dist.all_reduce(t)  # sum over ranks: 3.0 everywhere
    s = t + 0  # reads the all-reduced value
    dist.all_reduce(u)
    parts = [torch.zeros(2) for _ in range(world)]
    dist.all_gather(parts, torch.full((2,), float(rank)) * 1.0)
    b = torch.full((3,), 7.0 if rank == 0 else 0.0) * 1.0
    dist.broadcast(b, 0)
    # One write per line: the two ranks share the pipe.
    sys.stdout.write(json.dumps({"rank": rank, "step": step, "synced": truth}) + "\n")
    sys.stdout.flush()
dist.destroy_process_group()
