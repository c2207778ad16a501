"""The MCP server's tools, by what they do; each module registers its tools on the server
through a :class:`~torchscope.mcp.tools.context.ToolContext`:

- :mod:`~torchscope.mcp.tools.jobs`: the running jobs (``ls``, ``history``, ``watch``,
  ``record``);
- :mod:`~torchscope.mcp.tools.recordings`: what happened, in a recording or a live job
  (``steps``, ``alerts``, ``events``, ``event``, ``graph``, ``diff``);
- :mod:`~torchscope.mcp.tools.stepping`: a held job stopped and stepped (``state``,
  ``breakpoint_set``, ``breakpoint_clear``, ``pause``, ``step``, ``next``, ``continue``);
- :mod:`~torchscope.mcp.tools.paused`: a paused job's ``values`` and ``evaluate``; ``release``.

:mod:`~torchscope.mcp.tools.context` holds what they share (the context, the argument types,
answers and refusals), :mod:`~torchscope.mcp.tools.calls` how they talk to a live job.
"""

from __future__ import annotations

from torchscope.mcp.tools import jobs, paused, recordings, stepping
from torchscope.mcp.tools.context import ToolContext

__all__ = ["ToolContext", "register_all"]


def register_all(ctx: ToolContext) -> None:
    """Every tool, in the order the server lists them."""
    for group in (jobs, recordings, stepping, paused):
        group.register(ctx)
