"""Tracing never changes the numbers: same seeds, same losses and weights, bit for bit."""

from __future__ import annotations

import contextlib

import models
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchscope


def dropout_mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 4))


def run(make_model, make_batch, loss_fn, steps: int, trace: dict | None):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    torch.manual_seed(123)  # dropout draws from the global generator
    ctx = torchscope.trace(**trace) if trace is not None else contextlib.nullcontext()
    with ctx as tr:
        for step in range(steps):
            opt.zero_grad()
            loss = loss_fn(model, *make_batch(step))
            loss.backward()
            losses.append(loss.detach().clone())
            opt.step()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return losses, state, tr


CASES = {
    "transformer": (
        models.transformer,
        lambda s: models.lm_batch(s),
        models.lm_loss,
    ),
    "convnet": (
        models.convnet,
        lambda s: (
            torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(s)),
            torch.tensor([0, 1, 2, 1]),
        ),
        lambda m, x, y: F.cross_entropy(m(x), y),
    ),
    "dropout": (
        lambda: dropout_mlp(0),
        lambda s: (
            torch.randn(6, 8, generator=torch.Generator().manual_seed(s)),
            torch.randn(6, 4, generator=torch.Generator().manual_seed(s + 100)),
        ),
        lambda m, x, y: F.mse_loss(m(x), y),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("trace", [{}, {"steps": "1-2", "values": 0}], ids=["all", "some"])
def test_training_is_bit_identical(case, trace):
    make_model, make_batch, loss_fn = CASES[case]
    steps = 4
    ref_losses, ref_state, _ = run(make_model, make_batch, loss_fn, steps, None)
    losses, state, tr = run(make_model, make_batch, loss_fn, steps, trace)
    assert len(tr.ops) > 0 and tr.errors == []
    for a, b in zip(ref_losses, losses, strict=True):
        assert torch.equal(a, b), (a.item(), b.item())
    assert ref_state.keys() == state.keys()
    for k in ref_state:
        assert torch.equal(ref_state[k], state[k]), k
    traced = [0, 1, 2, 3] if not trace else [1, 2]
    assert sorted({o.step for o in tr.ops}) == traced
    # and the recorded loss is the loss
    loss_ops = [o for o in tr.ops if o.name.endswith(("cross_entropy", "mse_loss"))]
    assert [o.step for o in loss_ops] == traced
    for o in loss_ops:
        assert o.outputs[0]["stats"]["mean"] == losses[o.step].item()
