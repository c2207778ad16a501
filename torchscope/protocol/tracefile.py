"""Trace files: torchscope events on disk, readable up to the last chunk after a crash.

Layout, all integers little-endian::

    header   b"TSCTRACE" <HHI major, minor, header_len> msgpack map <I crc32 of the map>
    chunk*   <4sIIIqqq b"CHNK", payload_len, crc32, n_events, first_seq, first_step, last_step>
             then payload_len bytes: a msgpack array of event maps
    index    <4sII b"INDX", payload_len, crc32 of payload>
             then a msgpack array of [offset, n_events, first_seq, first_step, last_step]
    trailer  <8sQ b"TSCINDEX", offset of the INDX record>

A chunk's crc32 covers the four fields after the crc (n_events .. last_step) and then the
payload. first_step/last_step are the min/max integer ``step`` of its events, -1 when none has one.

Each chunk reaches the OS in one write() followed by a flush, so a writer killed at any moment
leaves whole chunks followed by at most one partial record. Readers treat such a tail as
truncation, not corruption. Only close() writes the index and trailer; without a valid one the
reader finds the chunks by walking their headers.

Imports neither torch nor textual.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import msgpack

from torchscope.protocol import codec
from torchscope.protocol.codec import ProtocolError
from torchscope.protocol.events import Event, Trace, as_event

__all__ = [
    "MAX_CHUNK_BYTES",
    "ChunkInfo",
    "TraceFileError",
    "TraceReader",
    "TraceWriter",
    "load_trace",
]

MAGIC = b"TSCTRACE"
CHUNK_MAGIC = b"CHNK"
INDEX_MAGIC = b"INDX"
TRAILER_MAGIC = b"TSCINDEX"

_VERSION = struct.Struct("<HHI")  # major, minor, header_len
_U32 = struct.Struct("<I")
_RECORD = struct.Struct("<4sII")  # magic, payload_len, crc32: starts both chunks and the index
_CHUNK_FIELDS = struct.Struct("<Iqqq")  # n_events, first_seq, first_step, last_step
_CHUNK_HEAD = _RECORD.size + _CHUNK_FIELDS.size  # == struct.calcsize("<4sIIIqqq") == 40
_TRAILER = struct.Struct("<8sQ")
_HEADER_FIXED = len(MAGIC) + _VERSION.size

# Limits on what a reader will believe, so a damaged length cannot make it allocate gigabytes.
MAX_HEADER_BYTES = 16 * 1024 * 1024
MAX_CHUNK_BYTES = 256 * 1024 * 1024
MAX_INDEX_BYTES = 256 * 1024 * 1024
# The writer cuts a chunk once this much is buffered; with single events capped at
# codec.MAX_MESSAGE_BYTES, no chunk can reach MAX_CHUNK_BYTES.
_CHUNK_TARGET_BYTES = 16 * 1024 * 1024

_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
_NO_STEP = -1
_SCAN_PROGRESS_EVERY = 256  # chunks between progress callbacks while scanning

# Indirection so tests can drive the chunk_seconds timer without sleeping.
_clock = time.monotonic


class TraceFileError(ProtocolError):
    """A trace file that cannot be written or read. One-line message; ``offset`` is the byte
    offset of the problem in the file where it is known, else None."""

    def __init__(self, message: str, offset: int | None = None) -> None:
        super().__init__(" ".join(str(message).splitlines()))
        self.offset = offset

    def __reduce__(self) -> tuple[Any, ...]:
        # Keep offset across pickling (e.g. an error raised in a worker process).
        return (type(self), (str(self), self.offset))


@dataclass(frozen=True)
class ChunkInfo:
    offset: int
    n_events: int
    first_seq: int
    first_step: int
    last_step: int


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc) or type(exc).__name__


def _clamp64(value: int) -> int:
    return min(max(value, _I64_MIN), _I64_MAX)


def _int_or_none(value: Any) -> int | None:
    # bool is an int subclass, but step=True is not step 1.
    return value if type(value) is int else None


def _pack_event(ev: Any, i: int) -> tuple[bytes, int | None, int | None]:
    """Encode one event, refusing what a reader would refuse, so one bad event cannot make a
    whole chunk (and every event in it) unreadable later.

    The checks mirror ``as_event`` and the reader's limits without decoding the bytes again:
    this runs for every event a traced job produces.
    """
    if not isinstance(ev, Mapping) or not isinstance(ev.get("kind"), str):
        raise TraceFileError(f"event {i} cannot be stored: it needs a string 'kind'")
    seq = _int_or_none(ev.get("seq"))
    if seq is None:
        raise TraceFileError(f"event {i} cannot be stored: it needs an integer 'seq'")
    try:
        data = codec.pack(ev)
    except Exception as exc:  # msgpack raises TypeError/ValueError/OverflowError for bad values
        raise TraceFileError(f"event {i} cannot be stored: {type(exc).__name__}: {exc}") from None
    if len(data) > codec.MAX_MESSAGE_BYTES:
        raise TraceFileError(
            f"event {i} cannot be stored: {len(data)} bytes exceeds the "
            f"{codec.MAX_MESSAGE_BYTES}-byte limit"
        )
    return data, seq, _int_or_none(ev.get("step"))


class TraceWriter:
    """Appends events to a trace file in checksummed chunks.

    ``write`` buffers; a chunk is written when ``chunk_events`` events are buffered, or on a
    ``write`` call at least ``chunk_seconds`` after the previous chunk. ``events_written``
    counts events that have reached the file. ``write``, ``flush`` and ``close`` may be called
    from different threads.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        metadata: Mapping[str, Any] | None = None,
        chunk_events: int = 4096,
        chunk_seconds: float = 0.5,
    ) -> None:
        if chunk_events < 1:
            raise ValueError("chunk_events must be at least 1")
        if chunk_seconds < 0:
            raise ValueError("chunk_seconds must not be negative")
        self.path = os.fspath(path)
        self.chunk_events = chunk_events
        self.chunk_seconds = chunk_seconds
        self.events_written = 0
        self._lock = threading.Lock()
        self._buf: list[bytes] = []
        self._buf_bytes = 0
        self._first_seq = -1
        self._min_step: int | None = None
        self._max_step: int | None = None
        self._index: list[list[int]] = []
        self._closed = False
        self._broken: TraceFileError | None = None
        self._offset = 0

        meta = dict(metadata or {})
        meta.setdefault("created", time.time())
        try:
            body = codec.pack(meta)
            codec.unpack(body, max_bytes=MAX_HEADER_BYTES)
        except Exception as exc:
            raise TraceFileError(
                f"trace metadata cannot be stored: {type(exc).__name__}: {exc}"
            ) from None
        major, minor = codec.PROTOCOL_VERSION
        header = b"".join(
            [MAGIC, _VERSION.pack(major, minor, len(body)), body, _U32.pack(zlib.crc32(body))]
        )
        try:
            self._f = open(self.path, "wb")  # noqa: SIM115 - lives as long as the writer
        except OSError as exc:
            raise TraceFileError(f"cannot create trace file {self.path}: {_reason(exc)}") from None
        try:
            self._put(header)
        except TraceFileError:
            self._f.close()
            raise
        self._last_chunk = _clock()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TraceWriter({self.path!r}, events_written={self.events_written})"

    def write(self, events: Iterable[Mapping[str, Any]]) -> None:
        # Encode outside the lock: it is the expensive part and touches no shared state. A bad
        # event rejects the whole batch before any of it is buffered.
        packed = [_pack_event(ev, i) for i, ev in enumerate(events)]
        with self._lock:
            self._check_usable()
            for data, seq, step in packed:
                if not self._buf:
                    self._first_seq = _clamp64(seq) if seq is not None else -1
                self._buf.append(data)
                self._buf_bytes += len(data)
                if step is not None:
                    step = _clamp64(step)
                    if self._min_step is None or step < self._min_step:
                        self._min_step = step
                    if self._max_step is None or step > self._max_step:
                        self._max_step = step
                if len(self._buf) >= self.chunk_events or self._buf_bytes >= _CHUNK_TARGET_BYTES:
                    self._emit()
            if self._buf and _clock() - self._last_chunk >= self.chunk_seconds:
                self._emit()

    def flush(self) -> None:
        """Write buffered events as a chunk now. A no-op when nothing is buffered or after
        close(), so a background flusher may race with close()."""
        with self._lock:
            if self._closed or not self._buf:
                return
            self._check_usable()
            self._emit()

    def close(self) -> None:
        """Flush, then write the index and trailer. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                # After a failed write the file may end in a partial chunk; an index would then
                # describe a layout that is not there, so leave the file to be read as truncated.
                if self._broken is None:
                    if self._buf:
                        self._emit()
                    payload = codec.pack(self._index)
                    self._put(
                        b"".join(
                            [
                                _RECORD.pack(INDEX_MAGIC, len(payload), zlib.crc32(payload)),
                                payload,
                                _TRAILER.pack(TRAILER_MAGIC, self._offset),
                            ]
                        )
                    )
            finally:
                # _put already flushed everything events_written counts.
                with contextlib.suppress(OSError):
                    self._f.close()

    def _check_usable(self) -> None:
        if self._closed:
            raise TraceFileError(f"trace file {self.path} is closed")
        if self._broken is not None:
            raise TraceFileError(str(self._broken), offset=self._broken.offset)

    def _put(self, data: bytes) -> None:
        # One write() per record, then flush: a kill can only cut the record being written.
        try:
            self._f.write(data)
            self._f.flush()
        except OSError as exc:
            self._broken = TraceFileError(
                f"cannot write trace file {self.path}: {_reason(exc)}", offset=self._offset
            )
            raise self._broken from None
        self._offset += len(data)

    def _emit(self) -> None:
        n = len(self._buf)
        payload = msgpack.Packer().pack_array_header(n) + b"".join(self._buf)
        first_step = self._min_step if self._min_step is not None else _NO_STEP
        last_step = self._max_step if self._max_step is not None else _NO_STEP
        fields = _CHUNK_FIELDS.pack(n, self._first_seq, first_step, last_step)
        crc = zlib.crc32(payload, zlib.crc32(fields))
        offset = self._offset
        self._put(b"".join([_RECORD.pack(CHUNK_MAGIC, len(payload), crc), fields, payload]))
        self._index.append([offset, n, self._first_seq, first_step, last_step])
        self.events_written += n
        self._buf = []
        self._buf_bytes = 0
        self._min_step = self._max_step = None
        self._last_chunk = _clock()


class TraceReader:
    """Reads a trace file, complete or cut short by a killed writer.

    ``complete`` is True iff a valid index and trailer were found. Otherwise the chunks were
    found by scanning, ``truncated`` is True and ``truncated_at`` is the offset just past the
    last complete chunk: everything from there on is ignored.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self.metadata: dict[str, Any] = {}
        self.version: tuple[int, int] = (0, 0)
        self.complete = False
        self.truncated = False
        self.truncated_at: int | None = None
        self.chunks: list[ChunkInfo] = []
        self._ends: list[int] = []  # chunk i occupies [chunks[i].offset, _ends[i])
        self._lock = threading.Lock()
        try:
            self._f = open(self.path, "rb")  # noqa: SIM115 - lives as long as the reader
        except OSError as exc:
            raise TraceFileError(f"cannot open trace file {self.path}: {_reason(exc)}") from None
        try:
            try:
                self._size = os.fstat(self._f.fileno()).st_size
            except OSError as exc:
                raise TraceFileError(
                    f"cannot read trace file {self.path}: {_reason(exc)}"
                ) from None
            self._data_start = self._read_header()
            if not self._load_index():
                self._scan(progress)
        except BaseException:
            self._f.close()
            raise

    def __enter__(self) -> TraceReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __len__(self) -> int:
        return sum(c.n_events for c in self.chunks)

    def __repr__(self) -> str:
        state = "complete" if self.complete else f"truncated at {self.truncated_at}"
        return f"TraceReader({self.path!r}, {len(self.chunks)} chunks, {state})"

    def close(self) -> None:
        with self._lock:
            self._f.close()

    def step_range(self) -> tuple[int, int] | None:
        """(min, max) step over all chunks, or None when no event has an integer step."""
        spans = [
            (c.first_step, c.last_step)
            for c in self.chunks
            if (c.first_step, c.last_step) != (_NO_STEP, _NO_STEP)
        ]
        if not spans:
            return None
        return min(s[0] for s in spans), max(s[1] for s in spans)

    def iter_events(self, *, step: int | None = None, start_chunk: int = 0) -> Iterator[Event]:
        """Events in file order, chunk by chunk. With ``step``, only chunks whose step range
        holds it are decoded, and only events with exactly that step are yielded."""
        for i in range(start_chunk, len(self.chunks)):
            info = self.chunks[i]
            if step is not None and not info.first_step <= step <= info.last_step:
                continue
            events = self.read_chunk(i)
            if step is None:
                yield from events
            else:
                yield from (e for e in events if _int_or_none(e.get("step")) == step)

    def read_chunk(self, i: int) -> list[Event]:
        """Decode and verify chunk ``i``; any damage raises TraceFileError naming its offset."""
        info = self.chunks[i]
        off = info.offset
        payload_len = self._ends[i] - off - _CHUNK_HEAD
        if payload_len > MAX_CHUNK_BYTES:
            raise TraceFileError(
                f"corrupt chunk at offset {off}: {payload_len} bytes exceeds the "
                f"{MAX_CHUNK_BYTES}-byte limit",
                offset=off,
            )
        with self._lock:
            # Read under the lock: seek+read on the shared file object is not atomic.
            head = self._read_at(off, _CHUNK_HEAD)
            payload = self._read_at(off + _CHUNK_HEAD, payload_len)
        if len(head) < _CHUNK_HEAD or len(payload) != payload_len:
            raise TraceFileError(f"corrupt chunk at offset {off}: cut short", offset=off)
        magic, stored_len, crc = _RECORD.unpack_from(head)
        if magic != CHUNK_MAGIC or stored_len != payload_len:
            raise TraceFileError(f"corrupt chunk at offset {off}: bad chunk header", offset=off)
        fields = head[_RECORD.size :]
        if zlib.crc32(payload, zlib.crc32(fields)) != crc:
            raise TraceFileError(f"corrupt chunk at offset {off}: checksum mismatch", offset=off)
        n, first_seq, first_step, last_step = _CHUNK_FIELDS.unpack(fields)
        if (n, first_seq, first_step, last_step) != (
            info.n_events,
            info.first_seq,
            info.first_step,
            info.last_step,
        ):
            raise TraceFileError(
                f"corrupt chunk at offset {off}: header does not match the index", offset=off
            )
        try:
            records = codec.unpack(payload, max_bytes=MAX_CHUNK_BYTES)
            if not isinstance(records, list) or len(records) != n:
                got = len(records) if isinstance(records, list) else type(records).__name__
                raise ProtocolError(f"holds {got} events, header says {n}")
            return [as_event(r) for r in records]
        except ProtocolError as exc:
            raise TraceFileError(f"corrupt chunk at offset {off}: {exc}", offset=off) from None

    def _read_at(self, offset: int, n: int) -> bytes:
        try:
            self._f.seek(offset)
            return self._f.read(n)
        except ValueError:  # I/O on a closed file
            raise TraceFileError(f"trace file {self.path} is closed") from None
        except OSError as exc:
            raise TraceFileError(
                f"cannot read trace file {self.path} at offset {offset}: {_reason(exc)}",
                offset=offset,
            ) from None

    def _read_header(self) -> int:
        """Validate the file header, fill metadata/version, return where chunks start."""
        head = self._read_at(0, _HEADER_FIXED)
        if not head:
            raise TraceFileError("empty file: not a torchscope trace file", offset=0)
        if head[: len(MAGIC)] != MAGIC[: len(head)]:
            raise TraceFileError("not a torchscope trace file (bad magic)", offset=0)
        if len(head) < _HEADER_FIXED:
            raise TraceFileError("truncated trace file: the header is incomplete", offset=0)
        major, minor, header_len = _VERSION.unpack_from(head, len(MAGIC))
        try:
            codec.check_version((major, minor))
        except ProtocolError as exc:
            raise TraceFileError(str(exc), offset=len(MAGIC)) from None
        if header_len > MAX_HEADER_BYTES:
            raise TraceFileError(
                f"corrupt trace file header: length {header_len} exceeds the "
                f"{MAX_HEADER_BYTES}-byte limit",
                offset=len(MAGIC),
            )
        body = self._read_at(_HEADER_FIXED, header_len + _U32.size)
        if len(body) < header_len + _U32.size:
            raise TraceFileError("truncated trace file: the header is incomplete", offset=0)
        (crc,) = _U32.unpack_from(body, header_len)
        body = body[:header_len]
        if zlib.crc32(body) != crc:
            raise TraceFileError(
                f"corrupt trace file header at offset {_HEADER_FIXED}: checksum mismatch",
                offset=_HEADER_FIXED,
            )
        try:
            meta = codec.unpack(body, max_bytes=MAX_HEADER_BYTES)
        except ProtocolError as exc:
            raise TraceFileError(
                f"corrupt trace file header at offset {_HEADER_FIXED}: {exc}",
                offset=_HEADER_FIXED,
            ) from None
        if not isinstance(meta, dict):
            raise TraceFileError(
                f"corrupt trace file header at offset {_HEADER_FIXED}: metadata is not a map",
                offset=_HEADER_FIXED,
            )
        self.metadata = meta
        self.version = (major, minor)
        return _HEADER_FIXED + header_len + _U32.size

    def _load_index(self) -> bool:
        """Use the index written by close() if it is intact and consistent; False otherwise.
        A bad index never raises: the chunks it describes can still be found by scanning."""
        start, size = self._data_start, self._size
        if size - start < _RECORD.size + _TRAILER.size:
            return False
        # Lengths are rechecked after each read: the file may shrink while we look at it.
        trailer = self._read_at(size - _TRAILER.size, _TRAILER.size)
        if len(trailer) != _TRAILER.size:
            return False
        magic, idx_off = _TRAILER.unpack(trailer)
        payload_len = size - _TRAILER.size - _RECORD.size - idx_off
        if magic != TRAILER_MAGIC or idx_off < start or not 0 <= payload_len <= MAX_INDEX_BYTES:
            return False
        record = self._read_at(idx_off, _RECORD.size)
        if len(record) != _RECORD.size:
            return False
        rmagic, stored_len, crc = _RECORD.unpack(record)
        if rmagic != INDEX_MAGIC or stored_len != payload_len:
            return False
        payload = self._read_at(idx_off + _RECORD.size, payload_len)
        if len(payload) != payload_len or zlib.crc32(payload) != crc:
            return False
        try:
            entries = codec.unpack(payload, max_bytes=MAX_INDEX_BYTES)
        except ProtocolError:
            return False
        if not isinstance(entries, list):
            return False
        chunks: list[ChunkInfo] = []
        for entry in entries:
            if not (
                isinstance(entry, list)
                and len(entry) == 5
                and all(type(x) is int and _I64_MIN <= x <= _I64_MAX for x in entry)
            ):
                return False
            chunks.append(ChunkInfo(*entry))
        # Chunks must tile the space between the header and the index exactly.
        offsets = [c.offset for c in chunks] + [idx_off]
        if offsets[0] != start:
            return False
        for a, b in itertools.pairwise(offsets):
            if b - a <= _CHUNK_HEAD:
                return False
        if any(not 0 <= c.n_events < 2**32 for c in chunks):
            return False
        self.chunks = chunks
        self._ends = offsets[1:]
        self.complete = True
        return True

    def _scan(self, progress: Callable[[int, int], None] | None) -> None:
        """Walk chunk headers from the start, checking only lengths; payloads are verified when
        read. A partial record at the end is a killed writer's last write: truncation."""
        pos, size = self._data_start, self._size
        while pos < size:
            head = self._read_at(pos, _CHUNK_HEAD)
            magic = head[: len(CHUNK_MAGIC)]
            if len(magic) < len(CHUNK_MAGIC):
                if not (CHUNK_MAGIC.startswith(magic) or INDEX_MAGIC.startswith(magic)):
                    raise self._bad_magic(pos, magic)
                break
            if magic == INDEX_MAGIC:
                break  # the index of a closed file, damaged (else _load_index would have used it)
            if magic != CHUNK_MAGIC:
                raise self._bad_magic(pos, magic)
            if len(head) < _CHUNK_HEAD:
                break
            _, payload_len, _ = _RECORD.unpack_from(head)
            if payload_len > MAX_CHUNK_BYTES:
                raise TraceFileError(
                    f"corrupt chunk at offset {pos}: length {payload_len} exceeds the "
                    f"{MAX_CHUNK_BYTES}-byte limit",
                    offset=pos,
                )
            end = pos + _CHUNK_HEAD + payload_len
            if end > size:
                break
            n, first_seq, first_step, last_step = _CHUNK_FIELDS.unpack_from(head, _RECORD.size)
            self.chunks.append(ChunkInfo(pos, n, first_seq, first_step, last_step))
            self._ends.append(end)
            pos = end
            if progress is not None and len(self.chunks) % _SCAN_PROGRESS_EVERY == 0:
                progress(pos, size)
        self.truncated = True
        self.truncated_at = pos
        if progress is not None:
            progress(size, size)

    @staticmethod
    def _bad_magic(pos: int, magic: bytes) -> TraceFileError:
        return TraceFileError(
            f"corrupt trace file at offset {pos}: expected a chunk, found {magic!r}", offset=pos
        )


def load_trace(
    path: str | os.PathLike[str], progress: Callable[[int, int], None] | None = None
) -> Trace:
    """Read every event of a trace file into a Trace. The Trace also gets ``metadata`` (the
    file header's map) and ``truncated`` (True when the writer did not close the file, so the
    events end at the last complete chunk)."""
    with TraceReader(path, progress=progress) as reader:
        trace = Trace(reader.iter_events())
        trace.metadata = reader.metadata  # type: ignore[attr-defined]
        trace.truncated = reader.truncated  # type: ignore[attr-defined]
    return trace
