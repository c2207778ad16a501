"""A rank paused before its forward does not time out the others inside DDP's broadcast of
buffers (two gloo ranks on CPU under torchrun, a model with BatchNorm)."""

from __future__ import annotations

import time

import pytest
from ranks import JOBS, Output, ended_well, finish, job_ranks, kill, torchrun

pytest.importorskip("torch")

JOB = JOBS / "ddp_batchnorm.py"
# The reference run (the same job without torchscope, for its losses) needs no short
# process-group timeout: a busy host must not fail it.
REFERENCE = {"JOB_PG_TIMEOUT": "60"}
SHORT = {"JOB_PG_TIMEOUT": "3"}  # the traced job: a rank left in a collective dies after 3 s
HOLD = 5.0  # how long the UI holds rank 1 paused: well past the group's timeout


def test_a_rank_held_before_its_forward_past_the_group_timeout_kills_neither(tmp_path):
    """Every rank traced by the command line; a UI stops rank 1 at the first op of a step,
    before DDP's forward (whose buffer broadcast is a collective), and holds it for 5 s
    against a 3 s process-group timeout. Rank 0 waits before its forward, in Python, and says
    at once that rank 1 is paused and where; a UI on rank 0 sees it waiting for rank 1. After
    continue both ranks finish, with the losses and running statistics of the job run
    without torchscope."""
    from torchscope.protocol.client import SessionClient

    pace = tmp_path / "pace"
    pace.touch()
    job = torchrun(
        "-m", "torchscope", "run", "--record", "t.tsc", "--lease", "3", str(JOB),
        cwd=tmp_path, env={"JOB_PACE_FILE": str(pace), **SHORT},
    )  # fmt: skip
    seen = Output(job)
    plain = None
    try:
        deadline = time.monotonic() + 90
        ranks = job_ranks(job, deadline)
        with SessionClient() as ui0, SessionClient() as ui1:
            ui0.connect(ranks[0], timeout=30)
            ui1.connect(ranks[1], timeout=30)
            ui1.request("arm")  # as the UI does: this client is there
            at = int(ui1.request("state")["step"]) + 4  # a few steps of 0.1 s ahead
            ui1.request("break_add", step=at, op="^torch.randn$")
            while ui1.request("state")["state"]["paused"] is None:
                assert time.monotonic() < deadline, "rank 1 did not pause at its breakpoint"
                ui0.request("ping")
                time.sleep(0.05)
            held = time.monotonic()
            # The same job without torchscope, meanwhile: started now that the traced ranks
            # wait (not competing with their start for the CPU), with no short timeout.
            plain = torchrun(str(JOB), cwd=tmp_path, env=REFERENCE)
            said = (
                f"torchscope[rank 0]: waiting before DistributedDataParallel.forward at step {at}"
            )
            line = waiting = beat = None
            # A fixed time, on purpose: the pause must outlast the process group's timeout,
            # a real-time clock inside the other rank's collective (another process): no
            # condition of ours can stand for it. Meanwhile both UIs keep their leases, and
            # what rank 0 says and shows is looked at.
            while time.monotonic() - held < HOLD or None in (line, waiting, beat):
                assert time.monotonic() < deadline, f"rank 0: {waiting}, {seen.err[-3000:]}"
                ui1.request("ping")
                # What a UI on rank 0 sees: it waits, before which call, for which rank, why.
                shown = ui0.request("state")["state"].get("waiting")
                if shown is not None and "1" in shown.get("paused", {}):
                    waiting = shown
                ui0.recv(timeout_ms=50)  # ... and its heartbeats carry the same
                if ui0.waiting is not None and "1" in ui0.waiting.get("paused", {}):
                    beat = ui0.waiting
                line = next((x for x in seen.err.splitlines() if x.startswith(said)), None)
                time.sleep(0.2)
            assert "rank 1 is paused at torch.randn" in line, line
            assert waiting["before"] == "DistributedDataParallel.forward", waiting
            assert (waiting["step"], waiting["here"], waiting["of"]) == (at, 1, 2), waiting
            assert waiting["paused"]["1"].startswith("torch.randn (before) at "), waiting
            assert beat["before"] == waiting["before"] and beat["step"] == at, beat
            assert ui1.request("state")["state"]["paused"] is not None
            pace.unlink()  # the rest of the job need not wait
            ui1.request("continue")
            ui1.request("disarm")
        out, err = seen.finish(timeout=120)
        ((plain_out, plain_err),) = finish(plain, timeout=120)
    finally:
        kill(job, plain)
    assert ended_well(job, err), err[-3000:]
    assert (
        f"torchscope[rank 0]: all 2 ranks reached DistributedDataParallel.forward at step {at}"
        in err
    )
    assert ended_well(plain, plain_err), plain_err[-2000:]
    assert len(out.splitlines()) == 60
    assert sorted(out.splitlines()) == sorted(plain_out.splitlines())  # bit-identical
