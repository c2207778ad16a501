"""Where the UI's events come from: the interface every source implements. The screens cannot
tell the sources apart.

An :class:`EventSource` runs on one worker thread (``run``) and hands everything to an
:class:`~torchscope.session.inbox.Inbox`: event batches (already turned into store rows, so
the UI thread only appends), whole steps it was asked to load, status changes and progress. The
UI asks for a step with ``request_step`` (thread-safe); the answer arrives through the inbox.
Commands to the job (pause, step, breakpoints, inspect: ``command``) travel the same way: the
source's thread sends them and posts each reply, or the one-line refusal, to the inbox. Only a
:class:`~torchscope.tui.sources.live.LiveSource` reaches a job; the others refuse every command
at once (CommandRefused).

- :class:`~torchscope.tui.sources.file.FileSource` replays a trace file.
- :class:`~torchscope.tui.sources.live.LiveSource` follows a running job.
- :class:`~torchscope.tui.sources.scripted.ScriptedSource` feeds a list of events (tests).

No textual imports here, and no torch.
"""

from __future__ import annotations

import itertools
import queue
import threading
from typing import Any

from torchscope.session.inbox import Inbox
from torchscope.session.stepper_view import REPLAY_REFUSAL

__all__ = ["CommandRefused", "EventSource", "SourceError", "session_status"]


class SourceError(Exception):
    """A target that names no trace file and no session."""


class CommandRefused(Exception):
    """A command this source cannot send (a replay has no job to talk to)."""


def session_status(session: Any) -> dict[str, Any]:
    if not isinstance(session, dict):
        return {}
    out: dict[str, Any] = {}
    for key in ("pid", "rank", "world_size", "host", "script", "torch"):
        if session.get(key) is not None:
            out[key] = session[key]
    return out


class EventSource:
    """The interface the app talks to. Subclasses implement ``run``."""

    mode: str = "replay"  # "replay" or "live"
    label: str = ""
    #: True when a step evicted from memory can be loaded again (request_step).
    can_reload: bool = False
    #: True when ``command`` reaches a job; else it raises CommandRefused with this text.
    can_command: bool = False
    refusal: str = REPLAY_REFUSAL

    def __init__(self) -> None:
        self._requests: queue.Queue[int] = queue.Queue()
        self._commands: queue.Queue[tuple[int, str, dict[str, Any]]] = queue.Queue()
        self._tokens = itertools.count(1)

    def run(self, inbox: Inbox, stop: threading.Event) -> None:  # pragma: no cover - abstract
        """Produce into ``inbox`` until ``stop`` is set (or there is nothing more to do and
        nothing more can come). Runs on a worker thread."""
        raise NotImplementedError

    def request_step(self, step: int) -> None:
        """Ask for all events of ``step``; answered with an inbox ``WholeStep`` (or
        ``StepPart`` items), or ``Unavailable`` (:mod:`torchscope.session.items`).
        Thread-safe."""
        self._requests.put(step)

    def command(self, cmd: str, **fields: Any) -> int:
        """Send a control command (``pause``, ``step``, ``break_add``, ``inspect``, ...) to the
        job; returns a token (> 0) that its inbox answer carries: a ``Reply`` or a
        ``Refused`` item. Thread-safe.
        Raises CommandRefused at once when this source has no job to send it to."""
        if not self.can_command:
            raise CommandRefused(self.refusal)
        token = next(self._tokens)
        self._commands.put((token, cmd, dict(fields)))
        return token

    def _take_commands(self) -> list[tuple[int, str, dict[str, Any]]]:
        out = []
        while True:
            try:
                out.append(self._commands.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        """Release resources. Never sends anything to a job."""

    def _take_requests(self) -> list[int]:
        """Pending requests, newest first, without duplicates."""
        out: list[int] = []
        while True:
            try:
                step = self._requests.get_nowait()
            except queue.Empty:
                break
            if step in out:
                out.remove(step)
            out.insert(0, step)
        return out
