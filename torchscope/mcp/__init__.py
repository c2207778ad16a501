"""``torchscope mcp``: the debugger for coding agents, as a Model Context Protocol server over
stdio.

The same jobs, recordings and commands as the terminal UI, as tools with typed arguments and
bounded answers:

- :mod:`~torchscope.mcp.views`: events, alerts, steps and graphs shaped into small, paginated
  answers in the UI's words (no SDK, no I/O);
- :mod:`~torchscope.mcp.sources`: what those tools read: a recording (a trace file) or a live
  job this server follows (:mod:`~torchscope.mcp.live`: its connection, lease and commands);
- :mod:`~torchscope.mcp.tools`: the tools themselves, by group (the running jobs, what
  happened, stepping, a paused job), each group registered on the server through a small
  shared context;
- :mod:`~torchscope.mcp.server`: the server, on the ``mcp`` SDK (``torchscope-debugger[mcp]``),
  its tools composed from the groups; imported only by the ``mcp`` command.

Imports neither torch nor textual: an agent on a laptop reads a cluster job's recordings.
"""
