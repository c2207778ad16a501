"""What the prompt under the timeline does in each of its uses: one small class per mode.

The main screen opens the prompt with a mode (``/`` search, ``|`` filter, ``:`` go to, ``e``
export; in the graph, ``/`` and ``|`` search and filter its nodes) and hands every change,
enter and escape to it. A mode keeps no reference to the screen: each call is given it.

=============  ==========================  ==============================================
mode           as the user types           enter / escape
=============  ==========================  ==============================================
search         the cursor to the 1st match  keep the search / clear it, back to the origin
filter         only the matching rows stay  keep the filter / clear it
graph          the graph's cursor to a node keep / clear, the graph keeps the focus
graph-filter   only matching nodes stay     keep / clear
command        (nothing: a ``:`` line)      run it (its error in the box) / close
export         (nothing: a file name)       write (asks again before overwriting) / close
evaluate       (nothing: an expression)     the job answers in the box; ↑↓ history / close
                                            (one still running is interrupted)
edit           (nothing: a replacement)     the job takes it (or refuses in the box) / close
=============  ==========================  ==============================================
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Protocol

from torchscope.session.search import FieldPattern
from torchscope.tui.screens.main.context import ScreenCore

if TYPE_CHECKING:
    from collections.abc import Callable

    from textual.app import App
    from textual.widget import Widget
    from textual.worker import Worker

    from torchscope.tui.widgets.filter_input import FilterInput
    from torchscope.tui.widgets.graph_tree import GraphTree


class PromptScreen(ScreenCore, Protocol):
    """The main screen, as the prompt's modes see it."""

    center: str  # "timeline" or "graph"
    current_step: int | None
    expressions: list[str]  # p / e: what was typed, for ↑↓
    filter: FilterInput
    graph: GraphTree
    search: FieldPattern | None

    @property
    def app(self) -> App[object]: ...

    def back_to_search_origin(self) -> None: ...

    def cancel_evaluation(self) -> None: ...

    def close_prompt(self) -> None: ...

    def edit(self, text: str) -> None: ...

    def evaluate(self, text: str) -> None: ...

    @property
    def focused(self) -> Widget | None: ...

    def graph_title(self) -> None: ...

    def matches(self) -> list[tuple[int, int]]: ...

    def refresh_title(self) -> None: ...

    def run_command(self, text: str) -> str | None: ...

    def run_worker(
        self,
        work: Callable[[], Any],
        name: str | None = "",
        group: str = "default",
        description: str = "",
        exit_on_error: bool = True,
        start: bool = True,
        exclusive: bool = False,
        thread: bool = False,
    ) -> Worker[Any]: ...

    def start_search(self) -> None: ...

    def to_match(
        self, direction: int, *, include_current: bool = False, origin: bool = False
    ) -> bool: ...


class PromptMode:
    """One use of the prompt. ``name`` is what tests and the help call it."""

    # Plain attributes, not ClassVar: the prompt box's ``Mode`` protocol reads them from an
    # instance.
    name: str
    title: str  # the box's border title (an error replaces it until the next key)
    placeholder: str
    regex: bool = True  # the text is a regex, applied as it is typed

    def __repr__(self) -> str:
        return f"<prompt mode {self.name}>"

    def opened(self, screen: PromptScreen) -> str:
        """Called as the prompt opens; returns the text it starts with."""
        return ""

    def typed(self, screen: PromptScreen, pattern: FieldPattern | None) -> None:
        """A valid regex was typed (None: the box is empty). Regex modes only."""

    def submitted(self, screen: PromptScreen, text: str) -> None:
        screen.close_prompt()

    def cancelled(self, screen: PromptScreen) -> None:
        screen.close_prompt()


class TimelineSearch(PromptMode):
    name = "search"
    title = (
        "/ search name · module · source · enter: keep · ctrl+n/ctrl+p: next/prev match · "
        "esc: clear"
    )
    placeholder = "regex (any case), each field on its own: name · module · source"

    def opened(self, screen: PromptScreen) -> str:
        screen.start_search()
        return ""

    def typed(self, screen: PromptScreen, pattern: FieldPattern | None) -> None:
        screen.search = pattern
        if pattern is None:
            screen.back_to_search_origin()
        elif not screen.to_match(1, include_current=True, origin=True):
            screen.filter.error(f"no match for /{pattern.pattern}/ in this step")
        screen.refresh_title()

    def submitted(self, screen: PromptScreen, text: str) -> None:
        prompt = screen.filter
        if prompt.has_class("-invalid") and not (prompt.border_title or "").startswith("no match"):
            screen.notify(prompt.border_title or "invalid regex", severity="error")
            return
        screen.close_prompt()
        if screen.search is not None:
            if not screen.matches():
                screen.notify(f"no match for /{screen.search.pattern}/ in this step", timeout=3)
            screen.refresh_title()

    def cancelled(self, screen: PromptScreen) -> None:
        screen.close_prompt()
        screen.search = None
        screen.back_to_search_origin()
        screen.refresh_title()


class TimelineFilter(PromptMode):
    name = "filter"
    title = "| filter name · module · source · enter: keep · esc: clear"
    placeholder = (
        "regex (any case), each field on its own: name · module · source — only matches stay"
    )

    def opened(self, screen: PromptScreen) -> str:
        pattern = screen.timeline.pattern
        return pattern.pattern if pattern is not None else ""

    def typed(self, screen: PromptScreen, pattern: FieldPattern | None) -> None:
        screen.timeline.set_filter(pattern)
        screen.refresh_title()

    def submitted(self, screen: PromptScreen, text: str) -> None:
        prompt = screen.filter
        if prompt.has_class("-invalid"):
            screen.notify(prompt.border_title or "invalid regex", severity="error")
            return
        screen.close_prompt()

    def cancelled(self, screen: PromptScreen) -> None:
        screen.close_prompt()
        screen.timeline.set_filter(None)
        screen.refresh_title()


class GraphPrompt(PromptMode):
    """The graph's own search and filter: the graph keeps the focus after enter or escape."""

    placeholder = "regex (any case) over node name, node id, parameter, op, module, source"

    def apply(self, screen: PromptScreen, pattern: FieldPattern | None) -> int:
        """Search or filter the graph's nodes; how many match."""
        raise NotImplementedError

    def typed(self, screen: PromptScreen, pattern: FieldPattern | None) -> None:
        found = self.apply(screen, pattern)
        if pattern is not None and not found:
            screen.filter.error(f"no node matches /{pattern.pattern}/")
        screen.graph_title()

    def submitted(self, screen: PromptScreen, text: str) -> None:
        self._back_to_graph(screen)

    def cancelled(self, screen: PromptScreen) -> None:
        self.apply(screen, None)
        self._back_to_graph(screen)

    @staticmethod
    def _back_to_graph(screen: PromptScreen) -> None:
        screen.filter.ok()
        screen.filter.display = False
        screen.graph.focus()
        screen.graph_title()


class GraphSearch(GraphPrompt):
    name = "graph"
    title = "search the graph · enter: keep · ctrl+n/ctrl+p: next/prev node · esc: clear"

    def opened(self, screen: PromptScreen) -> str:
        screen.graph.set_search(None)
        screen.graph_title()
        return ""

    def apply(self, screen: PromptScreen, pattern: FieldPattern | None) -> int:
        return screen.graph.set_search(pattern)


class GraphFilter(GraphPrompt):
    name = "graph-filter"
    title = "filter the graph · enter: keep · esc: clear"

    def opened(self, screen: PromptScreen) -> str:
        keep = screen.graph.node_filter
        return keep.pattern if keep is not None else ""

    def apply(self, screen: PromptScreen, pattern: FieldPattern | None) -> int:
        return screen.graph.set_filter(pattern)


class GoTo(PromptMode):
    """``:`` (k9s style): a step, an event seq or a node id."""

    name = "command"
    title = "go to · enter: go · esc: close"
    placeholder = ":12 step 12 · :#1234 event seq 1234 · :node 57 backward node id 57"
    regex = False

    def submitted(self, screen: PromptScreen, text: str) -> None:
        prompt = screen.filter
        problem = screen.run_command(text)
        if problem:
            prompt.error(problem)
            return
        prompt.ok()
        prompt.display = False
        if screen.focused is None or screen.focused is prompt:
            (screen.graph if screen.center == "graph" else screen.timeline).focus()


class ExportPath(PromptMode):
    """``e``: where to write the step (or the filtered rows) as JSON lines."""

    name = "export"
    title = "export to JSON lines · enter: write · esc: cancel"
    placeholder = "file to write (JSON lines, one event a line)"
    regex = False

    def __init__(self) -> None:
        self.confirmed: str | None = None  # the existing file the user was warned about

    def opened(self, screen: PromptScreen) -> str:
        from torchscope.session.export_view import default_path

        assert screen.current_step is not None
        return default_path(screen.current_step, screen.timeline.pattern is not None)

    def submitted(self, screen: PromptScreen, text: str) -> None:
        from torchscope.session.export_view import clean_path, snapshot, write_jsonl

        prompt = screen.filter
        path = clean_path(text)
        step = screen.current_step
        data = screen.store.data(step)
        if not path:
            prompt.error("a file name, please")
            return
        if data is None or step is None:
            prompt.error("the step is no longer in memory")
            return
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            prompt.error(f"no such directory: {folder}")
            return
        if os.path.exists(path) and self.confirmed != path:
            self.confirmed = path
            prompt.error(f"{os.path.basename(path)} exists: enter again to overwrite")
            return
        view = screen.timeline.view_indices()
        items = snapshot(data, view, screen.timeline.filtered_calls())
        what = f"{'filtered rows' if view is not None else 'events'} of step {step}"
        screen.close_prompt()
        app = screen.app

        def write() -> None:
            try:
                n = write_jsonl(items, path)
            except OSError as exc:
                message = f"export failed: {exc.strerror or exc}: {path}"
                app.call_from_thread(screen.notify, message, severity="error", timeout=6)
                return
            app.call_from_thread(screen.notify, f"exported {n:,} {what} to {path}", timeout=6)

        screen.run_worker(write, name="export", thread=True, exit_on_error=False)


class Evaluate(PromptMode):
    """``p``: a Python expression the paused job runs over the paused event's tensors (a
    recording: answered from what it kept). The box stays open for the next one."""

    name = "evaluate"
    title = "p evaluate at the pause (x, out, args, grad_inputs, module, torch, F) · ↑↓ history"
    placeholder = "x[0, :8] · (x == 0).float().mean() · x.abs().argmax() · module.weight.norm()"
    regex = False

    def submitted(self, screen: PromptScreen, text: str) -> None:
        screen.evaluate(text)

    def cancelled(self, screen: PromptScreen) -> None:
        screen.cancel_evaluation()  # one still running is interrupted: the job goes on
        screen.close_prompt()

    def history(self, screen: PromptScreen) -> list[str]:
        return screen.expressions


class Edit(PromptMode):
    """``e`` on the paused event: the replacement of its tensor in focus (``x``)."""

    name = "edit"
    title = "e edit x at the pause: its replacement (same shape, dtype) · applied as it goes on"
    placeholder = "x * 0 · x.clamp(-1, 1) · torch.nan_to_num(x) · grad_inputs[1] = x / 10"
    regex = False

    def submitted(self, screen: PromptScreen, text: str) -> None:
        screen.edit(text)

    def cancelled(self, screen: PromptScreen) -> None:
        screen.cancel_evaluation()
        screen.close_prompt()

    def history(self, screen: PromptScreen) -> list[str]:
        return screen.expressions


MODES: dict[str, type[PromptMode]] = {
    m.name: m
    for m in (
        TimelineSearch,
        TimelineFilter,
        GraphSearch,
        GraphFilter,
        GoTo,
        ExportPath,
        Evaluate,
        Edit,
    )
}
