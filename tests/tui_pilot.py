"""Helpers shared by the Pilot tests of the UI."""

from __future__ import annotations

import asyncio
import functools
import time

SIZE = (160, 45)


def sync(fn):
    """Run an async test without a pytest plugin."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        asyncio.run(fn(*args, **kwargs))

    return run


#: How long a condition may take before a test fails. A condition that holds returns at once,
#: so this costs nothing when things work; it is long because a loaded CI machine (two
#: CPU-burning processes beside the suite) makes a file's count pass or a render take seconds.
WAIT = 60.0


async def until(pilot, cond, timeout: float = WAIT, what: str = "") -> None:
    """Let the app run until ``cond()`` holds; fail with ``what`` after ``timeout`` seconds
    (never less than :data:`WAIT`: a shorter limit only makes a loaded machine fail)."""
    timeout = max(timeout, WAIT)
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or cond}")
        await pilot.pause(0.02)


def notes_of(app) -> list[str]:
    """Notifications the app shows, as text (toasts expire; this list does not)."""
    notes: list[str] = []
    notify = app.notify

    def record(message, *args, **kwargs):
        notes.append(str(message))
        return notify(message, *args, **kwargs)

    app.notify = record
    return notes
