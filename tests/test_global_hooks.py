"""A compiled model under torchscope's global module hooks: no warning at each call, nothing
left in torch's global hook dicts or the warning filters afterwards; and, watched, the weights
a bad update wrote are not reported as a new origin."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn.modules import module as module_mod  # noqa: E402

import torchscope  # noqa: E402
from torchscope.tracer.watch.nan_watch import NanWatch  # noqa: E402

WARNING = "when there are global hooks on modules"


def train(model: nn.Module, steps: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def compiled_model() -> nn.Module:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    return torch.compile(model, backend="eager")


def ours_in_filters() -> list:
    return [f for f in warnings.filters if f[1] is not None and "global hooks" in f[1].pattern]


@pytest.mark.parametrize("how", ["watch", "trace"])
def test_a_compiled_model_under_our_hooks_warns_nothing_and_nothing_is_left(how):
    model = compiled_model()
    # The watch looks for the top-level modules with a hook registered with_kwargs: torch
    # kept its flag after removal, a global hook forever in the eyes of every compiled call.
    ctx = NanWatch(report=lambda line: None) if how == "watch" else torchscope.trace(keep=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ctx:
            train(model, 3)
        assert not ours_in_filters()
        assert not module_mod._has_any_global_hook()
        train(model, 1)  # after: as before the hooks
    assert not [w for w in caught if WARNING in str(w.message)]


def test_the_job_still_warns_of_its_own_global_hooks_once_ours_are_gone():
    model = compiled_model()
    with NanWatch(report=lambda line: None):
        train(model, 2)
    mine = module_mod.register_module_forward_pre_hook(lambda module, args: None)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(model, 1)
    finally:
        mine.remove()
    assert [w for w in caught if WARNING in str(w.message)]


JOB = """\
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
compiled = torch.compile(model, backend="eager")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(5):
    loss = compiled(torch.randn(4, 8)).pow(2).mean()
    if step == 3:
        loss = torch.sqrt(loss - 100.0)  # NaN once, in the loop's code
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_a_compiled_models_output_from_weights_the_bad_update_wrote_is_no_new_origin(
    tmp_path: Path,
):
    """Under "continue" the bad update is made: the loop code's NaN is named at its op and
    line, and the next step's non-finite output is what its weights became, not a new
    origin."""
    (tmp_path / "job.py").write_text(textwrap.dedent(JOB))
    proc = subprocess.run(
        [sys.executable, "-m", "torchscope", "run", "--watch", "nan", "job.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    said = [s for s in proc.stderr.splitlines() if s.startswith("torchscope:")]
    assert WARNING not in proc.stderr
    (first,) = [s for s in said if "first appears" in s]
    assert first.startswith(
        "torchscope: NaN first appears at step 3 in torch.sqrt (forward) at job.py:"
    ), first
    assert first.endswith("in the training loop's code — seen as the step ran")
    assert not [s for s in said if "traced live" in s]
    assert "torchscope: NaN/Inf from step 3 lasted 2 checked steps" in said[-2]
