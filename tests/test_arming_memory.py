"""A dormant job armed and disarmed over and over keeps nothing of it: memory stays flat.

What ``torchscope record PID --next 1`` does in a loop, through the same control path: each
cycle is a new client (a new connection identity) that connects, arms the job for one step,
reads until the job releases its hold, and goes. Python memory is measured with tracemalloc
after a warm-up, each time with the job held between two steps and the publisher's queue
drained (a ``snapshot`` request pumps it), so nothing in flight is counted.
"""

from __future__ import annotations

import gc
import os
import threading
import time
import tracemalloc

import pytest

pytest.importorskip("torch")
pytest.importorskip("zmq")

import torch
import torch.nn.functional as F

from torchscope.protocol.client import SessionClient
from torchscope.protocol.events import TRACING
from torchscope.tracer.agent import Agent, ServeOptions

UNTRACED = 10  # cycles before tracemalloc starts (first imports, first arming)
WARM_UP = 30  # cycles traced by tracemalloc, then the first measurement
CYCLES = 120  # cycles between the two measurements
# Every armed period of this MLP (about 20 events) used to stay in the job: 45 KB a cycle by
# this measure (5.4 MB over the measured cycles). Without that, what is left is interpreter
# noise that does not build up (free lists, dict resizes, the last step's objects): 0.2-0.25 KB
# a cycle over these 120 cycles, under 0.05 KB a cycle over longer runs. 2 KB a cycle is 20x
# below the leak and 8x above the noise.
BOUND_PER_CYCLE = 2048


class Job:
    """A training loop on its own thread, served dormant; held between two steps on demand."""

    def __init__(self) -> None:
        self.agent: Agent | None = None
        self.started = threading.Event()
        self.stop = threading.Event()
        self.hold = threading.Event()
        self.held = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="job", daemon=True)

    def _run(self) -> None:
        try:
            self.agent = Agent(ServeOptions(quiet=True)).start()  # the training thread's clock
        except BaseException as exc:
            self.error = exc
            self.started.set()
            raise
        self.started.set()
        try:
            torch.manual_seed(0)
            model = torch.nn.Sequential(
                torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
            )
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            while not self.stop.is_set():
                if self.hold.is_set():
                    self.held.set()
                    while self.hold.is_set() and not self.stop.is_set():
                        time.sleep(0.005)
                    self.held.clear()
                loss = F.mse_loss(model(torch.randn(4, 8)), torch.zeros(4, 4))
                opt.zero_grad()
                loss.backward()
                opt.step()
                time.sleep(0.002)  # a few hundred steps a second: the clients get the CPU too
        except BaseException as exc:
            self.error = exc
        finally:
            self.agent.stop()


def _wait(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def record_next_1(target: str) -> None:
    """One ``record --next 1``: a new client arms the job for one step and reads until the
    job lets go of its hold (the ``tracing`` event naming it released)."""
    client = SessionClient()
    try:
        client.connect(target, timeout=30)
        holder = client.request("arm", timeout=30, next=1, by="record")["holder"]
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline, "the job never released a --next 1 hold"
            events = client.recv_events(100)
            if any(
                e.get("kind") == TRACING and holder in (e.get("released") or ()) for e in events
            ):
                return
            # Frames a slow subscription missed: the job says dormant once the hold is gone.
            if not events and client.hello(timeout=30)["tracing"] == "dormant":
                return
    finally:
        client.close()


def measure(job: Job) -> tuple[tracemalloc.Snapshot, int]:
    """Python memory with the job held between two steps and nothing queued for the UIs."""
    job.hold.set()
    try:
        _wait(job.held.is_set, "the job to stop between two steps")
        with SessionClient() as client:
            client.connect(str(os.getpid()), timeout=30)
            # Answered on the publisher's thread after it took everything queued so far.
            held_events = len(client.snapshot(timeout=30)["events"])
        gc.collect()
        return tracemalloc.take_snapshot(), held_events
    finally:
        job.hold.clear()


def test_a_dormant_job_armed_over_and_over_keeps_its_memory_flat():
    job = Job()
    job.thread.start()
    try:
        assert job.started.wait(60) and job.error is None, job.error
        target = str(os.getpid())  # found through the registry, as `record PID` does
        assert job.agent.publisher is not None
        for _ in range(UNTRACED):
            record_next_1(target)
        tracemalloc.start(1)
        try:
            for _ in range(WARM_UP):
                record_next_1(target)
            before, held_before = measure(job)
            armed = job.agent.armed_periods
            for _ in range(CYCLES):
                record_next_1(target)
            assert job.agent.armed_periods - armed == CYCLES  # each cycle armed, then disarmed
            after, held_after = measure(job)
        finally:
            tracemalloc.stop()
        assert job.error is None, job.error
    finally:
        job.stop.set()
        job.hold.clear()
        job.thread.join(30)
    ignore = [tracemalloc.Filter(False, tracemalloc.__file__)]
    diff = after.filter_traces(ignore).compare_to(before.filter_traces(ignore), "lineno")
    grown = sum(d.size_diff for d in diff)
    top = "\n".join(str(d) for d in diff[:8])
    assert grown < BOUND_PER_CYCLE * CYCLES, (
        f"{grown / CYCLES:.0f} bytes kept per arming over {CYCLES} cycles (bound "
        f"{BOUND_PER_CYCLE}); events the dormant job still held: {held_before} -> "
        f"{held_after}; grew most:\n{top}"
    )
