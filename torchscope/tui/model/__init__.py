"""The UI's model, free of textual and of torch: rows and the step store, search, the run's
history, the stepper's view, a recording's replay cursor, the compare table, row alignment, the
plain-text pieces the widgets show. What ``torchscope mcp`` shares with the UI, so the two agree.

Nothing here imports a source, a screen or a widget: sources put :mod:`.items` in an inbox and
the app applies them to an :class:`~torchscope.tui.model.store.EventStore`.
"""
