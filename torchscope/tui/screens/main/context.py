"""What every part of the main screen uses of it: :class:`ScreenCore`, and the small types
they share (:class:`Location`, :data:`Asked`).

Each part (navigation, stepping, pause, values, evaluate, the prompt's modes, search, graph,
sharing, hints, lanes, and the feature controllers: shown_step, alerts, panels, run_history)
declares what else it uses of the screen as its own protocol, built on ``ScreenCore``;
:class:`~torchscope.tui.screens.main.screen.MainScreen` satisfies them all, and mypy checks
it does where the screen builds each part. No part imports the screen or another part: what
it needs of another one it reaches through the screen's methods its protocol names, or is
handed. ``tests/test_layout.py`` holds that a part's protocol names only what the part uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from textual.notifications import SeverityLevel

    from torchscope.session.store import EventStore
    from torchscope.tui.widgets.op_timeline import OpTimeline


@dataclass(frozen=True)
class Location:
    """Where a jump starts or lands."""

    view: str  # "timeline" or "graph"
    step: int
    kind: str | None = None  # op / grad (timeline); None: whichever has this seq
    seq: int | None = None
    node: int | None = None  # graph


#: What ``@`` / ``E`` asked of the job's next step: (text, answered, the job's step then).
Asked = tuple[str, bool, "int | None"]


class ScreenCore(Protocol):
    """The main screen, as every part sees it: the store it shows, the timeline, a toast."""

    timeline: OpTimeline

    @property
    def store(self) -> EventStore: ...

    def notify(
        self,
        message: str,
        *,
        title: str = "",
        severity: SeverityLevel = "information",
        timeout: float | None = None,
        markup: bool = True,
    ) -> None: ...
