"""Runtime directory, session registry, addresses: what a UI relies on to find a job safely."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from torchscope.protocol import endpoints as ep
from torchscope.protocol import runtime
from torchscope.protocol.endpoints import SessionRecord
from torchscope.protocol.runtime import EndpointError


@pytest.fixture
def rt(monkeypatch: pytest.MonkeyPatch):
    """A private runtime dir with a short path (ipc socket paths have a ~107-byte limit)."""
    base = Path(tempfile.mkdtemp(prefix="tsep-", dir="/tmp"))
    monkeypatch.setenv(ep.ENV_RUNTIME_DIR, str(base / "run"))
    monkeypatch.delenv(ep.ENV_BIND, raising=False)
    yield base / "run"
    shutil.rmtree(base, ignore_errors=True)


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _record(pid: int, rank: int | None = None, **kw) -> SessionRecord:
    base = dict(
        pid=pid,
        rank=rank,
        world_size=None if rank is None else 2,
        script="/work/train.py",
        argv=["train.py", "--lr", "0.1"],
        host=os.uname().nodename,
        started=time.time(),
        events=f"ipc:///tmp/x/{pid}.events",
        control=f"ipc:///tmp/x/{pid}.control",
    )
    base.update(kw)
    return SessionRecord(**base)


@pytest.fixture
def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def other_pid():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc.pid
    proc.kill()
    proc.wait()


# -- runtime dir ------------------------------------------------------------------------------
def test_runtime_dir_is_created_private(rt: Path) -> None:
    old = os.umask(0)  # even a careless umask must not make it shared
    try:
        path = ep.runtime_dir()
    finally:
        os.umask(old)
    assert path == rt and path.is_dir()
    assert _mode(path) == 0o700
    assert _mode(ep.sessions_dir()) == 0o700
    assert ep.runtime_dir() == path  # existing, ours, private: accepted again


@pytest.mark.parametrize("mode", [0o777, 0o750, 0o701])
def test_runtime_dir_open_to_others_is_refused(rt: Path, mode: int) -> None:
    rt.mkdir(mode=0o700)
    os.chmod(rt, mode)
    with pytest.raises(EndpointError) as err:
        ep.runtime_dir()
    msg = str(err.value)
    assert "\n" not in msg and f"{mode:04o}" in msg and "chmod 700" in msg
    assert _mode(rt) == mode  # refused, not silently "fixed"


def test_runtime_dir_owned_by_someone_else_is_refused(rt: Path, monkeypatch) -> None:
    if os.geteuid() == 0:
        rt.mkdir(mode=0o700)
        os.chown(rt, 4242, 4242)
        target = rt
    else:  # a directory we cannot own: root's
        target = Path("/usr")
        monkeypatch.setenv(ep.ENV_RUNTIME_DIR, str(target))
    with pytest.raises(EndpointError, match=r"owned by uid \d+, not by you"):
        ep.runtime_dir()
    with pytest.raises(EndpointError):
        ep.register(_record(os.getpid()))  # nothing is written into it either


def test_runtime_dir_symlink_is_refused(rt: Path) -> None:
    real = rt.parent / "elsewhere"
    real.mkdir(mode=0o700)
    rt.symlink_to(real)
    with pytest.raises(EndpointError, match="symbolic link"):
        ep.runtime_dir()


def test_runtime_dir_file_is_refused(rt: Path) -> None:
    rt.write_text("")
    with pytest.raises(EndpointError, match="not a directory"):
        ep.runtime_dir()


def test_xdg_runtime_dir_used_when_usable(monkeypatch, tmp_path: Path) -> None:
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    monkeypatch.delenv(ep.ENV_RUNTIME_DIR, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    assert ep.runtime_dir() == xdg / "torchscope"
    assert _mode(xdg / "torchscope") == 0o700
    assert not runtime._xdg_usable(str(tmp_path / "missing"))
    assert not runtime._xdg_usable(str(xdg / "torchscope" / "nope"))


# -- addresses --------------------------------------------------------------------------------
def test_default_endpoints_ipc(rt: Path) -> None:
    ev, ctl = ep.default_endpoints(123, None)
    assert (ev, ctl) == (f"ipc://{rt}/123.events", f"ipc://{rt}/123.control")
    ev, ctl = ep.default_endpoints(123, 3)
    assert (ev, ctl) == (f"ipc://{rt}/123-3.events", f"ipc://{rt}/123-3.control")


def test_default_endpoints_tcp_loopback(rt: Path, monkeypatch) -> None:
    monkeypatch.setenv(ep.ENV_BIND, "tcp://127.0.0.1")
    assert ep.default_endpoints(1, None) == ("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    monkeypatch.setenv(ep.ENV_BIND, "tcp://127.0.0.1:6100")
    assert ep.default_endpoints(1, None) == ("tcp://127.0.0.1:*", "tcp://127.0.0.1:6100")
    assert ep.default_endpoints(1, 2)[1] == "tcp://127.0.0.1:6102"  # ranks of one host
    monkeypatch.setenv(ep.ENV_BIND, "tcp://[::1]:6100")
    assert ep.default_endpoints(1, None)[1] == "tcp://[::1]:6100"


@pytest.mark.parametrize("bind", ["tcp://0.0.0.0", "tcp://*:6100", "tcp://10.1.2.3", "tcp://eth0"])
def test_default_endpoints_refuse_public_tcp(rt: Path, monkeypatch, bind: str) -> None:
    monkeypatch.setenv(ep.ENV_BIND, bind)
    with pytest.raises(EndpointError, match="requires CURVE keys"):
        ep.default_endpoints(1, None)


@pytest.mark.parametrize(
    ("addr", "expected"),
    [
        ("tcp://127.0.0.1:5555", "tcp://127.0.0.1:5555"),
        ("tcp://127.8.9.10:*", "tcp://127.8.9.10:*"),
        ("tcp://localhost:5555", "tcp://127.0.0.1:5555"),
        ("tcp://[::1]:*", "tcp://[::1]:*"),
        ("ipc:///tmp/x/1.control", "ipc:///tmp/x/1.control"),
    ],
)
def test_check_bind_address_accepts(addr: str, expected: str) -> None:
    assert ep.check_bind_address(addr) == expected


@pytest.mark.parametrize(
    ("addr", "match"),
    [
        ("tcp://0.0.0.0:5555", "binding tcp://0.0.0.0:5555 requires CURVE keys"),
        ("tcp://192.168.1.4:5555", "requires CURVE keys"),
        ("tcp://[::]:5555", "requires CURVE keys"),
        ("tcp://example.com:5555", "requires CURVE keys"),
        ("tcp://127.0.0.1", "needs a port"),
        ("tcp://127.0.0.1:99999", "needs a port"),
        ("tcp://::1:5", "brackets"),
        ("ipc://", "needs a socket path"),
        ("ipc:///" + "x" * 200, "longer than"),
        ("udp://127.0.0.1:5", "unsupported endpoint"),
        ("inproc://x", "unsupported endpoint"),
        ("", "not an endpoint"),
    ],
)
def test_check_bind_address_refuses(addr: str, match: str) -> None:
    with pytest.raises(EndpointError, match=match) as err:
        ep.check_bind_address(addr)
    assert "\n" not in str(err.value)


def test_bad_bind_setting(rt: Path, monkeypatch) -> None:
    monkeypatch.setenv(ep.ENV_BIND, "carrier-pigeon")
    with pytest.raises(EndpointError, match="not understood"):
        ep.default_endpoints(1, None)


# -- records and the registry -----------------------------------------------------------------
def test_record_round_trip_and_validation() -> None:
    rec = _record(77, rank=1)
    d = rec.to_dict()
    assert "path" not in d and d["v"] == 1
    back = SessionRecord.from_dict(json.loads(json.dumps(d)), path="/p")
    assert back == SessionRecord(**{**rec.__dict__, "path": "/p"})
    bad = [
        [],
        {**d, "pid": "77"},
        {**d, "pid": 0},
        {**d, "pid": True},
        {**d, "rank": -1},
        {**d, "argv": "train.py"},
        {**d, "argv": [1]},
        {**d, "control": "http://x"},
        {**d, "control": None},
        {**d, "events": 5},
        {**d, "started": "now"},
        {**d, "v": 99},
    ]
    for item in bad:
        with pytest.raises(ValueError):
            SessionRecord.from_dict(item)


def test_record_from_session_event() -> None:
    session = {"kind": "session", "seq": 0, "pid": 5, "rank": 0, "world_size": 2,
               "script": "t.py", "argv": ["t.py"], "host": "h", "started": 12.5}  # fmt: skip
    rec = SessionRecord.from_session(session, events="ipc:///e", control="ipc:///c")
    assert (rec.pid, rec.rank, rec.world_size, rec.script, rec.host, rec.started) == (
        5, 0, 2, "t.py", "h", 12.5,
    )  # fmt: skip
    assert "rank 0" in rec.describe() and "t.py" in rec.describe()


def test_register_list_unregister(rt: Path) -> None:
    rec = _record(os.getpid(), rank=None)
    path = ep.register(rec)
    assert path == rt / "sessions" / f"{os.getpid()}-0.json" and rec.path == str(path)
    assert _mode(path) == 0o600
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left over
    assert json.loads(path.read_text())["control"] == rec.control
    assert ep.list_sessions() == [rec]
    rec.argv = ["again"]
    ep.register(rec)  # re-register replaces atomically
    assert ep.list_sessions()[0].argv == ["again"]
    ep.unregister(rec)
    assert not path.exists() and ep.list_sessions() == []
    ep.unregister(rec)  # twice is fine


def test_list_sessions_prunes_dead_and_garbage(rt: Path, dead_pid: int) -> None:
    live = _record(os.getpid(), rank=0)
    ep.register(live)
    dead = _record(dead_pid)
    ep.register(dead)
    # Our own pid, but a record older than this process: a reused pid, not a live session.
    reused = _record(os.getpid(), rank=5, started=1000.0)
    ep.register(reused)
    sessions = ep.sessions_dir()
    (sessions / "junk-1.json").write_text("{not json")
    (sessions / "junk-2.json").write_text(json.dumps({"pid": "x"}))
    (sessions / "junk-3.json").write_bytes(b"\xff\xfe" * 10)
    (sessions / "huge-4.json").write_text(" " * (ep.MAX_RECORD_BYTES + 10))
    (sessions / ".tmp-in-progress.tmp").write_text("{}")  # someone mid-write: left alone
    assert ep.list_sessions() == [live]
    left = sorted(p.name for p in sessions.iterdir())
    assert left == [".tmp-in-progress.tmp", f"{os.getpid()}-0.json"]


def test_resolve(rt: Path, other_pid: int) -> None:
    with pytest.raises(EndpointError, match=r"^no running torchscope session found$"):
        ep.resolve(None)
    a = _record(os.getpid(), rank=None)
    ep.register(a)
    assert ep.resolve(None) == a
    assert ep.resolve(str(os.getpid())) == a
    b = _record(other_pid, script="/work/eval.py")
    ep.register(b)
    with pytest.raises(EndpointError) as err:
        ep.resolve(None)
    msg = str(err.value)
    assert "2 torchscope jobs" in msg and str(other_pid) in msg and "eval.py" in msg
    assert "\n" not in msg
    assert ep.resolve(f" {other_pid} ") == b
    with pytest.raises(EndpointError, match="no torchscope session with pid 1 "):
        ep.resolve("1")
    direct = ep.resolve("tcp://127.0.0.1:6000")
    assert direct.control == "tcp://127.0.0.1:6000" and direct.events is None and direct.pid == 0
    assert ep.resolve("ipc:///tmp/x.control").control == "ipc:///tmp/x.control"
    with pytest.raises(EndpointError, match="cannot tell which session"):
        ep.resolve("train.py")


def test_the_ranks_of_one_torchrun_job_are_one_target(rt: Path, other_pid: int) -> None:
    rank1 = _record(other_pid, rank=1, job="run-7f3a")
    rank0 = _record(os.getpid(), rank=0, job="run-7f3a", started=rank1.started + 1)
    ep.register(rank1)
    ep.register(rank0)
    assert ep.resolve(None) == rank0  # one job: its rank 0, not "2 sessions are running"
    assert ep.job_sessions(rank1) == [rank0, rank1]
    assert ep.group_by_job(ep.list_sessions()) == [[rank0, rank1]]
    assert ep.list_sessions()[0].job == "run-7f3a"  # the field survives the registry file
    third = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        alone = _record(third.pid, rank=None, script="/work/eval.py")
        assert ep.job_sessions(alone) == [alone]
        ep.register(alone)
        assert len(ep.group_by_job(ep.list_sessions())) == 2
        with pytest.raises(EndpointError, match=r"^2 torchscope jobs are running .*2 ranks"):
            ep.resolve(None)
    finally:
        third.kill()
        third.wait()


def test_protocol_side_imports_without_torch_or_textual() -> None:
    """The UI machine may have neither torch nor (for `ls`/`record`) textual."""
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['textual'] = None\n"
        "import torchscope.protocol.endpoints, torchscope.protocol.frames\n"
        "import torchscope.protocol.client\n"
        "assert 'zmq' not in sys.modules or 'torchscope.protocol.client' in sys.modules\n"
    )
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(root)},
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
