"""The NaN watch names the op and line of a NaN/Inf the training loop's own code makes between
module calls (a loss function, ``torch.distributions``, a ``sqrt`` written in the loop), at the
step it happens, with no rerun; and the job is unchanged when nothing is wrong."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Normal
from watching import bits, line_of, watch
from watching import data as batch

from torchscope.tracer.watch.nan_watch import WatchStop


@pytest.fixture(autouse=True)
def _clean():
    torch.set_num_threads(1)
    yield
    assert torch._C._len_torch_function_stack() == 0


# -- the loops ---------------------------------------------------------------------------------
V = 7


def token_loop(model, step):
    """Token classification; at step 3 every label is ignored: the mean of nothing."""
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, V, (4, 10), generator=g)
    y = torch.randint(0, V, (4, 10), generator=g)
    if step == 3:
        y[:] = -100
    logits = model(x)
    return F.cross_entropy(logits.view(-1, V), y.view(-1), ignore_index=-100)


def token_model() -> nn.Module:
    return nn.Sequential(nn.Embedding(V, 16), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, V))


def policy_loop(model, step):
    """A Gaussian policy; at step 4 the scale underflows to exactly 0."""
    out = model(batch(step, 8, 4))
    mu, s = out[:, 0], out[:, 1]
    if step == 4:
        s = s - 1000.0
    scale = F.softplus(s)
    logp = Normal(mu, scale, validate_args=False).log_prob(batch(step + 50, 8))
    return -logp.mean()


def policy_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 2))


def sqrt_loop(model, step, bad_from: int = 3):
    """A root-mean-square loss whose residual goes negative at every step from ``bad_from``."""
    r = (model(batch(step, 8, 4)) - batch(step + 50, 8, 1)).pow(2).mean()
    if step >= bad_from:
        r = r - 100.0
    return torch.sqrt(r)


def regression_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))


def masked_loop(model, step):
    """Attention weights in the loop's code: a causal -inf mask is fine; at step 2 a row is
    masked out entirely and softmax turns it into NaN."""
    scores = model(batch(step, 4, 4))
    mask = torch.triu(torch.full((4, 4), float("-inf")), diagonal=1)
    if step == 2:
        mask[0, 0] = float("-inf")
    weights = torch.softmax(scores + mask, dim=-1)
    return (weights * scores).sum()


def train(model_fn, loop, steps: int, *, ctx=None, opt_cls=torch.optim.SGD, **opt_kw):
    torch.manual_seed(0)
    model = model_fn()
    opt = opt_cls(model.parameters(), **(opt_kw or {"lr": 0.05}))
    losses = []
    with ctx if ctx is not None else contextlib.nullcontext():
        for step in range(steps):
            opt.zero_grad()
            loss = loop(model, step)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses, model


# -- named in the one line ---------------------------------------------------------------------
def test_cross_entropy_with_every_label_ignored_is_named_at_its_line():
    w, lines = watch()
    train(token_model, token_loop, 4, ctx=w)
    (det,) = w.detections
    assert det["step"] == 3 and det["reproduced"] is True and det["loop_code"] is True
    assert det["origin"] == "torch.nn.functional.cross_entropy"
    assert det["source"] == line_of(token_loop, "F.cross_entropy(")
    assert det["where"] == "forward" and det["origin_what"] == "nan"
    assert lines[0].startswith(
        "torchscope: NaN first appears at step 3 in torch.nn.functional.cross_entropy (forward)"
    )
    assert "in the training loop's code" in lines[0]
    assert not det["unexplained"]  # named: nothing to trace afterwards


def test_a_distributions_log_prob_names_the_users_line_and_the_librarys_op():
    w, lines = watch()
    train(policy_model, policy_loop, 5, ctx=w)
    (det,) = w.detections
    assert det["step"] == 4 and det["loop_code"] is True
    # The first non-finite value in the order the ops ran: log(0) = -inf in log_prob.
    assert det["origin"] == "Tensor.log" and det["origin_what"] == "inf"
    assert det["source"] == line_of(policy_loop, ".log_prob(")
    assert det["library"].startswith("torch/distributions/normal.py:")
    assert "Inf first appears at step 4 in Tensor.log (forward) at " in lines[0]
    assert "(torch/distributions/normal.py:" in lines[0]


def test_an_inf_made_on_purpose_is_not_the_origin_the_softmax_that_makes_nan_is():
    w, lines = watch()
    train(lambda: nn.Linear(4, 4), masked_loop, 3, ctx=w)
    (det,) = w.detections
    assert det["step"] == 2 and det["origin"] == "torch.softmax"
    assert det["origin_what"] == "nan" and det["entered"] is False
    assert det["source"] == line_of(masked_loop, "torch.softmax(")
    assert "NaN first appears at step 2 in torch.softmax (forward) at " in lines[0]


def test_a_nan_in_the_batch_enters_the_loop_code_at_its_first_use():
    def loop(model, step):
        target = batch(step + 50, 8, 3)
        if step == 2:
            target[1, 1] = float("nan")  # a corrupted record
        return F.mse_loss(model(batch(step, 8, 4)), target)

    w, lines = watch()
    train(lambda: nn.Linear(4, 3), loop, 3, ctx=w)
    (det,) = w.detections
    assert det["step"] == 2 and det["entered"] is True
    assert det["origin"] == "torch.nn.functional.mse_loss"
    assert det["source"] == line_of(loop, "F.mse_loss(")
    assert lines[0].startswith("torchscope: NaN enters the training loop's code at step 2 in ")


@pytest.mark.parametrize("policy", ["stop", "continue"])
def test_a_recurring_loss_code_nan_is_named_at_the_step_it_starts(policy):
    w, lines = watch(on_nan=policy)
    if policy == "stop":
        with pytest.raises(WatchStop):
            train(regression_model, sqrt_loop, 6, ctx=w)
    else:
        train(regression_model, sqrt_loop, 6, ctx=w)
    det = w.detections[0]
    assert det["step"] == 3 and det["origin"] == "torch.sqrt"
    assert det["source"] == line_of(sqrt_loop, "torch.sqrt(r)")
    assert "NaN first appears at step 3 in torch.sqrt (forward) at " in lines[0]


def test_between_two_module_calls_the_loop_code_is_named_and_the_model_replayed_finite():
    crit = nn.MSELoss()

    def loop(model, step):
        out = model(batch(step, 8, 4))
        scaled = out / (0.0 if step == 2 else 1.0)  # loop code between the two calls
        return crit(scaled, batch(step + 50, 8, 3))

    w, _ = watch()
    train(lambda: nn.Linear(4, 3), loop, 3, ctx=w)
    (det,) = w.detections
    assert det["origin"] == "Tensor.div" and det["step"] == 2
    assert det["source"] == line_of(loop, "out / (")


# -- the job unchanged --------------------------------------------------------------------------
def test_losses_and_weights_are_bit_identical_under_the_watch_when_nothing_is_wrong():
    def loop(model, step):
        return token_loop(model, step + 10)  # never step 3: all healthy

    plain, m0 = train(token_model, loop, 6, opt_cls=torch.optim.AdamW, lr=1e-2)
    w, lines = watch()
    watched, m1 = train(token_model, loop, 6, ctx=w, opt_cls=torch.optim.AdamW, lr=1e-2)
    assert bits(plain) == bits(watched) and not lines
    for a, b in zip(m0.parameters(), m1.parameters(), strict=True):
        assert torch.equal(a, b)


def test_module_calls_run_with_the_jobs_own_mode_stack():
    """Inside a top-level module call the stack is as the job left it (no mode of ours: a
    compiled model never sees it); between calls, ours sits under the job's own modes, so a
    job's ``with torch.device(...)`` in the loop enters and leaves as it would."""
    seen: list[int] = []

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x):
            seen.append(torch._C._len_torch_function_stack())
            return self.lin(x)

    def loop(model, step):
        out = model(batch(step, 8, 4))
        with torch.device("cpu"):
            extra = torch.zeros(8, 3)  # made under the job's own mode
        inside = torch._C._len_torch_function_stack()
        return (out + extra).pow(2).mean() + 0 * inside

    w, _ = watch()
    train(Probe, loop, 3, ctx=w)
    assert seen and all(n == 0 for n in seen[1:])  # (the first step finds the modules)


def test_a_compiled_model_is_not_recompiled_and_its_loop_code_is_named():
    torch._dynamo.reset()
    counts = {"compiles": 0}

    def backend(gm, example_inputs):
        counts["compiles"] += 1
        return gm.forward

    def model_fn():
        return torch.compile(regression_model(), backend=backend)

    w, lines = watch()
    train(model_fn, lambda m, s: sqrt_loop(m, s, bad_from=4), 5, ctx=w)
    assert counts["compiles"] == 1
    (det,) = w.detections
    assert det["step"] == 4 and det["origin"] == "torch.sqrt"
    assert det["source"] == line_of(sqrt_loop, "torch.sqrt(r)")
    assert "in the training loop's code" in lines[0]
    torch._dynamo.reset()


# -- the command line --------------------------------------------------------------------------
def test_torchscope_run_stops_with_the_op_and_line_of_a_loss_function(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch, torch.nn as nn, torch.nn.functional as F
            torch.manual_seed(0)
            V = 7
            model = nn.Sequential(nn.Embedding(V, 16), nn.Linear(16, V))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            for step in range(6):
                x = torch.randint(0, V, (4, 10))
                y = torch.randint(0, V, (4, 10))
                if step == 3:
                    y[:] = -100
                logits = model(x)
                loss = F.cross_entropy(logits.view(-1, V), y.view(-1), ignore_index=-100)
                opt.zero_grad()
                loss.backward()
                opt.step()
            """
        )
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchscope",
            "run",
            "--watch",
            "nan",
            "--on-nan",
            "stop",
            str(script),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 3, proc.stderr
    assert (
        "torchscope: NaN first appears at step 3 in torch.nn.functional.cross_entropy "
        "(forward) at train.py:13, in the training loop's code" in proc.stderr
    ), proc.stderr
    assert "--record" not in proc.stderr  # named: no rerun to suggest


def test_under_skip_a_recurring_loss_code_nan_is_named_and_never_reaches_the_weights():
    """Every bad update is refused: the weights stay finite, the first bad step is named at
    its op and line, and the run ends as ``stop`` does once too many come in a row."""
    w, lines = watch(on_nan="skip", max_skips=2)
    torch.manual_seed(0)
    model = regression_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    steps = []
    with w, pytest.raises(WatchStop):
        for step in range(8):
            opt.zero_grad()
            loss = sqrt_loop(model, step, bad_from=3)
            loss.backward()
            opt.step()
            steps.append(step)
    assert steps == [0, 1, 2, 3, 4]  # steps 3 and 4 skipped, the third bad one in a row stops
    det = w.detections[0]
    assert det["step"] == 3 and det["origin"] == "torch.sqrt" and det["skipped"] is True
    assert det["source"] == line_of(sqrt_loop, "torch.sqrt(r)")
    assert "NaN first appears at step 3 in torch.sqrt (forward) at " in lines[0]
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
