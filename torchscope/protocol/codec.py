"""msgpack encoding with bounded decoding. Never pickle: only plain msgpack types cross."""

from __future__ import annotations

import threading
from typing import Any

import msgpack

# Major bumps break readers; minor bumps only add keys, which readers ignore.
PROTOCOL_VERSION = (1, 0)

# A single event or control message never needs more than this; larger input is refused.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class ProtocolError(ValueError):
    """Input that is not a valid torchscope message. The text is one line for the user."""


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack extension type {code} is not allowed")


_packers = threading.local()


def _packer() -> msgpack.Packer:
    # One Packer per thread, reused: packb builds a new one (and its buffer) per call, which
    # doubles the cost of encoding a traced step's events. A Packer is not thread-safe, and
    # it empties its buffer after each call, also when the call raises.
    packer = getattr(_packers, "packer", None)
    if packer is None:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
    return packer


def pack(obj: Any) -> bytes:
    return _packer().pack(obj)


def pack_with_packed(msg: dict[str, Any], key: str, items: list[bytes]) -> bytes:
    """``pack({**msg, key: [...]})`` where each element of the list is already encoded
    (``items``: one ``pack()`` each): the list's bytes are joined, not decoded and packed
    again. ``key`` must not be in ``msg``. Decodes as the plain message would."""
    packer = _packer()
    parts = [packer.pack_map_header(len(msg) + 1)]
    for k, v in msg.items():
        parts.append(packer.pack(k))
        parts.append(packer.pack(v))
    parts.append(packer.pack(key))
    parts.append(packer.pack_array_header(len(items)))
    parts.extend(items)
    return b"".join(parts)


def unpack(data: bytes | bytearray | memoryview, max_bytes: int = MAX_MESSAGE_BYTES) -> Any:
    """Decode one msgpack object; any malformed input raises ProtocolError."""
    if len(data) > max_bytes:
        raise ProtocolError(f"message of {len(data)} bytes exceeds the {max_bytes}-byte limit")
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=False,  # int keys are harmless; containers cannot be keys anyway
            ext_hook=_refuse_ext,
            max_str_len=max_bytes,
            max_bin_len=max_bytes,
            max_array_len=max_bytes,
            max_map_len=max_bytes // 2,
            max_ext_len=0,
        )
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types for bad bytes
        raise ProtocolError(f"malformed msgpack: {exc.__class__.__name__}: {exc}") from None


def check_version(version: Any) -> None:
    """Refuse data written by an incompatible major version, with a clear message."""
    if not (isinstance(version, (list, tuple)) and len(version) == 2):
        raise ProtocolError(f"missing or malformed protocol version: {version!r}")
    major = version[0]
    if major != PROTOCOL_VERSION[0]:
        raise ProtocolError(
            f"protocol version {major}.{version[1]} is not supported by this torchscope "
            f"(it reads {PROTOCOL_VERSION[0]}.x); upgrade torchscope to read it"
        )
