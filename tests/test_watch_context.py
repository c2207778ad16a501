"""The NaN watch's context around its one line: the module as the job's code names it, with
its class (``model.4 (Linear)``), and the growth line when the bad step ends a divergence."""

from __future__ import annotations

import re
from itertools import pairwise

import pytest
import torch
from torch import nn

from torchscope.tracer.watch.growth import figure, growth_line
from torchscope.tracer.watch.nan_watch import NanWatch


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def regression(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed batch of a linear target: the same data every step."""
    x = torch.randn(128, 8, generator=torch.Generator().manual_seed(1))
    return x, x.sum(1, keepdim=True)


def mlp() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1)
    )


class Named(nn.Module):
    """The same network as :func:`mlp` (same parameters in the same order), with names."""

    def __init__(self) -> None:
        super().__init__()
        self.fc0 = nn.Linear(8, 16)
        self.fc1 = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(torch.relu(self.fc0(x)))))


def diverge(build, lr: float = 3.0, steps: int = 12) -> tuple[NanWatch, list[str], list[float]]:
    """SGD with a learning rate far too large: the loss grows until a Linear's output
    overflows. The loop stops at the first detection; the losses are the job's own."""
    torch.manual_seed(0)
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    lines: list[str] = []
    losses: list[float] = []
    with NanWatch(report=lines.append) as w:
        for step in range(steps):
            x, y = regression(step)
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if w.detections:
                break
    return w, lines, losses


def figures(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"-?\d+(?:\.\d+)?(?:e-?\d+)?", text)]


def test_a_divergent_sequential_is_named_as_the_loop_names_it_and_the_growth_is_said():
    w, lines, losses = diverge(mlp)
    (det,) = w.detections
    bad = next(i for i, v in enumerate(losses) if not torch.isfinite(torch.tensor(v)))
    assert det["step"] == bad == 4
    assert det["module"] == "4"  # the tracer's path, as recordings and UIs have it
    assert det["module_text"] == "model.4 (Linear)"
    assert lines[0].startswith(
        "torchscope: Inf first appears at step 4 in aten.addmm.default inside "
        "torch.nn.functional.linear (forward) in model.4 (Linear) at "
    )
    # The line after it: the loss grew at each of the steps before the bad one.
    assert lines[1] == det["growth"]
    head, _, norms = lines[1].partition("; gradient norm ")
    assert head == (
        f"torchscope: the loss grew from {figure(losses[0])} to {figure(losses[bad - 1])} "
        f"over the {bad - 1} steps before"
    )
    first, last = figures(head)[:2]
    assert first == pytest.approx(losses[0], rel=5e-3)
    assert last == pytest.approx(losses[bad - 1], rel=5e-3)
    a, b = figures(norms)
    assert 0 < a < 100 < 1e10 < b  # the gradient norm over the same steps


def test_named_children_are_named_with_the_model_in_front():
    w, lines, losses = diverge(Named)
    (det,) = w.detections
    assert det["step"] == 4 and det["module"] == "fc2"
    assert det["module_text"] == "model.fc2 (Linear)"
    assert " in model.fc2 (Linear) at " in lines[0]
    assert lines[1].startswith(f"torchscope: the loss grew from {figure(losses[0])} to ")


def test_a_model_no_name_binds_is_named_by_its_class():
    torch.manual_seed(0)
    models = [mlp()]  # reached through a list: no local or global names it
    opt = torch.optim.SGD(models[0].parameters(), lr=3.0)
    lines: list[str] = []
    with NanWatch(report=lines.append) as w:
        for step in range(12):
            x, y = regression(step)
            opt.zero_grad()
            nn.functional.mse_loss(models[0](x), y).backward()
            opt.step()
            if w.detections:
                break
    (det,) = w.detections
    assert det["module_text"] == "Sequential.4 (Linear)"
    assert " in Sequential.4 (Linear) at " in lines[0]


class Root(nn.Module):
    """A NaN in the root's own forward code (sqrt of a negative at the bad step)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x, bad: bool):
        h = self.lin(x)
        return torch.sqrt(h - 100.0) if bad else h  # NaN origin


def test_a_healthy_run_says_no_growth_and_the_root_is_named_with_its_class():
    """The loss falls, then one step makes a NaN: the line names the root itself, and no
    growth line follows it."""
    torch.manual_seed(0)
    model = Root()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(2))
    y = x.sum(1, keepdim=True)
    lines: list[str] = []
    losses: list[float] = []
    with NanWatch(report=lines.append) as w:
        for step in range(8):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x, step == 6), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    assert all(b < a for a, b in pairwise(losses[:6]))  # it learned
    (det,) = w.detections
    assert det["step"] == 6 and det["module_text"] == "model (Root)"
    assert det["growth"] is None
    (line,) = [s for s in lines if "first appears" in s]
    assert " (forward) in model (Root) at " in line
    assert not any("grew" in s for s in lines)


def test_the_growth_rule():
    grow = [(0, 1.46, 3.1), (1, 58.0, 40.0), (2, 7.8e4, 9e5), (3, 8.5e18, 2.2e9)]
    assert growth_line(grow, 4) == (
        "torchscope: the loss grew from 1.46 to 8.5e18 over the 3 steps before; "
        "gradient norm 3.1 → 2.2e9"
    )
    # falling, wandering, or too little: nothing
    assert growth_line([(0, 3.0, 1.0), (1, 2.0, 1.0), (2, 1.0, 1.0)], 3) is None
    assert growth_line([(0, 1.0, 1.0), (1, 50.0, 1.0), (2, 20.0, 1.0), (3, 900.0, 1.0)], 4) is None
    assert growth_line([(0, 1.0, 1.0), (1, 1.5, 1.1), (2, 2.0, 1.2)], 3) is None
    # one rise is not a run
    assert growth_line([(0, 1.0, 1.0), (1, 1e6, 1.0)], 2) is None
    # only the steps just before the detection count (a gap breaks the run)
    assert growth_line([(0, 1.0, 1.0), (1, 10.0, 1.0), (2, 1e3, 1.0)], 5) is None
    # the gradient norm alone, when the loss does not grow
    assert growth_line([(0, 2.0, 1.0), (1, 2.0, 30.0), (2, 2.0, 4e4)], 3) == (
        "torchscope: the gradient norm grew from 1 to 4e4 over the 2 steps before; loss 2 → 2"
    )
