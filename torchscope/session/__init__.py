"""The session layer: what both front ends, the terminal UI and ``torchscope mcp``, know about
a session, free of textual and of torch. Rows and the step store, search, the run's history,
the stepper's view, a recording's replay cursor, the compare table, row alignment, eager
checks, the inbox a source's thread hands news through, the per-step counts of a recording,
and the plain-text pieces both show.

Nothing here imports a front end, a source, a screen or a widget: sources put :mod:`.items`
in an :class:`~torchscope.session.inbox.Inbox` and the app applies them to an
:class:`~torchscope.session.store.EventStore`; the MCP server reads the same store.
"""
