"""Crafted and damaged trace files, and full disks: every reader (``dump``, ``load()``, the UI's
TraceReader) refuses a bad file with one line naming the offset, reads every event of a file
whose index alone is damaged, and a writer that runs out of disk stops cleanly.

Crafted files carry valid checksums, so only the reader's own checks stand between them and
the renderers. Everything here is seeded and small: the module runs in a few seconds.
"""

from __future__ import annotations

import copy
import errno
import json
import math
import os
import random
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import msgpack
import pytest

import torchscope
from torchscope import cli
from torchscope.analysis.render import text_line
from torchscope.analysis.trace import load_trace
from torchscope.protocol import tracefile
from torchscope.protocol.codec import ProtocolError
from torchscope.protocol.events import MAX_EVENT_DEPTH, check_event, event_problem
from torchscope.protocol.jsontext import json_safe as _json_safe
from torchscope.protocol.jsontext import to_jsonl
from torchscope.protocol.tracefile import TraceFileError, TraceReader, TraceWriter
from torchscope.tui.demo.synthetic import make_trace

REPO = Path(__file__).resolve().parents[1]


# -- crafting files by hand ------------------------------------------------------------------
def header(meta: dict | None = None, version: tuple[int, int] = tracefile.FILE_VERSION) -> bytes:
    body = msgpack.packb(meta or {"crafted": True}, use_bin_type=True)
    return (
        b"TSCTRACE"
        + struct.pack("<HHI", *version, len(body))
        + body
        + struct.pack("<I", zlib.crc32(body))
    )


def chunk(
    payload: bytes, n: int, number: int | None, first_seq: int = 0, steps: tuple = (0, 0)
) -> bytes:
    """A chunk record with a valid checksum; ``number`` None: the 1.0 layout."""
    if number is None:
        fields = struct.pack("<Iqqq", n, first_seq, *steps)
    else:
        fields = struct.pack("<IqqqQ", n, first_seq, *steps, number)
    crc = zlib.crc32(payload, zlib.crc32(fields))
    return struct.pack("<4sII", b"CHNK", len(payload), crc) + fields + payload


def events_payload(events: list) -> bytes:
    return msgpack.packb(events, use_bin_type=True)


def index_and_trailer(entries: list[list[int]], at: int) -> bytes:
    payload = msgpack.packb(entries)
    return (
        struct.pack("<4sII", b"INDX", len(payload), zlib.crc32(payload))
        + payload
        + struct.pack("<8sQ", b"TSCINDEX", at)
    )


def craft(path: Path, chunks: list[bytes], *, version=tracefile.FILE_VERSION, index=True) -> Path:
    """A file of ``chunks`` (records), with an index that tiles them when ``index``."""
    data = header(version=version)
    entries = []
    for rec in chunks:
        n, first_seq, s0, s1 = struct.unpack_from("<Iqqq", rec, 12)
        entries.append([len(data), n, first_seq, s0, s1])
        data += rec
    if index:
        data += index_and_trailer(entries, len(data))
    path.write_bytes(data)
    return path


def op(seq: int, step: int = 0, **extra: Any) -> dict:
    out = {"shape": [2], "dtype": "float32", "device": "cpu", "values": [1.0, 2.0]}
    out["stats"] = {
        "min": 1.0,
        "max": 2.0,
        "mean": 1.5,
        "std": 0.7,
        "norm": 2.2,
        "nan": 0,
        "inf": 0,
    }
    return {"kind": "op", "seq": seq, "step": step, "name": "Tensor.mul", "outputs": [out], **extra}


def nested_map_bytes(depth: int) -> bytes:
    """msgpack of {"a": {"a": ... {}}} nested ``depth`` maps deep (packb stops at 511)."""
    return b"\x81\xa1a" * (depth - 1) + b"\x80"


def raw_event_with(key: str, value_bytes: bytes, kind: str = "op") -> bytes:
    """One event map's msgpack bytes: kind, seq 1, step 0, and ``key`` set to raw bytes."""
    head = b"\x84" + b"".join(msgpack.packb(x) for x in ("kind", kind, "seq", 1, "step", 0, key))
    return head + value_bytes


def dump(path: Path, fmt: str, capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    rc = cli.main(["dump", "--format", fmt, str(path)])
    out, err = capsys.readouterr()
    return rc, out, err


# -- 1. events are checked against one schema ------------------------------------------------
BAD_EVENTS = {
    "outputs is 5": op(1, outputs=5),
    "an output is 5": op(1, outputs=[5]),
    "shape is text": op(1, outputs=[{"shape": "2x2"}]),
    "shape holds text": op(1, inputs=[{"shape": [2, "x"]}]),
    "stats is a list": op(1, outputs=[{"stats": [1, 2]}]),
    "stats.nan is text": op(1, outputs=[{"stats": {"nan": "3"}}]),
    "values hold a map": op(1, outputs=[{"values": [{}]}]),
    "dtype is a number": op(1, outputs=[{"dtype": 7}]),
    "name is a list": op(1, name=["Tensor", "mul"]),
    "module is a map": op(1, module={"a": 1}),
    "step is text": op(1, step="3"),
    "step is True": op(1, step=True),
    "seq is a float": {"kind": "op", "seq": 1.5, "step": 0},
    "no kind": {"seq": 1, "step": 0},
    "not a map": [1, 2, 3],
    "grad node is a number": {"kind": "grad", "seq": 1, "step": 0, "node": 3},
    "grad_inputs is a map": {"kind": "grad", "seq": 1, "step": 0, "grad_inputs": {"a": 1}},
    "graph nodes hold a number": {"kind": "graph", "seq": 1, "step": 0, "nodes": [{}, 5]},
    "tracing holders is text": {"kind": "tracing", "seq": 1, "step": 0, "holders": "ui"},
    "alert message is a list": {"kind": "alert", "seq": 1, "step": 0, "message": ["x"]},
    "unknown kind, step is text": {"kind": "future", "seq": 1, "step": "x"},
}


@pytest.mark.parametrize("name", sorted(BAD_EVENTS))
def test_bad_event_is_one_line_naming_its_offset(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture
) -> None:
    bad = BAD_EVENTS[name]
    path = craft(
        tmp_path / "bad.tsc",
        [chunk(events_payload([op(0)]), 1, 0), chunk(events_payload([op(1), bad]), 2, 1)],
    )
    with TraceReader(path) as r:
        at = r.chunks[1].offset
        assert len(r.read_chunk(0)) == 1
        with pytest.raises(TraceFileError, match=f"offset {at}") as info:
            r.read_chunk(1)
    assert info.value.offset == at and "\n" not in str(info.value)
    with pytest.raises(TraceFileError, match=f"offset {at}"):
        torchscope.load(path)
    for fmt in ("text", "jsonl"):
        rc, out, err = dump(path, fmt, capsys)
        assert rc == 2, (fmt, out, err)
        assert len(err.strip().splitlines()) == 1 and f"offset {at}" in err, err
        assert '"seq":0' in out or "Tensor.mul" in out  # what came before the bad chunk


def test_deep_nesting_is_refused_not_a_recursion_error(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Depth 990, as a fuzzer found: RecursionError in `dump --format jsonl` before."""
    payload = b"\x91" + raw_event_with("deep", nested_map_bytes(990))
    path = craft(tmp_path / "deep.tsc", [chunk(payload, 1, 0)])
    for fmt in ("jsonl", "text"):
        rc, _, err = dump(path, fmt, capsys)
        assert rc == 2 and "nests deeper than" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(TraceFileError, match="nests deeper"):
        load_trace(path)
    # Just inside the bound is fine, one level more is not; unknown kinds are bounded too.
    for depth, ok in ((MAX_EVENT_DEPTH - 1, True), (MAX_EVENT_DEPTH, False)):
        for kind in ("op", "someday"):
            payload = b"\x91" + raw_event_with("deep", nested_map_bytes(depth), kind)
            path = craft(tmp_path / f"d{depth}{kind}.tsc", [chunk(payload, 1, 0)])
            if ok:
                (event,) = load_trace(path)
                assert to_jsonl(event) and text_line(event)
            else:
                with pytest.raises(TraceFileError, match="nests deeper"):
                    load_trace(path)


def test_cli_dump_of_crafted_event_in_a_subprocess(tmp_path: Path) -> None:
    """The issue's case end to end: `torchscope dump` on an op whose outputs is 5."""
    path = craft(tmp_path / "five.tsc", [chunk(events_payload([op(0, outputs=5)]), 1, 0)])
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    res = subprocess.run(
        [sys.executable, "-m", "torchscope", "dump", "--format", "jsonl", str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and "'outputs' is a int" in err[0] and f"offset {len(header())}" in err[0]


def test_unknown_kinds_and_keys_are_accepted(tmp_path: Path, capsys) -> None:
    events = [
        op(0, added_later={"x": [1, {"y": None}]}),
        {"kind": "hologram", "seq": 1, "step": 0, "frames": [[1, 2], {"a": b"\x00"}]},
        {"kind": "hologram", "seq": 2},  # an unknown kind needs only kind and seq
        op(3, outputs=[{"shape": [1], "stats": {"min": 1.0, "p99": [0.5, "new"]}, "new": {}}]),
        {"kind": "op", "seq": 4},  # known kind, no other field: readers use defaults
    ]
    path = craft(tmp_path / "future.tsc", [chunk(events_payload(events), len(events), 0)])
    assert [e.seq for e in load_trace(path)] == [0, 1, 2, 3, 4]
    for fmt in ("text", "jsonl"):
        rc, out, err = dump(path, fmt, capsys)
        assert rc == 0 and err == "", err
    assert json.loads(out.splitlines()[1])["frames"] == [[1, 2], {"a": "00"}]


def test_everything_the_tracer_emits_passes_the_schema() -> None:
    events = make_trace(3, 3, nan_step=1)
    assert {e["kind"] for e in events} >= {"session", "step", "op", "grad", "graph", "alert"}
    assert [event_problem(e) for e in events] == [None] * len(events)


# A pool of replacement values: wrong types, empties, deep values, non-finite numbers.
def _deep_list(depth: int) -> list:
    out: list = []
    for _ in range(depth - 1):
        out = [out]
    return out


POOL = [
    5,
    -1.5,
    math.nan,
    math.inf,
    "x",
    "",
    None,
    True,
    b"\x01",
    [],
    {},
    [5],
    ["x"],
    [None],
    {"a": 1},
    {"nan": "x"},
    [{}],
    [[1]],
    _deep_list(MAX_EVENT_DEPTH + 2),
    2**63,
]


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, (*prefix, i))
    return out


def _set(obj: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    target = obj
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return obj


def test_seeded_mutations_are_refused_or_render(tmp_path: Path) -> None:
    """Property: an event the schema accepts renders as text and as JSON without raising.
    Seeded random type substitutions anywhere in realistic events of every kind."""
    rng = random.Random(10)
    base = [e for e in make_trace(2, 2, nan_step=1) if e["kind"] != "session"]
    base += [e for e in make_trace(1, 1) if e["kind"] == "session"]
    accepted = refused = 0
    mutants = []
    for _ in range(1500):
        event = copy.deepcopy(dict(rng.choice(base)))
        for _ in range(rng.randint(1, 3)):
            path = rng.choice(_paths(event))
            event = _set(event, path, copy.deepcopy(rng.choice(POOL)))
        mutants.append(event)
        try:
            ev = check_event(event)
        except ProtocolError as exc:
            assert "\n" not in str(exc)
            refused += 1
            continue
        accepted += 1
        text_line(ev)
        json.loads(to_jsonl(ev))
    assert accepted > 100 and refused > 100, (accepted, refused)
    # The same mutants through a file: each read either gives events or one TraceFileError.
    path = tmp_path / "m.tsc"
    for i in range(0, 200, 2):
        pair = [m for m in mutants[i : i + 2] if isinstance(m, dict)]
        try:
            payload = events_payload(pair)
        except (TypeError, ValueError, OverflowError):
            continue
        craft(path, [chunk(payload, len(pair), 0)])
        try:
            for ev in load_trace(path):
                text_line(ev)
                to_jsonl(ev)
        except TraceFileError as exc:
            assert "\n" not in str(exc) and f"offset {len(header())}" in str(exc)


def test_jsonl_fast_path_matches_the_careful_one() -> None:
    def careful(ev: dict) -> str:
        return json.dumps(_json_safe(ev), separators=(",", ":"), allow_nan=False)

    cases = [
        op(1),
        op(2, x={"nan": math.nan, "inf": [math.inf, -math.inf]}, raw=b"\x00\xff"),
        op(3, text='é∂\n"', big=2**63 - 1, neg=-(2**63), t=(1, 2)),
        {"kind": "x", "seq": 4, 5: "int key", None: "null key"},
    ]
    for ev in cases:
        assert to_jsonl(ev) == careful(ev)


# -- 2. only a real end of file is truncation -------------------------------------------------
def unindexed(tmp_path: Path, n: int = 12, chunk_events: int = 3) -> tuple[Path, bytes, list]:
    path = tmp_path / "t.tsc"
    with TraceWriter(path, chunk_events=chunk_events, chunk_seconds=1e9) as w:
        w.write([op(i, step=i // 4) for i in range(n)])
    with TraceReader(path) as r:
        offsets = [c.offset for c in r.chunks]
        end = r._ends[-1]
    data = path.read_bytes()[:end]
    path.write_bytes(data)
    return path, data, offsets


def set_length(data: bytes, at: int, length: int) -> bytes:
    return data[: at + 4] + struct.pack("<I", length) + data[at + 8 :]


def test_huge_length_field_is_corruption_not_truncation(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A chunk length of 200 MiB with more chunks after it read as "cut short, 0 events"."""
    path, data, offsets = unindexed(tmp_path)
    for i in (0, 2):  # the first chunk, and one in the middle
        path.write_bytes(set_length(data, offsets[i], 200 * 1024 * 1024))
        with pytest.raises(TraceFileError, match=f"offset {offsets[i]}: its length field") as info:
            TraceReader(path)
        assert info.value.offset == offsets[i] and "more bytes follow" in str(info.value)
        rc, _, err = dump(path, "jsonl", capsys)
        assert rc == 2 and f"offset {offsets[i]}" in err and len(err.strip().splitlines()) == 1


def test_damaged_length_of_the_last_chunk_is_corruption(tmp_path: Path) -> None:
    path, data, offsets = unindexed(tmp_path)
    path.write_bytes(set_length(data, offsets[-1], len(data)))  # past the end, nothing after
    with pytest.raises(TraceFileError, match=f"offset {offsets[-1]}: its length field"):
        TraceReader(path)


def test_seeded_length_damage_is_never_silent(tmp_path: Path) -> None:
    """Any length that runs past the end of the file, on any chunk: an error, never fewer
    events read quietly. A length cut short lands inside a payload: an error as well."""
    path, data, offsets = unindexed(tmp_path, n=30, chunk_events=4)
    rng = random.Random(2)
    for _ in range(60):
        i = rng.randrange(len(offsets))
        (real,) = struct.unpack_from("<I", data, offsets[i] + 4)
        length = rng.choice([rng.randrange(real + 1, len(data)), rng.randrange(0, real)])
        path.write_bytes(set_length(data, offsets[i], length))
        with pytest.raises(TraceFileError):
            list(TraceReader(path).iter_events())


def test_a_real_partial_last_chunk_is_still_truncation(tmp_path: Path, capsys) -> None:
    path, data, _ = unindexed(tmp_path)
    path.write_bytes(data[:-7])
    rc, out, err = dump(path, "jsonl", capsys)
    assert rc == 0 and len(out.splitlines()) == 9 and "cut short" in err


# -- 3. chunks are numbered ------------------------------------------------------------------
def numbered_chunks(n: int = 4) -> list[bytes]:
    return [chunk(events_payload([op(2 * i), op(2 * i + 1)]), 2, i, 2 * i) for i in range(n)]


@pytest.mark.parametrize("index", [True, False])
def test_reordered_chunks_are_refused(tmp_path: Path, index: bool) -> None:
    recs = numbered_chunks()
    path = craft(tmp_path / "swap.tsc", [recs[0], recs[2], recs[1], recs[3]], index=index)
    with TraceReader(path) as r:
        at = r.chunks[1].offset
        assert [e.seq for e in r.read_chunk(0)] == [0, 1]
        with pytest.raises(TraceFileError, match=f"offset {at}: found chunk 2 where chunk 1"):
            list(r.iter_events())


@pytest.mark.parametrize("index", [True, False])
def test_duplicated_chunks_are_refused(tmp_path: Path, index: bool) -> None:
    recs = numbered_chunks()
    for layout in ([0, 1, 1, 2, 3], [0, 1, 2, 3, 3]):
        path = craft(tmp_path / "dup.tsc", [recs[i] for i in layout], index=index)
        with pytest.raises(TraceFileError, match="reordered or duplicated"):
            load_trace(path)


def test_writer_numbers_its_chunks_and_old_files_still_read(tmp_path: Path) -> None:
    path = tmp_path / "new.tsc"
    with TraceWriter(path, chunk_events=2) as w:
        w.write([op(i) for i in range(5)])
    data = path.read_bytes()
    with TraceReader(path) as r:
        assert r.version == tracefile.FILE_VERSION == (1, 2)
        numbers = [struct.unpack_from("<Q", data, c.offset + 40)[0] for c in r.chunks]
    assert numbers == [0, 1, 2]
    # Format 1.0: no number in the chunk header; read as before, without the check.
    old = [chunk(events_payload([op(i)]), 1, None, i) for i in (0, 1, 2)]
    path = craft(tmp_path / "old.tsc", old, version=(1, 0))
    trace = load_trace(path)
    assert [e.seq for e in trace] == [0, 1, 2] and trace.truncated is False
    path = craft(tmp_path / "old-cut.tsc", old, version=(1, 0), index=False)
    with TraceReader(path) as r:
        assert r.version == (1, 0) and r.truncated and [e.seq for e in r.iter_events()] == [0, 1, 2]


# -- 4. a damaged index or trailer says so and loses nothing ---------------------------------
def closed_file(tmp_path: Path) -> tuple[Path, bytes, int]:
    path = tmp_path / "t.tsc"
    with TraceWriter(path, chunk_events=3) as w:
        w.write([op(i, step=i // 3) for i in range(10)])
    data = path.read_bytes()
    (index_at,) = struct.unpack_from("<Q", data, len(data) - 8)
    return path, data, index_at


def damage(data: bytes, at: int, new: bytes) -> bytes:
    return data[:at] + new + data[at + len(new) :]


@pytest.mark.parametrize(
    "what, where, new, says",
    [
        ("trailer magic", -16, b"TSCINDEY", "the trailer at offset {trailer} is damaged"),
        ("trailer offset", -8, struct.pack("<Q", 12345), "the trailer at offset {trailer}"),
        ("trailer offset", -8, struct.pack("<Q", 2**40), "the trailer at offset {trailer}"),
        ("index magic", 0, b"INDY", "the index at offset {index} is damaged (bad magic"),
        ("index length", 4, struct.pack("<I", 3), "the index at offset {index} is damaged"),
        ("index length", 4, struct.pack("<I", 2**31), "the index at offset {index} is damaged"),
        ("index checksum", 8, b"\x00\x00\x00\x00", "index at offset {index} is damaged"),
        ("index payload", 13, b"\xc1", "the index at offset {index} is damaged"),
    ],
)
def test_damaged_index_or_trailer_says_what_and_reads_everything(
    tmp_path: Path, what: str, where: int, new: bytes, says: str, capsys
) -> None:
    path, data, index_at = closed_file(tmp_path)
    at = len(data) + where if where < 0 else index_at + where
    path.write_bytes(damage(data, at, new))
    says = says.format(trailer=len(data) - 16, index=index_at)
    with TraceReader(path) as r:
        assert not r.complete and not r.truncated, what
        assert says in r.damaged and "10 events" in r.damaged, r.damaged
        assert [e.seq for e in r.iter_events()] == list(range(10))
    trace = load_trace(path)
    assert len(trace) == 10 and trace.damaged == r.damaged and trace.truncated is False
    rc, out, err = dump(path, "jsonl", capsys)
    assert rc == 0 and len(out.splitlines()) == 10
    assert "did not finish" not in err and "cut short" not in err


def test_a_file_cut_inside_its_index_is_truncation(tmp_path: Path) -> None:
    """Killed while closing: the index record is there but incomplete."""
    path, data, index_at = closed_file(tmp_path)
    for cut in (index_at + 2, index_at + 14, len(data) - 1):
        path.write_bytes(data[:cut])
        with TraceReader(path) as r:
            assert r.truncated and r.truncated_at == index_at and r.damaged is None
            assert len(list(r.iter_events())) == 10


# -- 5. full disks -----------------------------------------------------------------------------
class FullDisk:
    """A file that takes ``budget`` more bytes, then fails as a full disk does: a short
    write, then ENOSPC."""

    def __init__(self, path: str, budget: int) -> None:
        self.f = open(path, "wb", buffering=0)  # noqa: SIM115 - closed by the writer
        self.budget = budget

    def write(self, data: Any) -> int:
        if self.budget <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = self.f.write(bytes(data[: self.budget]))
        self.budget -= n
        return n

    def fileno(self) -> int:
        return self.f.fileno()

    def close(self) -> None:
        self.f.close()


def with_budget(monkeypatch: pytest.MonkeyPatch, budget: int) -> None:
    monkeypatch.setattr(tracefile, "_open_for_writing", lambda p: FullDisk(p, budget))


def test_disk_full_at_start_is_a_clean_error_and_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "t.tsc"
    for budget in (0, 10):
        with_budget(monkeypatch, budget)
        with pytest.raises(TraceFileError, match=r"cannot write trace file .*No space left") as e:
            TraceWriter(path, {"run": 1})
        assert "\n" not in str(e.value) and not path.exists()


def test_disk_full_mid_run_stops_recording_once_and_keeps_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "t.tsc"
    said: list[str] = []
    probe = tmp_path / "probe.tsc"  # the same events on a roomy disk: where the chunks end
    with TraceWriter(probe, chunk_events=4, chunk_seconds=1e9) as w:
        w.write([op(i, step=i // 6) for i in range(12)])
    with TraceReader(probe) as r:
        third_chunk_ends = r._ends[2]  # 12 events, steps 0..1
    with_budget(monkeypatch, third_chunk_ends + 30)  # the 4th chunk is cut mid-write
    w = TraceWriter(path, chunk_events=4, chunk_seconds=1e9, on_stop=said.append)
    w.write([op(i, step=i // 6) for i in range(12)])
    assert w.stopped is None and w.events_written == 12
    for i in range(12, 40, 4):  # training continues: nothing raises, nothing more is written
        w.write([op(j, step=j // 6) for j in range(i, i + 4)])
        w.flush()
    w.close()
    w.close()
    message = (
        "recording stopped: disk full after 12 events (file readable up to step 1); "
        "training continues"
    )
    assert said == [message] and w.stopped == message and w.events_written == 12
    assert path.stat().st_size == third_chunk_ends  # the partial chunk was cut off
    with TraceReader(path) as r:
        assert r.truncated and r.truncated_at == third_chunk_ends
        assert [e.seq for e in r.iter_events()] == list(range(12))
    with pytest.raises(TraceFileError, match="closed"):
        w.write([op(99)])


def test_disk_full_is_said_on_stderr_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    with_budget(monkeypatch, len(header()) + 200)
    w = TraceWriter(tmp_path / "t.tsc", chunk_events=1)
    for i in range(5):
        w.write([op(i, step=None, pad="x" * 300)])
    w.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "torchscope: recording stopped: disk full after 0 events (no step in it); "
        "training continues"
    ]


def test_disk_full_at_the_index_keeps_every_event(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "t.tsc"
    probe = tmp_path / "probe.tsc"
    with TraceWriter(probe, chunk_events=5) as w:
        w.write([op(i) for i in range(10)])
    with TraceReader(probe) as r:
        chunks_end = r._ends[-1]
    with_budget(monkeypatch, chunks_end + 5)
    said: list[str] = []
    with TraceWriter(path, chunk_events=5, on_stop=said.append) as w:
        w.write([op(i) for i in range(10)])
    assert len(said) == 1 and "index could not be written (disk full)" in said[0]
    with TraceReader(path) as r:
        assert r.truncated and [e.seq for e in r.iter_events()] == list(range(10))


def test_other_write_errors_stop_recording_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Broken(FullDisk):
        def write(self, data: Any) -> int:
            if self.budget <= 0:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return super().write(data)

    monkeypatch.setattr(tracefile, "_open_for_writing", lambda p: Broken(p, len(header()) + 10))
    said: list[str] = []
    w = TraceWriter(tmp_path / "t.tsc", chunk_events=1, on_stop=said.append)
    w.write([op(0), op(1)])
    w.close()
    assert len(said) == 1 and "recording stopped: cannot write" in said[0]
    assert "Input/output error after 0 events" in said[0]
