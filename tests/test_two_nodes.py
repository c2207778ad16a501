"""Two torchrun nodes on one machine, as two hosts would run them (issue 23, item 4).

``torchrun --nnodes 2 --nproc_per_node 1 --rdzv_backend c10d`` started twice, each "node"
with its own runtime directory (its own registry, as another host has) and its own working
directory (its own files), every rank bound on every interface
(``TORCHSCOPE_BIND=tcp://0.0.0.0``) with the user's CURVE keys (`torchscope keys`, copied to
every node), as the README requires of anything other machines can reach. A UI with a third
runtime directory (a laptop) is given rank 0's control endpoint alone: it finds rank 1
through the job's c10d store, pauses both ranks and lets them go.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from ranks import STEADY_JOB, Output, ended_well, kill

pytest.importorskip("torch")


def _host_name() -> str | None:
    """This machine's name, as a rank records it and another machine would dial it; None
    when it does not resolve here."""
    name = socket.gethostname()
    try:
        socket.getaddrinfo(name, None)
    except OSError:
        return None
    return name


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700)
    path.chmod(0o700)
    return path


def _ls(env: dict[str, str]) -> str:
    return subprocess.run(
        [sys.executable, "-m", "torchscope", "ls"],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    ).stdout


class TwoNodes:
    """The job's two nodes once both ranks registered: ``records`` by rank (as each node's
    registry has them), ``dial`` (rank -> control endpoint by host name), ``pace`` (the
    job steps every 0.1 s while this file exists)."""

    def __init__(self, host: str, nodes: list[dict], records: dict, pace: Path) -> None:
        self.host, self.nodes, self.records, self.pace = host, nodes, records, pace
        self.deadline = time.monotonic() + 60
        self.outs: list[tuple[str, str]] = []

    @property
    def dial(self) -> dict[int, str]:
        from torchscope.tui.sources.open import dialable

        return {r: dialable(rec.control, self.host) for r, rec in self.records.items()}

    def finish(self) -> None:
        """Let the job run out and wait for both nodes."""
        with contextlib.suppress(FileNotFoundError):
            self.pace.unlink()
        self.outs = [node["output"].finish(timeout=60) for node in self.nodes]


@contextlib.contextmanager
def two_nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[TwoNodes]:
    """ddp_steady.py (200 steps) on two torchrun nodes of one rank each, ``--record t.tsc``;
    this process is left as the laptop: its own runtime directory, the user's keys."""
    host = _host_name()
    if host is None:
        pytest.skip("this machine's host name does not resolve: no address to dial it by")
    from torchscope.protocol import endpoints as ep

    keys = tmp_path / "keys"
    monkeypatch.setenv("TORCHSCOPE_KEYS_DIR", str(keys))  # the same keys on every machine
    base = {**os.environ}
    made = subprocess.run(
        [sys.executable, "-m", "torchscope", "keys"], capture_output=True, text=True, env=base
    )
    assert made.returncode == 0, made.stderr
    pace = tmp_path / "pace"
    pace.touch()
    port = _free_port()
    nodes: list[dict] = []
    jobs: list[subprocess.Popen] = []
    try:
        for n in (0, 1):
            cwd = _private_dir(tmp_path / f"node{n}")
            env = {
                **base,
                "TORCHSCOPE_RUNTIME_DIR": str(_private_dir(cwd / "run")),
                # Every interface, as a multi-node job binds: random ports, CURVE with the keys.
                "TORCHSCOPE_BIND": "tcp://0.0.0.0",
                "JOB_PACE_FILE": str(pace),
                "JOB_STEPS": "200",
                "JOB_PG_TIMEOUT": "30",
            }
            job = subprocess.Popen(
                [
                    sys.executable, "-m", "torch.distributed.run",
                    "--nnodes", "2", "--nproc_per_node", "1",
                    "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
                    "--rdzv_id", f"two-nodes-{port}",
                    "-m", "torchscope", "run", "--record", "t.tsc", "--lease", "5",
                    str(STEADY_JOB),
                ],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, env=env,
            )  # fmt: skip
            jobs.append(job)
            nodes.append({"cwd": cwd, "env": env, "output": Output(job), "job": job})
        deadline = time.monotonic() + 60
        # `ls` on each node: its own rank, under the one job, "1 of 2 ranks here".
        for node in nodes:
            while (listed := _ls(node["env"])).count(" ranks here") != 1:
                node["output"].wait_for(lambda: True, deadline, "a node never registered")
                time.sleep(0.2)
            assert "1 of 2 ranks here" in listed, listed
            assert "control tcp://0.0.0.0:" in listed, listed
        records = {}
        for node in nodes:
            monkeypatch.setenv("TORCHSCOPE_RUNTIME_DIR", node["env"]["TORCHSCOPE_RUNTIME_DIR"])
            (record,) = ep.list_sessions()
            records[record.rank] = record
            node["rank"] = record.rank
        assert sorted(records) == [0, 1] and records[0].job == records[1].job
        monkeypatch.setenv("TORCHSCOPE_RUNTIME_DIR", str(_private_dir(tmp_path / "laptop")))
        try:
            yield TwoNodes(host, nodes, records, pace)
        except Exception as exc:  # what each rank said, beside what went wrong
            said = "".join(
                f"\n--- node {n} stderr ---\n{node['output'].err[-2000:]}"
                for n, node in enumerate(nodes)
            )
            raise AssertionError(f"{type(exc).__name__}: {exc}{said}") from exc
    finally:
        kill(*jobs)


def _found_through_rank_0(job: TwoNodes) -> list:
    """What ``torchscope tui ENDPOINT-OF-RANK-0`` opens: both ranks, rank 1 found through the
    job's c10d store and named as its host is dialled (it bound tcp://0.0.0.0:PORT)."""
    from torchscope.tui.sources.open import open_sources

    dial = job.dial
    assert dial[0] == f"tcp://{job.host}:{job.records[0].control.rsplit(':', 1)[1]}"
    while True:  # each rank puts its record in the store at its first step boundary
        sources, first = open_sources([dial[0]])
        if len(sources) == 2:
            break
        assert time.monotonic() < job.deadline, "the UI did not find rank 1 through rank 0"
        time.sleep(0.2)
    assert first == 0
    assert [s.target for s in sources] == [dial[0], dial[1]]
    return sources


def test_one_ui_reaches_rank_0_alone_finds_rank_1_and_pauses_and_continues_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchscope.protocol.client import SessionClient

    with two_nodes(tmp_path, monkeypatch) as job:
        sources = _found_through_rank_0(job)
        # DDP rebuilds its buckets in its second forward, with a broadcast in C++ that no
        # meeting of the ranks covers: a rank paused just before it would hold the other in
        # there (docs/guides/ranks.md). Past it, a pause reaches both.
        for node in job.nodes:
            out = node["output"]
            out.wait_for(lambda o=out: "step 2 " in o.out, job.deadline, "no step 2")
        # What the UI's space and c do: the same command to every rank.
        with SessionClient() as ui0, SessionClient() as ui1:
            uis = {0: ui0, 1: ui1}
            for rank, ui in uis.items():
                ui.connect(sources[rank].target, timeout=30)
            for ui in uis.values():
                ui.request("pause", timeout=30)
            states: dict[int, dict] = {}
            while len(states) < 2:
                assert time.monotonic() < job.deadline, f"not both paused: {states}"
                for rank, ui in uis.items():
                    state = ui.request("state", timeout=30)["state"]
                    if state["paused"] is not None:
                        states[rank] = state
                time.sleep(0.05)
            held = time.monotonic()
            # A fixed time, on purpose: that both ranks stay paused is checked over a while,
            # in two other processes (their leases and collectives run on real clocks)
            while time.monotonic() - held < 1.0:  # held, both, while the UI is there
                for ui in uis.values():
                    assert ui.request("state", timeout=30)["state"]["paused"] is not None
                time.sleep(0.2)
            job.pace.unlink()
            for ui in uis.values():
                ui.request("continue", timeout=30)
        job.finish()
    for node, (out, err) in zip(job.nodes, job.outs, strict=True):
        assert ended_well(node["job"], err), err[-3000:]
        assert sum(line.startswith("rank ") for line in out.splitlines()) == 200
        # --record: each node wrote its own rank's file, in its own directory.
        files = sorted(p.name for p in node["cwd"].glob("*.tsc"))
        assert files == [f"t.rank{node['rank']}.tsc"], files


class Socks5:
    """A SOCKS5 server (no authentication, CONNECT), standing in for ``ssh -D PORT LOGIN``:
    the one tunnel a laptop opens to the cluster. ``dialled``: (host, port) it connected."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.dialled: list[tuple[str, int]] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._client, args=(conn,), daemon=True).start()

    @staticmethod
    def _read(conn: socket.socket, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = conn.recv(n - len(data))
            if not chunk:
                raise OSError("closed")
            data += chunk
        return data

    def _client(self, conn: socket.socket) -> None:
        try:
            _, methods = self._read(conn, 2)
            self._read(conn, methods)
            conn.sendall(b"\x05\x00")  # no authentication
            _, _, _, kind = self._read(conn, 4)
            if kind == 1:
                host = socket.inet_ntoa(self._read(conn, 4))
            elif kind == 3:  # a name, resolved here (at the far end of the tunnel)
                host = self._read(conn, self._read(conn, 1)[0]).decode()
            else:
                host = socket.inet_ntop(socket.AF_INET6, self._read(conn, 16))
            (port,) = struct.unpack("!H", self._read(conn, 2))
            self.dialled.append((host, port))
            far = socket.create_connection((host, port), timeout=5)
            far.settimeout(None)
            conn.sendall(b"\x05\x00\x00\x01" + bytes(4) + bytes(2))
        except OSError:
            conn.close()
            return
        for a, b in ((conn, far), (far, conn)):
            threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := a.recv(65536):
                b.sendall(data)
        for s in (a, b):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.sock.close()


def _socks_env() -> str | None:
    from torchscope.protocol import client

    return getattr(client, "ENV_SOCKS", None)


@pytest.mark.skipif(
    _socks_env() is None, reason="the UI's SOCKS support (TORCHSCOPE_SOCKS_PROXY) is not in"
)
def test_a_laptop_reaches_every_rank_through_one_socks_tunnel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The laptop of the README: one tunnel (``ssh -N -D 1080 LOGIN``, here a SOCKS5 server)
    and ``TORCHSCOPE_SOCKS_PROXY=localhost:1080 torchscope tui tcp://NODE0:PORT``: every
    connection, to rank 0 and to rank 1 found through it, goes through the tunnel, by the
    ranks' host name, and both answer."""
    from torchscope.protocol.client import SessionClient

    proxy = Socks5()
    try:
        with two_nodes(tmp_path, monkeypatch) as job:
            monkeypatch.setenv(str(_socks_env()), f"127.0.0.1:{proxy.port}")
            sources = _found_through_rank_0(job)
            for rank, source in enumerate(sources):
                with SessionClient() as ui:
                    assert ui.connect(source.target, timeout=30)["rank"] == rank
                    assert ui.subscribed
            job.finish()
    finally:
        proxy.close()
    ports = {int(r.control.rsplit(":", 1)[1]) for r in job.records.values()}
    assert ports <= {port for host, port in proxy.dialled if host == job.host}, proxy.dialled
