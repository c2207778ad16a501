"""Events per second, for the status bar."""

from __future__ import annotations

import time
from collections import deque

__all__ = ["RateMeter"]


class RateMeter:
    """Events per second over a sliding window."""

    def __init__(self, window: float = 2.0) -> None:
        self.window = window
        self._samples: deque[tuple[float, int]] = deque()
        self._total = 0

    def add(self, n: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if n:
            self._samples.append((now, n))
            self._total += n
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._samples and now - self._samples[0][0] > self.window:
            _, n = self._samples.popleft()
            self._total -= n

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self._trim(now)
        return self._total / self.window
