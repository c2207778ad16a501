"""MCP answers that agree with themselves: ``step`` is the step the job is in (the paused
step while paused), a released job shows no pause, and every tool asked about a job that is
gone says so in one line. Waits are on conditions, never fixed times."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("mcp")
pytest.importorskip("torch")

import anyio
from mcp import Client
from test_evaluate_interrupt import LossJob
from test_mcp import ok, refused

from torchscope.mcp.server import build_server


def test_state_at_a_pause_after_release_and_when_the_job_is_gone(tmp_path: Path) -> None:
    job = LossJob(tmp_path)
    try:
        job.wait_losses(2)

        async def go() -> None:
            async with Client(build_server(), mode="legacy") as client:
                await ok(client, "breakpoint_set", job=job.pid, spec=r"op:^torch\.log$")
                hit = await ok(client, "continue", job=job.pid, wait=60)
                paused = hit["paused"]
                assert paused["name"] == "torch.log" and hit["step"] == paused["step"], hit
                state = await ok(client, "state", job=job.pid)
                assert state["step"] == paused["step"] == state["paused"]["step"], state
                assert state["held"] and state["paused"]["seq"] == paused["seq"]
                assert state["tracing"] == "traced", state  # paused: traced, whatever came before

                let_go = await ok(client, "release", job=job.pid)
                assert let_go["paused"] is None and not let_go["held"], let_go
                assert let_go["step"] >= paused["step"]
                state = await ok(client, "state", job=job.pid)
                assert state["paused"] is None and state["step"] >= paused["step"], state

                job.stop()
                for tool, args in (
                    ("state", {}),
                    ("pause", {"timeout": 5}),
                    ("evaluate", {"expr": "1"}),
                    ("values", {"group": "inputs"}),
                    ("release", {}),
                ):
                    said = await refused(client, tool, job=job.pid, **args)
                    assert str(job.pid) in said and ("ended" in said or "gone" in said), said

        anyio.run(go)
    finally:
        job.stop()
