"""`torchscope export` (Perfetto/Chrome trace JSON, CSV, Parquet) and `Trace.to_pandas`, on a
real recording of a tiny training loop with a NaN alert."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import torchscope  # noqa: E402
from torchscope.export.tables import TABLE_KINDS  # noqa: E402


def record(path: Path) -> Path:
    """Three SGD steps of a small MLP; the third step's loss goes through sqrt(-1), so the
    recording holds an alert too."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    with torchscope.trace(record=path):
        for i in range(3):
            opt.zero_grad()
            loss = ((m(x) - y) ** 2).mean()
            if i == 2:
                loss = loss + torch.sqrt(torch.tensor(-1.0))
            loss.backward()
            opt.step()
    return path


def run(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torchscope", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record(tmp_path_factory.mktemp("export") / "t.tsc")


# -- Perfetto --------------------------------------------------------------------------------
def check_trace_event_format(doc: dict) -> dict[tuple, list[dict]]:
    """The trace-event format's rules this exporter relies on; returns the complete slices
    by (pid, tid) track."""
    assert isinstance(doc["traceEvents"], list) and doc["traceEvents"]
    tracks: dict[tuple, list[dict]] = defaultdict(list)
    for e in doc["traceEvents"]:
        for key in ("name", "ph", "pid", "tid"):
            assert key in e, (key, e)
        assert isinstance(e["name"], str) and isinstance(e["pid"], int)
        assert isinstance(e["tid"], int)
        assert e["ph"] in ("X", "i", "M"), e
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "thread_name") and "name" in e["args"]
            continue
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0
        assert isinstance(e.get("cat"), str)
        if e["ph"] == "X":
            assert isinstance(e["dur"], (int, float)) and e["dur"] > 0
            tracks[(e["pid"], e["tid"])].append(e)
        else:
            assert e["s"] in ("t", "p", "g")
    # Slices on one track nest properly: each lies inside the enclosing one or after it.
    for track, slices in tracks.items():
        ns = sorted(
            ((round(e["ts"] * 1000), round((e["ts"] + e["dur"]) * 1000), e) for e in slices),
            key=lambda t: (t[0], -t[1]),
        )
        stack: list[tuple] = []
        for start, end, e in ns:
            while stack and stack[-1][1] <= start:
                stack.pop()
            if stack:
                assert end <= stack[-1][1], (
                    f"{e['name']} overlaps {stack[-1][2]['name']} on {track}"
                )
            stack.append((start, end, e))
    return tracks


def test_perfetto_json_structure_on_a_real_recording(trace_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    res = run("export", trace_file, "--format", "perfetto", "-o", out)
    assert res.returncode == 0, res.stderr
    doc = json.loads(out.read_text())  # strict JSON: no NaN/Infinity literals
    tracks = check_trace_event_format(doc)
    trace = torchscope.load(trace_file)
    events = doc["traceEvents"]
    names = {(e["tid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert (1, "training thread (MainThread)") in names
    assert any(n.startswith("autograd") and tid != 1 for tid, n in names)
    train = [e for e in tracks[(trace.session["pid"], 1)]]
    ops = [e for e in train if e["cat"] == "forward"]
    steps = [e for e in train if e["cat"] == "step"]
    # Every op is a slice with its recorded duration, in order, inside its step.
    assert [e["args"]["seq"] for e in ops] == [o["seq"] for o in trace.ops]
    for e, o in zip(ops, trace.ops, strict=True):
        assert e["name"] == o["name"]
        assert e["dur"] == pytest.approx(o["duration_us"], abs=1e-3)
        assert e["args"]["outputs[0]"]["dtype"] == "float32"
        step = next(s for s in steps if s["args"]["step"] == o["step"])
        assert step["ts"] <= e["ts"] and e["ts"] + e["dur"] <= step["ts"] + step["dur"] + 1e-6
    assert sorted(s["args"]["step"] for s in steps) == [0, 1, 2]
    # Backward nodes: on the autograd track, one slice each, inside one backward slice per call.
    nodes = [e for e in events if e.get("cat") == "backward" and e["name"] != "backward 1"]
    assert {e["tid"] for e in nodes} and 1 not in {e["tid"] for e in nodes}
    assert sorted(e["args"]["seq"] for e in nodes) == [g["seq"] for g in trace.grads]
    calls = [e for e in events if e.get("name") == "backward 1"]
    assert len(calls) == 3
    # Stats in args, non-finite values as strings.
    mean_node = next(e for e in nodes if e["name"] == "MeanBackward0")
    assert set(mean_node["args"]["grad_inputs[0]"]) >= {"min", "max", "mean", "std", "norm"}
    # The alert: an instant event on the track of the op it names, at that op's start.
    alerts = [e for e in events if e["ph"] == "i"]
    assert trace.alerts and len(alerts) == len(trace.alerts)
    sqrt_op = next(e for e in ops if e["name"] == "torch.sqrt")
    a = alerts[0]
    assert (a["tid"], a["ts"]) == (sqrt_op["tid"], sqrt_op["ts"])
    assert sqrt_op["args"]["outputs[0]"]["nan"] == 1
    assert sqrt_op["args"]["outputs[0]"]["mean"] == "nan"


def test_perfetto_to_stdout_and_bad_input(trace_file: Path, tmp_path: Path) -> None:
    res = run("export", trace_file, "-o", "-")
    assert res.returncode == 0
    check_trace_event_format(json.loads(res.stdout))
    bad = tmp_path / "bad.tsc"
    bad.write_bytes(b"nope" * 50)
    res = run("export", bad, "-o", tmp_path / "x.json")
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x.json").exists()
    res = run("export", trace_file, "-o", tmp_path / "no" / "dir" / "x.json")
    assert res.returncode == 2 and res.stderr.startswith("torchscope: error: cannot write")


@pytest.mark.parametrize("fmt", ["perfetto", "csv"])
def test_export_never_writes_over_its_input_and_writes_through_a_pipe(
    trace_file: Path, tmp_path: Path, fmt: str
) -> None:
    import os
    import threading

    copy = tmp_path / "t.tsc"
    copy.write_bytes(trace_file.read_bytes())
    res = run("export", copy, "--format", fmt, "-o", copy)
    assert res.returncode == 2 and "is the recording being exported" in res.stderr
    assert copy.read_bytes() == trace_file.read_bytes()  # it used to be the export
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    res = run("export", trace_file, "--format", fmt, "-o", fifo)
    reader.join(timeout=30)
    assert res.returncode == 0, res.stderr
    assert fifo.is_fifo()  # not replaced by a regular file its reader never sees
    text = got[0].decode()
    if fmt == "perfetto":
        check_trace_event_format(json.loads(text))
    else:
        assert text.startswith("seq,step,kind,name,") and len(text.splitlines()) > 10


# -- pandas ----------------------------------------------------------------------------------
def test_pandas_round_trip_of_every_kind(trace_file: Path, tmp_path: Path) -> None:
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    trace = torchscope.load(trace_file)
    present = {e["kind"] for e in trace}
    assert {"session", "step", "op", "grad", "graph", "alert"} <= present
    for kind in TABLE_KINDS:
        df = trace.to_pandas(kind=kind)
        if kind == "tensor":
            expected = [
                (e["seq"], fld, i, s)
                for e in trace
                if e["kind"] in ("op", "grad")
                for fld in (
                    ("inputs", "outputs") if e["kind"] == "op" else ("grad_outputs", "grad_inputs")
                )
                for i, s in enumerate(e.get(fld) or ())
            ]
            assert len(df) == len(expected)
            for row, (seq, fld, i, s) in zip(df.itertuples(), expected, strict=True):
                assert (row.seq, row.field, row.index) == (seq, fld, i)
                if s and s.get("stats"):
                    assert _same(row.norm, s["stats"]["norm"])
                    assert row.nan == s["stats"]["nan"]
        else:
            events = trace.of_kind(kind)
            assert len(df) == len(events), kind
            if events:
                assert list(df["seq"]) == [e["seq"] for e in events]
                assert list(df.columns[:3]) == ["seq", "step", "kind"]
        if kind == "op":
            for row, e in zip(df.itertuples(), events, strict=True):
                assert row.name == e["name"] and row.module == e["module"]
                assert row.duration_us == e["duration_us"]
                for k, v in e["outputs"][0]["stats"].items():
                    assert _same(getattr(row, f"out0_{k}"), v), (k, v)
                assert json.loads(row.nodes) == e["nodes"]
        if kind == "grad":
            assert df["gout0_norm"].notna().all()
            acc = df[df["node"] == "AccumulateGrad"]
            assert set(acc["param"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
        if df.empty:
            continue
        # Through the CLI, to Parquet (types kept) and CSV (values kept) and back.
        for fmt in ("parquet", "csv"):
            out = tmp_path / f"{kind}.{fmt}"
            res = run("export", trace_file, "--format", fmt, "--kind", kind, "-o", out)
            assert res.returncode == 0, res.stderr
            if fmt == "parquet":
                back = pd.read_parquet(out)
                pd.testing.assert_frame_equal(back, df, check_dtype=True)
                continue
            # CSV keeps no types: read every cell as the text written, compare as text.
            back = pd.read_csv(out, dtype=str, keep_default_na=False)
            assert list(back.columns) == list(df.columns), kind
            for c in df.columns:
                for x, y in zip(df[c], back[c], strict=True):
                    assert _text(x) == y, (kind, c, x, y)


def _text(x: object) -> str:
    import pandas

    if x is None or x is pandas.NA or (isinstance(x, float) and math.isnan(x)):
        return ""
    return str(x)


def _same(x: object, y: object) -> bool:
    if isinstance(x, (int, float)) and isinstance(y, (int, float)):
        return x == y or (math.isnan(x) and math.isnan(y))
    return x == y


def test_missing_pandas_is_one_line(trace_file: Path, tmp_path: Path) -> None:
    # A child process where `import pandas` fails, as on a machine without the extra.
    code = (
        "import sys; sys.modules['pandas'] = None\n"
        "from torchscope.cli import main\n"
        f"sys.exit(main(['export', {str(trace_file)!r}, '--format', 'csv', '-o', 'x.csv']))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr.strip() == (
        "torchscope: error: tables need pandas: pip install 'torchscope-debugger[pandas]'"
    )
    code = (
        "import sys; sys.modules['pandas'] = None\n"
        "import torchscope\n"
        f"t = torchscope.load({str(trace_file)!r})\n"
        "try:\n    t.to_pandas()\nexcept ImportError as e:\n    print(e)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.stdout.strip() == "tables need pandas: pip install 'torchscope-debugger[pandas]'"


def test_core_imports_no_pandas(trace_file: Path) -> None:
    code = (
        "import sys, torchscope, torchscope.cli, torchscope.analysis.diff, torchscope.export\n"
        f"torchscope.load({str(trace_file)!r})\n"
        "bad = [m for m in ('pandas', 'pyarrow', 'numpy', 'torch', 'textual_serve') "
        "if m in sys.modules]\n"
        "print(bad)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.stdout.strip() == "[]", res.stderr


def test_perfetto_pauses_are_slices_on_their_own_track(tmp_path: Path) -> None:
    """A breakpoint with no UI pauses the job for its lease: the export shows that pause as a
    slice as long as the job stood still, on a "paused" track, and the ops after it start
    after it."""
    script = tmp_path / "job.py"
    script.write_text(
        "import torch\n"
        "m = torch.nn.Linear(4, 2)\n"
        "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "for _ in range(2):\n"
        "    opt.zero_grad()\n"
        "    torch.tanh(m(torch.randn(3, 4))).sum().backward()\n"
        "    opt.step()\n"
    )
    trace = tmp_path / "t.tsc"
    res = run("run", "--quiet", "--no-live", "--break-on", "op:^torch.tanh$,step:1",
              "--lease", "0.4", "--record", trace, script)  # fmt: skip
    assert res.returncode == 0, res.stderr
    out = tmp_path / "trace.json"
    assert run("export", trace, "-o", out).returncode == 0
    doc = json.loads(out.read_text())
    tracks = check_trace_event_format(doc)
    pid = torchscope.load(trace).session["pid"]
    (pause,) = tracks[(pid, 999)]
    assert pause["cat"] == "pause" and pause["name"] == "paused: breakpoint 1"
    assert pause["args"]["at"] == "torch.tanh (before)" and pause["args"]["resumed by"] == "lease"
    assert 0.35e6 <= pause["dur"] < 5e6  # µs: the lease, as the job stood still
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert "paused (step-through)" in names

    def ns(us: float) -> int:  # the exporter lays out integer ns, written as µs
        return round(us * 1000)

    start, end = ns(pause["ts"]), ns(pause["ts"]) + ns(pause["dur"])
    ops = [e for e in tracks[(pid, 1)] if e["cat"] == "forward"]
    assert all(ns(e["ts"]) + ns(e["dur"]) <= start or ns(e["ts"]) >= end for e in ops)
    tanh = [e for e in ops if e["name"] == "torch.tanh"]
    assert ns(tanh[0]["ts"]) < start and ns(tanh[1]["ts"]) >= end  # step 1's ran after it
