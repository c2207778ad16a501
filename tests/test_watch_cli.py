"""The NaN watch as users run it: ``torchscope run --watch``, ``serve(watch=...)``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

# A model whose forward makes a NaN at step 3 (sqrt of a negative, inside a module).
JOB = """\
import torch
PRELUDE
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 8)
        self.b = torch.nn.Linear(8, 1)
        self.drop = torch.nn.Dropout(0.2)

    def forward(self, x, bad):
        h = self.drop(torch.tanh(self.a(x)))
        if bad:
            h = torch.sqrt(h - 2.0)  # NaN origin
        return self.b(h)

torch.manual_seed(0)
net = Net()
opt = torch.optim.SGD(net.parameters(), lr=0.1)
gen = torch.Generator().manual_seed(1)
for step in range(STEPS):
    loss = net(torch.randn(8, 4, generator=gen), step == BAD).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} {loss.item()!r}", flush=True)
"""


def job(tmp_path: Path, bad: int = 3, steps: int = 6, prelude: str = "") -> Path:
    script = tmp_path / "train.py"
    script.write_text(
        JOB.replace("PRELUDE", prelude).replace("STEPS", str(steps)).replace("BAD", str(bad))
    )
    return script


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torchscope", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=180,
    )


def events(path: Path, cwd: Path) -> list[dict]:
    res = run("dump", str(path), "--format", "jsonl", cwd=cwd)
    assert res.returncode == 0, res.stderr
    return [json.loads(line) for line in res.stdout.splitlines()]


def test_watch_names_the_same_origin_as_full_tracing_and_records_the_replay(tmp_path):
    script = job(tmp_path)
    full = run("run", "--record", "full.tsc", str(script), cwd=tmp_path)
    watched = run("run", "--watch", "nan", "--record", "w.tsc", str(script), cwd=tmp_path)
    assert full.returncode == watched.returncode == 0, watched.stderr
    (origin,) = [e for e in events(tmp_path / "full.tsc", tmp_path) if e["kind"] == "alert"][:1]
    replay = events(tmp_path / "w.tsc", tmp_path)
    alerts = [e for e in replay if e["kind"] == "alert"]
    assert alerts and all(e.get("replay") for e in alerts)
    assert (
        (alerts[0]["name"], alerts[0]["source"], alerts[0]["step"])
        == (
            origin["name"],
            origin["source"],
            origin["step"],
        )
        == ("torch.sqrt", f"{script}:13", 3)
    )
    assert {e["step"] for e in replay if e["kind"] == "op"} == {3}  # only the bad step traced
    line = (
        "NaN first appears at step 3 in aten.sqrt.default inside torch.sqrt (forward) "
        f"in net (Net) at {script}:13 — replayed"
    )
    assert line in watched.stderr.replace("train.py:13", f"{script}:13")
    # The watch changes nothing: the same losses as untraced, NaN steps included.
    plain = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert watched.stdout == plain.stdout


def test_on_nan_stop_exits_3_before_the_update_with_a_complete_file(tmp_path):
    script = job(tmp_path)
    res = run(
        "run", "--watch", "nan", "--on-nan", "stop", "--record", "w.tsc", str(script), cwd=tmp_path
    )
    assert res.returncode == 3, res.stderr
    assert "stopped before the update of step 3 (--on-nan stop)" in res.stderr
    assert "step 3 " not in res.stdout and "step 2 " in res.stdout
    assert any(e["kind"] == "alert" for e in events(tmp_path / "w.tsc", tmp_path))


def test_a_watched_job_that_never_goes_nan_is_bit_identical_and_says_nothing(tmp_path):
    script = job(tmp_path, bad=-1, steps=8)
    watched = run("run", "--watch", "gradnorm:1e6", str(script), cwd=tmp_path)
    plain = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert watched.returncode == 0 and watched.stdout == plain.stdout
    assert "NaN" not in watched.stderr and "gradient norm" not in watched.stderr


def test_serve_watch_in_a_plain_python_job(tmp_path):
    script = job(tmp_path, prelude="import torchscope\ntorchscope.serve(watch='nan')\n")
    res = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert res.returncode == 0, res.stderr
    assert (
        "NaN first appears at step 3 in aten.sqrt.default inside torch.sqrt (forward)" in res.stderr
    )


def test_bad_watch_options_are_one_line(tmp_path):
    for args, needle in (
        (["--watch", "nan,bogus"], "bad watch 'bogus'"),
        (["--watch", "gradnorm:-1"], "gradnorm:X needs a number above 0"),
        (["--on-nan", "explode"], "--on-nan takes continue, pause, stop"),
    ):
        res = run("run", *args, "x.py", cwd=tmp_path)
        assert res.returncode == 2 and needle in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1


def test_ddp_two_ranks_each_rank_reports_what_its_own_replay_found(tmp_path):
    """The replay runs the module inside DDP (no collectives); the rank that made the NaN
    names it, the other says its replay is finite and where to look."""
    from ranks import NAN_JOB, NAN_LINE, ended_well, torchrun

    proc = torchrun("-m", "torchscope", "run", "--watch", "nan", str(NAN_JOB), cwd=tmp_path)
    stdout, stderr = proc.communicate(timeout=120)
    res = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert ended_well(proc, stderr), res.stderr[-3000:]  # or gloo's abort at exit
    err = res.stderr
    (line,) = [x for x in err.splitlines() if x.startswith("torchscope[rank 1]: NaN first")]
    assert line.startswith(
        "torchscope[rank 1]: NaN first appears at step 3 in aten.sqrt.default inside "
        "torch.sqrt (forward)"
    )
    assert line.endswith(f"ddp_nan.py:{NAN_LINE} — replayed")
    assert (
        "torchscope[rank 0]: NaN in the gradients at step 3, but the replay did not reproduce"
        in err
        and "came from another rank" in err
    )
    assert sum(1 for line in res.stdout.splitlines() if line.endswith("step 5 nan")) == 2, err


def test_the_watch_switched_on_from_outside_on_a_dormant_job(tmp_path):
    """``torchscope watch PID`` on a job started plainly: it watches from its next step."""
    script = job(tmp_path, bad=40, steps=60, prelude="import time")
    script.write_text(script.read_text().replace("flush=True)", "flush=True); time.sleep(0.03)"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchscope", "run", str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        while not proc.stdout.readline().startswith("step 5 "):
            pass
        res = run("watch", str(proc.pid), cwd=tmp_path)
        assert res.returncode == 0 and "watches every step" in res.stdout, res.stderr
        out = proc.stdout.read()
        err = proc.stderr.read()
        assert proc.wait(60) == 0, err
    finally:
        proc.kill()
    assert "watching every step from step" in err
    assert "NaN first appears at step 40 in aten.sqrt.default inside torch.sqrt (forward)" in err
    assert "step 59 nan" in out
    bad = run("watch", str(proc.pid), "--spec", "nope", cwd=tmp_path)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_a_bad_watch_is_named_once():
    from torchscope.tracer.steps import StepSpecError, parse_watch

    for spec, said in (("nann", "bad watch 'nann': use"), ("nan,bogus", "'bogus' in 'nan,bogus'")):
        with pytest.raises(StepSpecError) as err:
            parse_watch(spec)
        assert said in str(err.value)
        assert str(err.value).count("nann") <= 1
