"""FSDP2 (``fully_shard``) on 2 gloo ranks: the watch and the recordings on DTensor parameters.

Healthy: no internal error, losses bit-identical to the plain job, AccumulateGrad rows named as
the user wrote the parameters, no stats of FSDP's unfilled buffers. A NaN on rank 1: the watch
stops the job (exit 3) and says which rank made it; a recording holds one origin in the job."""

from __future__ import annotations

from pathlib import Path

import pytest
from ranks import JOBS, ended_well, finish, kill, rank_alerts, torchrun

pytest.importorskip("torch")

JOB = JOBS / "fsdp2_nan.py"
SQRT_LINE = next(
    i for i, line in enumerate(JOB.read_text().splitlines(), 1) if "torch.sqrt" in line
)
SHORT = {"JOB_PG_TIMEOUT": "10"}  # a hang fails fast
BAD = {**SHORT, "JOB_BAD": "1"}


def _losses(out: str) -> list[str]:
    return sorted(line for line in out.splitlines() if line.startswith("rank "))


def _run(tmp: Path, env: dict[str, str], *options: str) -> tuple[int | None, str, str]:
    """The job under ``torchscope run OPTIONS`` (plain without any): (exit code, out, err)."""
    args = ("-m", "torchscope", "run", *options) if options else ()
    proc = torchrun(*args, str(JOB), cwd=tmp, env=env)
    try:
        ((out, err),) = finish(proc, timeout=90)
    finally:
        kill(proc)
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    code, out, err = _run(tmp_path_factory.mktemp("plain"), SHORT)
    assert code == 0 or "terminate called" in err, err[-3000:]
    return _losses(out)


@pytest.mark.parametrize("options", [("--watch", "nan"), ("--record", "t.tsc")])
def test_a_healthy_fsdp2_job_is_unchanged_and_the_tracer_reports_no_error(tmp_path, plain, options):
    proc = torchrun("-m", "torchscope", "run", "--quiet", *options, str(JOB), cwd=tmp_path,
                    env=SHORT)  # fmt: skip
    try:
        ((out, err),) = finish(proc, timeout=90)
    finally:
        kill(proc)
    assert ended_well(proc, err), err[-3000:]
    assert "internal error" not in err, err[-3000:]
    assert _losses(out) == plain  # bit-identical
    if "--record" not in options:
        return
    import torchscope

    for rank in (0, 1):
        trace = torchscope.load(tmp_path / f"t.rank{rank}.tsc")
        assert list(trace.of_kind("alert")) == []
        names = {e.get("param") for e in trace.events if e.get("node") == "AccumulateGrad"}
        assert {"layers.0.fc.weight", "layers.2.norm.bias", "head.weight"} <= names, names
        for e in trace.events:  # FSDP's unfilled buffers: no stats, so no garbage ones
            for side in ("inputs", "outputs", "grad_inputs", "grad_outputs"):
                for s in e.get(side) or []:
                    stats = (s or {}).get("stats") or {}
                    assert not stats.get("nan") and not stats.get("inf"), (e["name"], s)
                    assert (stats.get("norm") or 0.0) < 1e30, (e.get("name"), s)


def test_the_watch_stops_a_nan_on_one_rank_and_says_which_rank_made_it(tmp_path):
    code, out, err = _run(tmp_path, BAD, "--watch", "nan", "--on-nan", "stop")
    assert code != 0 and "exitcode  : 3" in err, err[-3000:]
    assert "internal error" not in err, err[-3000:]
    assert "rank 1 step 6" not in out  # stopped before the bad update
    # Every rank replays the step together (the same all-gathers in the same order): the rank
    # that made it names the op, the line and the module.
    (made,) = [line for line in err.splitlines() if line.startswith("torchscope[rank 1]: NaN")]
    assert made.startswith(
        "torchscope[rank 1]: NaN first appears at step 6 in aten.sqrt.default inside torch.sqrt "
        "(forward) in model.layers.1 (Block) at "
    ) and made.endswith(f"fsdp2_nan.py:{SQRT_LINE} — replayed"), made
    assert "torchscope[rank 1]: waiting up to 5 s for every rank to replay step 6 together" in err
    assert "to name its op and line" not in err


def test_a_nan_made_by_one_ranks_loop_code_is_named_at_its_op_and_line(tmp_path):
    """The loop's code is recorded as it runs on each rank: no replay (and no collective) is
    needed to name it on the rank that made it."""
    code, out, err = _run(tmp_path, {**SHORT, "JOB_BAD": "loop"}, "--watch", "nan", "--on-nan",
                          "stop")  # fmt: skip
    assert code != 0 and "exitcode  : 3" in err, err[-3000:]
    assert "internal error" not in err, err[-3000:]
    assert "rank 1 step 6" not in out  # stopped before the bad update
    line = next(i for i, s in enumerate(JOB.read_text().splitlines(), 1) if "sqrt(loss" in s)
    (made,) = [s for s in err.splitlines() if s.startswith("torchscope[rank 1]: NaN")]
    assert (
        made.startswith(
            f"torchscope[rank 1]: NaN first appears at step 6 in torch.sqrt (forward) at "
            f"fsdp2_nan.py:{line}, in the training loop's code"
        )
        or f"/fsdp2_nan.py:{line}, in the training loop's code" in made
    ), made


def test_the_watch_on_the_other_rank_says_the_nan_came_through_the_reduce_scatter(tmp_path):
    # Not under "stop": there torchrun ends this rank as soon as rank 1 stops, which on a
    # loaded machine can come before this rank's own check has said anything.
    _, _, err = _run(tmp_path, BAD, "--watch", "nan")
    assert "internal error" not in err, err[-3000:]
    (came,) = [s for s in err.splitlines() if s.startswith("torchscope[rank 0]: NaN in")]
    assert came.startswith(
        "torchscope[rank 0]: NaN in the gradients at step 6 came from another rank through "
        "FSDP's gradient reduce-scatter"
    ), came


def test_under_skip_both_ranks_refuse_the_update_and_train_on_as_if_it_was_left_out(tmp_path):
    """The replay runs FSDP's forward on both ranks and reshards after it: the steps after the
    skipped one are bit-identical to a job that made no update at that step."""
    for name in ("plain", "skip"):
        (tmp_path / name).mkdir()
    _, left_out, err = _run(tmp_path / "plain", {**SHORT, "JOB_LEAVE_OUT": "6", "JOB_STEPS": "9"})
    code, out, err = _run(tmp_path / "skip", {**BAD, "JOB_STEPS": "9"}, "--watch", "nan",
                          "--on-nan", "skip")  # fmt: skip
    assert code == 0 and "internal error" not in err, err[-3000:]
    after = [line for line in _losses(out) if int(line.split()[3]) > 6]
    assert after == [line for line in _losses(left_out) if int(line.split()[3]) > 6]
    assert len(after) == 4  # steps 7 and 8 on both ranks
    for rank in (0, 1):
        assert f"torchscope[rank {rank}]: skipped the update of step 6; training goes on" in err


def test_a_recording_holds_one_origin_in_the_job_on_the_rank_that_made_it(tmp_path):
    from torchscope.analysis.trace import CONSEQUENCES, job_origins

    _, _, err = _run(tmp_path, BAD, "--quiet", "--record", "t.tsc")
    assert "internal error" not in err, err[-3000:]
    alerts = rank_alerts(lambda r: tmp_path / f"t.rank{r}.tsc")
    own = {r: [a for a in alerts[r] if a["where"] != CONSEQUENCES] for r in (0, 1)}
    (origin,) = own[1]  # no arrival back on the rank that made it
    assert origin["name"] == "torch.sqrt" and origin["step"] == 6
    assert origin["source"].endswith(f"fsdp2_nan.py:{SQRT_LINE}")
    assert all(a.get("arrival") for a in own[0]), [a["message"] for a in own[0]]
    assert not any("outside the traced ops" in a["message"] for r in (0, 1) for a in own[r])
    assert len(job_origins(alerts)) == 1
