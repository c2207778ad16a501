"""A plain ``accelerate`` loop (``Accelerator(cpu=True)``, 2 micro-batches per optimizer step
under ``accelerator.accumulate``), run by the tests with and without ``torchscope run``.

Step BAD's first micro-batch makes a NaN (sqrt of a negative, inside the model). Prints
``loss MICRO_BATCH STEP VALUE`` for every micro-batch.

Usage: integration_accelerate.py [BAD]   (BAD: -1, the default, for none)
"""

import sys

import torch
from accelerate import Accelerator

STEPS = 6
ACCUMULATE = 2
BAD = int(sys.argv[1]) if len(sys.argv) > 1 else -1


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 16)
        self.b = torch.nn.Linear(16, 1)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x, bad):
        h = self.drop(torch.tanh(self.a(x)))
        if bad:
            h = torch.sqrt(h - 2.0)  # NaN origin
        return self.b(h)


accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
torch.manual_seed(0)
model = Net()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
data = torch.utils.data.TensorDataset(torch.randn(STEPS * ACCUMULATE * 8, 4))
loader = torch.utils.data.DataLoader(data, batch_size=8)
model, opt, loader = accelerator.prepare(model, opt, loader)
for micro, (x,) in enumerate(loader):
    step = micro // ACCUMULATE
    with accelerator.accumulate(model):
        loss = model(x, step == BAD and micro % ACCUMULATE == 0).pow(2).mean()
        accelerator.backward(loss)
        opt.step()  # accelerate runs the update on the last micro-batch only
        opt.zero_grad()
    print(f"loss {micro} {step} {loss.item()!r}", flush=True)
