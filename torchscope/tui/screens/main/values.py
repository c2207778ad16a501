"""The paused event's tensor values: ``v`` fetches them from the job, ``<`` / ``>`` page through
slices, ``!`` finds the first NaN/Inf value (in the job's tensor, or the recorded summary's)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from torchscope.protocol.events import GRAD
from torchscope.session.stepper_view import (
    ValuesView,
    default_choice,
    pause_key,
)
from torchscope.tui.screens.main.context import ScreenCore

if TYPE_CHECKING:
    from collections.abc import Callable

    from torchscope.session.rows import PendingRow, Row
    from torchscope.session.stepper_view import ValuesView
    from torchscope.tui.screens.host import Host
    from torchscope.tui.widgets.detail_panel import DetailPanel


class ValuesScreen(ScreenCore, Protocol):
    """The main screen, as the paused event's values see it."""

    detail: DetailPanel
    host: Host
    values: ValuesView | None

    def call_after_refresh(
        self, callback: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> bool: ...

    def is_paused_row(self, row: Row | PendingRow) -> bool: ...

    @property
    def live(self) -> bool: ...

    def select_paused(self) -> bool: ...

    def show_detail(self) -> None: ...

    def values_for(self, pause: dict) -> ValuesView: ...


class Values:
    def __init__(self, main: ValuesScreen) -> None:
        self.main = main

    def cycle(self) -> None:
        pause = self.main.store.stepper.paused
        if pause is None:
            if self.main.host.can_command():
                self.main.notify("values come from a paused job (space pauses it)", timeout=3)
            return
        values = self.main.values_for(pause)
        if not values.choices:
            self.main.notify("no tensor is held at this point", timeout=3)
            return
        row = self.main.timeline.current_row()
        if row is None or not self.main.is_paused_row(row):
            self.main.select_paused()
        if values.current < 0:
            values.current = default_choice(values.choices)
        else:
            values.current = (values.current + 1) % len(values.choices)
        values.start = 0
        values.mark = None
        self._fetch_values()

    def next_slice(self) -> None:
        values = self._values_ready()
        if values is None:
            return
        numel = values.numel
        if numel is not None and values.start + values.count >= numel:
            self.main.notify("that is the last slice", timeout=2)
            return
        values.start += values.count
        self._fetch_values()

    def prev_slice(self) -> None:
        values = self._values_ready()
        if values is None:
            return
        if values.start == 0:
            self.main.notify("that is the first slice", timeout=2)
            return
        values.start = max(0, values.start - values.count)
        self._fetch_values()

    def _values_ready(self) -> ValuesView | None:
        pause = self.main.store.stepper.paused
        values = self.main.values
        if pause is None or values is None or values.key != pause_key(pause):
            self.main.notify("v fetches values of the paused event first", timeout=3)
            return None
        if values.choice is None:
            self.main.notify("v fetches values first", timeout=3)
            return None
        return values

    def _fetch_values(self) -> None:
        values = self.main.values
        if values is None or values.choice is None:
            return
        group, index, _ = values.choice
        request = (values.key, values.current, values.start)
        values.requested = request
        values.note = None
        values.loading = True
        values.error = None
        values.result = None
        values.bump()
        self.main.show_detail()

        def arrived(ok: bool, payload: Any) -> None:
            if self.main.values is not values or values.requested != request:
                return  # another pause, tensor or slice was asked for since
            values.loading = False
            if ok and isinstance(payload, dict):
                values.result = payload
            else:
                values.error = str(payload)
            values.bump()
            self.main.show_detail()

        if not self.main.host.command(
            "inspect",
            group=group,
            index=index,
            start=values.start,
            count=values.count,
            then=arrived,
        ):
            values.loading = False
            values.error = self.main.host.source.refusal
            values.bump()
            self.main.show_detail()

    # -- ! : the first NaN/Inf value --------------------------------------------------------
    #: The search through a paused job's tensor asks for this many values at a time (the
    #: most one ``inspect`` answers), at most this many times.
    NAN_PAGE = 100_000
    NAN_PAGES = 64

    def first_nan(self) -> None:
        """``!``: the first NaN/Inf value. Paused: searched through the tensor the values
        section shows (or the first one whose stats count one), fetched page by page; else
        in the small values the event recorded."""
        pause = self.main.store.stepper.paused
        row = self.main.timeline.current_row()
        if pause is not None and row is not None and self.main.is_paused_row(row):
            values = self.main.values_for(pause)
            if values.choice is None or not _bad_count(values.choice[2]):
                bad = [i for i, c in enumerate(values.choices) if _bad_count(c[2])]
                if bad:
                    values.current = bad[0]
                    values.start = 0
            if values.choice is not None:
                self._search_nan(values)
                return
        self._recorded_nan()

    def _recorded_nan(self) -> None:
        from torchscope.session.format import first_bad, index_text

        ev = self.main.detail.event
        if not ev:
            self.main.notify("! finds the first NaN/Inf of the selected op or node", timeout=3)
            return
        groups = (
            ("grad_outputs", "grad_inputs") if ev.get("kind") == GRAD else ("inputs", "outputs")
        )
        counted = None
        for group in groups:
            for i, s in enumerate(ev.get(group) or ()):
                if not isinstance(s, dict):
                    continue
                bad = first_bad(s.get("values"))
                shape = s.get("shape") if isinstance(s.get("shape"), list) else None
                if bad is not None:
                    self.main.notify(
                        f"first NaN/Inf: {group}[{i}] at {index_text(bad, shape)}", timeout=5
                    )
                    self._scroll_detail_to("first NaN/Inf at")
                    return
                if counted is None and _bad_count(s):
                    counted = f"{group}[{i}]"
        if counted is not None:
            where = (
                "v fetches them, ! finds it"
                if self.main.live
                else "pause the job there (b) to fetch them"
            )
            self.main.notify(
                f"{counted} holds NaN/Inf, but its values were not recorded (too many): {where}",
                timeout=6,
            )
        else:
            self.main.notify("no NaN/Inf in this event's tensors", timeout=3)

    def _scroll_detail_to(self, text: str) -> None:
        lines = str(self.main.detail.body.render()).split("\n")
        line = next((n for n, t in enumerate(lines) if text in t), None)
        if line is not None:
            self.main.detail.scroll_to(y=max(0, line - 4), animate=False)

    def _search_nan(self, values: ValuesView) -> None:
        from torchscope.session.format import first_bad, index_text

        assert values.choice is not None  # first_nan() searches a chosen tensor only
        group, index, summary = values.choice
        label = values.label()
        result = values.result
        if result is not None and isinstance(result.get("values"), list):
            bad = first_bad(result["values"])
            raw = result.get("start")
            start = raw if type(raw) is int else values.start
            if bad is not None and (start == 0 or values.mark == start + bad):
                values.mark = start + bad
                values.note = None
                values.bump()
                self.main.show_detail()
                self.main.call_after_refresh(self.main.detail._scroll_to_values)
                return
        if not _bad_count(summary):
            self.main.notify(f"no NaN/Inf in {label} (its stats count none)", timeout=3)
            return
        shape = summary.get("shape") if isinstance(summary.get("shape"), list) else None
        token = object()
        values.requested = ("nan", token)
        values.mark = None

        def ask(page: int) -> None:
            values.note = f"looking for the first NaN/Inf… {page * self.NAN_PAGE:,} values read"
            values.bump()
            self.main.show_detail()
            ok = self.main.host.command(
                "inspect",
                group=group,
                index=index,
                start=page * self.NAN_PAGE,
                count=self.NAN_PAGE,
                then=lambda ok, payload: arrived(page, ok, payload),
            )
            if not ok:
                values.note = None
                values.bump()
                self.main.show_detail()

        def arrived(page: int, ok: bool, payload: Any) -> None:
            if self.main.values is not values or values.requested != ("nan", token):
                return  # another pause, tensor or slice was asked for since
            if (
                not ok
                or not isinstance(payload, dict)
                or not isinstance(payload.get("values"), list)
            ):
                values.note = f"the search stopped: {payload}"
                values.bump()
                self.main.show_detail()
                return
            vals = payload["values"]
            bad = first_bad(vals)
            if bad is not None:
                flat = page * self.NAN_PAGE + bad
                last = shape[-1] if shape and shape[-1] > 0 else 1
                values.mark = flat
                values.note = None
                values.start = max(0, flat - flat % last)
                self.main.notify(f"first NaN/Inf of {label}: {index_text(flat, shape)}", timeout=4)
                self._fetch_values()
                self.main.call_after_refresh(self.main.detail._scroll_to_values)
                return
            numel = payload.get("numel")
            end = (page + 1) * self.NAN_PAGE
            if (type(numel) is int and end >= numel) or len(vals) < self.NAN_PAGE:
                values.note = f"no NaN/Inf in the {min(end, numel or end):,} values now"
            elif page + 1 >= self.NAN_PAGES:
                values.note = f"no NaN/Inf in the first {end:,} values (the search stops there)"
            else:
                ask(page + 1)
                return
            values.bump()
            self.main.show_detail()

        ask(0)


def _bad_count(summary: Any) -> int:
    """NaN + Inf values a tensor summary counts (0 when it says nothing)."""
    stats = summary.get("stats") if isinstance(summary, dict) else None
    if not isinstance(stats, dict):
        return 0
    return int(stats.get("nan") or 0) + int(stats.get("inf") or 0)
