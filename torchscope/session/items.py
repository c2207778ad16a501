"""What a source tells the store, one frozen dataclass per kind of news.

A source's worker thread puts these in its :class:`~torchscope.session.inbox.Inbox`; the
UI thread drains them and hands them to :meth:`EventStore.apply
<torchscope.session.store.EventStore.apply>`, which tells them apart with ``match``. They
live here, beside the store that reads them, so that the model needs nothing of the sources.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, TypeAlias

from torchscope.protocol.events import Event
from torchscope.session.rows import Rec

__all__ = [
    "Answer",
    "Counts",
    "ErrorMessage",
    "Events",
    "HistoryBatch",
    "InboxItem",
    "NewSession",
    "Overview",
    "Progress",
    "ProgressDone",
    "Refused",
    "Reply",
    "Status",
    "StepAbort",
    "StepIndex",
    "StepPart",
    "Unavailable",
    "WholeStep",
]


@dataclass(frozen=True, slots=True)
class Events:
    """Events as they stream in (already turned into records by ``prepare``)."""

    items: list[Rec | Event]


@dataclass(frozen=True, slots=True)
class WholeStep:
    """All of one step, loaded when asked for: it replaces whatever of it was resident."""

    step: int
    items: list[Rec | Event]


@dataclass(frozen=True, slots=True)
class StepPart:
    """Part ``done`` of ``total`` of a step being loaded (a huge step streams in, chunk by
    chunk); ``first`` replaces what was resident, ``last`` makes its counts exact."""

    step: int
    items: list[Rec | Event]
    first: bool
    last: bool
    done: int
    total: int


@dataclass(frozen=True, slots=True)
class StepAbort:
    """The source gave up loading ``step`` (another step was asked for)."""

    step: int


@dataclass(frozen=True, slots=True)
class StepIndex:
    """Steps known to exist in a file, not loaded: ``(step, counted)``."""

    entries: list[tuple[int, bool]]


@dataclass(frozen=True, slots=True)
class Counts:
    """A replay's background count pass: ``{step: (ops, grads, graph_nodes, alerts, events,
    alert_events[, grad_sq, grad_norms[, aten]])}``, the steps whose counts are now complete,
    and ``{step: (loss, rank)}``."""

    counts: dict[int, tuple]
    final: list[int]
    losses: dict[int, tuple] | None = None


@dataclass(frozen=True, slots=True)
class Overview:
    """A live session's loss and gradient norms: ``{step: (grad_sq, grad_norms)}`` (added up)
    and ``{step: (loss, rank)}``."""

    grads: dict[int, tuple[float, int]]
    losses: dict[int, tuple]


@dataclass(frozen=True, slots=True)
class HistoryBatch:
    """The run's history points and buckets a source found (a ``history`` event's fields)."""

    wire: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Status:
    """Status fields that changed (mode, state, connected, file, pid, ...)."""

    values: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Reply:
    """A job's answer to a command (``token`` 0: a request of the source's own)."""

    token: int
    cmd: str
    fields: dict[str, Any]
    result: Any


@dataclass(frozen=True, slots=True)
class Refused:
    """A command that did not reach the job, or that it refused, in one line."""

    token: int
    cmd: str
    fields: dict[str, Any]
    message: str


@dataclass(frozen=True, slots=True)
class Progress:
    """A long task of the source, ``done`` of ``total``."""

    done: float
    total: float
    label: str


@dataclass(frozen=True, slots=True)
class ProgressDone:
    """The long task ended."""


@dataclass(frozen=True, slots=True)
class ErrorMessage:
    """Something went wrong, in one line."""

    message: str


@dataclass(frozen=True, slots=True)
class Unavailable:
    """A step asked for that the source cannot give, and why."""

    step: int
    message: str


@dataclass(frozen=True, slots=True)
class NewSession:
    """The followed job started again: what comes after belongs to a fresh store (the app
    applies what came before, then starts one)."""


InboxItem: TypeAlias = (
    Events
    | WholeStep
    | StepPart
    | StepAbort
    | StepIndex
    | Counts
    | Overview
    | HistoryBatch
    | Status
    | Reply
    | Refused
    | Progress
    | ProgressDone
    | ErrorMessage
    | Unavailable
    | NewSession
)


class Answer(NamedTuple):
    """A command's answer as ``Changes.replies`` hands it to the app: ``tag`` is ``"reply"``
    (``payload`` the result) or ``"refused"`` (``payload`` the one-line message)."""

    tag: str
    token: int
    cmd: str
    fields: dict[str, Any]
    payload: Any
