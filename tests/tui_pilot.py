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


async def until(pilot, cond, timeout: float = 10.0, what: str = "") -> None:
    """Let the app run until ``cond()`` holds; fail with ``what`` after ``timeout`` seconds."""
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
