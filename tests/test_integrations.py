"""The training frameworks users run: Lightning and the HF Trainer with ``TorchscopeCallback``,
a plain ``accelerate`` loop under ``torchscope run``.

Each framework's jobs run in as few processes as possible (importing one costs seconds): a job
script (tests/jobs/integration_*.py) runs its plain, dormant and recorded runs one after the
other and prints each run's losses, and the tests compare them.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import torchscope

pytest.importorskip("torch")

JOBS = Path(__file__).parent / "jobs"


def needs(package: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        importlib.util.find_spec(package) is None, reason=f"{package} is not installed"
    )


def results(stdout: str) -> dict[str, dict]:
    """The ``RESULT {json}`` lines of a job, by run name."""
    out = {}
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            run = json.loads(line.removeprefix("RESULT "))
            out[run["run"]] = run
    return out


def torchscope_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torchscope", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=180,
    )


def steps_of(path: Path, op: str) -> Counter:
    """How many times each step ran the op named ``op`` in a recording."""
    return Counter(e.step for e in torchscope.load(path).ops if e.name == op)


def origin_line(script: Path) -> int:
    lines = script.read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if "# NaN origin" in line)


def nan_line(script: Path, step: int, module: str | None = None) -> str:
    """The watch's line; ``module``: the module the op ran in, as the job's code names it."""
    within = f"in {module} " if module else ""
    return (
        f"NaN first appears at step {step} in aten.sqrt.default inside torch.sqrt (forward) "
        f"{within}at {script}:{origin_line(script)} — replayed"
    )


class Job:
    """A job process, started at once, its output in files (several run at the same time)."""

    def __init__(self, argv: list[str], cwd: Path, stdout_pipe: bool = False) -> None:
        self.cwd = cwd
        self.stdout_path, self.stderr_path = cwd / f"{id(self)}.out", cwd / f"{id(self)}.err"
        with self.stdout_path.open("w") as stdout, self.stderr_path.open("w") as stderr:
            self.proc = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE if stdout_pipe else stdout,
                stderr=stderr,
                text=True,
                cwd=cwd,
                env={**os.environ, "OMP_NUM_THREADS": "1"},  # tiny models: threads only contend
            )

    def finish(self, timeout: float = 180) -> subprocess.CompletedProcess:
        try:
            self.proc.wait(timeout=timeout)
        finally:
            self.proc.kill()
        stdout = self.stdout_path.read_text() if self.stdout_path.exists() else ""
        stderr = self.stderr_path.read_text()
        assert self.proc.returncode == 0, f"{self.proc.args}: {stderr}"
        return subprocess.CompletedProcess(self.proc.args, 0, stdout, stderr)


def accelerate_commands(script: str) -> dict[str, list[str]]:
    """The loop with a NaN at step 3: plain; recorded under ``accelerate launch -m torchscope
    run``; watched under ``torchscope run``."""
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes=1"]
    launch += ["--num_machines=1", "--mixed_precision=no", "--dynamo_backend=no"]
    return {
        "plain": [sys.executable, script, "3"],
        "record": [*launch, "-m", "torchscope", "run", "--record", "acc.tsc", script, "3"],
        "watch": [sys.executable, "-m", "torchscope", "run", "--watch", "nan", script, "3"],
    }


# The older package name is tested where it is installed too.
LEGACY = ["legacy"] if importlib.util.find_spec("pytorch_lightning") is not None else []
LIGHTNING_RUNS = ["plain", "dormant", "record", "resumed", *LEGACY, "paced"]
SERVED_LIGHTNING_RUNS = ["dormant", "record", *LEGACY]
HF_RUNS = ["plain", "poisoned", "dormant", "record", "watch"]
FRAMEWORKS = {"lightning": "lightning", "hf": "transformers", "accelerate_runs": "accelerate"}


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory) -> dict[str, Job]:
    """Every framework job the selected tests need, started together (each one spends seconds
    importing its framework: side by side, the file's tests take the time of the slowest)."""
    wanted = {
        name
        for item in request.session.items
        if item.module is request.module
        for name, package in FRAMEWORKS.items()
        if name in item.fixturenames and importlib.util.find_spec(package) is not None
    }
    started: dict[str, Job] = {}
    if "lightning" in wanted:
        out = tmp_path_factory.mktemp("lightning")
        (out / "pace").touch()
        argv = [sys.executable, str(JOBS / "integration_lightning.py"), str(out), *LIGHTNING_RUNS]
        started["lightning"] = Job(argv, out, stdout_pipe=True)
    if "hf" in wanted:
        out = tmp_path_factory.mktemp("hf")
        started["hf"] = Job(
            [sys.executable, str(JOBS / "integration_hf.py"), str(out), *HF_RUNS], out
        )
    if "accelerate_runs" in wanted:
        out = tmp_path_factory.mktemp("accelerate")
        for name, argv in accelerate_commands(str(JOBS / "integration_accelerate.py")).items():
            started[f"accelerate {name}"] = Job(argv, out)
    yield started
    for job in started.values():
        job.proc.kill()


# -- the callbacks' own contract (no framework imported) -------------------------------------


def test_the_callbacks_take_serves_options_and_say_so_for_others():
    from torchscope.integrations._serving import ServedJob
    from torchscope.tracer.options import SERVE_KEYWORDS

    serve_keywords = set(inspect.signature(torchscope.serve).parameters)
    assert set(SERVE_KEYWORDS) == serve_keywords
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'recrod'.*serve\(\)"):
        ServedJob({"recrod": "t.tsc"})


class FakeClock:
    def __init__(self, step: int) -> None:
        self.step = step
        self.boundaries: list[int] = []

    def set_step(self, step: int) -> None:
        self.step = step
        self.boundaries.append(step)


def test_a_served_job_is_renumbered_only_where_the_framework_counts_otherwise(monkeypatch, capsys):
    from types import SimpleNamespace

    from torchscope.integrations._serving import ServedJob
    from torchscope.tracer import agent as agent_mod

    # A job already served (torchscope run): the callback keeps it, switches the watch on,
    # and says which of its options cannot change.
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # the callback chains its own
    watch_requests = []
    running = SimpleNamespace(
        clock=FakeClock(0),
        options=agent_mod.Options(),
        watch_setting=lambda: (None, "continue"),
        request_watch=lambda *args, **kw: watch_requests.append(args),
    )
    monkeypatch.setattr(agent_mod, "_agent", running)
    served = ServedJob({"watch": "nan", "record": "late.tsc"})
    assert served.start(global_step=0) is running
    assert watch_requests == [("nan", "continue")]
    assert "record cannot change while it runs" in capsys.readouterr().err
    served.follow(0)
    served.follow(0)
    assert running.clock.boundaries == []  # equal counts: no second boundary at a step
    served.follow(7)  # resumed, or a second fit() from 0 after this one
    served.follow(7)
    assert running.clock.boundaries == [7]


@pytest.mark.parametrize(
    ("module", "hidden", "message"),
    [
        (
            "torchscope.integrations.lightning",
            ("lightning", "lightning.pytorch", "pytorch_lightning"),
            "torchscope.integrations.lightning needs Lightning: pip install lightning",
        ),
        (
            "torchscope.integrations.pytorch_lightning",
            ("pytorch_lightning",),
            "torchscope.integrations.pytorch_lightning needs pytorch_lightning",
        ),
        (
            "torchscope.integrations.hf",
            ("transformers",),
            "torchscope.integrations.hf needs Hugging Face transformers: pip install transformers",
        ),
    ],
)
def test_a_missing_framework_is_a_one_line_import_error(monkeypatch, module, hidden, message):
    for name in hidden:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(ImportError) as err:
        importlib.import_module(module)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
    assert err.value.__cause__ is None and err.value.__suppress_context__


def test_the_integrations_package_imports_no_framework_and_no_torch():
    code = "import sys, torchscope.integrations; print(sorted({'torch', 'lightning', "
    code += "'pytorch_lightning', 'transformers', 'accelerate'} & set(sys.modules)))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stderr


# -- Lightning -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lightning(jobs):
    """One process: plain, dormant, recorded, resumed and legacy-package runs, then a paced run
    that ``torchscope record PID --next 2`` attaches to."""
    job = jobs["lightning"]
    out, stdout = job.cwd, job.proc.stdout
    assert stdout is not None
    lines = []
    for line in stdout:
        lines.append(line)
        if line.startswith("PACED "):
            break
    else:
        pytest.fail(f"no paced run: {''.join(lines)}{job.stderr_path.read_text()}")
    attach = torchscope_cli(
        "record", str(job.proc.pid), "-o", str(out / "attached.tsc"), "--next", "2", "--quiet",
        cwd=out,
    )  # fmt: skip
    (out / "pace").unlink()  # the paced run stops at its next batch
    lines += stdout.readlines()
    job.finish()
    return {"out": out, "runs": results("".join(lines)), "attach": attach}


@needs("lightning")
def test_lightning_losses_are_bit_identical_with_the_callback_dormant_or_recording(lightning):
    runs = lightning["runs"]
    assert len(runs["plain"]["losses"]) == 12  # 6 steps of 2 micro-batches
    for run in SERVED_LIGHTNING_RUNS:
        assert runs[run]["losses"] == runs["plain"]["losses"], run


@needs("lightning")
def test_lightning_steps_are_numbered_by_the_trainers_global_step(lightning):
    out, runs = lightning["out"], lightning["runs"]
    # The agent counts the optimizer steps Lightning counts (2 backward calls each) ...
    for run in SERVED_LIGHTNING_RUNS:
        assert runs[run]["numbering"] == [[s, s] for s in range(6) for _ in range(2)], run
    # ... and a run resumed at global step 6 is renumbered from there.
    assert runs["resumed"]["numbering"] == [[s, s] for s in range(6, 9) for _ in range(2)]
    mse = "torch.nn.functional.mse_loss"
    assert steps_of(out / "record.tsc", mse) == dict.fromkeys(range(6), 2)
    assert steps_of(out / "resumed.tsc", mse) == dict.fromkeys(range(6, 9), 2)


@needs("lightning")
def test_record_pid_attaches_to_a_job_served_by_the_lightning_callback(lightning):
    attach, runs = lightning["attach"], lightning["runs"]
    assert attach.returncode == 0, attach.stderr
    assert all(g == c for g, c in runs["paced"]["numbering"])
    # Two whole steps, from a step boundary, numbered by the global step (resumed at 6).
    steps = steps_of(lightning["out"] / "attached.tsc", "torch.nn.functional.mse_loss")
    (first, second) = sorted(steps)
    assert first >= 6 and second == first + 1 and set(steps.values()) == {2}


# -- Hugging Face Trainer ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf(jobs):
    """One process: plain, poisoned (a NaN at step 3), dormant, recorded and watched runs."""
    job = jobs["hf"]
    res = job.finish()
    script = JOBS / "integration_hf.py"
    return {"out": job.cwd, "runs": results(res.stdout), "stderr": res.stderr, "script": script}


@needs("transformers")
def test_hf_trainer_losses_are_bit_identical_with_the_callback_dormant_or_recording(hf):
    runs = hf["runs"]
    assert len(runs["plain"]["losses"]) == 12  # 6 steps of 2 micro-batches
    assert runs["dormant"]["losses"] == runs["record"]["losses"] == runs["plain"]["losses"]


@needs("transformers")
def test_hf_trainer_steps_are_numbered_by_the_global_step(hf):
    runs = hf["runs"]
    for run in ("dormant", "record", "watch"):
        assert runs[run]["numbering"] == [[s, s] for s in range(6)], run
    steps = steps_of(hf["out"] / "record.tsc", "torch.nn.functional.cross_entropy")
    assert steps == dict.fromkeys(range(6), 2)


@needs("transformers")
def test_hf_trainer_watch_finds_the_nan_and_changes_nothing(hf):
    runs, stderr = hf["runs"], hf["stderr"]
    assert nan_line(hf["script"], 3, "model.transformer.h.1 (GPT2Block)") in stderr
    assert stderr.count("NaN first appears") == 1
    poisoned = runs["poisoned"]["losses"]
    assert "nan" not in poisoned[:6] and poisoned[6] == "nan"  # step 3's first micro-batch
    assert runs["watch"]["losses"] == poisoned


# -- a plain accelerate loop under torchscope run ---------------------------------------------


@pytest.fixture(scope="module")
def accelerate_runs(jobs):
    done = {name: jobs[f"accelerate {name}"].finish() for name in ("plain", "record", "watch")}
    out = jobs["accelerate plain"].cwd
    return {"out": out, "done": done, "script": JOBS / "integration_accelerate.py"}


@needs("accelerate")
def test_accelerate_loop_is_bit_identical_recorded_or_watched(accelerate_runs):
    done = accelerate_runs["done"]
    plain = done["plain"].stdout
    assert len(plain.splitlines()) == 12 and " nan" in plain  # 6 steps of 2 micro-batches
    assert done["record"].stdout == plain
    assert done["watch"].stdout == plain


@needs("accelerate")
def test_accelerate_loop_is_numbered_by_optimizer_steps_and_its_nan_found(accelerate_runs):
    out, done, script = accelerate_runs["out"], accelerate_runs["done"], accelerate_runs["script"]
    # Two micro-batches (two backward calls) are one step: the update accelerate runs.
    assert steps_of(out / "acc.tsc", "torch.tanh") == dict.fromkeys(range(6), 2)
    alerts = torchscope.load(out / "acc.tsc").alerts
    assert (alerts[0].step, alerts[0].name) == (3, "torch.sqrt")
    assert nan_line(script, 3, "model (Net)") in done["watch"].stderr
