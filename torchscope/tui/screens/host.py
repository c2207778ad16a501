"""What the screens need of the app, declared here so that no screen imports the app.

The app (:class:`~torchscope.tui.app.TorchscopeApp`) satisfies :class:`Host`: its lanes (the
shown one's store, source and status), the commands to the job, and the signals by which it
tells the screens what changed. The app imports screens only to push them; screens reach the
app only through this protocol (``host_of``), so the two never import each other.

Signals are published with the callbacks run at once (``subscribe(..., immediate=True)``), in
the app's ``batch_update()``: a tick's changes are drawn in one repaint, as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from textual.message import Message
from textual.signal import Signal

from torchscope.tui.keys import Hint

if TYPE_CHECKING:
    from textual.dom import DOMNode

    from torchscope.session.rate import RateMeter
    from torchscope.session.store import Changes, EventStore
    from torchscope.tui.lanes import JobAlerts, Lane
    from torchscope.tui.sources.base import EventSource

#: Called with (ok, result or one-line refusal) when a command's answer arrives.
ReplyHandler = Callable[[bool, Any], Any]

#: (lane, step, alignment key, label) of the op ``X`` marked
Mark = tuple[int, int, tuple, str]


@dataclass(frozen=True)
class Applied:
    """One lane's batch, applied to its store (``Host.applied``)."""

    lane: int
    changes: Changes
    shown: bool  # the lane the main screen shows


@dataclass(frozen=True)
class LaneSwitch:
    """The main screen is to show another lane (``Host.lane_switch``): it moves its view over
    and calls ``Host.show_lane`` at the moment the new lane becomes the shown one."""

    old: int
    new: int
    align: bool  # keep the step and the op (by name, module and occurrence)


@dataclass(frozen=True)
class Redraw:
    """What to draw again (``Host.redraw``): the status and key bars, the source bar."""

    status: bool = True
    bar: bool = True


class ArmAtStep(Message):
    """Arm the job from ``step`` on (the agent's ``arm`` with ``at_step``)."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step


class ArmWhen(Message):
    """Arm the job at the first step boundary after ``condition`` holds (``arm`` with
    ``when``); ``condition`` is valid for ``parse_condition``."""

    def __init__(self, condition: str) -> None:
        super().__init__()
        self.condition = condition


class Host(Protocol):
    """The app, as the screens see it."""

    # -- what changed (screens subscribe on mount) -------------------------------------------
    applied: Signal[Applied]
    restarted: Signal[int]  # a lane's job began a new run: its store is fresh
    lane_switch: Signal[LaneSwitch]
    breakpoints_changed: Signal[None]  # the shown lane's breakpoints
    redraw: Signal[Redraw]

    # -- the lanes -------------------------------------------------------------------------
    lanes: list[Lane]
    current: int
    scope: str
    mark: Mark | None

    @property
    def lane(self) -> Lane: ...

    @property
    def multi(self) -> bool: ...

    @property
    def source(self) -> EventSource: ...

    @property
    def store(self) -> EventStore: ...

    @property
    def status(self) -> dict[str, Any]: ...

    @property
    def rate(self) -> RateMeter: ...

    def labels(self) -> list[str]: ...

    def label(self, lane: Lane) -> str: ...

    def lane_hints(self) -> list[Hint]: ...

    def job_alerts(self) -> JobAlerts | None: ...

    def origin_lane(self) -> int | None: ...

    def select_lane(self, index: int, *, align: bool = True) -> None: ...

    def show_lane(self, index: int) -> None: ...

    def screen_ready(self) -> None: ...

    # -- commands to the job ---------------------------------------------------------------
    def command(
        self, cmd: str, *, then: ReplyHandler | None = None, quiet: bool = False, **fields: Any
    ) -> bool: ...

    def can_command(self, *, say: bool = True) -> bool: ...

    def running_elsewhere(self) -> bool: ...


def host_of(node: DOMNode) -> Host:
    """The app a mounted screen runs in, as a :class:`Host`."""
    return cast("Host", node.app)


T = TypeVar("T")


def subscribe(signal: Signal[T], node: DOMNode, callback: Callable[[T], object]) -> None:
    """``callback`` at once on each publish. A Signal logs and drops what its callbacks
    raise: here an error reaches the app's handler instead, as it did from a direct call."""

    def call(data: T) -> None:
        try:
            callback(data)
        except Exception as exc:
            node.app._handle_exception(exc)

    signal.subscribe(node, call, immediate=True)
