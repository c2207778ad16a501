"""Minimal events for the transport and security tests (no torch needed)."""

from __future__ import annotations

import os
import time


def session_event(**kw) -> dict:
    d = {
        "kind": "session",
        "seq": 0,
        "step": 0,
        "pid": os.getpid(),
        "rank": None,
        "world_size": None,
        "script": "/work/train.py",
        "argv": ["train.py"],
        "host": os.uname().nodename,
        "started": time.time(),
    }
    d.update(kw)
    return d


def ops(lo: int, hi: int, **extra) -> list[dict]:
    return [
        {"kind": "op", "seq": i, "step": 0, "name": "Tensor.mul", **extra} for i in range(lo, hi)
    ]
