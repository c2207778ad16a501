"""A small Lightning job whose forward makes a NaN at a chosen batch (for
tests/test_watch_frameworks.py).

Arguments: ``--bad N`` (the batch whose forward takes the sqrt of a negative; -1: none),
``--steps N`` (optimizer steps), ``--accumulate K`` (``accumulate_grad_batches``), ``--clip V``
(``gradient_clip_val``). Prints each batch's loss, exactly (``repr``), as it is computed.
``main(argv)`` runs it again in the same process (fresh seeds): one process gives the
unwatched losses of several configurations.
"""

import argparse
import warnings

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class Net(L.LightningModule):
    def __init__(self, bad: int) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 8)
        self.b = torch.nn.Linear(8, 1)
        self.bad = bad

    def forward(self, x, bad):
        h = torch.tanh(self.a(x))
        if bad:
            h = torch.sqrt(h - 2.0)  # NaN origin
        return self.b(h)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = self(x, batch_idx == self.bad).pow(2).mean()
        print(f"batch {batch_idx} {loss.item()!r}", flush=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bad", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--clip", type=float, default=None)
    opts = parser.parse_args(argv)
    warnings.filterwarnings("ignore")  # Lightning's advice (workers, logging) is not the test's
    torch.manual_seed(0)
    batches = opts.steps * opts.accumulate
    data = torch.randn(8 * batches, 4, generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(data), batch_size=8)
    trainer = L.Trainer(
        max_steps=opts.steps,
        accumulate_grad_batches=opts.accumulate,
        gradient_clip_val=opts.clip,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )
    trainer.fit(Net(opts.bad), loader)


if __name__ == "__main__":
    main()
