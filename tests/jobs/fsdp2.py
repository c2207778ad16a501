"""FSDP2 (fully_shard) on 2 gloo ranks: prints each step's loss and the norm of this rank's
shard of every parameter's gradient after backward() (what the optimizer uses)."""

import datetime
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer)
fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
gen = torch.Generator().manual_seed(1 + rank)
for step in range(3):
    loss = model(torch.randn(8, 4, generator=gen)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    shards = {n: p.grad.to_local().norm().item() for n, p in model.named_parameters()}
    opt.step()
    line = {"rank": rank, "step": step, "loss": loss.item(), "shards": shards}
    sys.stdout.write(json.dumps(line) + "\n")  # one write: the ranks share the pipe
    sys.stdout.flush()
dist.destroy_process_group()
