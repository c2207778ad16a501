"""Errors inside torchscope: said once per place and kind, never raised into the job."""

from __future__ import annotations

import contextlib
import sys


def error_line(exc: BaseException) -> str:
    """``Type: message``, first line only."""
    return f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__


class ReportOnce:
    """Prints ``torchscope: internal error in <what> (<where>): ...`` on stderr the first time
    a place fails with a kind of error; later ones are counted as said.

    ``what`` names the part (``"the NaN watch"``; empty: the place alone), ``goes_on`` what
    happens next (``"tracing continues"``).
    """

    def __init__(self, what: str, goes_on: str) -> None:
        self._what = what
        self._goes_on = goes_on
        self._seen: set[tuple[str, str]] = set()

    def __call__(self, where: str, exc: BaseException) -> str | None:
        """The error's line when it is new here (said now), else None."""
        key = (where, type(exc).__name__)
        if key in self._seen:
            return None
        self._seen.add(key)
        message = error_line(exc)
        place = f"{self._what} ({where})" if self._what else where
        with contextlib.suppress(Exception):  # a closed or broken stderr must not reach the job
            print(
                f"torchscope: internal error in {place}: {message} ({self._goes_on}; "
                "reported once)",
                file=sys.stderr,
            )
        return message
