"""What every command shares: a usage mistake is one line on stderr and exit code 2, never a
traceback."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class UsageError(Exception):
    """A mistake in how torchscope was called; its text is the one line the user sees."""


def fail(message: str) -> int:
    print(f"torchscope: error: {message}", file=sys.stderr)
    return 2


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")


def seconds(text: str) -> float:
    """An argparse type: a number of seconds, more than 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes seconds, not {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, not {text}")
    return value
