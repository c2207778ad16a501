"""Helpers for the multi-rank tests: two gloo ranks on CPU under torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

JOBS = Path(__file__).parent / "jobs"
# DDP on a small model; rank 1 makes a NaN (sqrt of a negative) in its forward at step 3.
NAN_JOB = JOBS / "ddp_nan.py"
NAN_LINE = 25  # the line of that sqrt
# DDP, 40 steps of about 0.1 s: long enough for a UI to attach and arm both ranks (JOB_STEPS,
# JOB_SLEEP and JOB_PACE_FILE change that; the losses stay the same).
STEADY_JOB = JOBS / "ddp_steady.py"


def torchrun(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``torchrun --standalone --nproc_per_node 2 ARGS``, both ranks' output on its pipes."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=None if env is None else {**os.environ, **env},
    )


# torch 2.13's gloo sometimes aborts a rank as its process exits, after the job's work and
# destroy_process_group(), on a loaded host: with or without torchscope (about 3 runs in 30
# with 3 CPU burners; pytorch#190489). torchrun then exits 1 naming the rank's exit code -6.
GLOO_EXIT_ABORT = "terminate called without an active exception"


def ended_well(proc: subprocess.Popen, err: str) -> bool:
    """Whether a torchrun job ended as it should: exit 0, or only gloo's abort at exit (the
    caller's checks of what the job printed and recorded still decide the test)."""
    if proc.returncode == 0:
        return True
    return proc.returncode == 1 and GLOO_EXIT_ABORT in err and "(exitcode: -6)" in err


def finish(*procs: subprocess.Popen, timeout: float = 60) -> list[tuple[str, str]]:
    """Each process's (stdout, stderr) once it has ended."""
    return [p.communicate(timeout=timeout) for p in procs]


def kill(*procs: subprocess.Popen | None) -> None:
    """On the way out of a test, passed or not: no rank is left behind."""
    for p in procs:
        if p is not None:  # not started: the test failed before it got there
            p.kill()


def job_ranks(job: subprocess.Popen, deadline: float) -> list:
    """The session records of both ranks of ``job`` once both registered (by rank)."""
    from torchscope.protocol import endpoints as ep

    while True:
        assert time.monotonic() < deadline and job.poll() is None, "no 2 rank sessions"
        found = [r for r in ep.list_sessions() if r.job is not None and r.pid != job.pid]
        ranks = ep.job_sessions(found[0]) if found else []
        if len(ranks) == 2:
            return ranks
        time.sleep(0.1)


class Output:
    """A process's stdout and stderr read as they come, so that a test can wait for a line
    instead of sleeping for long enough."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self._lines: dict[str, list[str]] = {"out": [], "err": []}
        self._readers = [
            threading.Thread(target=self._read, args=(pipe, self._lines[name]), daemon=True)
            for name, pipe in (("out", proc.stdout), ("err", proc.stderr))
        ]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(pipe, lines: list[str]) -> None:
        for line in pipe:
            lines.append(line)

    @property
    def out(self) -> str:
        return "".join(self._lines["out"])

    @property
    def err(self) -> str:
        return "".join(self._lines["err"])

    def wait_for(self, cond: Callable[[], bool], deadline: float, what: str) -> None:
        """Until ``cond()``; fails (saying ``what``) past ``deadline`` or if the process ends."""
        while not cond():
            alive = time.monotonic() < deadline and self.proc.poll() is None
            assert alive, f"{what}; stderr so far:\n{self.err[-3000:]}"
            time.sleep(0.05)

    def finish(self, timeout: float = 60) -> tuple[str, str]:
        """(stdout, stderr) once the process has ended and both pipes are read to their end."""
        self.proc.wait(timeout)
        for reader in self._readers:
            reader.join(timeout)
        return self.out, self.err


# DDP with gradient clipping, 6 steps; rank 1 alone makes one bad value at step 4 (JOB_BAD:
# batch, batch_inf, param, collective), written by the loop's own code on the line that says so.
ONE_NAN_JOB = JOBS / "ddp_one_nan.py"


def bad_line(bad: str) -> int:
    """The line of ONE_NAN_JOB that writes JOB_BAD's bad value (its origin)."""
    wanted = {
        "batch": 'x[0, 0] = float("nan")',
        "batch_inf": 'x[0, 0] = float("inf")',
        "param": 'model.module[0].weight[0, 0] = float("nan")',
        "collective": 'scale[0] = float("nan")',
    }[bad]
    lines = ONE_NAN_JOB.read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if wanted in line)


def rank_alerts(path_of: Callable[[int], Path]) -> dict[int, list]:
    """Each rank's alert events as recorded (rank -> list), from its trace file."""
    import torchscope

    return {r: [dict(e) for e in torchscope.load(path_of(r)).of_kind("alert")] for r in (0, 1)}
