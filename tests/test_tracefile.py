"""Trace file format: round trips, seeking by step, truncation, corruption, crash safety."""

from __future__ import annotations

import math
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from torchscope.analysis.trace import load_trace
from torchscope.protocol import codec, tracefile
from torchscope.protocol.tracefile import TraceFileError, TraceReader, TraceWriter

REPO = Path(__file__).resolve().parents[1]


def ev(seq: int, step: int | None = 0, **extra: object) -> dict:
    return {"kind": "op", "seq": seq, "step": step, **extra}


def make_trace(path: Path, n: int = 6, chunk_events: int = 2) -> bytes:
    with TraceWriter(path, {"run": "t"}, chunk_events=chunk_events, chunk_seconds=1e9) as w:
        w.write([ev(i, step=i // 2, name=f"op{i}") for i in range(n)])
    return path.read_bytes()


def index_offset(data: bytes) -> int:
    magic, offset = struct.unpack("<8sQ", data[-16:])
    assert magic == b"TSCINDEX" and data[offset : offset + 4] == b"INDX"
    return offset


def read_all(path: Path) -> tuple[TraceReader, list[dict]]:
    with TraceReader(path) as r:
        return r, list(r.iter_events())


def test_round_trip_preserves_values_and_metadata(tmp_path: Path) -> None:
    odd = {"nested": {"a": [1, [2, {"b": None}]], "c": {}}, "raw": b"\x00\xff", "text": "é∂"}
    odd.update(nan=math.nan, inf=math.inf, ninf=-math.inf, big=2**63 - 1)
    p = tmp_path / "t.tsc"
    with TraceWriter(p, {"model": "mlp", "world": 2}, chunk_events=2) as w:
        w.write([ev(i, **odd) for i in range(5)])
    trace = load_trace(p)
    assert trace.truncated is False
    assert trace.metadata["model"] == "mlp" and isinstance(trace.metadata["created"], float)
    assert [e.seq for e in trace] == list(range(5))
    for e in trace:
        assert e.nested == odd["nested"] and e.raw == b"\x00\xff" and e.text == "é∂"
        assert math.isnan(e.nan) and e.inf == math.inf and e.ninf == -math.inf
        assert e.big == 2**63 - 1


def test_index_is_used_without_scanning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "t.tsc"
    make_trace(p, n=7, chunk_events=3)
    monkeypatch.setattr(TraceReader, "_scan", lambda self, progress: pytest.fail("scanned"))
    calls: list[tuple[int, int]] = []
    with TraceReader(p, progress=lambda done, total: calls.append((done, total))) as r:
        assert r.complete and not r.truncated and r.truncated_at is None
        assert [c.n_events for c in r.chunks] == [3, 3, 1]
        assert [c.first_seq for c in r.chunks] == [0, 3, 6]
        assert [(c.first_step, c.last_step) for c in r.chunks] == [(0, 1), (1, 2), (3, 3)]
        assert len(r) == 7 and r.version == tracefile.FILE_VERSION
    assert calls == []


def test_step_filter_decodes_only_matching_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = tmp_path / "t.tsc"
    with TraceWriter(p, chunk_events=4) as w:
        w.write([ev(0, step=None)] + [ev(i, step=(i - 1) // 3) for i in range(1, 19)])
    decoded: list[int] = []
    real = TraceReader.read_chunk
    monkeypatch.setattr(TraceReader, "read_chunk", lambda s, i: decoded.append(i) or real(s, i))
    with TraceReader(p) as r:
        assert r.step_range() == (0, 5)
        got = [e.seq for e in r.iter_events(step=3)]
        assert got == [10, 11, 12]
        assert decoded == [2, 3]  # chunks [8..11] and [12..15]; the other three are skipped
        assert [e.seq for e in r.iter_events(start_chunk=4)] == [16, 17, 18]
        assert list(r.iter_events(step=99)) == []
    with TraceWriter(tmp_path / "none.tsc") as w:
        w.write([ev(0, step=None)])
    with TraceReader(tmp_path / "none.tsc") as r:
        assert r.step_range() is None and r.chunks[0].first_step == -1


def test_chunks_cut_by_count(tmp_path: Path) -> None:
    p = tmp_path / "t.tsc"
    with TraceWriter(p, chunk_events=4, chunk_seconds=1e9) as w:
        for i in range(10):
            w.write([ev(i)])
            assert w.events_written == (i + 1) // 4 * 4
        w.write([ev(i) for i in range(10, 20)])  # a big batch is still cut every 4 events
    with TraceReader(p) as r:
        assert [c.n_events for c in r.chunks] == [4, 4, 4, 4, 4]
        assert [c.first_seq for c in r.chunks] == [0, 4, 8, 12, 16]


def test_chunks_cut_by_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(tracefile, "_clock", lambda: now[0])
    p = tmp_path / "t.tsc"
    w = TraceWriter(p, chunk_events=1000, chunk_seconds=0.5)
    w.write([ev(0)])
    for seq, t, written in ((1, 100.4, 0), (2, 100.5, 3), (3, 100.9, 3)):  # 0.5 s since a chunk
        now[0] = t
        w.write([ev(seq)])
        assert w.events_written == written
    with TraceReader(p) as r:  # the writer is still open: what is on disk is already readable
        assert [c.n_events for c in r.chunks] == [3] and r.truncated and not r.complete
    for _ in range(2):  # the second flush has nothing to write; close is idempotent
        w.flush()
        w.close()
    with TraceReader(p) as r:
        assert [c.n_events for c in r.chunks] == [3, 1] and r.complete


def test_truncation_at_every_byte_offset(tmp_path: Path) -> None:
    full = tmp_path / "full.tsc"
    data = make_trace(full, n=6, chunk_events=2)
    with TraceReader(full) as r:
        assert r.complete and len(r.chunks) == 3
        start = r.chunks[0].offset
        ends = [c.offset for c in r.chunks[1:]] + [index_offset(data)]
    cut_path = tmp_path / "cut.tsc"
    for cut in range(len(data)):
        cut_path.write_bytes(data[:cut])
        if cut < start:
            with pytest.raises(TraceFileError, match=r"not a torchscope|header is incomplete"):
                TraceReader(cut_path)
            continue
        n_chunks = sum(1 for e in ends if e <= cut)
        r, events = read_all(cut_path)
        assert (r.truncated, r.complete) == (True, False), cut
        assert len(r.chunks) == n_chunks, cut
        assert r.truncated_at == (ends[n_chunks - 1] if n_chunks else start)
        assert [e.seq for e in events] == list(range(2 * n_chunks)), cut
        assert r.metadata["run"] == "t"


CHILD = """
import sys
from torchscope.protocol.tracefile import TraceWriter
w = TraceWriter(sys.argv[1], chunk_events=400, chunk_seconds=60)
seq = 0
while True:
    w.write([{"kind": "op", "seq": seq + i, "step": seq // 4000, "pad": "x" * 300}
             for i in range(400)])
    seq += 400
    print(w.events_written // 400, flush=True)
"""


def test_sigkill_leaves_readable_file(tmp_path: Path) -> None:
    p = tmp_path / "killed.tsc"
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(p)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
        env=env,
    )
    try:
        reported = 0
        deadline = time.monotonic() + 30
        while reported < 25 and time.monotonic() < deadline:
            line = child.stdout.readline()
            assert line, child.stderr.read().decode()
            reported = int(line)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
        child.stderr.close()
    assert reported >= 25
    r, events = read_all(p)
    assert r.truncated and not r.complete
    assert len(r) >= 25 * 400 and len(events) == len(r)
    assert [e.seq for e in events] == list(range(len(events)))


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("with_index", [True, False])
def test_flipped_payload_byte_names_the_chunk(tmp_path: Path, with_index: bool) -> None:
    p = tmp_path / "t.tsc"
    data = make_trace(p)
    with TraceReader(p) as r:
        bad = r.chunks[1].offset
    if not with_index:
        p.write_bytes(data[: index_offset(data)])
    flip(p, bad + 45)
    with TraceReader(p) as r:
        assert r.complete is with_index
        assert [e.seq for e in r.read_chunk(0)] == [0, 1]
        with pytest.raises(TraceFileError, match=f"offset {bad}: checksum mismatch") as info:
            list(r.iter_events())
        assert info.value.offset == bad


def test_bad_chunk_magic_is_corruption_not_truncation(tmp_path: Path) -> None:
    p = tmp_path / "t.tsc"
    data = bytearray(make_trace(p))
    with TraceReader(p) as r:
        bad, index_at = r.chunks[1].offset, index_offset(data)
    data[bad : bad + 4] = b"JUNK"
    p.write_bytes(bytes(data))
    with TraceReader(p) as r, pytest.raises(TraceFileError, match=f"offset {bad}: bad chunk"):
        r.read_chunk(1)
    p.write_bytes(bytes(data[:index_at]))  # no index: the scan hits it
    with pytest.raises(TraceFileError, match=f"offset {bad}") as info:
        TraceReader(p)
    assert info.value.offset == bad


def test_damaged_index_falls_back_to_scanning(tmp_path: Path) -> None:
    p = tmp_path / "t.tsc"
    data = make_trace(p)
    size, index_at = len(data), index_offset(data)
    flip(p, index_at + 13)
    calls: list[tuple[int, int]] = []
    with TraceReader(p, progress=lambda done, total: calls.append((done, total))) as r:
        # The writer finished: the file is not "cut short", its index is damaged.
        assert not r.complete and not r.truncated and r.truncated_at is None
        assert f"index at offset {index_at} is damaged (checksum mismatch)" in r.damaged
        assert [e.seq for e in r.iter_events()] == list(range(6))
    assert calls[-1] == (size, size)


def test_any_single_flipped_byte_raises_only_trace_file_error(tmp_path: Path) -> None:
    p = tmp_path / "t.tsc"
    data = make_trace(p)
    for off in range(len(data)):
        p.write_bytes(data)
        flip(p, off)
        try:
            events = read_all(p)[1]
        except TraceFileError as exc:
            assert "\n" not in str(exc)
        else:
            assert all(e.kind == "op" for e in events)


def test_not_trace_files(tmp_path: Path) -> None:
    p = tmp_path / "x.tsc"
    for content in (b"", b"#!/bin/sh\n" + os.urandom(200), b"TSCTRACX" + bytes(100)):
        p.write_bytes(content)
        with pytest.raises(TraceFileError, match="not a torchscope trace file"):
            TraceReader(p)
    with pytest.raises(TraceFileError, match="cannot open"):
        TraceReader(tmp_path / "missing.tsc")
    with pytest.raises(TraceFileError, match="cannot create"):
        TraceWriter(tmp_path / "no" / "dir.tsc")


def test_header_only_and_empty_files(tmp_path: Path) -> None:
    p = tmp_path / "t.tsc"
    w = TraceWriter(p, {"run": 1})
    with TraceReader(p) as r:  # writer killed before its first chunk
        assert (len(r), r.chunks, r.truncated, r.complete) == (0, [], True, False)
        assert r.metadata["run"] == 1 and r.truncated_at == p.stat().st_size
    header = p.read_bytes()
    w.close()
    with TraceReader(p) as r:
        assert (len(r), r.complete, r.truncated, r.step_range()) == (0, True, False, None)
    p.write_bytes(header + b"Zzzz" + bytes(60))
    with pytest.raises(TraceFileError, match=f"offset {len(header)}: expected a chunk"):
        TraceReader(p)


def test_future_major_version_refused(tmp_path: Path) -> None:
    p = tmp_path / "t.tsc"
    data = bytearray(make_trace(p))
    major = codec.PROTOCOL_VERSION[0] + 1
    data[8:12] = struct.pack("<HH", major, 0)
    p.write_bytes(bytes(data))
    with pytest.raises(TraceFileError, match=f"version {major}\\.0 .*upgrade torchscope"):
        TraceReader(p)


def aten_call(seq: int, op_seq: int) -> dict:
    """An aten event as the tracer writes one at the aten level (format 1.2 on)."""
    out = {"shape": [], "dtype": "float32", "device": "cpu", "values": [4.0]}
    out["stats"] = {"min": 4.0, "max": 4.0, "mean": 4.0, "std": 0.0, "norm": 4.0, "nan": 0}
    return {
        "kind": "aten",
        "seq": seq,
        "step": 0,
        "name": "aten.mul.Tensor",
        "module": "",
        "op_seq": op_seq,
        "node_id": None,
        "node": None,
        "inputs": [out],
        "outputs": [out],
    }


def set_minor(path: Path, minor: int) -> None:
    """Rewrite the header's minor version (the header's crc covers only its metadata)."""
    data = bytearray(path.read_bytes())
    major, _ = struct.unpack_from("<HH", data, 8)
    struct.pack_into("<HH", data, 8, major, minor)
    path.write_bytes(bytes(data))


def test_files_written_now_are_format_1_2_and_hold_aten_events(tmp_path: Path) -> None:
    p = tmp_path / "t.tsc"
    with TraceWriter(p, chunk_events=2) as w:
        w.write([aten_call(0, op_seq=1), ev(1, name="Tensor.mul"), aten_call(2, op_seq=3)])
    assert struct.unpack_from("<HH", p.read_bytes(), 8) == (1, 2)  # major, minor on disk
    trace = load_trace(p)
    assert tracefile.FILE_VERSION == (1, 2) and codec.PROTOCOL_VERSION[0] == 1
    assert [(e.kind, e.seq) for e in trace] == [("aten", 0), ("op", 1), ("aten", 2)]
    assert trace.events[0].outputs[0]["values"] == [4.0] and trace.events[2].op_seq == 3
    with TraceReader(p) as r:
        assert r.version == (1, 2) and r.complete


@pytest.mark.parametrize("minor", [3, 99])
def test_a_newer_minor_with_an_unknown_kind_reads_with_that_kind_left_out(
    tmp_path: Path, minor: int
) -> None:
    """A file from a newer torchscope of the same major: read whole, without error; the kind
    this reader does not know is in the events but in no view by kind, nor in a diff."""
    from torchscope.analysis.diff import Options, compare

    p = tmp_path / "newer.tsc"
    future = {"kind": "hologram", "seq": 1, "step": 0, "frames": [[1, 2], {"a": None}]}
    with TraceWriter(p, chunk_events=2) as w:
        w.write([ev(0, name="Tensor.add"), future, ev(2, name="Tensor.mul")])
    set_minor(p, minor)
    trace = load_trace(p)
    assert trace.truncated is False and trace.damaged is None
    with TraceReader(p) as r:
        assert r.version == (1, minor) and r.complete
    assert [e.seq for e in trace] == [0, 1, 2]
    assert [e.seq for e in trace.ops] == [0, 2] and trace.grads == trace.alerts == []
    res = compare(trace, load_trace(p), Options(exact=True))
    assert res.same and res.matched == 2 and res.only_a == res.only_b == 0
    for cmd in (["dump", str(p)], ["diff", str(p), str(p)]):
        run = subprocess.run(
            [sys.executable, "-m", "torchscope", *cmd],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=60,
        )
        assert run.returncode == 0 and run.stderr == "", (cmd, run.stderr)


def test_a_1_1_reader_reads_the_aten_events_of_a_1_2_file_as_an_unknown_kind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader from before the aten level: its schema has no "aten" kind. The events still
    pass its check (as a kind it does not know) and the file reads whole."""
    from torchscope.protocol import events

    p = tmp_path / "t.tsc"
    with TraceWriter(p) as w:
        w.write([aten_call(0, op_seq=1), ev(1, name="Tensor.mul")])
    monkeypatch.delitem(events._SCHEMA, "aten")
    trace = load_trace(p)
    assert [(e.kind, e.seq) for e in trace] == [("aten", 0), ("op", 1)]
    assert [e.seq for e in trace.ops] == [1]


def test_unstorable_events_are_rejected_whole_batch(tmp_path: Path) -> None:
    p = tmp_path / "t.tsc"
    with TraceWriter(p, chunk_events=1) as w:
        w.write([ev(0)])
        for bad in ({"kind": "op"}, {"kind": "op", "seq": "1"}, ev(1, x=object())):
            with pytest.raises(TraceFileError, match="event 1 cannot be stored"):
                w.write([ev(1), bad])
        assert w.events_written == 1
    assert [e.seq for e in load_trace(p)] == [0]
    with pytest.raises(TraceFileError, match="closed"):
        w.write([ev(2)])


def test_two_writer_threads_and_a_flusher(tmp_path: Path) -> None:
    p = tmp_path / "t.tsc"
    w = TraceWriter(p, chunk_events=16, chunk_seconds=0.001)
    stop = threading.Event()

    def produce(base: int) -> None:
        for i in range(0, 3000, 3):
            w.write([ev(base + i + k, step=i // 300) for k in range(3)])

    def flusher() -> None:
        while not stop.is_set():
            w.flush()

    threads = [threading.Thread(target=produce, args=(b,)) for b in (0, 10_000)]
    background = threading.Thread(target=flusher)
    for t in [*threads, background]:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    background.join()
    w.close()
    r, events = read_all(p)
    assert r.complete and w.events_written == 6000 == len(r)
    seqs = [e.seq for e in events]
    assert sorted(seqs) == [*range(3000), *range(10_000, 13_000)]
    for base in (0, 10_000):  # each thread's events keep their order
        mine = [s for s in seqs if base <= s < base + 3000]
        assert mine == sorted(mine)


def test_encoding_after_a_refused_object_starts_clean():
    """The codec reuses one msgpack Packer per thread: an object it refuses must not leave
    half an encoding behind for the next message."""
    import msgpack

    from torchscope.protocol import codec

    with pytest.raises(TypeError):
        codec.pack({"kind": "op", "seq": 1, "bad": [1, 2, object()]})
    good = {"kind": "op", "seq": 2, "outputs": [{"shape": [2, 3]}]}
    assert codec.pack(good) == msgpack.packb(good, use_bin_type=True)
    assert codec.unpack(codec.pack(good)) == good


def test_a_second_writer_of_the_same_file_is_refused_and_the_first_recording_survives(tmp_path):
    path = tmp_path / "same.tsc"
    first = TraceWriter(path)
    first.write([{"kind": "step", "seq": 0, "step": 0}])
    first.flush()
    with pytest.raises(TraceFileError, match="another recording is being written to it"):
        TraceWriter(path)  # it used to empty the file and write its own header over it
    first.write([{"kind": "step", "seq": 1, "step": 1}])
    first.close()
    assert [e["seq"] for e in read_all(path)[1]] == [0, 1]
    TraceWriter(path).close()  # free again once the first writer is done
