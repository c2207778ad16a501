"""What every group of tools shares: the :class:`ToolContext` they register on (the server,
the recordings and live jobs they read, the limits), the argument types they have in common,
and how an answer or a refusal leaves a tool."""

from __future__ import annotations

import functools
import inspect
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import CallToolResult, TextContent
from pydantic import Field

from torchscope.analysis.diff import DiffError
from torchscope.mcp import views
from torchscope.mcp.live import JobError, Jobs
from torchscope.mcp.sources import Recordings, SourceError, looks_like_job
from torchscope.protocol.breakpoints import BreakpointError
from torchscope.protocol.client import SessionRefused, SessionUnreachable
from torchscope.protocol.codec import ProtocolError
from torchscope.protocol.frames import one_line
from torchscope.protocol.runtime import EndpointError

Job = Annotated[
    int | str | None,
    Field(description="a job: its pid or control endpoint; omitted: the only running job"),
]
Target = Annotated[
    str | int,
    Field(description="a recording (trace file path) or a live job (pid or control endpoint)"),
]
Offset = Annotated[int, Field(ge=0, description="first item of the page (from next_offset)")]
Limit = Annotated[int, Field(ge=1, le=views.MAX_LIMIT, description="items per page")]
Step = Annotated[int, Field(ge=0, description="training step number")]


class Refusal(Exception):
    """A one-line refusal a tool raises; turned into the tool's error."""


@dataclass(frozen=True)
class ToolContext:
    """What a group of tools is given: the server to register on, the live jobs this server
    follows, the recordings it has opened, and its limits."""

    server: MCPServer
    jobs: Jobs
    recordings: Recordings
    record_timeout_cap: float = 600.0

    def tool(self, **kw: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Register the function as a tool: its name (a trailing ``_`` keeps a Python word
        free: ``next_`` is the tool "next"), its docstring the description."""

        def register(fn: Callable[..., Any]) -> Callable[..., Any]:
            self.server.add_tool(_refusals(fn), name=kw.get("name") or fn.__name__.rstrip("_"))
            return fn

        return register

    def source(self, target: str | int) -> Any:
        """A recording or a live job this server follows, by its target."""
        text = str(target).strip()
        if not text:
            raise Refusal("give a recording (a trace file) or a job (a pid or endpoint)")
        if looks_like_job(text):
            link = self.jobs.get(text)
            if link.gone:
                raise Refusal(link.gone)
            return link
        return self.recordings.get(text)


_EXPECTED = (
    Refusal,
    JobError,
    SourceError,
    views.ViewError,
    DiffError,
    BreakpointError,
    EndpointError,
    SessionUnreachable,
    SessionRefused,
    ProtocolError,  # a request the client cannot send (a number out of range)
)


def _refusals(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Expected failures become the tool's one-line error; answers become a compact JSON
    text plus the same data, structured."""
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def run_async(*args: Any, **kwargs: Any) -> CallToolResult:
            try:
                return _answer(await fn(*args, **kwargs))
            except _EXPECTED as exc:
                raise ToolError(one_line(str(exc), 1000)) from None

        return run_async

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> CallToolResult:
        try:
            return _answer(fn(*args, **kwargs))
        except _EXPECTED as exc:
            raise ToolError(one_line(str(exc), 1000)) from None

    return run


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if x != x else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, bytes):
        return f"<{len(x)} bytes>"
    return x


def _answer(data: dict[str, Any]) -> CallToolResult:
    data = _jsonable(data)
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return CallToolResult(content=[TextContent(type="text", text=text)], structured_content=data)
