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
    ONE_NAN_JOB,
    STEADY_JOB,
    Output,
    bad_line,
    ended_well,
    finish,
    job_ranks,
    kill,
    rank_alerts,
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
    assert ended_well(proc, stderr), res.stderr[-3000:]  # or gloo's abort at exit
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
    assert arrived["step"] == 2 and arrived["where"] == "arrival"
    assert arrived["message"].startswith(
        "NaN arrives through torch.distributed.all_reduce from another rank"
    )
    assert "origin" not in arrived  # never an origin of rank 0's own
    (link,) = [a for a in alerts[0] if a.get("from_rank") is not None]
    assert link["step"] == 2 and link["name"] == "rank 1" and link["arrival"] == arrived["arrival"]
    (made,) = [a for a in alerts[1] if a.get("origin") and a["where"] != "consequences"]
    assert link["linked_origin"] == made["origin"]
    assert link["message"] == f"NaN arrived from rank 1: {made['message']}"
    assert made["message"].startswith("NaN first appears in Tensor.__setitem__ (forward) at ")


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
            ui.connect(rank1, timeout=30)
            ui.request("arm")  # as the UI does: this client is there
            while ui.request("state")["state"]["paused"] is None:
                assert time.monotonic() < deadline, "rank 1 did not pause at its NaN"
                time.sleep(0.05)
            held = time.monotonic()
            # The same job without torchscope, meanwhile: started now that the traced ranks
            # wait (not competing with their start for the CPU), with no short timeout.
            plain = torchrun(str(NAN_JOB), cwd=tmp_path, env=REFERENCE)
            # A fixed time, on purpose: the pause must outlast the process group's timeout,
            # a real-time clock inside the other rank's collective (another process): no
            # condition of ours can stand for it.
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
            ui0.connect(ranks[0], timeout=30)
            hello = ui1.connect(ranks[1], timeout=30)
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
            # A fixed time, on purpose: the pause outlasts the process group's timeout (a
            # real-time clock in the ranks' collectives, other processes)
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


def test_a_pause_asked_of_every_rank_stops_the_one_waiting_for_a_paused_rank(tmp_path):
    """What the UI's space does on a job: a pause to every rank. Rank 1 stops first (here at a
    breakpoint); rank 0 then reaches no op until rank 1 goes on, as it waits for it before
    its backward. The pause stops it there, in that wait; continue lets both finish."""
    import time

    from torchscope.protocol.client import SessionClient

    pace = tmp_path / "pace"  # steps of 0.1 s until the pauses are over
    pace.touch()
    job = torchrun(
        "-m", "torchscope", "run", "--record", "t.tsc", "--lease", "30", str(STEADY_JOB),
        cwd=tmp_path, env={"JOB_PACE_FILE": str(pace), "JOB_PG_TIMEOUT": "30"},
    )  # fmt: skip
    output = Output(job)
    try:
        deadline = time.monotonic() + 90
        ranks = job_ranks(job, deadline)
        with SessionClient() as ui0, SessionClient() as ui1:
            ui0.connect(ranks[0], timeout=30)
            at = int(ui1.connect(ranks[1], timeout=30)["step"]) + 3
            ui1.request("break_add", step=at, op="^Tensor.pow$")
            waiting = f"torchscope[rank 0]: waiting before Tensor.backward() at step {at}"
            output.wait_for(lambda: waiting in output.err, deadline, "rank 0 never waited")
            ui0.request("pause")
            ui1.request("pause")  # paused already: nothing changes
            while (paused := ui0.request("state")["state"]["paused"]) is None:
                assert time.monotonic() < deadline, "rank 0 did not pause in its wait"
                ui1.request("ping")  # rank 1's pause stays held (its lease)
                time.sleep(0.05)
            assert paused["phase"] == "before" and paused["by"] == "a UI", paused
            event = paused["event"]
            assert (event["name"], event["step"]) == ("Tensor.backward", at), event
            assert event["source"].endswith("ddp_steady.py:26"), event
            assert ui1.request("state")["state"]["paused"]["event"]["name"] == "Tensor.pow"
            pace.unlink()
            for ui in (ui0, ui1):
                ui.request("continue")
        out, err = output.finish(timeout=90)
    finally:
        kill(job)
    assert ended_well(job, err), err[-3000:]
    assert f"all 2 ranks reached Tensor.backward() at step {at}; going on" in err, err[-3000:]
    steps = [line for line in out.splitlines() if line.startswith("rank ")]
    assert len(steps) == 2 * 40, out[-2000:]


class _Store:
    """A c10d store's ``add`` on one key, as this rank's meeting sees it."""

    def __init__(self) -> None:
        self.count = 0
        self.looks = 0

    def add(self, key: str, n: int) -> int:
        self.count += n
        self.looks += n == 0
        return self.count


class _Pause:
    """A UI's pause at the meeting: ``asked()`` from the ``at``-th look on, until it held."""

    def __init__(self, store: _Store, at: int, other_comes_while: str) -> None:
        self.store, self.at, self.other_comes_while = store, at, other_comes_while
        self.held_with: list[int] = []  # the meeting's count while this rank was paused

    def asked(self) -> bool:
        wanted = self.store.looks >= self.at and not self.held_with
        if wanted and self.other_comes_while == "asked":
            self.store.count += 1  # the other rank arrives between the look and the pause
        return wanted

    def hold(self) -> None:
        self.held_with.append(self.store.count)
        if self.other_comes_while == "held":
            self.store.count += 1  # ... or while this one is paused


def test_a_rank_pauses_in_a_meeting_counted_out_so_the_others_cannot_run_on_without_it():
    from torchscope.tracer.ranks import RankGate

    store = _Store()
    pause = _Pause(store, at=2, other_comes_while="held")
    RankGate(store, rank=0, world=2, say=lambda line: None).meet(5, "Tensor.backward()", "", pause)
    # Paused counted out: the other rank, come meanwhile, saw 1 of 2 and waited in Python.
    assert pause.held_with == [0] and store.count == 2

    store = _Store()
    pause = _Pause(store, at=2, other_comes_while="asked")
    RankGate(store, rank=0, world=2, say=lambda line: None).meet(5, "Tensor.backward()", "", pause)
    # The last rank came since the look and may be in the collective already: no pause.
    assert pause.held_with == [] and store.count == 2


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
            ui.connect(rank1, timeout=30)
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
    assert time.monotonic() - t0 < 5  # a third of the group's 1.5 s timeout, not 10 s


# -- one bad value, one origin in the whole job (issue 23) ------------------------------------


def _one_nan(tmp: Path, bad: str, *options: str) -> tuple[str, str, dict[int, list]]:
    """ONE_NAN_JOB under ``torchscope run OPTIONS --record t.tsc``: (stdout, stderr, each
    rank's alerts as recorded)."""
    job = torchrun(
        "-m", "torchscope", "run", *options, "--record", "t.tsc", str(ONE_NAN_JOB),
        cwd=tmp, env={"JOB_BAD": bad},
    )  # fmt: skip
    try:
        ((out, err),) = finish(job, timeout=80)
    finally:
        kill(job)
    assert ended_well(job, err), err[-3000:]
    assert sum(line.startswith("rank ") for line in out.splitlines()) == 12  # 2 ranks x 6
    return out, err, rank_alerts(lambda r: tmp / f"t.rank{r}.tsc")


@pytest.mark.parametrize("bad", ["batch", "batch_inf", "param", "collective"])
def test_one_bad_value_on_rank_1_has_one_origin_in_the_job_named_alike_on_rank_0(
    tmp_path: Path, bad: str
) -> None:
    """Rank 1's loop writes one NaN (or Inf) at step 4, into its batch, a weight, or a
    tensor it all-reduces: across both files exactly one origin, on rank 1, at that write;
    rank 0 has an arrival linked to it in the same words, no origin of its own; what
    follows (the NaN weights of step 5 on both ranks, rank 1's averaged gradients) is counted
    under it, not listed."""
    from torchscope.analysis.trace import fold_alerts, job_origins

    _, _, alerts = _one_nan(tmp_path, bad, "--quiet")
    noun = "Inf" if bad == "batch_inf" else "NaN"
    (origin,) = job_origins(alerts)
    assert (origin["rank"], origin["step"], origin["name"]) == (1, 4, "Tensor.__setitem__")
    assert origin["message"] == (
        f"{noun} first appears in Tensor.__setitem__ (forward) at {ONE_NAN_JOB}:{bad_line(bad)}"
    )
    # No rank names an origin of its own but rank 1, once.
    made = [
        a for r in (0, 1) for a in alerts[r] if a.get("origin") and a["where"] != "consequences"
    ]
    assert [a["origin"] for a in made] == [origin["origin"]]
    assert not [a for a in alerts[1] if a.get("arrived") or a.get("from_rank") is not None]
    # Rank 0: one line, the arrival at step 4, in rank 1's words; never "rank 0" blamed.
    (shown,) = fold_alerts(alerts[0])
    assert shown["where"] == "arrival" and shown["step"] == 4 and "origin" not in shown
    assert shown["message"] == f"NaN arrived from rank 1: {origin['message']}"
    assert shown["from_rank"] == 1 and shown["linked_origin"] == origin["origin"]
    assert not any("rank 0" in a["message"] for r in (0, 1) for a in alerts[r])
    # Counted under the origin across ranks: the arrival and the 4 weights gone NaN there,
    # the 4 weights here.
    assert origin["arrivals"] == [{"rank": 0, "step": 4, "message": shown["message"]}]
    assert (origin["consequences"], shown["consequences"]) == (4, 4)
    assert origin["job_consequences"] == 9


def test_a_nan_breakpoint_pauses_once_in_the_whole_job_at_the_origin(tmp_path: Path) -> None:
    """``--break-on nan`` with the NaN written into rank 1's batch: rank 1 pauses there, once
    (then goes on: no UI); rank 0, where it only arrives, and the knock-on NaN after it
    (clip_grad_norm_'s _foreach_norm, the NaN weights of step 5) never pause."""
    _, err, _ = _one_nan(tmp_path, "batch", "--quiet", "--break-on", "nan", "--lease", "1")
    import torchscope

    pauses = {
        r: [e for e in torchscope.load(tmp_path / f"t.rank{r}.tsc").events if e["kind"] == "pause"]
        for r in (0, 1)
    }
    assert pauses[0] == [], pauses[0]
    assert [(p["step"], p["event"]["name"]) for p in pauses[1]] == [(4, "Tensor.__setitem__")]
    paused = [line for line in err.splitlines() if ": paused at " in line]
    assert len(paused) == 1 and paused[0].startswith("torchscope[rank 1]: paused at "), err[-3000:]


def test_the_nan_watch_on_rank_0_links_the_origin_rank_1_names(tmp_path: Path) -> None:
    """``--watch nan`` (nothing traced until a step goes bad): rank 1's replay names the
    origin; rank 0's replay is finite, so the NaN arrived: rank 0 links rank 1's origin, in
    its words, on stderr and in its file (no "origin unknown", no full tracing after it)."""
    from torchscope.analysis.trace import fold_alerts, job_origins

    _, err, alerts = _one_nan(tmp_path, "batch", "--watch", "nan")
    (origin,) = job_origins(alerts)
    assert origin["rank"] == 1 and origin["step"] == 4
    said = f"torchscope[rank 0]: NaN arrived from rank 1: {origin['message']}"
    assert said in err.splitlines(), err[-3000:]
    assert "origin unknown" not in err and "tracing the next" not in err
    (shown,) = fold_alerts(alerts[0])
    assert shown["step"] == 4 and shown["from_rank"] == 1
    assert shown["message"] == f"NaN arrived from rank 1: {origin['message']}"
    assert [a["rank"] for a in origin["arrivals"]] == [0]


def test_a_link_folds_into_its_arrival_and_the_job_counts_consequences_across_ranks() -> None:
    """What a reader makes of the alerts (no job needed): the link the rank checks emit is
    folded into rank 0's arrival (or, under the watch, into its report of that step), the
    arrival's own consequences stay counted under it, and ``job_origins`` adds the arrival
    and those to the origin's count; the UI lists the arrival apart from origins."""
    from torchscope.analysis.trace import fold_alerts, job_origins
    from torchscope.tui.widgets.alert_list import alert_label, group_alerts, is_arrival

    words = "NaN first appears in Tensor.__setitem__ (forward) at job.py:27"
    rank1 = [
        {"kind": "alert", "seq": 9, "step": 4, "what": "nan", "where": "forward",
         "origin": "1:9", "event_seq": 8, "name": "Tensor.__setitem__", "message": words},
        {"kind": "alert", "seq": 20, "step": 5, "what": "nan", "where": "consequences",
         "origin": "1:9", "consequences": 4, "consequence_steps": [5, 5],
         "first_consequences": [], "message": "4 consequences"},
    ]  # fmt: skip
    arrival = {
        "kind": "alert", "seq": 7, "step": 4, "what": "nan", "where": "arrival",
        "arrival": "0:7", "arrived": True, "event_seq": 6,
        "name": "torch.distributed.ddp_gradient_sync from another rank",
        "message": "NaN arrives through torch.distributed.ddp_gradient_sync from another rank",
    }  # fmt: skip
    link = {
        "kind": "alert", "seq": 8, "step": 4, "what": "nan", "where": "arrival",
        "event_seq": None, "name": "rank 1", "arrival": "0:7", "from_rank": 1,
        "linked_origin": "1:9", "origin_step": 4, "message": f"NaN arrived from rank 1: {words}",
    }  # fmt: skip
    tally = {
        "kind": "alert", "seq": 21, "step": 5, "what": "nan", "where": "consequences",
        "arrival": "0:7", "consequences": 3, "consequence_steps": [5, 5],
        "first_consequences": [], "message": "3 consequences",
    }  # fmt: skip
    (shown,) = fold_alerts([arrival, link, tally])
    assert shown["message"] == f"NaN arrived from rank 1: {words}" and "origin" not in shown
    assert shown["name"] == "torch.distributed.ddp_gradient_sync (from rank 1)"
    assert (shown["from_rank"], shown["linked_origin"], shown["consequences"]) == (1, "1:9", 3)
    assert is_arrival(shown) and alert_label(shown).split()[:3] == ["4", "NaN", "arr"]
    assert [g[0]["seq"] for g in group_alerts([arrival, link, tally])] == [7]
    # Under the watch nothing is traced: the link names the watch's report of the step.
    watched = {
        "kind": "alert", "seq": 5, "step": 4, "what": "nan", "where": "watch",
        "event_seq": None, "name": "the gradients", "message": "NaN in the gradients",
    }  # fmt: skip
    (report,) = fold_alerts([watched, {**link, "arrival": None}])
    assert report["message"] == f"NaN arrived from rank 1: {words}" and report["from_rank"] == 1
    (origin,) = job_origins({0: [arrival, link, tally], 1: rank1})
    assert (origin["rank"], origin["consequences"], origin["job_consequences"]) == (1, 4, 8)
    assert origin["arrivals"] == [{"rank": 0, "step": 4, "message": link["message"]}]
