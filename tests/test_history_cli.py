"""The run's history end to end: a real job under ``torchscope run``, clients that come and go,
``torchscope history``, ``ls``, ``record`` and ``dump``."""

from __future__ import annotations

import csv
import io
import json
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("zmq")

from test_attach import (
    finish,
    losses,
    plain_losses,
    read_until_step,
    recorded,
    start,
    torchscope,
    write_job,
)

from torchscope.protocol.client import SessionClient, SessionRefused
from torchscope.protocol.events import HISTORY


def printed(lines: list[str]) -> dict[int, str]:
    """step -> the loss the job printed for it (repr of loss.item())."""
    return {int(x.split()[1]): x.split()[2] for x in lines if x.startswith("step ")}


def wait_traced(client: SessionClient, state: str, within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while client.hello()["tracing"] != state:
        assert time.monotonic() < deadline, f"the job never became {state}"
        time.sleep(0.05)


def test_history_of_a_500_step_job_attached_at_step_400_survives_its_clients(tmp_path: Path):
    # Quick to step 400, then slow enough for two clients to come and go before its end.
    script = write_job(tmp_path, steps=500, sleep="(0.003 if step < 400 else 0.06)")
    job = start([sys.executable, "-m", "torchscope", "run", str(script)], tmp_path)
    lines: list[str] = []
    live: list[dict] = []
    try:
        read_until_step(job, 400, lines)
        with SessionClient() as ui:
            ui.connect(str(job.pid), timeout=30)
            first = ui.request("history", timeout=30)
            ui.request("arm", timeout=30)  # a UI: holds it traced while it talks
            wait_traced(ui, "traced")
            # A while of live history: 2 s, and on a loaded machine until the first comes.
            deadline, limit = time.monotonic() + 2, time.monotonic() + 60
            while (time.monotonic() < deadline or not live) and time.monotonic() < limit:
                live += [e for e in ui.recv_events(100) if e["kind"] == HISTORY]
                ui.request("ping")
            ui.request("disarm")
            wait_traced(ui, "dormant")
        # Another client, later: the same history, the first one's traced steps marked.
        read_until_step(job, 0, lines)
        with SessionClient() as other:
            other.connect(str(job.pid), timeout=30)
            second = other.request("history", timeout=30)
        finish(job, lines)
    finally:
        job.kill()
    said = printed(lines)
    assert len(said) == 500
    steps = [p["step"] for p in first["points"]]
    assert steps == list(range(len(steps))) and len(steps) >= 400  # every step since step 0
    for p in first["points"]:
        assert repr(p["loss"]) == said[p["step"]]  # bit for bit what the job printed
    assert live, "no live history event reached the subscribed client"
    for e in live:
        for p in e["points"]:
            assert repr(p["loss"]) == said[p["step"]]
    later = {p["step"]: p for p in second["points"]}
    assert set(steps) < set(later)  # nothing of it lost when the first client left
    assert all(later[s]["loss"] == p["loss"] for s, p in zip(steps, first["points"], strict=True))
    traced = sorted(s for s, p in later.items() if p.get("traced"))
    assert traced and traced[0] > 400 and traced == list(range(traced[0], traced[-1] + 1))
    assert not any(p.get("traced") for p in first["points"])
    assert losses(lines) == plain_losses(script, tmp_path)  # the job's numbers untouched


def test_history_ls_record_and_dump_from_the_command_line(tmp_path: Path):
    script = write_job(tmp_path, steps=300, sleep=0.02)
    job = start(
        [sys.executable, "-m", "torchscope", "run", "--watch", "nan", str(script)], tmp_path
    )
    lines: list[str] = []
    out = tmp_path / "rec.tsc"
    try:
        read_until_step(job, 30, lines)
        pid = str(job.pid)
        table = torchscope("history", pid, "--last", "5")
        as_csv = torchscope("history", pid, "--format", "csv")
        as_jsonl = torchscope("history", pid, "--format", "jsonl", "--since", "9")
        listing = torchscope("ls").stdout
        with SessionClient() as client:
            client.connect(pid, timeout=30)
            with pytest.raises(SessionRefused, match="not a condition") as refused:
                client.request("arm", when="loss>>1")
            assert "\n" not in str(refused.value)
        rec = torchscope("record", pid, "-o", str(out), "--next", "3", "--quiet")
        assert rec.returncode == 0, rec.stderr
        finish(job, lines)
    finally:
        job.kill()
    said = printed(lines)
    assert table.returncode == 0, table.stderr
    rows = table.stdout.splitlines()
    assert rows[0].split()[:3] == ["STEP", "LOSS", "GRAD"] and len(rows) == 6
    for row in rows[1:]:  # the watch is on: a norm and the largest module's for each step
        step, loss, norm, module, _value = row.split()
        assert float(loss) == pytest.approx(float(said[int(step)]), rel=1e-5)
        assert float(norm) > 0 and module in ("0:", "2:")

    table_csv = list(csv.DictReader(io.StringIO(as_csv.stdout)))
    assert len(table_csv) >= 30 and {"norm:0", "norm:2"} <= set(table_csv[0])
    for r in table_csv:
        assert repr(float(r["loss"])) == said[int(r["step"])]
        norms = float(r["norm:0"]) ** 2 + float(r["norm:2"]) ** 2
        assert norms == pytest.approx(float(r["grad_norm"]) ** 2, rel=1e-4)

    points = [json.loads(x) for x in as_jsonl.stdout.splitlines()]
    assert points[0]["step"] == 10 and all(set(p["module_norms"]) == {"0", "2"} for p in points)

    (row,) = [r.split() for r in listing.splitlines() if r.split()[:1] == [str(job.pid)]]
    assert row[3] == "dormant" and float(row[4]) >= 0  # the LOSS column: a number

    events = recorded(out)
    history = [e for e in events if e["kind"] == HISTORY]
    steps = sorted({p["step"] for e in history for p in e["points"]})
    assert steps == list(range(steps[-1] + 1))  # the whole run up to the recording's end
    traced = sorted({p["step"] for e in history for p in e["points"] if p.get("traced")})
    assert traced == sorted({e["step"] for e in events if e["kind"] == "op"})
    assert len(traced) == 3
    dump = torchscope("dump", str(out), "--kind", "history")
    assert dump.returncode == 0, dump.stderr
    # One line per step, as `torchscope history` prints it.
    rows = dump.stdout.splitlines()
    assert rows[0].split()[:3] == ["STEP", "LOSS", "GRAD"]
    assert [int(r.split()[0]) for r in rows[1:]] == steps


def test_history_refuses_bad_input_in_one_line(tmp_path: Path):
    for args, says in (
        (["history", "--last", "-1"], "--last"),
        (["history", "--format", "xml"], "invalid choice"),
        (["history", "999999999"], ""),
    ):
        res = torchscope(*args)
        assert res.returncode == 2, res
        assert len(res.stderr.strip().splitlines()) == 1 and says in res.stderr


def test_the_history_benchmark_prints_its_rows():
    """benchmarks/history.py keeps running (tiny settings: that it works, not what it says)."""
    import subprocess

    bench = Path(__file__).resolve().parent.parent / "benchmarks" / "history.py"
    proc = subprocess.run(
        [sys.executable, str(bench), "--quick", "--workload", "mlp"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [x.split("|")[1].strip() for x in proc.stdout.splitlines() if x.startswith("| ")]
    assert rows[1:6] == [
        "untraced",
        "dormant, no history",
        "dormant (serve): loss history",
        "watch nan, no history",
        "watch nan + history + module norms",
    ]
    assert "50 points, 50 with a loss, 16 module norms each" in proc.stdout
