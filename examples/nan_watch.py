"""A NaN made inside a model: a hand-written RMS norm over a batch whose row 3 at step 5 is
padding (all zeros), so 0 / sqrt(0) is NaN. Run it under the watch:

    torchscope run --watch nan --on-nan stop examples/nan_watch.py

``--clean`` leaves the padding row out: the same run, healthy (to diff the two).
"""

import sys

import torch
from torch import nn


class RMSNorm(nn.Module):
    def forward(self, x):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True))  # 0 / 0 on an all-zero row


torch.manual_seed(0)
model = nn.Sequential(RMSNorm(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(10):
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    if step == 5 and "--clean" not in sys.argv[1:]:
        x[3] = 0.0  # a padding row
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step}: loss {loss.item():.4f}")
