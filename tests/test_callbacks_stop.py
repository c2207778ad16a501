"""A job that the watch stops (``on_nan="stop"``) ends the same way however it was served:
one line, exit code 3, no traceback. ``torchscope run`` does it itself; a plain script served
by a framework callback (or its own ``serve()``) does it through ``sys.excepthook``, having
run what its exit runs (the recording's index). Other errors keep their traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

JOBS = Path(__file__).parent / "jobs"
STOPPED = 'torchscope: stopped before the update of step 3 (on_nan="stop"); exit code 3'


def start(*args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd
    )


def finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=240)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def origin_of(job: str) -> str:
    """``.../job.py:N``: the line the job marks as its NaN origin."""
    path = JOBS / job
    (n,) = [i for i, s in enumerate(path.read_text().splitlines(), 1) if "# NaN origin" in s]
    return f"{path}:{n}"


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Each framework's job, stopped at its NaN; both at once (each is mostly start-up)."""
    out = tmp_path_factory.mktemp("stopped")
    procs = {}
    if _has("transformers"):
        procs["hf"] = start(str(JOBS / "callback_stop.py"), "hf", str(out), cwd=out)
    if _has("lightning"):
        procs["lightning"] = start(str(JOBS / "callback_stop.py"), "lightning", cwd=out)
    return {name: finish(p) for name, p in procs.items()} | {"out": out}  # type: ignore[dict-item]


def _has(package: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(package) is not None


@pytest.mark.parametrize(
    ("framework", "origin"),
    [("hf", "integration_hf.py"), ("lightning", "lightning_nan.py")],
)
def test_a_callbacks_stop_ends_the_script_as_run_does(stopped, framework, origin):
    if framework not in stopped:
        pytest.skip(f"{framework} is not installed")
    res = stopped[framework]
    assert res.returncode == 3, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    said = [line for line in res.stderr.splitlines() if line.startswith("torchscope")]
    assert said[-1] == STOPPED, res.stderr[-3000:]
    assert [x for x in said if " first appears at step 3 " in x and origin_of(origin) in x]
    assert "the job went on" not in res.stdout


def test_the_stopped_jobs_recording_is_complete(stopped):
    """The exit ran the atexit handlers: the agent closed the file with its index."""
    if "hf" not in stopped:
        pytest.skip("transformers is not installed")
    from torchscope.protocol.tracefile import TraceReader

    with TraceReader(stopped["out"] / "stop.tsc") as reader:
        assert reader.complete


def test_other_errors_keep_their_traceback_and_exit_code(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import torchscope\ntorchscope.serve(quiet=True)\nraise ValueError('own')\n")
    res = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert res.returncode == 1
    assert "Traceback" in res.stderr and "ValueError: own" in res.stderr
