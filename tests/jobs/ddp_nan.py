import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

# A short process-group timeout: a rank left waiting in a collective dies after 5 s.
# (The tests' reference runs without torchscope give themselves longer: JOB_PG_TIMEOUT.)
timeout = datetime.timedelta(seconds=float(os.environ.get("JOB_PG_TIMEOUT", "5")))
dist.init_process_group("gloo", timeout=timeout)
rank = dist.get_rank()


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 8)
        self.b = torch.nn.Linear(8, 1)

    def forward(self, x, bad):
        h = torch.tanh(self.a(x))
        if bad:
            h = torch.sqrt(h - 2.0)  # NaN on rank 1 at step 3
        return self.b(h)


torch.manual_seed(0)
model = DDP(Net())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
gen = torch.Generator().manual_seed(1 + rank)
for step in range(6):
    loss = model(torch.randn(8, 4, generator=gen), step == 3 and rank == 1).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sys.stdout.write(f"rank {rank} step {step} {loss.item()!r}\n")  # one write: shared pipe
    sys.stdout.flush()
dist.destroy_process_group()
