"""A small conv net with BatchNorm2d in channels_last, SGD, 6 steps; with JOB_BAD=1 its second
block takes the log of negatives at step 4 (the line that says so). BatchNorm then writes
that NaN into its running_mean/running_var in place: consequences, not origins."""

import os
import sys

import torch
from torch import nn

BAD = os.environ.get("JOB_BAD") == "1"


class Block(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)
        self.bn = nn.BatchNorm2d(cout)
        self.poison = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        if self.poison:
            h = torch.log(h - 10.0)  # NaN: the second block, step 4
        return torch.relu(self.bn(h))


torch.manual_seed(0)
blocks = [Block(3, 8), Block(8, 8), Block(8, 8)]
model = nn.Sequential(*blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))
model = model.to(memory_format=torch.channels_last)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(6):
    blocks[1].poison = BAD and step == 4
    x = torch.randn(4, 3, 8, 8).to(memory_format=torch.channels_last)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sys.stdout.write(f"step {step} {loss.item()!r}\n")
