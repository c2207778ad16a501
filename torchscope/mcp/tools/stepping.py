"""A live job this server holds, stopped and stepped as in the UI: its ``state``, its
breakpoints (``breakpoint_set``, ``breakpoint_clear``), ``pause``, ``step``, ``next`` and
``continue``."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from torchscope.mcp.tools.calls import call, link_to, stepper, wait_pause, wait_resumed
from torchscope.mcp.tools.context import Job, Refusal, ToolContext
from torchscope.protocol.breakpoints import BreakpointError, parse_break_spec
from torchscope.session.stepper_view import pause_key


def register(ctx: ToolContext) -> None:
    tool, jobs = ctx.tool, ctx.jobs

    @tool()
    async def state(
        job: Job = None,
        wait: Annotated[
            float, Field(ge=0, le=600, description="seconds to wait for a pause (0: none)")
        ] = 0.0,
    ) -> dict[str, Any]:
        """The job's stepper: where it is paused (op or node, phase, source, stack), its
        breakpoints; with wait, waits for a pause (a breakpoint hit) first."""
        link = await link_to(jobs, job)
        await call(link.request, "state")
        waited = None
        if wait and link.paused is None:
            waited = await wait_pause(link, None, wait, "a pause (a breakpoint hit)")
        return stepper(link, waited)

    @tool()
    async def breakpoint_set(
        spec: Annotated[
            str,
            Field(
                description="conditions joined by ',': nan, inf, anynan, op:REGEX, "
                "module:REGEX, aten:REGEX, line:FILE:LINE, gradnorm:X, step:N, from:N",
                min_length=1,
                max_length=1000,
            ),
        ],
        job: Job = None,
    ) -> dict[str, Any]:
        """Set a breakpoint on a live job, as the UI's B (the --break-on syntax): the job
        stops at the first op or node where all conditions hold (nan: where NaN first
        appears). Holds the job: traced from its next step while this server runs."""
        try:
            fields = parse_break_spec(spec)
        except BreakpointError as exc:
            raise Refusal(str(exc)) from None
        link = await link_to(jobs, job)
        await call(link.hold)
        await call(link.request, "break_add", **fields)
        return stepper(link)

    @tool()
    async def breakpoint_clear(
        job: Job = None,
        id: Annotated[int | None, Field(ge=1, description="breakpoint id; omitted: all")] = None,
    ) -> dict[str, Any]:
        """Delete a breakpoint (by id, from state) or all of them."""
        link = await link_to(jobs, job)
        await call(link.request, "break_list")
        ids = [b.get("id") for b in link.stepper.breakpoints] if id is None else [id]
        for bp in ids:
            await call(link.request, "break_delete", bp=bp)
        return stepper(link)

    @tool()
    async def pause(
        job: Job = None,
        timeout: Annotated[float, Field(gt=0, le=600, description="seconds to wait")] = 15.0,
    ) -> dict[str, Any]:
        """Pause a live job at its next op or node (the UI's space), and wait until it is
        paused. Holds the job (traced while this server runs)."""
        link = await link_to(jobs, job)
        await call(link.hold)
        await call(link.request, "state")
        if link.paused is not None:
            return {**stepper(link), "said": "already paused"}
        await call(link.request, "pause")
        waited = await wait_pause(
            link, None, timeout, "the job to pause at its next traced op or node"
        )
        return stepper(link, waited)

    async def _resume(cmd: str, job: Any, wait: float, what: str) -> dict[str, Any]:
        link = await link_to(jobs, job)
        await call(link.hold)
        before = pause_key(link.paused)
        await call(link.request, cmd)
        if wait:
            waited = await wait_pause(link, before, wait, what)
        else:
            waited = None
            await wait_resumed(link, before)
        return stepper(link, waited)

    @tool()
    async def step(
        job: Job = None,
        timeout: Annotated[float, Field(gt=0, le=600, description="seconds to wait")] = 15.0,
    ) -> dict[str, Any]:
        """Run one op or node (the UI's s) and wait until the job pauses after it."""
        return await _resume("step", job, timeout, "the job to pause after one op or node")

    @tool()
    async def next_(
        job: Job = None,
        timeout: Annotated[float, Field(gt=0, le=600, description="seconds to wait")] = 60.0,
    ) -> dict[str, Any]:
        """Run to the next training step (the UI's n) and wait until the job pauses there."""
        return await _resume("next", job, timeout, "the job to reach its next training step")

    @tool(name="continue")
    async def continue_(
        job: Job = None,
        wait: Annotated[
            float, Field(ge=0, le=600, description="seconds to wait for the next pause (0: none)")
        ] = 0.0,
    ) -> dict[str, Any]:
        """Continue (the UI's c): the job runs to its next breakpoint; with wait, waits for
        that pause."""
        return await _resume("continue", job, wait, "the next breakpoint hit")
