"""``torchscope keys``: make the CURVE keys a job on a public address needs, and say how to
use them."""

from __future__ import annotations

import sys
from typing import Any


def cmd_keys(args: Any) -> int:
    """``torchscope keys [--force]``: make keys and say how to use them; 2 on failure."""
    from torchscope.protocol.security import SecurityError, generate_and_describe

    try:
        text = generate_and_describe(force=bool(getattr(args, "force", False)))
    except SecurityError as exc:
        print(f"torchscope: error: {exc}", file=sys.stderr)
        return 2
    print(text)
    return 0
