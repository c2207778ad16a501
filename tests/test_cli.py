"""The command line as a user meets it: real subprocesses, real files, real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from torchscope.protocol.tracefile import TraceReader

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "seed_grads.py"


def torchscope(
    *args: str, cwd: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torchscope", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )


def jsonl(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def seed_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("seed") / "seed.tsc"
    res = torchscope("run", "--record", str(path), str(EXAMPLE))
    assert res.returncode == 0, res.stderr
    assert "MulBackward0" in res.stdout  # the example still prints its own table
    return path


def test_run_records_and_dump_jsonl_has_the_schema(seed_trace: Path) -> None:
    res = torchscope("dump", str(seed_trace), "--format", "jsonl")
    assert res.returncode == 0, res.stderr
    events = jsonl(res.stdout)
    kinds = [e["kind"] for e in events]
    assert kinds[0] == "session" and "step" in kinds and "graph" in kinds
    assert all(isinstance(e["seq"], int) and "step" in e for e in events)
    ops = {e["seq"]: e for e in events if e["kind"] == "op"}
    mul = next(e for e in ops.values() if e["name"] == "Tensor.mul")
    assert mul["grad_fn"] == "MulBackward0" and mul["module"] == ""
    assert mul["source"].endswith("seed_grads.py:30")
    assert mul["outputs"][0]["values"] == [4.0]
    grads = {e["node"]: e for e in events if e["kind"] == "grad"}
    assert set(grads) == {"AddBackward0", "DivBackward0", "MulBackward0"}
    assert grads["DivBackward0"]["grad_inputs"][0]["values"] == [0.5]
    assert grads["DivBackward0"]["grad_inputs"][1] is None
    assert grads["MulBackward0"]["grad_outputs"][0]["values"] == [1.0]
    assert ops[grads["MulBackward0"]["op_seq"]]["name"] == "Tensor.mul"
    assert all(g["param"] is None and isinstance(g["node_id"], int) for g in grads.values())


def test_dump_text_filters_by_kind_and_step(seed_trace: Path) -> None:
    res = torchscope("dump", str(seed_trace), "--kind", "grad")
    assert res.returncode == 0
    lines = res.stdout.splitlines()[1:]
    assert len(lines) == 3 and all(" grad " in line for line in lines)
    assert torchscope("dump", str(seed_trace), "--step", "7").stdout.splitlines()[1:] == []


def test_dump_to_a_full_disk_is_one_line(seed_trace: Path) -> None:
    with open("/dev/full", "w") as full:
        res = subprocess.run(
            [sys.executable, "-m", "torchscope", "dump", str(seed_trace)],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    assert res.returncode == 2  # it was a traceback
    assert res.stderr == "torchscope: error: cannot write the output: No space left on device\n"


def test_module_mode_passes_arguments_and_exit_code(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(
        textwrap.dedent(
            """
            import sys, torch
            x = torch.ones(3, requires_grad=True)
            (x * 3).sum().backward()
            print("args", sys.argv[1:])
            sys.exit(3)
            """
        )
    )
    res = torchscope("run", "--record", "t.tsc", "-m", "pkg.train", "--lr", "0.1", cwd=tmp_path)
    assert res.returncode == 3, res.stderr
    assert "args ['--lr', '0.1']" in res.stdout
    events = jsonl(torchscope("dump", str(tmp_path / "t.tsc"), "--format", "jsonl").stdout)
    assert [e["node"] for e in events if e["kind"] == "grad"] == [
        "SumBackward0",
        "MulBackward0",
        "AccumulateGrad",
    ]


def test_script_error_shows_the_user_traceback_only(tmp_path: Path) -> None:
    script = tmp_path / "boom.py"
    script.write_text("def f():\n    raise ValueError('boom')\nf()\n")
    res = torchscope("run", str(script))
    assert res.returncode == 1
    assert "ValueError: boom" in res.stderr and "boom.py" in res.stderr
    assert "runpy" not in res.stderr and "torchscope/cli/" not in res.stderr


def test_a_script_sees_what_python_shows_it(tmp_path: Path) -> None:
    """argv[0] as typed, an absolute __file__, a source loader, its directory first on
    sys.path (not the console script's), and its own excepthook for an uncaught error; a
    directory with __main__.py runs too."""
    (tmp_path / "show.py").write_text(
        textwrap.dedent(
            """
            import os, sys
            def hook(kind, exc, tb):
                print("hook:", kind.__name__, exc, file=sys.stderr)
            sys.excepthook = hook
            print(sys.argv[0], os.path.isabs(__file__), type(__loader__).__name__, __name__)
            print(sys.path[0] == os.path.dirname(os.path.abspath(__file__)))
            raise ValueError("mine")
            """
        )
    )
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__main__.py").write_text("import sys\nprint('app', sys.argv[1:])\n")
    plain = subprocess.run(
        [sys.executable, "show.py"], capture_output=True, text=True, cwd=tmp_path, timeout=60
    )
    res = torchscope("run", "--quiet", "show.py", cwd=tmp_path)
    assert (
        (res.returncode, res.stdout)
        == (plain.returncode, plain.stdout)
        == (
            1,
            "show.py True SourceFileLoader __main__\nTrue\n",
        )
    )
    assert res.stderr == plain.stderr == "hook: ValueError mine\n"
    res = torchscope("run", "--quiet", "app", "x", cwd=tmp_path)
    assert (res.returncode, res.stdout) == (0, "app ['x']\n"), res.stderr


def test_an_empty_script_name_runs_the_directory_as_python_does(tmp_path: Path) -> None:
    # It was taken for no script at all, and the run died in a TypeError of its own.
    (tmp_path / "__main__.py").write_text("print('main ran')\n")
    plain = subprocess.run(
        [sys.executable, ""], capture_output=True, text=True, cwd=tmp_path, timeout=60
    )
    res = torchscope("run", "--quiet", "", cwd=tmp_path)
    assert (res.returncode, res.stdout) == (plain.returncode, plain.stdout) == (0, "main ran\n")


@pytest.mark.parametrize(
    "args, message",
    [
        (["run"], "needs a script"),
        (["run", "--steps", "x-y", "a.py"], "bad step spec"),
        (["run", "--bogus", "a.py"], "unknown option"),
        (["run", "missing.py"], "no such script"),
        (["run", "--values", "many", "a.py"], "whole number"),
        (["dump"], "required"),
        (["dump", "missing.tsc"], "missing.tsc"),
        (["dump", "x.tsc", "--format", "xml"], "invalid choice"),
        (["frobnicate"], "invalid choice"),
        (["run", "--on-nan", "stop", "a.py"], "add --watch nan"),  # it did nothing, silently
        (["run", "--lease", "inf", "a.py"], "--lease must be a number of seconds above 0"),
        (["run", "--break-on", "gradnorm:-1", "a.py"], "gradnorm must be a number above 0"),
        (["record", "1", "--timeout", "-1", "-o", "x.tsc"], "must be more than 0 seconds"),
        (["watch", "1", "--timeout", "0"], "must be more than 0 seconds"),
        (["ls", "--timeout", "nan"], "must be more than 0 seconds"),
        (["export", "x.tsc", "--kind", "grad", "-o", "x.json"], "--format csv or parquet"),
    ],
)
def test_bad_arguments_give_one_line_and_exit_2(
    args: list[str], message: str, tmp_path: Path
) -> None:
    res = torchscope(*args, cwd=tmp_path)
    assert res.returncode == 2
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert message in res.stderr and "Traceback" not in res.stderr


def test_a_double_dash_ends_torchscopes_options(tmp_path: Path) -> None:
    (tmp_path / "-dash.py").write_text("import sys\nprint(sys.argv)\n")
    res = torchscope("run", "--quiet", "--", "-dash.py", "--steps", "3", cwd=tmp_path)
    assert (res.returncode, res.stdout) == (0, "['-dash.py', '--steps', '3']\n"), res.stderr


def test_unwritable_record_path_is_a_usage_error(tmp_path: Path) -> None:
    res = torchscope("run", "--record", str(tmp_path / "no" / "dir" / "t.tsc"), str(EXAMPLE))
    assert res.returncode == 2
    assert "cannot create trace file" in res.stderr and "Traceback" not in res.stderr


def test_corrupt_file_names_the_offset_and_exits_2(seed_trace: Path, tmp_path: Path) -> None:
    data = bytearray(seed_trace.read_bytes())
    with TraceReader(seed_trace) as reader:
        chunk = reader.chunks[0]
    at = chunk.offset + 60  # inside the first chunk's payload
    data[at] ^= 0xFF
    bad = tmp_path / "bad.tsc"
    bad.write_bytes(bytes(data))
    res = torchscope("dump", str(bad))
    assert res.returncode == 2
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in res.stderr
    assert f"offset {chunk.offset}" in err[0]


def test_garbage_file_is_refused_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "notes.tsc"
    bad.write_text("this is not a trace\n" * 10)
    res = torchscope("dump", str(bad))
    assert res.returncode == 2 and "not a torchscope trace file" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


TRAIN_FOREVER = """
import sys, time, torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
step = 0
while True:
    loss = model(torch.randn(4, 8)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(step, time.monotonic(), flush=True)
    step += 1
    time.sleep(0.02)
"""


def test_sigkill_while_recording_leaves_a_readable_file(tmp_path: Path) -> None:
    script = tmp_path / "forever.py"
    script.write_text(TRAIN_FOREVER)
    trace = tmp_path / "t.tsc"
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchscope", "run", "--record", str(trace), str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    printed: list[tuple[int, float]] = []
    assert proc.stdout is not None
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            step, at = proc.stdout.readline().split()
            printed.append((int(step), float(at)))
            if printed[-1][1] - printed[0][1] > 3.0:
                break
    finally:
        killed_at = time.monotonic()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    res = torchscope("dump", str(trace), "--format", "jsonl")
    assert res.returncode == 0, res.stderr
    assert "cut short" in res.stderr and "Traceback" not in res.stderr
    events = jsonl(res.stdout)
    steps_on_disk = {e["step"] for e in events if e["kind"] == "grad"}
    # Chunks reach the disk at least once a second: every step finished 1.5 s before the kill
    # is in the file.
    old_steps = [s for s, at in printed if at < killed_at - 1.5]
    assert old_steps, "the script did not run long enough"
    assert set(old_steps) <= steps_on_disk
    # Alerts are numbered when found, right after the event they name: every other event is
    # in seq order, and no seq repeats.
    seqs = [e["seq"] for e in events if e["kind"] != "alert"]
    assert seqs == sorted(seqs)
    assert len({e["seq"] for e in events}) == len(events)


SLOW_TRAINING = """
import time, torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
print("started", flush=True)
from torchscope.tracer.agent import current_agent
# Trains until it has been traced 20 steps (by `record`), not a fixed 30 steps: on a loaded
# machine `ls` and `record` could start so late that the recording saw only the last few.
traced = 0
for step in range(3000):  # a cap: 5 minutes
    loss = model(torch.randn(4, 8)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(0.1)
    traced += current_agent().tracer is not None  # the step after this one is traced
    if traced > 20:
        break
print("last", step, flush=True)
"""


def test_ls_finds_a_live_run_and_record_captures_it_until_the_end(tmp_path: Path) -> None:
    script = tmp_path / "slow.py"
    script.write_text(SLOW_TRAINING)
    job = subprocess.Popen(
        [sys.executable, "-m", "torchscope", "run", str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert job.stdout is not None and job.stdout.readline().strip() == "started"
        listing = torchscope("ls")
        assert listing.returncode == 0
        lines = listing.stdout.splitlines()
        (at,) = [i for i, line in enumerate(lines) if line.split()[0] == str(job.pid)]
        assert "slow.py" in lines[at] and lines[at + 1].split()[:1] == ["control"]
        assert "ipc://" in lines[at + 1]
        assert all(len(line) <= 80 for line in lines), lines  # no wrap at 80 columns
        out = tmp_path / "live.tsc"
        rec = torchscope("record", str(job.pid), "-o", str(out), "--quiet")
        assert rec.returncode == 0, rec.stderr
        assert job.wait(timeout=60) == 0
        (last,) = [int(line.split()[1]) for line in job.stdout if line.startswith("last ")]
    finally:
        job.kill()
    events = jsonl(torchscope("dump", str(out), "--format", "jsonl").stdout)
    grads = [e for e in events if e["kind"] == "grad"]
    steps = sorted({e["step"] for e in grads})
    # Joined late, then every step to the end.
    assert steps == list(range(last - len(steps) + 1, last + 1)) and len(steps) >= 20
    assert {g["param"] for g in grads if g["node"] == "AccumulateGrad"} == {
        "0.weight",
        "0.bias",
        "2.weight",
        "2.bias",
    }
    seqs = [e["seq"] for e in events if e["kind"] != "alert"]
    assert len(seqs) == len(set(seqs)), "no event recorded twice"


def test_record_unreachable_target_is_one_line(tmp_path: Path) -> None:
    res = torchscope(
        "record",
        "ipc://" + str(tmp_path / "nobody.control"),
        "-o",
        "x.tsc",
        "--timeout",
        "0.3",
        cwd=tmp_path,
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x.tsc").exists()
