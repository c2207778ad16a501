"""What a dead job leaves behind goes: registry records, ipc socket files, session key files.

What a user is promised: `torchscope ls` (endpoints.list_sessions) removes the records, socket
files and key files of processes that are gone, and never touches a live process's files or
files that are not ours; endpoints.cleanup_process() removes one process's, for a SIGTERM
handler that cannot wait for a clean close.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from torchscope.protocol import endpoints as ep

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def rt(monkeypatch: pytest.MonkeyPatch):
    base = Path(tempfile.mkdtemp(prefix="tsclean-", dir="/tmp"))
    monkeypatch.setenv(ep.ENV_RUNTIME_DIR, str(base / "run"))
    monkeypatch.delenv(ep.ENV_BIND, raising=False)
    yield ep.runtime_dir()
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def unix_socket_file(path: Path) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()  # the file stays, like one a SIGKILLed job leaves


def record(pid: int, rank: int | None, rt: Path) -> ep.SessionRecord:
    stem = f"{pid}" if rank is None else f"{pid}-{rank}"
    return ep.SessionRecord(
        pid=pid,
        rank=rank,
        started=time.time(),  # after the process began, as a real session's
        host=socket.gethostname(),
        events=f"ipc://{rt}/{stem}.events",
        control=f"ipc://{rt}/{stem}.control",
    )


def test_ls_removes_what_dead_processes_left(rt: Path, dead_pid: int) -> None:
    me = os.getpid()
    for pid in (dead_pid, me):
        for suffix in ("events", "control"):
            unix_socket_file(rt / f"{pid}.{suffix}")
        (rt / f"{pid}.0a1b2c3d.curve").write_text("{}")
    ep.register(record(dead_pid, None, rt))
    ep.register(record(me, None, rt))
    # Left without a record (the registry write failed, or it went first): still removed.
    unix_socket_file(rt / f"{dead_pid}-1.control")
    # Not ours to judge: other names, and a regular file with a socket's name.
    (rt / "notes.txt").write_text("keep")
    (rt / f"{dead_pid}-2.events").write_text("a regular file")

    live = ep.list_sessions()

    assert [r.pid for r in live] == [me]
    names = sorted(p.name for p in rt.iterdir() if p.name != "sessions")
    assert names == sorted(
        [
            f"{me}.events",
            f"{me}.control",
            f"{me}.0a1b2c3d.curve",
            "notes.txt",
            f"{dead_pid}-2.events",
        ]
    )
    assert [p.name for p in ep.sessions_dir().iterdir()] == [f"{me}-0.json"]


def test_cleanup_process_removes_one_process(rt: Path, dead_pid: int) -> None:
    me = os.getpid()
    for pid in (dead_pid, me):
        for rank in (0, 1):
            for suffix in ("events", "control"):
                unix_socket_file(rt / f"{pid}-{rank}.{suffix}")
            ep.register(record(pid, rank, rt))
        (rt / f"{pid}-0.deadbeef.curve").write_text("{}")
    removed = ep.cleanup_process(dead_pid)  # e.g. a supervisor cleaning up after a child
    assert removed == 2 * 2 + 2 + 1  # sockets, records, key file
    left = sorted(p.name for p in rt.iterdir() if p.name != "sessions")
    sockets = [f"{me}-{r}.{s}" for r in (0, 1) for s in ("events", "control")]
    assert left == sorted([*sockets, f"{me}-0.deadbeef.curve"])
    assert ep.cleanup_process() == 2 * 2 + 2 + 1  # this process, by default
    assert [p.name for p in rt.iterdir()] == ["sessions"]
    assert list(ep.sessions_dir().iterdir()) == []
    assert ep.cleanup_process() == 0  # twice is fine


JOB = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, sys.argv[1])
    from live_events import session_event
    from torchscope.tracer.publisher import EventPublisher
    pub = EventPublisher(session_event()).start()
    print("ready", flush=True)
    time.sleep(60)
    """
)


@pytest.mark.parametrize("bind", ["ipc", "tcp://127.0.0.1"])
def test_sigkilled_job_is_cleaned_by_ls(bind: str, rt: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), TORCHSCOPE_BIND=bind)
    job = subprocess.Popen(
        [sys.executable, "-c", JOB, str(ROOT / "tests")], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert job.stdout.readline().strip() == "ready"
        (rec,) = ep.list_sessions()
        assert rec.pid == job.pid
        mine = sorted(p.name for p in rt.iterdir() if p.name.startswith(f"{job.pid}"))
        assert mine, "the job left no files to find it by"
        if bind == "ipc":
            assert mine == [f"{job.pid}.control", f"{job.pid}.events"]
        else:
            assert len(mine) == 1 and mine[0].endswith(".curve")
            assert job.pid == json.loads((rt / mine[0]).read_text())["pid"]
    finally:
        job.send_signal(signal.SIGKILL)
        job.wait()
    assert ep.list_sessions() == []
    assert [p.name for p in rt.iterdir() if p.name.startswith(f"{job.pid}")] == []
    assert list(ep.sessions_dir().iterdir()) == []
