"""``on_nan="skip"``: the watch refuses a bad update, as a loss scaler skips an overflowed step,
and training goes on as if that batch had never been there; a run that keeps going bad stops.

Real loops with real optimizers: the run that met a one-off NaN batch and skipped it must go on
bit-identically to the run that never saw that batch (weights, losses, optimizer state)."""

from __future__ import annotations

import contextlib
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_watch import _clean, watch  # noqa: F401  (_clean: the watch leaves nothing behind)
from test_watch_cli import run
from torch import nn

from torchscope.tracer.watch.nan_watch import NanWatch, WatchStop

BAD = 5  # the step whose batch holds a NaN feature
STEPS = 10


def batches(steps: int = STEPS, bad: tuple[int, ...] = (BAD,)) -> list[tuple[torch.Tensor, ...]]:
    """The data set, one batch a step; the batches of ``bad`` hold a NaN feature (a corrupted
    record)."""
    gen = torch.Generator().manual_seed(7)
    out = []
    for step in range(steps):
        x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)
        if step in bad:
            x[3, 1] = float("nan")
        out.append((x, y))
    return out


def optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if kind == "lbfgs":
        return torch.optim.LBFGS(params, lr=0.5, max_iter=4)
    name, _, impl = kind.partition("-")
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name]
    return cls(params, lr=0.01, foreach=impl == "foreach")


def train(kind: str, data, *, ctx=None, closure: bool = False, after_step=None):
    """The job: a small MLP, ``kind``'s optimizer, a plain step or ``step(closure)``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = optimizer(kind, model.parameters())
    losses: list[float] = []
    with ctx if ctx is not None else contextlib.nullcontext():
        for step, (x, y) in enumerate(data):
            if closure:

                def again(x=x, y=y):
                    opt.zero_grad()
                    loss = nn.functional.mse_loss(model(x), y)
                    loss.backward()
                    return loss

                loss = opt.step(again)
            else:
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
            losses.append(loss.item())
            if after_step is not None:
                after_step(step, model)
    return losses, model, opt


def bits(values: list[float]) -> list[bytes]:
    return [struct.pack("<d", v) for v in values]


def same_tensors(a, b) -> bool:
    """Equal down to the bit, through dicts and lists (a state_dict)."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_tensors(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_tensors(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


# -- the watch itself ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kind,closure",
    [
        ("sgd", False),
        ("adam-foreach", False),
        ("adam-loop", False),
        ("adamw-foreach", False),
        ("adamw-loop", False),
        ("adam-foreach", True),
    ],
)
def test_a_one_off_nan_batch_is_skipped_as_if_it_had_never_been_there(kind, closure):
    grads_after: dict[str, bool] = {}

    def look(step, model):
        if step == BAD:  # .grad given back, as the job left it (NaN): not None
            grads = [p.grad for p in model.parameters()]
            grads_after["kept"] = all(g is not None for g in grads)
            grads_after["nan"] = any(bool(g.isnan().any()) for g in grads if g is not None)

    w, lines = watch(on_nan="skip")
    losses, model, opt = train(kind, batches(), ctx=w, closure=closure, after_step=look)
    ref_losses, ref_model, ref_opt = train(kind, batches()[:BAD] + batches()[BAD + 1 :])

    assert all(bool(p.isfinite().all()) for p in model.parameters())
    assert bits(losses[:BAD] + losses[BAD + 1 :]) == bits(ref_losses)
    assert same_tensors(model.state_dict(), ref_model.state_dict())
    assert same_tensors(opt.state_dict(), ref_opt.state_dict())  # momentum, moments, step
    assert grads_after == {"kept": True, "nan": True}
    (det,) = w.detections
    assert det["step"] == BAD and det["skipped"]
    assert f"torchscope: skipped the update of step {BAD}; training goes on" in lines
    assert lines.index(det["message"]) < lines.index(
        f"torchscope: skipped the update of step {BAD}; training goes on"
    )
    assert (w.refusal.refused, w.step) == (1, STEPS)  # the step counted, its update refused


def test_lbfgs_a_closure_called_several_times_a_step_is_skipped_once():
    w, lines = watch(on_nan="skip")
    losses, model, opt = train("lbfgs", batches(), ctx=w, closure=True)
    ref_losses, ref_model, ref_opt = train(
        "lbfgs", batches()[:BAD] + batches()[BAD + 1 :], closure=True
    )
    assert bits(losses[:BAD] + losses[BAD + 1 :]) == bits(ref_losses)
    assert same_tensors(model.state_dict(), ref_model.state_dict())
    state, ref_state = opt.state_dict()["state"][0], ref_opt.state_dict()["state"][0]
    # LBFGS counts the closure's call before it finds no gradient to follow: only that differs
    assert state.pop("func_evals") == ref_state.pop("func_evals") + 1
    assert same_tensors(state, ref_state)
    assert [line for line in lines if "skipped the update" in line] == [
        f"torchscope: skipped the update of step {BAD}; training goes on"
    ]


def test_bad_steps_in_a_row_are_each_refused_then_the_job_stops():
    """Every step from step 3 goes bad: the check sees one bad stretch (reported once), but
    each of its steps is refused, until the limit; a good step starts the count again."""
    data = batches(12, bad=(1, 3, 4, 5, 6, 7, 8, 9, 10, 11))
    w, lines = watch(on_nan="skip", max_skips=4)
    weights = []

    def keep(step, model):
        weights.append(model[0].weight.detach().clone())

    with pytest.raises(WatchStop) as stop:
        train("adam-foreach", data, ctx=w, after_step=keep)
    assert stop.value.detection["step"] == 7 and stop.value.policy == "skip"
    assert len(weights) == 7  # steps 0-6 ran; step 7 stopped before its update
    assert all(bool(p.isfinite().all()) for p in weights)
    skipped = [line for line in lines if "skipped the update" in line]
    assert [s.split(";")[0].split(":")[1] for s in skipped] == [
        f" skipped the update of step {n}" for n in (1, 3, 4, 5, 6)
    ]
    assert "still NaN/Inf (4 bad steps in a row since step 3" in skipped[-1]
    (limit,) = [line for line in lines if "stopped before the update" in line]
    assert limit.startswith("torchscope: NaN/Inf at step 7, 5 bad steps in a row since step 3")
    assert limit == stop.value.detection["message"]
    assert w.refusal.refused == 5


def test_a_job_that_updates_by_hand_is_not_refused_and_says_so_once():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    w, lines = watch(on_nan="skip")
    with w:
        for x, y in batches(8, bad=(2, 3)):
            model.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            w.before_update()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
    assert [line for line in lines if "cannot refuse" in line] == [
        'torchscope: on_nan="skip" cannot refuse this update: the job makes it in its own '
        'code (no optimizer.step()); it goes on as under "continue"'
    ]
    assert w.refusal.refused == 0


def test_a_nan_the_model_made_under_a_loss_scaler_is_skipped_once():
    """The scaler skips a step with non-finite gradients itself: the watch leaves it to it
    (one skip, said once, counted once), and the job goes on."""
    scaler_cls = getattr(torch.amp, "GradScaler", None)
    if scaler_cls is None:
        pytest.skip("no torch.amp.GradScaler")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = scaler_cls("cpu", init_scale=4.0)
    w, lines = watch(on_nan="skip")
    with w:
        for x, y in batches():
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert all(bool(p.isfinite().all()) for p in model.parameters())
    (det,) = w.detections
    assert det["step"] == BAD and det["skipped"]
    assert [line for line in lines if "skipped" in line] == [
        f"torchscope: skipped the update of step {BAD}; training goes on"
    ]
    assert (w.refusal.refused, w.loss_scaling.overflows, w.step) == (1, 0, STEPS)


def test_bad_options():
    with pytest.raises(ValueError, match="on_nan must be one of continue, pause, stop, skip"):
        NanWatch(on_nan="drop")
    with pytest.raises(ValueError, match="max_skips"):
        NanWatch(on_nan="skip", max_skips=-1)


# -- torchscope run --on-nan skip ------------------------------------------------------------
JOB = """\
import sys
import torch
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
opt = torch.optim.Adam(net.parameters(), lr=0.01)
gen = torch.Generator().manual_seed(1)
data = []
for step in range(STEPS):
    x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)
    if step in BAD:
        x[3, 1] = float("nan")  # a corrupted record
    data.append((x, y))
if "--leave-out" in sys.argv:
    data = [b for i, b in enumerate(data) if i not in BAD]
for step, (x, y) in enumerate(data):
    loss = torch.nn.functional.mse_loss(net(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} {loss.item()!r}", flush=True)
state = opt.state_dict()["state"]
print("final", [p.sum().item() for p in net.parameters()], int(state[0]["step"]), flush=True)
"""


def skip_job(tmp_path: Path, bad: tuple[int, ...], steps: int = STEPS) -> Path:
    script = tmp_path / "train.py"
    script.write_text(JOB.replace("STEPS", str(steps)).replace("BAD", repr(bad)))
    return script


def test_run_on_nan_skip_goes_on_as_if_the_batch_had_been_left_out(tmp_path):
    script = skip_job(tmp_path, (BAD,))
    res = run(
        "run", "--watch", "nan", "--on-nan", "skip", "--record", "w.tsc", str(script), cwd=tmp_path
    )
    ref = run("run", str(script), "--leave-out", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert ref.returncode == 0, ref.stderr
    losses = [line.split()[2] for line in res.stdout.splitlines() if line.startswith("step")]
    ref_losses = [line.split()[2] for line in ref.stdout.splitlines() if line.startswith("step")]
    assert losses[BAD] == "nan"
    assert losses[:BAD] + losses[BAD + 1 :] == ref_losses  # repr: bit-identical floats
    final = [line for line in res.stdout.splitlines() if line.startswith("final")]
    assert final == [line for line in ref.stdout.splitlines() if line.startswith("final")]
    assert f"torchscope: skipped the update of step {BAD}; training goes on" in res.stderr
    assert res.stderr.count("skipped the update") == 1
    history = run("dump", "w.tsc", "--kind", "history", "--format", "jsonl", cwd=tmp_path)
    points = [p for line in history.stdout.splitlines() for p in json.loads(line)["points"]]
    assert [p["step"] for p in points if p.get("skipped")] == [BAD]  # `torchscope history` too


def test_run_on_nan_skip_stops_a_run_that_keeps_going_bad(tmp_path):
    script = skip_job(tmp_path, tuple(range(3, 12)), steps=12)
    res = run(
        "run", "--watch", "nan", "--on-nan", "skip", "--max-skips", "3", str(script), cwd=tmp_path
    )
    assert res.returncode == 3, res.stderr
    assert [line.split()[1] for line in res.stdout.splitlines()] == ["0", "1", "2", "3", "4", "5"]
    assert "4 bad steps in a row since step 3" in res.stderr
    assert "stopped before the update of step 6 (--on-nan skip); exit code 3" in res.stderr
    assert "Traceback" not in res.stderr


def test_run_refuses_max_skips_without_skip(tmp_path):
    script = skip_job(tmp_path, ())
    res = run("run", "--watch", "nan", "--max-skips", "3", str(script), cwd=tmp_path)
    assert res.returncode == 2 and "--max-skips" in res.stderr


def test_watch_pid_on_nan_skip_switches_a_running_job_to_skip(tmp_path):
    """``torchscope watch PID --on-nan skip --max-skips N``: the job, started plainly, waits at
    step 2 until the watch is asked for (a file the test writes), then goes bad from step 4."""
    script = skip_job(tmp_path, tuple(range(4, 12)), steps=12)
    flag = tmp_path / "watching"
    text = script.read_text().replace(
        '    print(f"step {step}',
        f"    while step == 2 and not os.path.exists({str(flag)!r}):\n"
        "        time.sleep(0.01)\n"
        '    print(f"step {step}',
    )
    script.write_text("import os, time\n" + text)
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchscope", "run", str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = ""
        while not line.startswith("step 1 "):
            line = proc.stdout.readline()
            assert line, proc.stderr.read()  # the job ended before it
        res = run("watch", str(proc.pid), "--on-nan", "skip", "--max-skips", "2", cwd=tmp_path)
        assert res.returncode == 0 and "then skip" in res.stdout, res.stderr
        flag.write_text("")
        err = proc.stderr.read()
        assert proc.wait(120) == 3, err
    finally:
        proc.kill()
    assert "skipped the update of step 4; training goes on" in err
    assert "3 bad steps in a row since step 4 (at most 2 updates skipped in a row)" in err
    assert "stopped before the update of step 6 (--on-nan skip); exit code 3" in err


def test_history_table_shows_a_skipped_update_without_a_scaler():
    from torchscope.cli.history import _table

    points = [{"step": 4, "loss": 0.5}, {"step": 5, "loss": float("nan"), "skipped": True}]
    rows = list(_table(points, []))
    assert "UPDATE" in rows[0] and "SCALE" not in rows[0]
    assert "skipped" in rows[2] and "skipped" not in rows[1]
