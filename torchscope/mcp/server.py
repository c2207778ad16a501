"""The MCP server: torchscope's jobs, recordings and commands as tools for coding agents.

Built on the official ``mcp`` SDK (``pip install 'torchscope-debugger[mcp]'``), over stdio
(``torchscope mcp``). Every tool has typed arguments and a bounded answer (pages with
``offset``/``limit`` and ``next_offset``); every failure is one line (``tool: what went
wrong``); a tool that waits (``record``, ``pause``, ``step``, ``next``, ``continue``,
``state``) has a timeout and says what it waited for.

The tools (:mod:`~torchscope.mcp.tools`, by group) read recordings and live jobs alike
(:mod:`~torchscope.mcp.sources`) and shape them with :mod:`~torchscope.mcp.views`; live jobs
are reached through :mod:`~torchscope.mcp.live`, with a UI's commands and a UI's lease,
nothing more.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio.to_thread
from mcp.server.mcpserver import MCPServer

from torchscope import __version__
from torchscope.mcp.live import Jobs
from torchscope.mcp.sources import Recordings
from torchscope.mcp.tools import ToolContext, register_all
from torchscope.protocol.frames import one_line

__all__ = ["build_server", "main"]

INSTRUCTIONS = """\
torchscope: a live step-through debugger for PyTorch training (every forward op and the \
gradient through every backward node). A target is a recording (a trace file, .tsc) or a \
live job (its pid, or a control endpoint).
From "loss is NaN" to the op and line: `ls` finds the running jobs; `record` a job's next \
N steps into a file (or take the file of `torchscope run --record`); `alerts` on it names \
where NaN/Inf first appeared (op, module, file:line, step, rank); `events` lists a step \
(filter/search as in the UI), `event` shows one op or node with both sides, `graph` the \
backward nodes around it. `history` gives a job's loss per step, `watch` switches its NaN \
watch on. To stop a live job: `breakpoint_set` (e.g. "nan"), `continue` with wait, \
`pause`, `step`, `next`, `state`, `values`; `release` lets the job go (it also goes when \
the agent closes this server). `diff` compares two recordings."""


# -- errors on one line -------------------------------------------------------------------------
_PREFIX = re.compile(r"^Error executing tool (\S+): ", re.S)
_PYDANTIC = re.compile(r"^\d+ validation errors? for \S+\n")
_DETAIL = re.compile(r"\s*\[type=(\w+)(?:, input_value=(.*?))?(?:, input_type=\w+)?\]\s*$")


def one_line_error(text: str) -> str:
    """A tool error as one line: ``tool: message``; the SDK's argument validation (several
    lines from pydantic) as ``tool: field: what is wrong (got X)``, every field."""
    tool = ""
    m = _PREFIX.match(text)
    if m:
        tool, text = m.group(1), text[m.end() :]
    if _PYDANTIC.match(text):
        parts: list[str] = []
        field = ""
        for line in text.splitlines()[1:]:
            if not line.startswith(" "):
                field = line.strip()
            elif line.startswith("  ") and not line.startswith("    "):
                msg = line.strip()
                d = _DETAIL.search(msg)
                if d:
                    msg = msg[: d.start()].strip()
                    if d.group(2) is not None and d.group(1) != "missing":
                        msg += f" (got {d.group(2)})"
                parts.append(f"{field}: {msg}" if field else msg)
        text = "bad arguments: " + "; ".join(parts)
    return one_line(f"{tool}: {text}" if tool else text, 1000)


async def _one_line_errors(ctx: Any, call_next: Any) -> Any:
    """Middleware: every tool error leaves as one line."""
    result = await call_next(ctx)
    failed = isinstance(result, dict) and (result.get("isError") or result.get("is_error"))
    if getattr(ctx, "method", None) == "tools/call" and failed:
        for block in result.get("content") or ():
            if isinstance(block, dict) and isinstance(block.get("text"), str):
                block["text"] = one_line_error(block["text"])
    return result


# -- the server ---------------------------------------------------------------------------------
def build_server(*, record_timeout_cap: float = 600.0) -> MCPServer:
    """The server with every tool. Its live jobs are let go when it stops."""
    jobs = Jobs()

    @asynccontextmanager
    async def lifespan(_server: MCPServer) -> AsyncIterator[None]:
        try:
            yield None
        finally:
            await anyio.to_thread.run_sync(jobs.close)

    server = MCPServer(
        "torchscope",
        title="torchscope",
        instructions=INSTRUCTIONS,
        version=__version__,
        lifespan=lifespan,
        log_level="WARNING",
        middleware=[_one_line_errors],
    )
    register_all(ToolContext(server, jobs, Recordings(), record_timeout_cap))
    return server


def main() -> int:
    """``torchscope mcp``: serve on stdin/stdout until the agent closes them."""
    build_server().run("stdio")
    return 0
