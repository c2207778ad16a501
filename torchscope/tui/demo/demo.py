"""``torchscope demo``: the UI on a simulated job, no torch and no training needed.

A synthetic 2-block MLP (:mod:`torchscope.tui.demo.synthetic`) whose step ``NAN_STEP`` makes a NaN,
run by a :class:`~torchscope.tui.demo.fakejob.FakeJob` that pauses, steps and answers ``inspect``
like a traced job. It starts paused before the first op of step 1 with a ``nan`` breakpoint
set, so ``c`` stops where the NaN first appears; every key of a live session works.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torchscope.protocol.breakpoints import BEFORE
from torchscope.tui.app import TorchscopeApp
from torchscope.tui.demo.fakejob import FakeJob
from torchscope.tui.demo.synthetic import make_trace

__all__ = ["DemoApp", "demo_source", "run_demo"]

STEPS = 6
LAYERS = 2
NAN_STEP = 3
START_STEP = 1

GREETING = (
    "demo: a simulated job (no torch), paused at the start of step 1 with a nan breakpoint. "
    "c: run to the NaN · s: step · n: next step · v: values · ?: every key"
)


def demo_source(steps: int = STEPS, nan_step: int = NAN_STEP) -> FakeJob:
    """The demo's job: paused before the first op of step ``START_STEP``, a ``nan``
    breakpoint set (``c`` stops at the NaN's origin in step ``nan_step``)."""
    trace = make_trace(steps, LAYERS, nan_step=nan_step)
    first = next(e["seq"] for e in trace if e.get("kind") == "op" and e.get("step") == START_STEP)
    return FakeJob(
        trace,
        pause_at=first,
        phase=BEFORE,
        reason="demo: paused at the start of step 1",
        breakpoints=[{"nan": "nan"}],
        ends=True,
    )


class DemoApp(TorchscopeApp):
    """The app on the demo job, saying what it is once it opens."""

    # textual reads a relative CSS_PATH beside the module that defines the class: this one
    # lives in demo/, the app's stylesheet beside app.py
    CSS_PATH = str(Path(__file__).resolve().parent.parent / "app.tcss")

    def on_mount(self) -> None:
        super().on_mount()
        self.notify(GREETING, title="torchscope demo", timeout=12)


def run_demo(**options: Any) -> int:
    source = demo_source()
    app = DemoApp(source, **options)
    try:
        app.run()
    finally:
        app.stop_event.set()
        source.close()
    code = app.return_code
    return 1 if code is None else code
