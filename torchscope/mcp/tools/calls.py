"""How the tools talk to a live job: a blocking call off the event loop, this server's link
to a job, waiting for a pause or its end, one command through a link or a short connection,
and the stepper's answer."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from contextlib import suppress
from typing import Any

import anyio
import anyio.to_thread

from torchscope.mcp import views
from torchscope.mcp.live import JobError, JobLink, Jobs
from torchscope.mcp.tools.context import Refusal
from torchscope.protocol import endpoints as ep
from torchscope.protocol.client import SessionClient
from torchscope.protocol.runtime import EndpointError
from torchscope.session.stepper_view import pause_key


async def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))


async def link_to(jobs: Jobs, job: Any) -> JobLink:
    link = await call(jobs.get, job)
    if link.gone:
        raise Refusal(link.gone)
    return link


async def wait_pause(link: JobLink, before: Any, timeout: float, what: str) -> str | None:
    """Wait until the job is paused at a pause other than ``before``; None when it is, else
    one line saying what was waited for. Asks the job's state a few times a second too (a
    pause event may be lost on a slow reader)."""
    deadline = time.monotonic() + timeout
    asked = 0.0
    while True:
        paused = link.paused
        if paused is not None and pause_key(paused) != before:
            return None
        gone = link.gone
        if gone:
            raise Refusal(f"{gone} while waiting for {what}")
        now = time.monotonic()
        if now >= deadline:
            return f"waited {timeout:g} s for {what}: not paused yet (the job is running)"
        if now - asked >= 0.25:
            asked = now
            with suppress(JobError):
                await call(link.request, "state", timeout=2.0)
            continue
        await anyio.sleep(0.05)


async def wait_resumed(link: JobLink, before: Any, within: float = 3.0) -> None:
    """Until the pause ``before`` has ended (a reply's state may show it for a few more
    milliseconds: the job resumes right after it answers); at most ``within`` seconds."""
    deadline = time.monotonic() + within
    while before is not None and pause_key(link.paused) == before:
        if link.gone or time.monotonic() >= deadline:
            return
        with suppress(JobError):
            await call(link.request, "state", timeout=2.0)
        await anyio.sleep(0.05)


def stepper(link: JobLink, waited: str | None = None) -> dict[str, Any]:
    out = {**link.status(), **views.pause_view(link.state, link.paused, link.stepper)}
    if waited:
        out["waited"] = waited
    return out


def ask(jobs: Jobs, job: Any, cmd: str, **fields: Any) -> dict[str, Any]:
    """One command to a job: through this server's link to it when there is one, else a
    short connection (as the CLI's commands)."""
    text = None if job is None else str(job).strip() or None
    try:
        record = ep.resolve(text)
    except EndpointError as exc:
        raise Refusal(str(exc)) from None
    link = next((k for k in jobs.known() if k.record.control == record.control), None)
    if link is not None and link.gone is None:
        return link.request(cmd, timeout=10.0, **fields)
    with SessionClient() as client:
        client.connect(record, timeout=5.0)
        return client.request(cmd, timeout=10.0, **fields)
