"""Helpers shared by the tests of live sessions (publisher, client, security)."""

from __future__ import annotations

import threading
import time

import pytest
from zmq.auth.thread import AuthenticationThread

from torchscope.protocol.client import SessionClient

# What a client that gets no answer is told: its request queued and never answered, or never
# taken at all while a refused CURVE handshake leaves it no connection (a loaded machine sees
# both).
NO_ANSWER = r"did not answer 'hello'|is not accepting requests"


@pytest.fixture(autouse=True)
def _nothing_left():
    """After each test: no publisher or authenticator thread outlives it."""
    yield
    deadline = time.monotonic() + 15  # threads end soon; a loaded box is slow
    while any(
        t.name == "torchscope-publisher" or isinstance(t, AuthenticationThread)
        for t in threading.enumerate()
    ):
        assert time.monotonic() < deadline, "a publisher or authenticator thread outlived its test"
        time.sleep(0.01)


def some_events(client: SessionClient, timeout: float = 30.0) -> list:
    """Events from the first frames that carry any (heartbeats may come first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events = client.recv_events(50)
        if events:
            return events
    return []
