"""Two ranks (gloo, CPU) under torchrun: one file per rank, collectives recorded with their
real results, DDP's averaged gradients beside each rank's local ones."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from ranks import (
    JOBS,
    NAN_JOB,
    STEADY_JOB,
    Output,
    ended_well,
    finish,
    job_ranks,
    kill,
    torchrun,
)

pytest.importorskip("torch")

JOB = JOBS / "ddp_collectives.py"
# The reference runs (the same jobs without torchscope, for their losses) need no short
# process-group timeout: a busy host must not fail them.
REFERENCE = {"JOB_PG_TIMEOUT": "60"}
# The traced jobs that a UI holds paused: a 3 s process-group timeout, and a hold well past it.
SHORT = {"JOB_PG_TIMEOUT": "3"}
HOLD = 5.0


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    tmp = tmp_path_factory.mktemp("ddp")
    proc = torchrun("-m", "torchscope", "run", "--quiet", "--record", "t.tsc", str(JOB), cwd=tmp)
    stdout, stderr = proc.communicate(timeout=120)
    res = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert res.returncode == 0, res.stderr[-3000:]
    printed = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    return tmp, printed


def events(tmp: Path, rank: int) -> list[dict]:
    import torchscope

    return [dict(e) for e in torchscope.load(tmp / f"t.rank{rank}.tsc").events]


def test_each_rank_records_its_own_file_named_by_rank(recorded) -> None:
    tmp, _ = recorded
    assert sorted(p.name for p in tmp.glob("*.tsc")) == ["t.rank0.tsc", "t.rank1.tsc"]
    for rank in (0, 1):
        (session,) = [e for e in events(tmp, rank) if e["kind"] == "session"]
        assert (session["rank"], session["world_size"], session["local_rank"]) == (rank, 2, rank)
        assert session["host"] and session["record"].endswith(f"t.rank{rank}.tsc")


def test_collectives_are_ops_with_their_real_results(recorded) -> None:
    tmp, _ = recorded
    for rank in (0, 1):
        ops = [e for e in events(tmp, rank) if e["kind"] == "op"]
        reduce = [
            o
            for o in ops
            if o["name"] == "torch.distributed.all_reduce" and o["inputs"][0]["shape"] == [5]
        ]
        assert reduce and all(o["outputs"][0]["stats"]["mean"] == 3.0 for o in reduce)
        assert all(o["group_size"] == 2 for o in reduce)
        # The op after all_reduce reads the reduced value, not the one from before it.
        after = [ops[ops.index(o) + 1] for o in reduce]
        assert all(
            o["name"] == "Tensor.add" and o["inputs"][0]["stats"]["mean"] == 3.0 for o in after
        )
        gather = [o for o in ops if o["name"] == "torch.distributed.all_gather"]
        assert all([s["stats"]["mean"] for s in o["outputs"]] == [0.0, 1.0] for o in gather)
        bcast = [o for o in ops if o["name"] == "torch.distributed.broadcast"]
        assert bcast and all(o["outputs"][0]["stats"]["mean"] == 7.0 for o in bcast)


def test_ddp_synced_gradients_are_the_mean_of_the_ranks_local_ones(recorded) -> None:
    tmp, printed = recorded
    local = {}
    synced = {}
    for rank in (0, 1):
        for e in events(tmp, rank):
            if e["kind"] == "grad" and e["node"] == "AccumulateGrad":
                local[(rank, e["step"], e["param"])] = e["grad_outputs"][0]["stats"]["mean"]
            elif e["kind"] == "op" and e["name"] == "torch.distributed.ddp_gradient_sync":
                for s in e["outputs"]:
                    synced[(rank, e["step"], s["param"])] = s["stats"]["mean"]
    assert len(synced) == 2 * 3 * 4  # 2 ranks, 3 steps, 4 parameters
    for (rank, step, param), mean in synced.items():
        expected = (local[(0, step, param)] + local[(1, step, param)]) / 2
        assert mean == pytest.approx(expected, rel=1e-5, abs=1e-7)
        (truth,) = [p for p in printed if p["rank"] == rank and p["step"] == step]
        assert mean == pytest.approx(truth["synced"][param], rel=1e-6, abs=1e-8)
        assert synced[(0, step, param)] == synced[(1, step, param)]  # the ranks agree


def test_a_nan_made_on_one_rank_is_reported_where_it_arrives_with_that_ranks_origin(
    recorded,
) -> None:
    tmp, _ = recorded
    alerts = {
        r: [e for e in events(tmp, r) if e["kind"] == "alert" and e["where"] != "ranks"]
        for r in (0, 1)
    }
    assert [(a["step"], a["name"]) for a in alerts[1]][:1] == [(2, "Tensor.__setitem__")]
    (arrived,) = [a for a in alerts[0] if "arrives through" in a["message"]]
    assert arrived["step"] == 2
    assert arrived["message"].startswith(
        "NaN arrives through torch.distributed.all_reduce from another rank"
    )
    (origin,) = [a for a in alerts[0] if a.get("where") == "rank"]
    assert origin["step"] == 2 and origin["name"] == "rank 1"
    assert origin["message"].startswith(
        "the NaN that arrived here at step 2 was made on rank 1: NaN first appears in "
        "Tensor.__setitem__ (forward) at "
    )


def test_ddp_replicas_that_drift_apart_are_an_alert_on_both_ranks(recorded) -> None:
    tmp, _ = recorded
    for rank, other in ((0, 1), (1, 0)):
        drift = [e for e in events(tmp, rank) if e["kind"] == "alert" and e["where"] == "ranks"]
        # Changed after step 2 began (after the update that opened it): seen at step 3's.
        assert [(a["step"], a["name"]) for a in drift] == [(3, f"rank {other}")], drift
        assert drift[0]["message"].startswith(
            "DDP replicas differ at the start of step 3: module.0.weight on this rank"
        )


def test_a_ui_holds_one_rank_paused_past_the_process_group_timeout_and_no_rank_dies(tmp_path):
    """Rank 1 stops at its NaN; a UI holds it for 5 s against a 3 s process-group timeout.
    Rank 0 waits before its backward (in Python, not in the all-reduce) and says so; after
    continue both ranks finish, with the losses of the same job run without torchscope."""
    import time

    from torchscope.protocol.client import SessionClient

    job = torchrun(
        "-m",
        "torchscope",
        "run",
        "--break-on",
        "nan,step:3",
        "--lease",
        "3",
        str(NAN_JOB),
        cwd=tmp_path,
        env=SHORT,
    )
    plain = None
    try:
        deadline = time.monotonic() + 60
        rank1 = job_ranks(job, deadline)[1]
        with SessionClient() as ui:
            ui.connect(rank1, timeout=10)
            ui.request("arm")  # as the UI does: this client is there
            while ui.request("state")["state"]["paused"] is None:
                assert time.monotonic() < deadline, "rank 1 did not pause at its NaN"
                time.sleep(0.05)
            held = time.monotonic()
            # The same job without torchscope, meanwhile: started now that the traced ranks
            # wait (not competing with their start for the CPU), with no short timeout.
            plain = torchrun(str(NAN_JOB), cwd=tmp_path, env=REFERENCE)
            while time.monotonic() - held < HOLD:  # past the group's timeout
                ui.request("ping")
                time.sleep(0.5)
            assert ui.request("state")["state"]["paused"] is not None
            ui.request("continue")
            ui.request("disarm")
        (out, err), (plain_out, plain_err) = finish(job, plain)
    finally:
        kill(job, plain)
    assert ended_well(job, err), err[-3000:]
    assert (
        "torchscope[rank 0]: waiting before Tensor.backward() at step 3 for the other ranks" in err
    )
    assert ended_well(plain, plain_err), plain_err[-2000:]
    assert sorted(out.splitlines()) == sorted(plain_out.splitlines())  # bit-identical losses


def test_a_ui_on_every_rank_arms_them_together_and_a_pause_on_one_kills_neither(tmp_path):
    """A dormant torchrun job: `ls` shows its ranks as one job; a UI on each rank arms them
    (they agree on the steps they meet in); a breakpoint on rank 1 holds it for 5 s against
    a 3 s process-group timeout; rank 0 waits before its backward and says so; after
    continue and disarm both finish, with the losses of the job run without torchscope."""
    import time

    from torchscope.protocol import endpoints as ep
    from torchscope.protocol.client import SessionClient, SessionRefused

    # Steps of 0.1 s until the pause is over (time for the UIs to attach), then at full speed.
    pace = tmp_path / "pace"
    pace.touch()
    job = torchrun(
        "-m", "torchscope", "run", "--lease", "3", str(STEADY_JOB),
        cwd=tmp_path, env={"JOB_PACE_FILE": str(pace), **SHORT},
    )  # fmt: skip
    plain = None
    try:
        deadline = time.monotonic() + 60
        ranks = job_ranks(job, deadline)
        assert [r.rank for r in ranks] == [0, 1] and ranks[0].job == ranks[1].job
        ls = subprocess.run(
            [sys.executable, "-m", "torchscope", "ls"], capture_output=True, text=True, timeout=30
        )
        assert f"job {ranks[0].job} · 2 of 2 ranks here" in ls.stdout, ls.stdout
        with SessionClient() as ui0, SessionClient() as ui1:
            ui0.connect(ranks[0], timeout=10)
            hello = ui1.connect(ranks[1], timeout=10)
            # Found through the job too (its c10d store), as a UI on another host would.
            while True:  # each rank registers at its first step boundary
                try:
                    listed = [ep.SessionRecord.from_dict(r) for r in ui1.request("ranks")["ranks"]]
                    break
                except SessionRefused:
                    assert time.monotonic() < deadline, "the ranks never all registered"
                    time.sleep(0.1)
            assert [(r.rank, r.pid, r.control) for r in listed] == [
                (r.rank, r.pid, r.control) for r in ranks
            ]
            ui0.request("arm")
            ui1.request("arm")
            at = int(hello["step"]) + 6
            ui1.request("break_add", step=at, op="^Tensor.pow$")
            while ui1.request("state")["state"]["paused"] is None:
                assert time.monotonic() < deadline, "rank 1 did not pause at its breakpoint"
                ui0.request("ping")
                time.sleep(0.05)
            held = time.monotonic()
            # The same job without torchscope, meanwhile: started now that the traced ranks
            # wait (not competing with them for the CPU before), with no short timeout.
            plain = torchrun(str(STEADY_JOB), cwd=tmp_path, env={"JOB_SLEEP": "0", **REFERENCE})
            while time.monotonic() - held < HOLD:  # past the group's timeout
                ui0.request("ping")
                ui1.request("ping")
                time.sleep(0.5)
            state = ui1.request("state")["state"]
            assert state["paused"] is not None
            # What the UI shows a pause against: the group's timeout, the pause's age, the lease.
            assert state["pg_timeout_s"] == 3.0 and state["paused_s"] >= HOLD, state
            assert state["lease_s"] == 3.0
            pace.unlink()  # the rest of the job need not wait
            ui1.request("continue")
            ui0.request("disarm")
            ui1.request("disarm")
        (out, err), (plain_out, plain_err) = finish(job, plain)
    finally:
        kill(job, plain)
    assert ended_well(job, err), err[-3000:]
    assert "ranks traced from step" in err, err[-3000:]
    assert f"torchscope[rank 0]: waiting before Tensor.backward() at step {at}" in err, err[-3000:]
    assert ended_well(plain, plain_err), plain_err[-2000:]
    assert sorted(out.splitlines()) == sorted(plain_out.splitlines())  # bit-identical losses


def test_wait_holds_every_rank_until_one_ui_reaches_the_job(tmp_path):
    """`run --wait` under torchrun: every rank waits (saying so) before its first op; a UI on
    rank 1 alone lets both go, so rank 0 does not leave rank 1 alone in DDP's constructor."""
    import time

    from torchscope.protocol.client import SessionClient

    job = torchrun(
        "-m", "torchscope", "run", "--wait", "--lease", "3", str(STEADY_JOB),
        cwd=tmp_path, env={"JOB_SLEEP": "0", "JOB_STEPS": "6"},
    )  # fmt: skip
    output = Output(job)
    waiting = [
        f"torchscope[rank {rank}]: waiting for a UI (on any rank of this job) before the "
        "first op (--wait)"
        for rank in (0, 1)
    ]
    try:
        deadline = time.monotonic() + 60
        rank1 = job_ranks(job, deadline)[1]
        output.wait_for(
            lambda: all(line in output.err for line in waiting), deadline, "a rank did not wait"
        )
        assert not any(line.startswith("rank ") for line in output.out.splitlines())  # no step
        with SessionClient() as ui:
            ui.connect(rank1, timeout=10)
            ui.request("arm")
            while job.poll() is None:
                assert time.monotonic() < deadline, "the job did not finish"
                with contextlib.suppress(Exception):
                    ui.request("ping")
                time.sleep(0.1)
        out, err = output.finish(timeout=30)
    finally:
        job.kill()
    assert ended_well(job, err), err[-3000:]
    assert "torchscope[rank 0]: a UI reached another rank of this job: going on" in err
    assert sum(line.startswith("rank ") for line in out.splitlines()) == 12  # 2 ranks x 6


def test_fsdp2_shards_of_the_synced_gradients_are_recorded_and_buffers_raise_no_alert(tmp_path):
    """fully_shard on 2 gloo ranks: after each backward every parameter's gradient shard
    (reduce-scattered: what this rank's optimizer uses) is recorded; FSDP's uninitialised
    all-gather buffers are not NaN origins; the losses are those of the untraced job."""
    job = JOBS / "fsdp2.py"
    traced = torchrun("-m", "torchscope", "run", "--quiet", "--record", "t.tsc", str(job),
                      cwd=tmp_path)  # fmt: skip
    plain = torchrun(str(job), cwd=tmp_path)
    try:
        (out, err), (plain_out, plain_err) = finish(traced, plain, timeout=120)
    finally:
        kill(traced, plain)
    assert ended_well(traced, err), err[-3000:]
    assert ended_well(plain, plain_err), plain_err[-3000:]
    printed = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert sorted(out.splitlines()) == sorted(plain_out.splitlines())  # bit-identical
    for rank in (0, 1):
        evs = events(tmp_path, rank)
        assert [e for e in evs if e["kind"] == "alert"] == []
        syncs = [e for e in evs if e.get("name") == "torch.distributed.fsdp_gradient_sync"]
        assert [e["step"] for e in syncs] == [0, 1, 2]
        for e in syncs:
            (truth,) = [p for p in printed if p["rank"] == rank and p["step"] == e["step"]]
            norms = {s["param"]: s["stats"]["norm"] for s in e["outputs"]}
            assert norms == pytest.approx(truth["shards"], rel=1e-5)


def test_a_rank_armed_alone_waits_for_the_others_well_under_the_group_timeout(monkeypatch):
    """`record PID` (or a UI) on one rank of a dormant job: the other ranks never answer and go
    on into the step's all-reduce. The armed rank's wait for them must end before that
    collective times out (it waited 10 s against a 5 s timeout, and the job died)."""
    import time

    import torch.distributed as dist

    from torchscope.tracer import ranks

    monkeypatch.setattr(ranks, "pg_timeout_seconds", lambda: 1.5)
    said: list[str] = []
    periods = ranks.AgreedPeriods(dist.HashStore(), 0, 2, said.append)
    assert periods.at_boundary(10, wanted=True) is False  # proposes step 12
    assert periods.at_boundary(11, wanted=True) is False
    t0 = time.monotonic()
    assert periods.at_boundary(12, wanted=True) is False  # nobody else came: not gated
    assert time.monotonic() - t0 < 1.0  # a third of the group's timeout, not 10 s
