"""A DDP job that runs long enough to be attached to: 40 steps (JOB_STEPS) of about 0.1 s
(JOB_SLEEP; with JOB_PACE_FILE, only while that file exists), no NaN."""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

# A short process-group timeout: a rank left waiting in a collective dies after 5 s.
# (The tests' reference runs without torchscope give themselves longer: JOB_PG_TIMEOUT.)
timeout = datetime.timedelta(seconds=float(os.environ.get("JOB_PG_TIMEOUT", "5")))
dist.init_process_group("gloo", timeout=timeout)
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
gen = torch.Generator().manual_seed(1 + rank)
pace = os.environ.get("JOB_PACE_FILE")  # the test deletes it when the rest may run at once
for step in range(int(os.environ.get("JOB_STEPS", "40"))):
    loss = model(torch.randn(8, 4, generator=gen)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sys.stdout.write(f"rank {rank} step {step} {loss.item()!r}\n")  # one write: shared pipe
    sys.stdout.flush()
    if pace is None or os.path.exists(pace):
        time.sleep(float(os.environ.get("JOB_SLEEP", "0.1")))
dist.destroy_process_group()
