"""The running jobs on this machine: ``ls`` finds them, ``history`` gives a job's (or a
recording's) loss per step, ``watch`` switches a job's NaN watch, ``record`` records a job's
next steps into a trace file."""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Annotated, Any

import anyio
import anyio.to_thread
from pydantic import Field

from torchscope.mcp import views
from torchscope.mcp.live import JobLink
from torchscope.mcp.sources import SourceError, looks_like_job
from torchscope.mcp.tools.calls import ask
from torchscope.mcp.tools.context import Job, Refusal, ToolContext
from torchscope.protocol import endpoints as ep
from torchscope.protocol.client import SessionClient, SessionRefused, SessionUnreachable
from torchscope.protocol.policies import POLICIES
from torchscope.protocol.runtime import EndpointError


def register(ctx: ToolContext) -> None:
    tool, jobs, recordings = ctx.tool, ctx.jobs, ctx.recordings
    record_timeout_cap = ctx.record_timeout_cap

    @tool()
    def ls() -> dict[str, Any]:
        """The live torchscope jobs on this machine (as `torchscope ls`): pid, rank, step,
        tracing (dormant / arming / traced), latest loss, script; the ranks of a torchrun job
        share a `job`. `held`: this server holds it (traced while this server runs)."""
        try:
            records = ep.list_sessions()
        except EndpointError as exc:
            raise Refusal(str(exc)) from None
        held = {link.record.control: link for link in jobs.known() if link.gone is None}
        out = []
        for ranks in ep.group_by_job(records)[:50]:
            for rec in ranks[:64]:
                out.append(_ls_row(rec, held.get(rec.control)))
        hint = None if out else "no running torchscope jobs (start one with torchscope run)"
        return {"jobs": out, **({"note": hint} if hint else {})}

    @tool()
    def history(
        job: Annotated[
            int | str | None,
            Field(
                description="a job (its pid or control endpoint; omitted: the only running "
                "job) or a recording (a trace file path)"
            ),
        ] = None,
        since: Annotated[int | None, Field(ge=-1, description="only steps after this")] = None,
        last: Annotated[int, Field(ge=1, le=500, description="the newest N steps")] = 50,
    ) -> dict[str, Any]:
        """A run's loss per step (and, with the watch on, its gradient norm and the
        largest module norms), traced or not: the run's history, as `torchscope history`,
        of a running job or a recording. A step the watch flagged as a loss spike has
        `spike: true` and the spike's `line`; `skipped: true` where its update was skipped
        (the watch's skip policies, a loss scaler)."""
        text = None if job is None else str(job).strip() or None
        lines: dict[int, str] = {}
        if text is not None and not looks_like_job(text):
            try:
                recorded = recordings.get(text)
                reply, lines = views.recorded_history(recorded.step_table_events())
            except SourceError as exc:
                raise Refusal(str(exc)) from None
            if since is not None:
                reply["points"] = [p for p in reply["points"] if p["step"] > since]
        else:
            reply = ask(jobs, job, "history", since=since, max_points=last)
            try:  # the spikes' lines: from this server's link to the job, when it has one
                control = ep.resolve(text).control
            except EndpointError:
                control = None
            link = next((k for k in jobs.known() if k.record.control == control), None)
            for a in link.alerts() if link is not None else ():
                if a.get("what") == "spike" and type(a.get("step")) is int:
                    lines.setdefault(a["step"], str(a.get("message") or ""))
        points, older = views.history_view(reply, lines, last)
        out: dict[str, Any] = {"step": reply.get("step"), "points": points}
        if reply.get("pending"):
            out["pending"] = f"{reply['pending']} steps still on the device"
        if older:
            out["older"] = older
        return out

    @tool()
    def watch(
        job: Job = None,
        spec: Annotated[
            str, Field(description="nan, gradnorm:X, spike, or a comma list", max_length=64)
        ] = "nan",
        on_nan: Annotated[
            str,
            Field(
                description="what the job does then (skip: refuse the bad update, go on)",
                pattern=f"^({'|'.join(POLICIES)})$",
                json_schema_extra={"enum": list(POLICIES)},
            ),
        ] = "continue",
        max_skips: Annotated[
            int | None,
            Field(ge=0, description="with on_nan=skip: bad steps in a row before it stops"),
        ] = None,
        on_spike: Annotated[
            str | None,
            Field(
                description="with spec spike: what the job does after a loss spike",
                pattern=f"^({'|'.join(POLICIES)})$",
                json_schema_extra={"enum": list(POLICIES)},
            ),
        ] = None,
        off: Annotated[bool, Field(description="stop watching")] = False,
    ) -> dict[str, Any]:
        """Switch a running job's NaN watch on (from its next backward: every step checked,
        an untraced job's NaN replayed to name the op and line) or off, as `torchscope watch`."""
        limit: dict[str, Any] = {} if max_skips is None else {"max_skips": max_skips}
        if on_spike is not None:
            limit["on_spike"] = on_spike
        ask(jobs, job, "watch", spec=None if off else spec, on_nan=on_nan, **limit)
        if off:
            return {"watch": None, "said": "stops watching for NaN at its next backward()"}
        return {
            "watch": spec,
            "on_nan": on_nan,
            "said": f"watches every step from its next backward() ({spec}, then {on_nan}); "
            "its reports go to its stderr, its trace file and the alerts of a recording",
        }

    @tool()
    async def record(
        output: Annotated[str, Field(description="trace file to write (.tsc)", min_length=1)],
        job: Job = None,
        next: Annotated[int, Field(ge=1, le=10_000, description="steps to record")] = 3,
        timeout: Annotated[
            float, Field(gt=0, le=600, description="seconds to wait for the steps")
        ] = 120.0,
        aten: Annotated[
            str | None, Field(description='also every aten call ("": all; a module regex)')
        ] = None,
        overwrite: Annotated[bool, Field(description="replace an existing file")] = False,
    ) -> dict[str, Any]:
        """Arm a running job for its next N steps and record them into a trace file, as
        `torchscope record JOB --next N`; the job goes dormant again after. Waits for the N
        steps (at most `timeout`; then the file holds what came). Answers with the file's
        steps and its NaN/Inf origins."""
        path = os.path.abspath(os.path.expanduser(output))
        if os.path.exists(path) and not overwrite:
            raise Refusal(f"{output} exists: give another path, or overwrite=true")
        text = None if job is None else str(job).strip() or None
        try:
            found = await anyio.to_thread.run_sync(lambda: ep.resolve(text))
        except EndpointError as exc:
            raise Refusal(str(exc)) from None
        who = str(found.pid) if found.pid else found.control
        args = [sys.executable, "-m", "torchscope", "record", who, "-o", path]
        args += ["--next", str(next), "--quiet", "--timeout", "10"]
        if aten is not None:
            args += [f"--aten={aten}"]
        said, stopped = await _run_recorder(args, min(timeout, record_timeout_cap))
        if not os.path.exists(path):
            raise Refusal(said or f"record: nothing was written to {output}")
        rec = await anyio.to_thread.run_sync(lambda: recordings.get(path))
        steps = await anyio.to_thread.run_sync(
            lambda: views.steps_view(rec.step_table_events(), limit=views.MAX_LIMIT)
        )
        alerts = await anyio.to_thread.run_sync(
            lambda: views.alerts_view({rec.rank: rec.alerts()}, limit=10)
        )
        out: dict[str, Any] = {
            "output": path,
            "said": said,
            "traced_steps": [s["step"] for s in steps["steps"]],
            "alerts": alerts["alerts"],
            "alerts_total": alerts["total"],
        }
        if stopped:
            out["waited"] = (
                f"waited {timeout:g} s for {next} traced steps of {who}: stopped "
                "before they all came (a slow or stalled job); the file holds what came"
            )
        return out


def _ls_row(rec: ep.SessionRecord, link: JobLink | None) -> dict[str, Any]:
    row: dict[str, Any] = {
        "pid": rec.pid,
        "rank": rec.rank,
        "script": rec.script,
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rec.started)),
        "control": rec.control,
    }
    if rec.job is not None:
        row["job"] = rec.job
        row["world_size"] = rec.world_size
    try:
        with SessionClient() as client:
            hello = client.connect(rec, timeout=1.0)
            row["step"] = hello.get("step")
            row["tracing"] = hello.get("tracing") or "traced"
            try:
                latest = client.request("history", timeout=1.0, max_points=0).get("latest")
            except (SessionUnreachable, SessionRefused):
                latest = None
            if isinstance(latest, dict) and latest.get("loss") is not None:
                row["loss"] = latest["loss"]
    except (SessionUnreachable, SessionRefused, EndpointError) as exc:
        row["unreachable"] = " ".join(str(exc).split())
    row["held"] = link is not None and link.held
    return row


async def _run_recorder(args: list[str], timeout: float) -> tuple[str, bool]:
    """Run ``torchscope record``: its last stderr line, and whether it was stopped at the
    timeout (SIGTERM: it closes its file complete and lets the job go dormant)."""
    stopped = False
    async with await anyio.open_process(
        args,
        stdin=None,
        stdout=None,
        stderr=-1,  # subprocess.PIPE
    ) as proc:
        chunks: list[bytes] = []

        async def read() -> None:
            assert proc.stderr is not None
            async for chunk in proc.stderr:
                chunks.append(chunk)

        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            with anyio.move_on_after(timeout) as scope:
                await proc.wait()
            if scope.cancelled_caught:
                stopped = True
                proc.send_signal(signal.SIGTERM)
                with anyio.move_on_after(15):
                    await proc.wait()
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
    text = b"".join(chunks).decode(errors="replace").strip().splitlines()
    said = text[-1] if text else ""
    if said.startswith("torchscope: error: "):
        raise Refusal("record: " + said.removeprefix("torchscope: error: "))
    return said.removeprefix("torchscope: "), stopped
