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


async def shows(pilot, *texts: str, gone: tuple[str, ...] = (), what: str = "") -> str:
    """Let the app run until its screen shows every one of ``texts`` and none of ``gone``
    (a change is drawn a frame or two after the state changes); returns that screen's text."""
    seen = ""

    def cond() -> bool:
        nonlocal seen
        seen = pilot.app.screen_text()
        return all(t in seen for t in texts) and not any(t in seen for t in gone)

    await until(pilot, cond, what=what or f"the screen to show {texts} and not {gone}")
    return seen


async def focus(pilot, widget) -> None:
    """Give ``widget`` the focus and let the app run until it has it (the focus moves by a
    message; the widget's focus styles follow at once: the app has no CSS transitions)."""
    widget.focus()
    await until(pilot, lambda: widget.has_focus, what=f"the focus on {widget!r}")


def notes_of(app) -> list[str]:
    """Notifications the app shows, as text (toasts expire; this list does not)."""
    notes: list[str] = []
    notify = app.notify

    def record(message, *args, **kwargs):
        notes.append(str(message))
        return notify(message, *args, **kwargs)

    app.notify = record
    return notes
