"""A job that trains for a long while (a small MLP, about 20 steps a second), to attach to:

torchscope run examples/long_job.py &
torchscope ls
torchscope record PID --next 3 -o t.tsc
"""

import time

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(100_000):
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 1000 == 0:
        print(f"step {step}: loss {loss.item():.4f}", flush=True)
    time.sleep(0.05)  # the rest of a real step: data loading, logging
