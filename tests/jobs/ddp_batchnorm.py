"""A DDP job over a model with BatchNorm: DDP broadcasts its buffers (the running statistics)
at the start of every forward, a collective outside any backward. 30 steps (JOB_STEPS) of
about 0.1 s while JOB_PACE_FILE exists (the test deletes it when the rest may run at once)."""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

# A short process-group timeout: a rank left waiting in a collective dies after it.
# (The tests' reference runs without torchscope give themselves longer: JOB_PG_TIMEOUT.)
timeout = datetime.timedelta(seconds=float(os.environ.get("JOB_PG_TIMEOUT", "5")))
dist.init_process_group("gloo", timeout=timeout)
rank = dist.get_rank()
torch.manual_seed(0)
net = torch.nn.Sequential(
    torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
)
model = DDP(net)
assert model.will_sync_module_buffers()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
gen = torch.Generator().manual_seed(1 + rank)
pace = os.environ.get("JOB_PACE_FILE")
for step in range(int(os.environ.get("JOB_STEPS", "30"))):
    x = torch.randn(8, 4, generator=gen)  # the step's first op: before the forward
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    stats = net[1].running_mean.sum().item()  # rank 0's, broadcast: the same on every rank
    sys.stdout.write(f"rank {rank} step {step} {loss.item()!r} {stats!r}\n")  # one write
    sys.stdout.flush()
    if pace is not None and os.path.exists(pace):
        time.sleep(0.1)
dist.destroy_process_group()
