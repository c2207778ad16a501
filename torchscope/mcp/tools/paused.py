"""A paused job: the ``values`` of a tensor at its pause, an expression ``evaluate``d there;
and ``release``, which lets the job go (its breakpoints and pauses with it)."""

from __future__ import annotations

import time
from contextlib import suppress
from typing import Annotated, Any, Literal

import anyio
from pydantic import Field

from torchscope.mcp.live import JobError
from torchscope.mcp.tools.calls import call, link_to, stepper, wait_resumed
from torchscope.mcp.tools.context import Job, Refusal, ToolContext
from torchscope.session.stepper_view import pause_key


def register(ctx: ToolContext) -> None:
    tool, jobs = ctx.tool, ctx.jobs

    @tool()
    async def values(
        group: Annotated[
            Literal["inputs", "outputs", "grad_outputs", "grad_inputs"],
            Field(description="which side of the paused event"),
        ],
        job: Job = None,
        index: Annotated[int, Field(ge=0, le=100_000, description="which tensor")] = 0,
        start: Annotated[int, Field(ge=0, description="first flat index")] = 0,
        count: Annotated[int, Field(ge=1, le=1000, description="how many values")] = 100,
    ) -> dict[str, Any]:
        """The values of one tensor of the event the job is paused at (the UI's v), a flat
        slice; NaN and Inf spelled out."""
        link = await link_to(jobs, job)
        if link.paused is None:
            await call(link.request, "state")
        if link.paused is None:
            raise Refusal(f"{link.label} is not paused")
        reply = await call(
            link.request, "inspect", group=group, index=index, start=start, count=count
        )
        return {
            k: reply.get(k)
            for k in ("group", "index", "shape", "dtype", "numel", "start", "values")
        }

    @tool()
    async def evaluate(
        expr: Annotated[
            str,
            Field(
                max_length=1000,
                description="a Python expression over the paused event's tensors: x, out, "
                "args, kwargs (an op); grad_inputs, grad_outputs (a node); module, torch, F",
            ),
        ],
        job: Job = None,
        group: Annotated[
            Literal["inputs", "outputs", "grad_outputs", "grad_inputs"] | None,
            Field(description="the tensor x names (default: the event's main one)"),
        ] = None,
        index: Annotated[int, Field(ge=0, le=100_000, description="which tensor")] = 0,
        count: Annotated[int, Field(ge=0, le=1000, description="values to return")] = 16,
        budget_s: Annotated[
            float | None,
            Field(
                gt=0,
                le=3600,
                description="seconds it may run before it is interrupted (default: the "
                "job's budget, 10 s unless it was started with another)",
            ),
        ] = None,
    ) -> dict[str, Any]:
        """Evaluate a Python expression in the job at its pause (the UI's p), on its training
        thread under no_grad: a tensor's summary and first values, or a bounded repr; an
        exception as its one line. The expression is code run in the job, as in pdb. One
        that runs past its budget, or that nobody waits for any more (this call cancelled,
        release), is interrupted: "interrupted after N s", the pause as it was."""
        from torchscope.protocol.expressions import answer_text

        link = await link_to(jobs, job)
        if link.paused is None:
            await call(link.request, "state")
        if link.paused is None:
            raise Refusal(f"{link.label} is not paused")
        where: dict[str, Any] = {"group": group, "index": index} if group is not None else {}
        if budget_s is not None:
            where["budget"] = budget_s
        reply = await call(link.request, "evaluate", expr=expr, count=count, **where)
        task = reply.get("pending")
        budget = budget_s or (link.state or {}).get("eval_budget_s") or 10.0
        # The budget ends it; a call into C++ may hold it longer: then it is let go of.
        deadline = time.monotonic() + float(budget) + 30.0
        try:
            while reply.get("pending") and time.monotonic() < deadline:
                await anyio.sleep(0.2)
                reply = await call(link.request, "evaluate", poll=task)
        finally:
            if reply.get("pending"):  # nobody waits for it any more: the job lets it go
                with anyio.CancelScope(shield=True), suppress(JobError):
                    reply = await call(link.request, "evaluate", cancel=task)
        out = {
            k: reply.get(k) for k in ("expr", "summary", "values", "repr", "error", "x", "took_s")
        }
        out["text"] = answer_text(reply)
        if reply.get("interrupted"):
            out["interrupted"] = True
        if reply.get("pending"):
            out["pending"] = True
        return {k: v for k, v in out.items() if v is not None}

    @tool()
    async def release(job: Job = None) -> dict[str, Any]:
        """Let a job go, as quitting the UI: it goes dormant at its next step boundary (unless
        others hold it), this server's breakpoints and pauses with it."""
        link = await link_to(jobs, job)
        before = pause_key(link.paused)
        await call(link.release)
        await call(link.request, "state")
        await wait_resumed(link, before)
        if link.paused is not None and (link.state or {}).get("paused") is None:
            link.stepper.clear()  # the job says it runs: the pause this server saw is over
        return {**stepper(link), "said": f"{link.label} let go"}
