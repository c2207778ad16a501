"""Trace files: torchscope events on disk, readable up to the last chunk after a crash.

Layout, all integers little-endian::

    header   b"TSCTRACE" <HHI major, minor, header_len> msgpack map <I crc32 of the map>
    chunk*   <4sIIIqqqQ b"CHNK", payload_len, crc32, n_events, first_seq, first_step, last_step,
             number> then payload_len bytes: a msgpack array of event maps
    index    <4sII b"INDX", payload_len, crc32 of payload>
             then a msgpack array of [offset, n_events, first_seq, first_step, last_step]
    trailer  <8sQ b"TSCINDEX", offset of the INDX record>

A chunk's crc32 covers the fields after the crc (n_events .. number) and then the payload.
first_step/last_step are the min/max integer ``step`` of its events, -1 when none has one.
``number`` counts the file's chunks from 0, so a reader refuses chunks that were reordered or
duplicated. Files of format 1.0 have no ``number`` (their chunk header ends at last_step) and
are read without that check.
Format 1.2 changes no layout: its files may hold ``aten`` events, which readers of 1.1 read
as a kind they do not know.

Each chunk reaches the OS in one write(), so a writer killed at any moment leaves whole chunks
followed by at most one partial record. Readers treat such a tail as truncation, not
corruption, but only when it really is one: a record whose length runs past the end of the
file while its events end before it is a damaged length. Only close() writes the index and
trailer; without a valid one the reader finds the chunks by walking their headers, and says
whether the writer did not finish (no index) or the index or trailer is damaged.

Every event read is checked against the event schema (``events.check_event``), the one
shared by ``dump``, ``torchscope.load()`` and the UI: a bad event is a TraceFileError naming
the offset of its chunk.

A writer that cannot write (disk full) stops recording, keeps the file readable up to its
last complete chunk, and says so once (``stopped``, ``on_stop``); it never raises into the
traced job after the header is written.

Imports neither torch nor textual.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import itertools
import os
import stat
import struct
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import msgpack

# A platform check (not try/except ImportError) so that mypy types fcntl as the module.
if sys.platform == "win32":  # no advisory locks
    fcntl = None
else:
    import fcntl

from torchscope.protocol import codec
from torchscope.protocol.codec import ProtocolError
from torchscope.protocol.events import Event, check_event, event_problem

__all__ = [
    "FILE_VERSION",
    "MAX_CHUNK_BYTES",
    "ChunkInfo",
    "TraceFileError",
    "TraceReader",
    "TraceWriter",
]

MAGIC = b"TSCTRACE"
CHUNK_MAGIC = b"CHNK"
INDEX_MAGIC = b"INDX"
TRAILER_MAGIC = b"TSCINDEX"

# The file format: its major is the protocol's (codec.check_version refuses another); minor 1
# added chunk numbers, minor 2 aten events (kind "aten", the aten level). Readers read every
# minor of their major: an event of a kind a reader does not know passes the schema check
# (only its step and nesting are checked) and is left out wherever events are taken by kind
# (``Trace.ops``, diff, tables), so a reader of 1.1 reads a 1.2 file without error.
FILE_VERSION = (codec.PROTOCOL_VERSION[0], 2)
_NUMBERED_SINCE_MINOR = 1

_VERSION = struct.Struct("<HHI")  # major, minor, header_len
_U32 = struct.Struct("<I")
_RECORD = struct.Struct("<4sII")  # magic, payload_len, crc32: starts both chunks and the index
_CHUNK_FIELDS = struct.Struct("<IqqqQ")  # n_events, first_seq, first_step, last_step, number
_CHUNK_FIELDS_1_0 = struct.Struct("<Iqqq")  # format 1.0: no number
_CHUNK_HEAD = _RECORD.size + _CHUNK_FIELDS.size  # == struct.calcsize("<4sIIIqqqQ") == 48
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

# Indirections so tests can drive the chunk_seconds timer without sleeping, and hand the
# writer a file that fails (a full disk) without filling one.
_clock = time.monotonic


def _open_for_writing(path: str) -> Any:
    """The file, emptied and locked for this writer alone.

    Locked before it is emptied: a second job given the same path must not truncate the
    first one's recording (both were lost), so it is refused while the first still writes.
    Unbuffered: a record is one write() of our own, and after a failed one no hidden buffer
    is left to be flushed later, behind a truncation."""
    f = open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o666), "wb", buffering=0)  # noqa: SIM115
    try:
        if stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # a pipe or device: written as it is
            if fcntl is not None:
                try:
                    fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise OSError(errno.EBUSY, "another recording is being written to it") from None
            os.ftruncate(f.fileno(), 0)
    except BaseException:
        f.close()
        raise
    return f


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

    The envelope is checked here for every event; the full schema (``check_event``) only
    for the kinds that may carry data the tracer did not build itself (a session's metadata,
    kinds it does not know). Ops and grads, nearly every event of a traced job, are built by
    the tracer in the schema's shape, and this runs for each of them.
    """
    if not isinstance(ev, Mapping) or not isinstance(ev.get("kind"), str):
        raise TraceFileError(f"event {i} cannot be stored: it needs a string 'kind'")
    seq = _int_or_none(ev.get("seq"))
    if seq is None:
        raise TraceFileError(f"event {i} cannot be stored: it needs an integer 'seq'")
    kind = ev["kind"]
    if kind != "op" and kind != "grad":
        why = event_problem(ev if isinstance(ev, dict) else dict(ev))
        if why is not None:
            raise TraceFileError(f"event {i} cannot be stored: {why}")
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


def _say_on_stderr(message: str) -> None:
    with contextlib.suppress(Exception):  # a closed or broken stderr must not reach the job
        print(f"torchscope: {message}", file=sys.stderr, flush=True)


class TraceWriter:
    """Appends events to a trace file in checksummed, numbered chunks.

    ``write`` buffers; a chunk is written when ``chunk_events`` events are buffered, or on a
    ``write`` call at least ``chunk_seconds`` after the previous chunk. ``events_written``
    counts events that have reached the file. ``write``, ``flush`` and ``close`` may be called
    from different threads.

    A header that cannot be written raises TraceFileError and leaves no file behind. After
    that, a failed write (disk full, I/O error) never raises: the writer cuts the file back to
    its last complete chunk, stops recording (later events are dropped, ``write`` and
    ``flush`` do nothing), sets ``stopped`` to a one-line message such as "recording stopped:
    disk full after N events (file readable up to step S); training continues" and passes it,
    once, to ``on_stop`` (by default: printed on stderr). The file then reads as cut short.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        metadata: Mapping[str, Any] | None = None,
        chunk_events: int = 4096,
        chunk_seconds: float = 0.5,
        *,
        on_stop: Callable[[str], None] | None = None,
    ) -> None:
        if chunk_events < 1:
            raise ValueError("chunk_events must be at least 1")
        if chunk_seconds < 0:
            raise ValueError("chunk_seconds must not be negative")
        self.path = os.fspath(path)
        self.chunk_events = chunk_events
        self.chunk_seconds = chunk_seconds
        self.events_written = 0
        self.stopped: str | None = None  # why recording stopped early, once it has
        self.on_stop = on_stop if on_stop is not None else _say_on_stderr
        self._lock = threading.Lock()
        self._buf: list[bytes] = []
        self._buf_bytes = 0
        self._first_seq = -1
        self._min_step: int | None = None
        self._max_step: int | None = None
        self._last_step_written: int | None = None  # the highest step in the file so far
        self._index: list[list[int]] = []
        self._closed = False
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
        major, minor = FILE_VERSION
        header = b"".join(
            [MAGIC, _VERSION.pack(major, minor, len(body)), body, _U32.pack(zlib.crc32(body))]
        )
        try:
            self._f = _open_for_writing(self.path)
        except OSError as exc:
            raise TraceFileError(f"cannot create trace file {self.path}: {_reason(exc)}") from None
        try:
            self._put(header)
        except OSError as exc:
            # Nothing of the recording exists yet: leave no empty or partial file behind
            # (only a regular file: never a device or pipe the path may name, /dev/full).
            with contextlib.suppress(OSError, ValueError):
                if stat.S_ISREG(os.fstat(self._f.fileno()).st_mode):
                    os.unlink(self.path)
            with contextlib.suppress(OSError):
                self._f.close()
            raise TraceFileError(
                f"cannot write trace file {self.path}: {_reason(exc)}", offset=0
            ) from None
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
        if self.stopped is not None and not self._closed:
            return  # recording stopped (disk full): said once already
        # Encode outside the lock: it is the expensive part and touches no shared state. A bad
        # event rejects the whole batch before any of it is buffered.
        packed = [_pack_event(ev, i) for i, ev in enumerate(events)]
        with self._lock:
            if self._closed:
                raise TraceFileError(f"trace file {self.path} is closed")
            if self.stopped is not None:
                return
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
                full = len(self._buf) >= self.chunk_events or self._buf_bytes >= _CHUNK_TARGET_BYTES
                if full and not self._emit():
                    return
            if self._buf and _clock() - self._last_chunk >= self.chunk_seconds:
                self._emit()

    def flush(self) -> None:
        """Write buffered events as a chunk now. A no-op when nothing is buffered, after
        close() (so a background flusher may race with close()) or once recording stopped."""
        with self._lock:
            if self._closed or self.stopped is not None or not self._buf:
                return
            self._emit()

    def close(self) -> None:
        """Flush, then write the index and trailer. Idempotent; never raises for a failed
        write (see the class docstring)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                # After a failed write the file ends at its last complete chunk, without an
                # index: it reads as cut short, which is what it is.
                if self.stopped is None and (not self._buf or self._emit(closing=True)):
                    payload = codec.pack(self._index)
                    try:
                        self._put(
                            b"".join(
                                [
                                    _RECORD.pack(INDEX_MAGIC, len(payload), zlib.crc32(payload)),
                                    payload,
                                    _TRAILER.pack(TRAILER_MAGIC, self._offset),
                                ]
                            )
                        )
                    except OSError as exc:
                        self._stop(
                            f"trace file {self.path}: its index could not be written "
                            f"({self._what_failed(exc)}); all {self.events_written} events "
                            "are still readable"
                        )
            finally:
                with contextlib.suppress(OSError):
                    self._f.close()

    def _put(self, data: bytes) -> None:
        """Write one record with as few write() calls as the OS allows (one, on a regular
        file): a kill can only cut the record being written. Raises OSError; ``_offset``
        moves only past a record that was written whole."""
        view = memoryview(data)
        done, size = 0, len(view)
        while done < size:
            n = self._f.write(view[done:])
            if not n:
                raise OSError(errno.EIO, "write wrote nothing")
            done += n
        self._offset += size

    def _what_failed(self, exc: OSError) -> str:
        if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
            return "disk full"
        return f"cannot write {self.path}: {_reason(exc)}"

    def _stop(self, message: str) -> None:
        """Stop recording after a failed write: cut the file back to its last whole record,
        drop what is buffered, and say ``message`` once. Called with the lock held."""
        with contextlib.suppress(OSError, ValueError):
            os.ftruncate(self._f.fileno(), self._offset)
        self._buf = []
        self._buf_bytes = 0
        self._min_step = self._max_step = None
        if self.stopped is None:
            self.stopped = message
            with contextlib.suppress(Exception):  # the job must never see our reporting fail
                self.on_stop(message)

    def _emit(self, closing: bool = False) -> bool:
        """Write the buffer as the next chunk; False when that failed and recording stopped."""
        n = len(self._buf)
        number = len(self._index)
        payload = msgpack.Packer().pack_array_header(n) + b"".join(self._buf)
        first_step = self._min_step if self._min_step is not None else _NO_STEP
        last_step = self._max_step if self._max_step is not None else _NO_STEP
        fields = _CHUNK_FIELDS.pack(n, self._first_seq, first_step, last_step, number)
        crc = zlib.crc32(payload, zlib.crc32(fields))
        offset = self._offset
        try:
            self._put(b"".join([_RECORD.pack(CHUNK_MAGIC, len(payload), crc), fields, payload]))
        except OSError as exc:
            step = self._last_step_written
            upto = f"file readable up to step {step}" if step is not None else "no step in it"
            self._stop(
                f"recording stopped: {self._what_failed(exc)} after {self.events_written} "
                f"events ({upto})" + ("" if closing else "; training continues")
            )
            return False
        self._index.append([offset, n, self._first_seq, first_step, last_step])
        self.events_written += n
        if self._max_step is not None and (
            self._last_step_written is None or self._max_step > self._last_step_written
        ):
            self._last_step_written = self._max_step
        self._buf = []
        self._buf_bytes = 0
        self._min_step = self._max_step = None
        self._last_chunk = _clock()
        return True


def _decode_events(payload: bytes | memoryview, n: int) -> list[Event]:
    """The events of a chunk payload, each checked against the event schema; ProtocolError
    for anything else.

    The cyclic garbage collector is paused meanwhile: a chunk is thousands of new containers,
    and collections triggered by allocating them (that can free none of them) cost as much
    as the decoding itself.
    """
    enabled = gc.isenabled()
    if enabled:
        gc.disable()
    try:
        records = codec.unpack(payload, max_bytes=MAX_CHUNK_BYTES)
        if type(records) is not list or len(records) != n:
            got = len(records) if isinstance(records, list) else type(records).__name__
            raise ProtocolError(f"holds {got} events, header says {n}")
        return [check_event(r) for r in records]
    finally:
        if enabled:
            gc.enable()


class _IndexProblem(Exception):
    """Why an index or trailer cannot be used (a few words, for a message)."""


class TraceReader:
    """Reads a trace file, complete or cut short by a killed writer.

    ``complete`` is True iff a valid index and trailer were found. Otherwise the chunks were
    found by scanning, and either

    - ``truncated`` is True: the writer did not finish (no index), and ``truncated_at`` is the
      offset just past the last complete chunk; everything from there on is ignored; or
    - ``damaged`` says which of the index or the trailer is damaged (one line): the writer
      finished, and every chunk was found anyway.

    Chunks are verified when read (``read_chunk``): checksum, number (files of format 1.1 on:
    reordered or duplicated chunks are refused) and every event against the event schema.
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
        self.damaged: str | None = None
        self.chunks: list[ChunkInfo] = []
        self._ends: list[int] = []  # chunk i occupies [chunks[i].offset, _ends[i])
        self._lock = threading.Lock()
        self._fields = _CHUNK_FIELDS
        self._head = _CHUNK_HEAD
        self._trailer_points_to: int | None = None  # where an intact-looking trailer points
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
            try:
                self._load_index()
            except _IndexProblem as exc:
                self._scan(progress, str(exc))
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
        if self.complete:
            state = "complete"
        elif self.truncated:
            state = f"truncated at {self.truncated_at}"
        else:
            state = f"damaged: {self.damaged}"
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
        read_chunk = self.read_chunk
        for i in range(start_chunk, len(self.chunks)):
            if step is None:
                yield from read_chunk(i)
                continue
            info = self.chunks[i]
            if info.first_step <= step <= info.last_step:
                for e in read_chunk(i):
                    s = e.get("step")
                    if s == step and type(s) is int:
                        yield e

    def read_chunk(self, i: int) -> list[Event]:
        """Decode and verify chunk ``i``; any damage raises TraceFileError naming its offset."""
        info = self.chunks[i]
        off = info.offset
        head_len = self._head
        payload_len = self._ends[i] - off - head_len
        if payload_len > MAX_CHUNK_BYTES:
            raise TraceFileError(
                f"corrupt chunk at offset {off}: {payload_len} bytes exceeds the "
                f"{MAX_CHUNK_BYTES}-byte limit",
                offset=off,
            )
        with self._lock:
            # Read under the lock: seek+read on the shared file object is not atomic.
            data = self._read_at(off, head_len + payload_len)
        if len(data) != head_len + payload_len:
            raise TraceFileError(f"corrupt chunk at offset {off}: cut short", offset=off)
        magic, stored_len, crc = _RECORD.unpack_from(data)
        if magic != CHUNK_MAGIC or stored_len != payload_len:
            raise TraceFileError(f"corrupt chunk at offset {off}: bad chunk header", offset=off)
        view = memoryview(data)
        if zlib.crc32(view[head_len:], zlib.crc32(view[_RECORD.size : head_len])) != crc:
            raise TraceFileError(f"corrupt chunk at offset {off}: checksum mismatch", offset=off)
        fields = self._fields.unpack_from(data, _RECORD.size)
        if len(fields) > 4 and fields[4] != i:
            raise TraceFileError(
                f"corrupt trace file at offset {off}: found chunk {fields[4]} where chunk {i} "
                "belongs (chunks reordered or duplicated)",
                offset=off,
            )
        n, first_seq, first_step, last_step = fields[:4]
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
            return _decode_events(view[head_len:], n)
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
        if minor < _NUMBERED_SINCE_MINOR:
            self._fields = _CHUNK_FIELDS_1_0
            self._head = _RECORD.size + _CHUNK_FIELDS_1_0.size
        return _HEADER_FIXED + header_len + _U32.size

    def _load_index(self) -> None:
        """Use the index written by close() if it and the trailer are intact and consistent;
        else raise _IndexProblem saying why (the chunks can still be found by scanning)."""
        start, size = self._data_start, self._size
        if size - start < _RECORD.size + _TRAILER.size:
            raise _IndexProblem("no trailer")
        trailer = self._read_at(size - _TRAILER.size, _TRAILER.size)
        if len(trailer) != _TRAILER.size:  # the file shrank while we looked at it
            raise _IndexProblem("no trailer")
        magic, idx_off = _TRAILER.unpack(trailer)
        if magic != TRAILER_MAGIC:
            raise _IndexProblem(f"bad magic {magic!r}")
        if not start <= idx_off <= size - _TRAILER.size - _RECORD.size:
            raise _IndexProblem(f"it points at offset {idx_off}, outside the file")
        self._trailer_points_to = idx_off
        chunks, ends = self._parse_index(idx_off)
        # Chunks must tile the space between the header and the index exactly.
        offsets = [c.offset for c in chunks] + [idx_off]
        if offsets[0] != start:
            raise _IndexProblem("its first chunk is not where the chunks start")
        for a, b in itertools.pairwise(offsets):
            if b - a <= self._head:
                raise _IndexProblem("its chunk offsets do not follow each other")
        self.chunks = chunks
        self._ends = ends
        self.complete = True

    def _parse_index(self, idx_off: int) -> tuple[list[ChunkInfo], list[int]]:
        """The INDX record at ``idx_off``, which must end where the trailer starts."""
        size = self._size
        payload_len = size - _TRAILER.size - _RECORD.size - idx_off
        if not 0 <= payload_len <= MAX_INDEX_BYTES:
            raise _IndexProblem(f"its length {payload_len} is impossible")
        record = self._read_at(idx_off, _RECORD.size)
        if len(record) != _RECORD.size:
            raise _IndexProblem("cut short")
        rmagic, stored_len, crc = _RECORD.unpack(record)
        if rmagic != INDEX_MAGIC:
            raise _IndexProblem(f"bad magic {rmagic!r}")
        if stored_len != payload_len:
            raise _IndexProblem(
                f"its length field says {stored_len} bytes, the file leaves {payload_len}"
            )
        payload = self._read_at(idx_off + _RECORD.size, payload_len)
        if len(payload) != payload_len:
            raise _IndexProblem("cut short")
        if zlib.crc32(payload) != crc:
            raise _IndexProblem("checksum mismatch")
        try:
            entries = codec.unpack(payload, max_bytes=MAX_INDEX_BYTES)
        except ProtocolError as exc:
            raise _IndexProblem(str(exc)) from None
        if not isinstance(entries, list):
            raise _IndexProblem("it is not a list")
        chunks: list[ChunkInfo] = []
        for entry in entries:
            if not (
                isinstance(entry, list)
                and len(entry) == 5
                and all(type(x) is int and _I64_MIN <= x <= _I64_MAX for x in entry)
                and 0 <= entry[1] < 2**32
            ):
                raise _IndexProblem(f"malformed entry {len(chunks)}")
            chunks.append(ChunkInfo(*entry))
        ends = [c.offset for c in chunks[1:]] + [idx_off]
        return chunks, ends

    def _scan(self, progress: Callable[[int, int], None] | None, index_problem: str) -> None:
        """Walk chunk headers from the start, checking only lengths; payloads are verified when
        read. A partial record at the end is a killed writer's last write: truncation. The
        INDX record of a closed file whose index or trailer is damaged ends the walk."""
        pos, size, head_len = self._data_start, self._size, self._head
        fields_struct = self._fields
        found_index = False
        while pos < size:
            head = self._read_at(pos, head_len)
            magic = head[: len(CHUNK_MAGIC)]
            if len(magic) < len(CHUNK_MAGIC):
                if not (CHUNK_MAGIC.startswith(magic) or INDEX_MAGIC.startswith(magic)):
                    raise self._bad_magic(pos, magic)
                break
            if magic == INDEX_MAGIC or (magic != CHUNK_MAGIC and pos == self._trailer_points_to):
                found_index = True  # the trailer (intact) or the INDX magic says: the index
                break
            if magic != CHUNK_MAGIC:
                raise self._bad_magic(pos, magic)
            if len(head) < head_len:
                break  # the end of the file: a partial header
            _, payload_len, _ = _RECORD.unpack_from(head)
            if payload_len > MAX_CHUNK_BYTES:
                raise TraceFileError(
                    f"corrupt chunk at offset {pos}: length {payload_len} exceeds the "
                    f"{MAX_CHUNK_BYTES}-byte limit",
                    offset=pos,
                )
            fields = fields_struct.unpack_from(head, _RECORD.size)
            end = pos + head_len + payload_len
            if end > size:
                self._check_cut_short(pos, payload_len, fields[0])
                break
            self.chunks.append(ChunkInfo(pos, *fields[:4]))
            self._ends.append(end)
            pos = end
            if progress is not None and len(self.chunks) % _SCAN_PROGRESS_EVERY == 0:
                progress(pos, size)
        if found_index and not self._index_cut_short(pos):
            self.damaged = self._describe_damage(pos, index_problem)
        else:
            self.truncated = True
            self.truncated_at = pos
        if progress is not None:
            progress(size, size)

    def _index_cut_short(self, idx_off: int) -> bool:
        """Whether the file ends inside the index record at ``idx_off`` or its trailer: the
        writer was killed while closing the file, after its last chunk. Not so when an intact
        trailer points at it: the writer finished, and a length in the record is damaged."""
        if idx_off == self._trailer_points_to:
            return False
        record = self._read_at(idx_off, _RECORD.size)
        if len(record) < _RECORD.size:
            return True
        _, stored_len, _ = _RECORD.unpack(record)
        return idx_off + _RECORD.size + stored_len + _TRAILER.size > self._size

    def _describe_damage(self, idx_off: int, index_problem: str) -> str:
        """One line on what is damaged, the index at ``idx_off`` or the trailer after it."""
        n = len(self)
        tail = f"read the {n} events of all {len(self.chunks)} chunks by scanning"
        try:
            chunks, _ = self._parse_index(idx_off)
        except _IndexProblem as exc:
            return f"the index at offset {idx_off} is damaged ({exc}); {tail}"
        if chunks != self.chunks:
            return f"the index at offset {idx_off} does not match the chunks; {tail}"
        at = self._size - _TRAILER.size
        points_to = self._trailer_points_to
        if points_to is not None and points_to != idx_off:
            index_problem = f"it points at offset {points_to}, not at the index"
        return f"the trailer at offset {at} is damaged ({index_problem}); {tail}"

    def _check_cut_short(self, pos: int, payload_len: int, n: int) -> None:
        """A chunk at ``pos`` whose length runs past the end of the file: a killed writer's
        partial last write, or a damaged length field? A partial write holds a strict prefix
        of the chunk's msgpack array, which never decodes whole; a damaged length sits on a
        chunk whose array is complete, with more bytes after it. Raise for the latter."""
        avail = self._size - pos - self._head
        data = self._read_at(pos + self._head, avail)
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(avail, 1))
        unpacker.feed(data)
        try:
            count = unpacker.read_array_header()
            for _ in range(count):
                unpacker.skip()
        except msgpack.OutOfData:
            return  # a prefix of a chunk: truncation
        except Exception as exc:
            raise TraceFileError(
                f"corrupt chunk at offset {pos}: its length field says {payload_len} bytes, "
                f"past the end of the file, and the {avail} bytes there are not a chunk's "
                f"start ({type(exc).__name__})",
                offset=pos,
            ) from None
        used = unpacker.tell()
        raise TraceFileError(
            f"corrupt chunk at offset {pos}: its length field says {payload_len} bytes, past "
            f"the end of the file, but its {count} events end after {used} bytes "
            f"({avail - used} more bytes follow; header says {n} events)",
            offset=pos,
        )

    @staticmethod
    def _bad_magic(pos: int, magic: bytes) -> TraceFileError:
        return TraceFileError(
            f"corrupt trace file at offset {pos}: expected a chunk, found {magic!r}", offset=pos
        )


def per_rank_path(path: str, rank: int | None = None) -> str:
    """Where rank ``rank`` of a multi-process job records ``path``: ``trace.tsc`` becomes
    ``trace.rank1.tsc`` (every rank would otherwise write the same file). ``rank`` defaults
    to the ``RANK`` environment variable torchrun sets; without it, ``path`` as it is."""
    if rank is None:
        try:
            rank = int(os.environ["RANK"])
        except (KeyError, ValueError):
            return path
    head, tail = os.path.split(path)
    stem, dot, ext = tail.rpartition(".")
    name = f"{stem}.rank{rank}.{ext}" if dot and stem else f"{tail}.rank{rank}"
    return os.path.join(head, name)
