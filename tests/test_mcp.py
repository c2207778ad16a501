"""``torchscope mcp``, driven by the MCP SDK's own client: its tools listed and called on a real
recording (``torchscope run --record`` of a job whose loss goes NaN), on a real dormant job
(armed and recorded, the origin of its NaN found, paused at it and continued), and with bad
arguments (one line each). Waits are on conditions with deadlines, never fixed sleeps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mcp")
pytest.importorskip("torch")

import anyio
from mcp import Client, StdioServerParameters

from torchscope.mcp.server import build_server, one_line_error

ROOT = Path(__file__).resolve().parents[1]

# A loss that goes NaN at step 2 (sqrt of a negative, in the forward): recorded from its start.
RECORDED = """\
import torch
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 8)
        self.b = torch.nn.Linear(8, 1)

    def forward(self, x, bad):
        h = torch.tanh(self.a(x))
        if bad:
            h = torch.sqrt(h - 2.0)  # NaN origin
        return self.b(h)

torch.manual_seed(0)
net = Net()
opt = torch.optim.SGD(net.parameters(), lr=0.1)
gen = torch.Generator().manual_seed(1)
for step in range(4):
    loss = net(torch.randn(8, 4, generator=gen), step == 2).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} {loss.item()!r}", flush=True)
"""
RECORDED_LINE = 11

# A job that runs dormant under `torchscope run` and makes a NaN every 4th step; a bad batch
# is skipped (no update), so the model stays finite and every bad step has the same origin.
# (Steps are counted at optimizer.step(): a skipped batch belongs to the next step.)
DORMANT = """\
import time
import torch
torch.manual_seed(0)
lin = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(lin.parameters(), lr=0.01)
gen = torch.Generator().manual_seed(1)
for step in range(100000):
    x = torch.randn(8, 4, generator=gen)
    h = lin(x)
    if step % 4 == 3:
        h = torch.log(h - 10.0)  # NaN origin
    loss = h.pow(2).mean()
    opt.zero_grad()
    loss.backward()
    if torch.isfinite(loss):
        opt.step()
    print(f"step {step} {loss.item()!r}", flush=True)
    time.sleep(0.05)
"""
DORMANT_LINE = 11


def text_of(result: Any) -> str:
    return result.content[0].text


async def ok(client: Client, name: str, **args: Any) -> dict[str, Any]:
    result = await client.call_tool(name, args)
    assert not result.is_error, f"{name}: {text_of(result)}"
    data = result.structured_content
    assert data == json.loads(text_of(result))  # the text is the same data, compact
    return data


async def refused(client: Client, name: str, **args: Any) -> str:
    result = await client.call_tool(name, args)
    assert result.is_error, f"{name} answered: {text_of(result)[:300]}"
    text = text_of(result)
    assert "\n" not in text and text.startswith(f"{name}: "), text
    return text


def run(fn: Any) -> Any:
    return anyio.run(fn)


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real recording: `torchscope run --record` of a job whose loss goes NaN at step 2."""
    where = tmp_path_factory.mktemp("mcp-rec")
    (where / "train.py").write_text(RECORDED)
    res = subprocess.run(
        [sys.executable, "-m", "torchscope", "run", "--record", "t.tsc", "train.py"],
        capture_output=True,
        text=True,
        cwd=where,
        timeout=180,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "step 2 nan" in res.stdout
    return where / "t.tsc"


# -- the tools on a recording ---------------------------------------------------------------------
def test_tools_are_listed_with_typed_arguments() -> None:
    async def go() -> None:
        async with Client(build_server(), mode="legacy") as client:
            tools = {t.name: t for t in (await client.list_tools()).tools}
            assert set(tools) >= {
                "ls", "history", "record", "watch", "steps", "alerts", "events", "event",
                "graph", "diff", "state", "breakpoint_set", "breakpoint_clear", "pause",
                "step", "next", "continue", "values", "evaluate", "release",
            }  # fmt: skip
            events = tools["events"].input_schema
            assert events["required"] == ["target", "step"]
            assert events["properties"]["limit"]["maximum"] == 200
            assert events["properties"]["step"]["type"] == "integer"
            assert all(t.description for t in tools.values())

    run(go)


def test_from_nan_to_the_op_and_line_in_a_recording(recording: Path) -> None:
    path = str(recording)

    async def go() -> None:
        async with Client(build_server(), mode="legacy") as client:
            steps = await ok(client, "steps", target=path)
            assert [s["step"] for s in steps["steps"]] == [0, 1, 2, 3]
            assert steps["steps"][2]["loss"] == "nan" and steps["steps"][2]["alerts"] == 1
            assert isinstance(steps["steps"][0]["loss"], float)

            alerts = await ok(client, "alerts", target=path)
            (origin,) = alerts["alerts"]
            assert origin["origin"] and origin["step"] == 2 and origin["what"] == "nan"
            assert origin["op"] == "torch.sqrt" and origin["where"] == "forward"
            assert origin["source"] == f"{recording.parent / 'train.py'}:{RECORDED_LINE}"
            assert origin["consequences"] >= 1 and origin["consequence_steps"] == [3, 3]
            assert (await ok(client, "alerts", target=path, step=1))["total"] == 0

            # the UI's filter: only matching rows; its search: every row, matches marked
            rows = await ok(client, "events", target=path, step=2, filter="sqrt")
            assert [(r["name"], r["kind"]) for r in rows["rows"]] == [
                ("torch.sqrt", "op"),
                ("SqrtBackward0", "grad"),
            ]
            assert rows["rows"][0]["bad"] == "NaN made here"
            assert rows["rows"][0]["source"] == f"train.py:{RECORDED_LINE}"
            found = await ok(client, "events", target=path, step=2, search=r"^b$", limit=3)
            assert found["total"] > found["matches"] >= 1
            assert found["rows"][0]["match"] and found["rows"][0]["module"] == "b"
            assert found["offset"] == found["rows"][0]["i"]
            by_line = await ok(client, "events", target=path, step=2, filter=f":{RECORDED_LINE}$")
            assert {r["name"] for r in by_line["rows"]} == {
                "Tensor.sub", "torch.sqrt", "SqrtBackward0", "SubBackward0",
            }  # fmt: skip
            # pages: bounded, with where the next one starts
            first = await ok(client, "events", target=path, step=2, limit=5)
            assert len(first["rows"]) == 5 and first["next_offset"] == 5
            second = await ok(client, "events", target=path, step=2, offset=5, limit=5)
            assert [r["i"] for r in second["rows"]] == [5, 6, 7, 8, 9]
            nodes = await ok(client, "events", target=path, step=2, kind="grad", limit=200)
            assert nodes["rows"] and all(r["kind"] == "grad" for r in nodes["rows"])

            op = await ok(client, "event", target=path, step=2, seq=origin["event_seq"])
            assert op["name"] == "torch.sqrt" and op["outputs"][0]["stats"]["nan"] == 64
            assert op["inputs"][0]["stats"]["max"] < 0 and op["nodes"][0]["name"] == "SqrtBackward0"
            sqrt_node = next(r for r in nodes["rows"] if r["name"] == "SqrtBackward0")
            node = await ok(client, "event", target=path, step=2, seq=sqrt_node["seq"])
            assert node["made_by"]["seq"] == origin["event_seq"]
            assert node["grad_outputs (what arrived)"][0]["stats"]["nan"] == 64
            (sent,) = node["grad_inputs (what it sends on)"]
            assert sent["to"].startswith("SubBackward0 #")

            graph = await ok(client, "graph", target=path, step=2, seq=origin["event_seq"])
            names = {n["name"]: n for n in graph["nodes"]}
            assert names["SqrtBackward0"]["distance"] == 0
            assert names["SubBackward0"]["distance"] == 1  # toward the parameters
            assert any(n["distance"] < 0 for n in graph["nodes"])  # toward the loss
            assert all(n["executed"] for n in graph["nodes"])

            same = await ok(client, "diff", a=path, b=path)
            assert same["same"] and same["divergences"] == 0 and same["report"]

    run(go)


def test_bad_arguments_are_one_line_each(recording: Path, tmp_path: Path) -> None:
    path = str(recording)

    async def go() -> None:
        async with Client(build_server(), mode="legacy") as client:
            said = await refused(client, "events", target=path, step=-1, limit=1000)
            assert "step: Input should be greater than or equal to 0 (got -1)" in said
            assert "limit: Input should be less than or equal to 200 (got 1000)" in said
            said = await refused(client, "events", target=path)
            assert "step: Field required" in said
            said = await refused(client, "events", target=str(tmp_path / "none.tsc"), step=0)
            assert "no such recording" in said
            said = await refused(client, "events", target=path, step=2, filter="(")
            assert "not a regular expression" in said
            assert "no events of step 99" in await refused(client, "events", target=path, step=99)
            assert "no event 99999" in await refused(
                client, "event", target=path, step=2, seq=99999
            )
            assert "one of them" in await refused(client, "graph", target=path, step=2)
            not_a_trace = tmp_path / "x.tsc"
            not_a_trace.write_text("hello")
            assert "x.tsc" in await refused(client, "alerts", target=str(not_a_trace))
            assert "no running torchscope session" in await refused(client, "pause")
            assert "no torchscope session with pid" in await refused(
                client, "state", job=str(2**22 + 7)
            )
            assert "bad breakpoint condition" in await refused(
                client, "breakpoint_set", spec="nan,oops:1"
            )
            assert "exists" in await refused(client, "record", output=path)
            assert "on_nan" in await refused(client, "watch", on_nan="explode")

    run(go)


def test_one_line_error_reads_pydantic_and_plain_errors() -> None:
    text = (
        "Error executing tool events: 1 validation error for eventsArguments\n"
        "target\n  Field required [type=missing, input_value={}, input_type=dict]\n"
        "    For further information visit https://errors.pydantic.dev/2/v/missing"
    )
    assert one_line_error(text) == "events: bad arguments: target: Field required"
    assert one_line_error("Error executing tool x: a\n  b") == "x: a b"
    assert one_line_error("Unknown tool: nope") == "Unknown tool: nope"


def test_without_the_sdk_the_command_says_how_to_get_it() -> None:
    code = "import sys; sys.modules['mcp'] = None; from torchscope.cli import main; "
    code += "sys.exit(main(['mcp']))"
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr == (
        "torchscope: error: torchscope mcp needs the MCP SDK (mcp 2.3+): "
        "pip install 'torchscope-debugger[mcp]'\n"
    )


def test_the_command_serves_over_stdio(recording: Path) -> None:
    """`torchscope mcp` as an agent starts it: a subprocess speaking on stdin/stdout."""
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "torchscope", "mcp"],
        cwd=str(ROOT),
        env=dict(os.environ),
    )

    async def go() -> None:
        async with Client(params, mode="legacy") as client:
            assert "alerts" in {t.name for t in (await client.list_tools()).tools}
            alerts = await ok(client, "alerts", target=str(recording))
            assert alerts["alerts"][0]["op"] == "torch.sqrt"

    run(go)


# -- the tools on a live job ----------------------------------------------------------------------
class Job:
    """The dormant job under `torchscope run`, its printed steps read on a thread (so a wait
    has a deadline even when the job prints nothing)."""

    def __init__(self, tmp_path: Path, *run_args: str) -> None:
        (tmp_path / "job.py").write_text(DORMANT)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torchscope", "run", *run_args, "job.py"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
        )
        self.pid = self.proc.pid
        self.steps: list[int] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("step "):
                self.steps.append(int(line.split()[1]))

    def wait_step(self, at_least: int, within: float = 120.0) -> None:
        deadline = time.monotonic() + within
        while not (self.steps and self.steps[-1] >= at_least):
            if self.proc.poll() is not None:
                err = self.proc.stderr.read() if self.proc.stderr else ""
                raise AssertionError(f"the job ended early: {err[-3000:]}")
            assert time.monotonic() < deadline, f"the job did not reach step {at_least}"
            time.sleep(0.05)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


async def until(what: str, check: Any, within: float = 60.0) -> Any:
    deadline = time.monotonic() + within
    while True:
        got = await check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await anyio.sleep(0.1)


def test_a_dormant_job_armed_recorded_its_origin_found_paused_and_continued(
    tmp_path: Path, recording: Path
) -> None:
    job = Job(tmp_path)
    pid = job.pid
    line = f"{tmp_path / 'job.py'}:{DORMANT_LINE}"
    try:
        job.wait_step(2)

        async def go() -> None:
            async with Client(build_server(), mode="legacy") as client:
                listed = await ok(client, "ls")
                (row,) = [r for r in listed["jobs"] if r["pid"] == pid]
                assert row["tracing"] == "dormant" and not row["held"]
                assert row["script"].endswith("job.py")

                history = await ok(client, "history", job=pid, last=5)
                assert 1 <= len(history["points"]) <= 5
                assert all("loss" in p for p in history["points"])

                # arm for the next 8 steps, record them: two bad steps come in them
                out = tmp_path / "rec.tsc"
                rec = await ok(client, "record", job=str(pid), output=str(out), next=8)
                assert len(rec["traced_steps"]) == 8 and out.exists()
                assert "waited" not in rec, rec
                origin = rec["alerts"][0]
                assert origin["origin"] and origin["op"] == "torch.log"
                assert origin["source"] == line and origin["step"] in rec["traced_steps"]
                alerts = await ok(client, "alerts", target=str(out))
                assert alerts["total"] >= 2 and all(a["source"] == line for a in alerts["alerts"])
                rows = await ok(client, "events", target=str(out), step=origin["step"],
                                filter="log")  # fmt: skip
                assert rows["rows"][0]["bad"] == "NaN made here"
                # the job went dormant again after its 8 steps
                await until(
                    "the job dormant again",
                    lambda: _tracing(client, pid, "dormant"),
                )
                differ = await ok(client, "diff", a=str(recording), b=str(out))
                assert not differ["same"] and differ["first"]["what"]

                # the watch on a running job
                watched = await ok(client, "watch", job=pid)
                assert watched["watch"] == "nan"

                # stop where the NaN first appears, look, continue
                bp = await ok(client, "breakpoint_set", job=pid, spec="nan")
                assert bp["held"] and [b["spec"] for b in bp["breakpoints"]] == ["nan"]
                hit = await ok(client, "continue", job=pid, wait=60)
                assert "waited" not in hit, hit
                paused = hit["paused"]
                assert paused["name"] == "torch.log" and paused["source"] == line
                assert paused["story"].startswith("NaN first appears: torch.log")
                vals = await ok(client, "values", job=pid, group="outputs", count=8)
                assert vals["values"] and all(v == "nan" for v in vals["values"])
                asked = await ok(client, "evaluate", job=pid, expr="torch.isnan(out).all()")
                assert asked["text"] == "1", asked  # run by the job at its pause
                state = await ok(client, "state", job=pid)
                assert state["paused"]["seq"] == paused["seq"]
                # the live job's events: the paused step as the stream brought it
                live = await ok(client, "events", target=str(pid), step=paused["step"])
                assert live["rows"] and live["rows"][0]["kind"] == "op"

                cleared = await ok(client, "breakpoint_clear", job=pid)
                assert cleared["breakpoints"] == []
                going = await ok(client, "continue", job=pid)
                assert going["paused"] is None or going["paused"]["seq"] != paused["seq"]
                live_alerts = await until(
                    "the origin on the live stream",
                    lambda: _live_alerts(client, pid),
                )
                assert live_alerts[0]["source"] == line

                # pause anywhere, step one op or node, continue
                stopped = await ok(client, "pause", job=pid, timeout=30)
                assert stopped["paused"] is not None, stopped
                stepped = await ok(client, "step", job=pid, timeout=30)
                assert stepped["paused"]["seq"] != stopped["paused"]["seq"] or (
                    stepped["paused"]["phase"] != stopped["paused"]["phase"]
                )
                resumed = await ok(client, "continue", job=pid)
                assert resumed["held"]
                let_go = await ok(client, "release", job=pid)
                assert not let_go["held"]
                await until("the job dormant", lambda: _tracing(client, pid, "dormant"))

        run(go)
        # the job went on after the session
        job.wait_step(job.steps[-1] + 2, within=60)
    finally:
        job.stop()


async def _tracing(client: Client, pid: int, state: str) -> bool:
    listed = await ok(client, "ls")
    return any(r["pid"] == pid and r.get("tracing") == state for r in listed["jobs"])


async def _live_alerts(client: Client, pid: int) -> list[dict]:
    found = await ok(client, "alerts", target=str(pid))
    return [a for a in found["alerts"] if a["origin"]]


def test_the_session_end_lets_a_held_job_go(tmp_path: Path) -> None:
    """A job paused by this server resumes when the server's session ends (as a UI's quit)."""
    job = Job(tmp_path, "--lease", "300")  # a lost session would hold it 5 minutes
    pid = job.pid
    try:
        job.wait_step(1)
        printed: list[int] = []

        async def go() -> None:
            async with Client(build_server(), mode="legacy") as client:
                stopped = await ok(client, "pause", job=pid, timeout=60)
                assert stopped["paused"] is not None and stopped["held"]
                printed.append(len(job.steps))

        run(go)
        # it runs again at once (a lost session would hold it for the 300 s lease; 60 s is
        # what a loaded machine may take to print two steps)
        deadline = time.monotonic() + 60
        while len(job.steps) < printed[0] + 2:
            assert time.monotonic() < deadline, "the job stayed paused after the session"
            time.sleep(0.05)
    finally:
        job.stop()


def test_the_server_needs_neither_torch_nor_textual(recording: Path) -> None:
    code = f"""
import sys
sys.modules["torch"] = None
sys.modules["textual"] = None
import anyio
from mcp import Client
from torchscope.mcp.server import build_server

async def go():
    async with Client(build_server(), mode="legacy") as client:
        r = await client.call_tool("alerts", {{"target": {str(recording)!r}}})
        assert not r.is_error, r.content[0].text
        r = await client.call_tool("events", {{"target": {str(recording)!r}, "step": 2}})
        assert not r.is_error, r.content[0].text
anyio.run(go)
bad = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "textual") and sys.modules[m])
assert not bad, bad
print("ok")
"""
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "ok"
