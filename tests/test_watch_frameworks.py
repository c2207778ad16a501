"""The NaN watch where the framework owns the step: ``optimizer.step(closure)`` (Lightning's
automatic optimization, LBFGS), and loop code around a ``torch.compile``d model."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.optim import optimizer as optim_mod  # noqa: E402
from watching import bits, data, line_of, watch  # noqa: E402

from torchscope.tracer.watch.nan_watch import WatchStop  # noqa: E402

JOBS = Path(__file__).parent / "jobs"
LIGHTNING_JOB = JOBS / "lightning_nan.py"
ORIGINAL_AUTOGRAD_BACKWARD = torch.autograd.backward


@pytest.fixture(autouse=True)
def _clean():
    hooks = len(optim_mod._global_optimizer_pre_hooks), len(optim_mod._global_optimizer_post_hooks)
    yield
    assert (
        len(optim_mod._global_optimizer_pre_hooks),
        len(optim_mod._global_optimizer_post_hooks),
    ) == hooks
    assert torch.autograd.backward is ORIGINAL_AUTOGRAD_BACKWARD


# -- Lightning: the Trainer's closure, under `torchscope run` ---------------------------------
def lightning_origin() -> str:
    """``.../lightning_nan.py:N``, N the line of the job's NaN origin."""
    text = LIGHTNING_JOB.read_text().splitlines()
    (n,) = [i for i, s in enumerate(text, 1) if "# NaN origin" in s]
    return f"{LIGHTNING_JOB}:{n}"


def start(*args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd
    )


def finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=240)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


# One unwatched process gives both configurations' losses (the job's main() reseeds).
PLAIN = "--bad 3 --steps 6".split()
ACCUMULATED = "--bad 8 --steps 6 --accumulate 2 --clip 0.01".split()  # bad: step 4's 1st batch
BASELINE = (
    "import sys; sys.path.insert(0, {jobs!r}); import lightning_nan as job; "
    "job.main({a!r}); print('--', flush=True); job.main({b!r})"
)


def test_lightning_on_nan_stop_exits_3_naming_the_origin_bit_identical_before(tmp_path):
    """Lightning runs forward and backward inside ``optimizer.step(closure)`` (and clips the
    gradients there, after the closure): the watch checks when the closure returns, replays
    the step's module calls, and the stop leaves through the Trainer as exit 3, one line,
    no traceback. With gradient accumulation the NaN of the step's first micro-batch (run
    outside ``step()``) is found by the check after the second."""
    watched = ("-m", "torchscope", "run", "--watch", "nan", "--on-nan", "stop", str(LIGHTNING_JOB))
    procs = [
        start("-c", BASELINE.format(jobs=str(JOBS), a=PLAIN, b=ACCUMULATED), cwd=tmp_path),
        start(*watched, *PLAIN, cwd=tmp_path),
        start(*watched, *ACCUMULATED, cwd=tmp_path),
    ]
    baseline, plain, accumulated = (finish(p) for p in procs)
    assert baseline.returncode == 0, baseline.stderr[-3000:]
    unwatched = [part.strip().splitlines() for part in baseline.stdout.split("--\n")]
    assert "closure" not in plain.stderr + accumulated.stderr  # no more "not watched"
    for res, losses, step, bad, batches in (
        (plain, unwatched[0], 3, 3, 4),  # stopped after batch 3's closure
        (accumulated, unwatched[1], 4, 8, 10),  # after batch 9's: step 4 is batches 8 and 9
    ):
        assert res.returncode == 3, res.stderr[-3000:]
        assert "Traceback" not in res.stderr, res.stderr[-3000:]
        origin = [x for x in res.stderr.splitlines() if " first appears " in x]
        assert origin == [
            f"torchscope: NaN first appears at step {step} in aten.sqrt.default inside "
            f"torch.sqrt (forward) in Net at {lightning_origin()} — replayed"
        ]
        stopped = f"stopped before the update of step {step} (--on-nan stop); exit code 3"
        assert stopped in res.stderr
        # bit-identical (repr) up to the bad step, and nothing trained after it
        assert res.stdout.splitlines() == losses[:batches], res.stderr[-2000:]
        assert losses[bad].endswith(" nan") and " nan" not in "\n".join(losses[:bad])


# -- LBFGS: plain PyTorch, a closure called several times per step ----------------------------
class SqrtNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x, bad):
        h = torch.tanh(self.lin(x))
        if bad:
            h = torch.sqrt(h - 2.0)  # NaN origin
        return h.pow(2).mean()


class LbfgsRun:
    """LBFGS (3 closure calls a step at most) on ``SqrtNet``; the forward of closure call
    ``bad[1]`` of step ``bad[0]`` makes a NaN. What it did stays readable when it raises:
    every call's loss, and the parameters the last call computed its gradients at."""

    def __init__(self, bad: tuple[int, int]) -> None:
        self.bad = bad
        self.losses: list[float] = []
        self.seen: list[torch.Tensor] = []
        torch.manual_seed(0)
        self.model = SqrtNet()

    def train(self, steps: int) -> list[float]:
        opt = torch.optim.LBFGS(self.model.parameters(), lr=0.5, max_iter=3)
        for step in range(steps):
            opt.step(self.closure(opt, step))
        return self.losses

    def closure(self, opt: torch.optim.Optimizer, step: int):
        x, calls = data(step, 8, 4), [0]

        def closure():
            opt.zero_grad()
            self.seen = [p.detach().clone() for p in self.model.parameters()]
            loss = self.model(x, (step, calls[0]) == self.bad)
            calls[0] += 1
            loss.backward()
            self.losses.append(loss.item())
            return loss

        return closure


def test_lbfgs_closure_checked_after_every_call_replayed_and_bit_identical():
    plain = LbfgsRun((2, 0)).train(4)
    w, lines = watch()
    with w:
        losses = LbfgsRun((2, 0)).train(4)
    assert bits(losses) == bits(plain)
    (det,) = w.detections
    assert (det["step"], det["origin"], det["where"], det["reproduced"]) == (
        2,
        "torch.sqrt",
        "forward",
        True,
    )
    assert det["source"] == line_of(SqrtNet.forward, "# NaN origin")
    assert lines[0].startswith(
        "torchscope: NaN first appears at step 2 in aten.sqrt.default inside torch.sqrt "
        "(forward) in self.model (SqrtNet) at "  # the trainer's attribute that holds it
    )
    # the later calls of step 2 and 3 (NaN weights) count once per step, not once per call
    assert (det["repeats"], det["last_step"]) == (1, 3)
    assert w.steps_checked == len(losses) > 4  # at each closure call, not once per step


def test_lbfgs_stop_at_the_closure_call_that_went_bad_before_its_update():
    """Step 1's first call is fine, its second makes the NaN: the watch stops there, before
    the update that would have followed that call."""
    plain = LbfgsRun((1, 1)).train(3)
    w, lines = watch(on_nan="stop")
    run = LbfgsRun((1, 1))
    with w, pytest.raises(WatchStop) as info:
        run.train(3)
    det = info.value.detection
    assert (det["step"], det["origin"], info.value.exit_code) == (1, "torch.sqrt", 3)
    assert lines[0] == str(info.value)
    # step 0's three calls and step 1's two, as unwatched; the last one is the NaN
    assert len(run.losses) == 5 and bits(run.losses) == bits(plain[:5])
    assert str(run.losses[-1]) == "nan" and "nan" not in map(str, run.losses[:-1])
    # not updated since the bad call computed its gradients
    assert all(p.equal(s) for p, s in zip(run.model.parameters(), run.seen, strict=True))


# -- loop code around a compiled model --------------------------------------------------------
def compiled_mlp() -> nn.Module:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
    return torch.compile(mlp, backend="eager")  # the watch keeps no graph for any compiled model


def train_compiled(loop, steps: int, ctx=None) -> list[float]:
    torch._dynamo.reset()
    model = compiled_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    with ctx if ctx is not None else contextlib.nullcontext():
        for step in range(steps):
            opt.zero_grad()
            loss = loop(model, step)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


def sqrt_of_loss(model, step):
    """Loop code: NaN in the forward at step 2, outside the compiled model."""
    mse = model(data(step, 8, 4)).pow(2).mean()
    return torch.sqrt(mse - (100.0 if step == 2 else 0.0))


def sqrt_at_zero(model, step):
    """Loop code: finite forward, Inf in the backward (sqrt at 0) at step 2."""
    out = model(data(step, 8, 4))
    mask = torch.zeros(8, 3) if step == 2 else torch.ones(8, 3)
    return torch.sqrt((out * mask).pow(2).sum())


COMPILE_WARNING = "ignore:Using `torch.compile\\(module\\)` when there are global hooks"


@pytest.mark.filterwarnings(COMPILE_WARNING)
def test_loop_code_around_a_compiled_model_is_named_at_its_op_and_line():
    """A compiled model's backward is not retained, so the step's graph cannot be replayed
    (it said "Trying to backward through the graph a second time ... origin unknown"): the
    loop code's forward ops were recorded as they ran, around the compiled call, and the one
    that made the loss NaN is named, as without compile."""
    plain = train_compiled(sqrt_of_loss, 4)
    w, lines = watch()
    losses = train_compiled(sqrt_of_loss, 4, ctx=w)
    assert bits(losses) == bits(plain)
    det = w.detections[0]
    assert (det["step"], det["loop_code"], det["origin"]) == (2, True, "torch.sqrt")
    assert det["where"] == "forward" and det["outside_modules"] and det["notes"] == []
    assert lines[0].startswith(
        "torchscope: NaN first appears at step 2 in torch.sqrt (forward) at "
    )
    assert lines[0].endswith("in the training loop's code — seen as the step ran")
    assert "Trying to backward" not in " ".join(lines) and "origin unknown" not in lines[0]


@pytest.mark.filterwarnings(COMPILE_WARNING)
def test_a_backward_origin_in_loop_code_around_a_compiled_model_is_placed():
    w, lines = watch()
    train_compiled(sqrt_at_zero, 3, ctx=w)
    det = w.detections[0]
    assert (det["step"], det["origin"], det["where"], det["origin_what"]) == (
        2,
        "SqrtBackward0",
        "backward",
        "inf",
    )
    assert lines[0].startswith(
        "torchscope: Inf first appears at step 2 in SqrtBackward0 (backward) outside the "
        "module calls (training-loop code; backward() at "
    )
