"""A Lightning job with torchscope's callback: the watch checks every step, and the NaN that
batch 3's forward makes (the sqrt of a negative) stops the run before its update. Run it as
it is, with no ``torchscope run``:

    python examples/lightning_watch.py
"""

import logging
import warnings

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from torchscope.integrations.lightning import TorchscopeCallback


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 8)
        self.b = torch.nn.Linear(8, 1)

    def forward(self, x, bad):
        h = torch.tanh(self.a(x))
        if bad:
            h = torch.sqrt(h - 2.0)  # a bug that only batch 3 reaches
        return self.b(h)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self(x, batch_idx == 3).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


warnings.filterwarnings("ignore")  # Lightning's advice on workers and logging
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)  # and its banner
torch.manual_seed(0)
data = DataLoader(TensorDataset(torch.randn(48, 4)), batch_size=8)
trainer = L.Trainer(
    max_steps=6,
    accelerator="cpu",
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    callbacks=[TorchscopeCallback(watch="nan", on_nan="stop")],
)
trainer.fit(Net(), data)
