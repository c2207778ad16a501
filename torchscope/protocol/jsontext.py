"""Events (and any value in them) as JSON text.

JSON has no NaN or Infinity and no bytes: :func:`json_safe` writes them as the strings
``"nan"``, ``"inf"``, ``"-inf"`` and as hex, so every event becomes valid JSON. The one
conversion ``torchscope dump --format jsonl``, the UI's copy and export views, and the
Perfetto and table exports share.

Imports nothing outside ``torchscope.protocol`` and the standard library.
"""

from __future__ import annotations

import json
import math
from typing import Any

from torchscope.protocol.events import Event

__all__ = ["json_safe", "to_jsonl"]


def _json_key(key: Any) -> str:
    """A map key as JSON writes it (the same text as the C encoder's for str/int/bool/None)."""
    if isinstance(key, str):
        return key
    if key is None or isinstance(key, bool):
        return json.dumps(key)
    if isinstance(key, bytes):
        return key.hex()
    return str(json_safe(key))


def json_safe(obj: Any) -> Any:
    """JSON has no NaN/Infinity: write them as the strings "nan", "inf", "-inf"; bytes as
    hex."""
    if isinstance(obj, float):
        if math.isnan(obj):
            return "nan"
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return obj
    if isinstance(obj, dict):
        return {_json_key(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, bytes):
        return obj.hex()
    return obj


# Reused: json.dumps with arguments builds a new encoder per call.
_encode = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode


def to_jsonl(event: Event) -> str:
    """One event as one line of JSON. Most events hold only JSON's own types and go through
    the C encoder as they are; only one that it refuses (a NaN or Inf, bytes) is rewritten
    first, which costs a walk over the whole event in Python."""
    try:
        return _encode(event)
    except (ValueError, TypeError):
        return _encode(json_safe(event))
