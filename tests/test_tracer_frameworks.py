"""The tracer under training frameworks' own loops (Lightning's automatic optimization)."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

import torchscope

L = pytest.importorskip("lightning")  # in the test extra; skipped only where not installed


class TinyModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)
        )
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def fit(ctx) -> TinyModule:
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(40, 4), torch.randn(40, 1))
    module = TinyModule()
    trainer = L.Trainer(
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )
    with warnings.catch_warnings(), ctx:
        warnings.simplefilter("ignore")
        trainer.fit(module, DataLoader(data, batch_size=8))
    return module


def test_lightning_closure_is_traced_and_the_update_around_it_is_not():
    """Lightning calls optimizer.step(closure): the closure (forward, backward) is the model's
    work and is traced; Adam's update after it is not (as without a closure)."""
    plain = fit(contextlib.nullcontext())
    tr = torchscope.trace()
    traced = fit(tr)
    assert traced.losses == plain.losses
    assert tr.errors == []
    steps = {o.step for o in tr.ops if o.name == "torch.nn.functional.mse_loss"}
    assert steps == {0, 1, 2, 3}  # one step per optimizer step
    assert {g.node for g in tr.grads} >= {"MseLossBackward0", "AddmmBackward0", "AccumulateGrad"}
    update = {"Tensor.addcdiv_", "Tensor.lerp_", "Tensor.sqrt", "Tensor.addcmul_"}
    assert not update & {o.name for o in tr.ops}
