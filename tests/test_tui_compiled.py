"""torch.compile in the UI: a compiled module's call tagged ``[compiled]`` (what runs inside
is not traced), the ops of its eager re-run tagged ``[eager]``, eager checks listed as checks
(not NaN origins) with what differs; and the keys that ask a live job for more in its next
step: ``@`` (the aten level, inside the selected row's module) and ``E`` (eager-checked)."""

from __future__ import annotations

import re
import time
from typing import Any

from tui_pilot import SIZE, notes_of, sync, until

from torchscope.protocol.events import ALERT, GRAD, OP
from torchscope.session.store import EventStore
from torchscope.tui.app import TorchscopeApp
from torchscope.tui.demo.fakejob import FakeJob
from torchscope.tui.keys import STEPPING, help_sections
from torchscope.tui.screens.help import HelpScreen
from torchscope.tui.sources.live import LiveSource
from torchscope.tui.sources.scripted import ScriptedSource

SRC = "/work/job/train.py:30"
NET = "torch.compile:Net"
ATTN = "blocks.0.attn"


def _t(value: float) -> dict:
    stats = {"min": value, "max": value, "mean": value, "std": 0.0, "norm": abs(value)}
    stats.update(nan=0, inf=0)
    return {"shape": [2], "dtype": "float32", "device": "cpu", "stats": stats}


def _diff(of: str, max_abs: float, max_rel: float, within: bool, **more: Any) -> dict:
    d = {"of": of, "max_abs": max_abs, "max_rel": max_rel, "within": within}
    d.update(nonfinite_only_compiled=0, nonfinite_only_eager=0, rtol=1.3e-06, atol=1e-05)
    return d | more


FWD_MESSAGE = (
    f"{NET} against its eager run: outputs: 1 of 1 differ beyond tolerance (rtol 1.3e-06, "
    "atol 1e-05); worst output 0: max |Δ| 0.0199 (rel 0.01)"
)
BWD_MESSAGE = (
    f"{NET} against its eager run: gradients: eager agrees within tolerance "
    "(fc.weight: max |Δ| 2e-07 (rel 1e-07))"
)


def compiled_trace() -> list[dict]:
    """One step: an op in blocks.0.attn with a NaN alert (and a knock-on input alert at the
    end), the compiled call of Net (#4), its eager re-run's two ops, the compiled graph's
    backward node, and the two eager checks of the call (forward: differs; backward:
    within tolerance)."""
    op = {"kind": OP, "step": 0, "source": SRC, "function": "forward"}
    alert = {"kind": ALERT, "step": 0, "source": SRC}
    return [
        {"kind": "session", "seq": 0, "step": 0, "pid": 1, "steps": "all"},
        {"kind": "step", "seq": 1, "step": 0},
        {**op, "seq": 2, "name": "torch.nn.functional.linear", "module": ATTN}
        | {"inputs": [_t(1.0)], "outputs": [_t(2.0)]},
        {**alert, "seq": 3, "what": "nan", "where": "forward", "event_seq": 2}
        | {"name": "torch.nn.functional.linear", "message": "NaN first appears in F.linear"},
        {**op, "seq": 4, "name": NET, "module": "", "compiled": True}
        | {"inputs": [_t(1.0)], "outputs": [_t(3.0)], "nodes": [{"id": 7}]},
        {**op, "seq": 5, "name": "torch.nn.functional.linear", "module": "fc", "eager_check": 4}
        | {"inputs": [_t(1.0)], "outputs": [_t(3.02)]},
        {**op, "seq": 6, "name": "torch.relu", "module": "act", "eager_check": 4}
        | {"inputs": [_t(3.02)], "outputs": [_t(3.02)]},
        {**alert, "seq": 7, "what": "eager_check", "where": "forward", "name": NET}
        | {"module": "", "event_seq": 4, "message": FWD_MESSAGE}
        | {"differences": [_diff("output 0", 0.0199, 0.01, False)]},
        {"kind": GRAD, "step": 0, "seq": 8, "node": "CompiledFunctionBackward", "node_id": 7}
        | {"op_seq": 4, "source": SRC, "backward": 1, "param": None}
        | {"grad_outputs": [_t(1.0)], "grad_inputs": [_t(0.5)]},
        {**alert, "seq": 9, "what": "eager_check", "where": "backward", "name": NET}
        | {"module": "", "event_seq": 4, "message": BWD_MESSAGE}
        | {"differences": [_diff("fc.weight", 2e-07, 1e-07, True)]},
        {**alert, "seq": 10, "what": "nan", "where": "input", "event_seq": None}
        | {"name": "parameter fc.weight", "message": "NaN in parameter fc.weight"},
    ]


async def _shown(pilot, app: TorchscopeApp) -> None:
    await until(
        pilot,
        lambda: app.main.current_step == 0 and app.main.timeline.row_count() == 5,
        what="step 0 shown",
    )


def _line(tl, index: int, width: int = 120) -> str:
    return "".join(text for text, _ in tl.render_row(index, width))


def _body(app: TorchscopeApp) -> str:
    return str(app.main.detail.body.render())


async def _select(pilot, app: TorchscopeApp, seq: int) -> None:
    main = app.main
    await pilot.press("colon", *f"#{seq}", "enter")
    await until(pilot, lambda: (main.detail.event or {}).get("seq") == seq, what=f"#{seq}")


# -- the timeline and the detail ------------------------------------------------------------
@sync
async def test_a_compiled_call_is_tagged_and_its_detail_says_its_inside_is_not_traced():
    app = TorchscopeApp(ScriptedSource(compiled_trace(), mode="replay"))
    async with app.run_test(size=SIZE) as pilot:
        tl = app.main.timeline
        await _shown(pilot, app)
        assert f"{NET} [compiled]" in _line(tl, 1)
        tag = next(c for c in tl.render_row(1, 120) if "[compiled]" in c[0])
        assert tag[1] == tl.cstyle("dim")
        assert "[" not in _line(tl, 0).split("F.linear")[1][:6]  # a plain op: no tag
        assert "CompiledFunctionBackward" in _line(tl, 4) and "[compiled]" not in _line(tl, 4)
        assert "⚠" in _line(tl, 0) and "⚠" not in _line(tl, 1)  # a check is no NaN mark
        await _select(pilot, app, 4)
        body = _body(app)
        assert (
            "compiled: what runs inside is not traced (E: check the next step against eager)"
            in (body)
        )
        assert "≠ eager check: outputs: 1 of 1 differ beyond tolerance" in body
        assert "✓ eager check: gradients: eager agrees within tolerance" in body


@sync
async def test_the_ops_of_an_eager_re_run_are_tagged_and_name_the_compiled_call():
    app = TorchscopeApp(ScriptedSource(compiled_trace(), mode="replay"))
    async with app.run_test(size=SIZE) as pilot:
        main, tl = app.main, app.main.timeline
        await _shown(pilot, app)
        assert "F.linear [eager]" in _line(tl, 2) and "torch.relu [eager]" in _line(tl, 3)
        tag = next(c for c in tl.render_row(3, 120) if "[eager]" in c[0])
        assert tag[1] == tl.cstyle("dim")
        await _select(pilot, app, 6)
        assert "eager re-run of the compiled call #4" in _body(app)
        # the line is a link to the compiled call
        assert main.detail.link_texts()[0] == "eager re-run of the compiled call #4"
        main.detail.focus()
        await pilot.press("enter")
        await until(pilot, lambda: (main.detail.event or {}).get("seq") == 4, what="followed")


@sync
async def test_tags_keep_the_columns_aligned_at_80x24():
    app = TorchscopeApp(ScriptedSource(compiled_trace(), mode="replay"))
    async with app.run_test(size=(80, 24)) as pilot:
        tl = app.main.timeline
        await _shown(pilot, app)
        width = tl.scrollable_content_region.width
        c = tl.columns(width)
        after_name = c.seq + 1 + c.dir + c.name + 1  # where the next column starts
        lines = ["".join(t for t, _ in tl.render_row(i, width)) for i in range(5)]
        assert "[compiled]" in lines[1] and "[eager]" in lines[2]
        assert len({len(line) for line in lines}) == 1
        for line in lines:
            assert line[after_name - 1] == " " and line[after_name] != " ", line
        screen = app.screen_text()
        assert "[compiled]" in screen and "[eager]" in screen


# -- eager checks among the alerts ----------------------------------------------------------
@sync
async def test_an_eager_check_is_listed_as_a_check_with_its_differences_not_as_a_nan_origin():
    app = TorchscopeApp(ScriptedSource(compiled_trace(), mode="replay"))
    async with app.run_test(size=SIZE) as pilot:
        main = app.main
        await _shown(pilot, app)
        alerts = main.alerts
        await until(pilot, lambda: len(alerts.groups) == 3, what="the alerts")
        # the NaN origin keeps its knock-on (the input alert after the checks)
        (origin, knock_on), (fwd, none1), (bwd, none2) = alerts.groups
        assert origin["seq"] == 3 and [a["seq"] for a in knock_on] == [10]
        assert (fwd["seq"], bwd["seq"], none1, none2) == (7, 9, [], [])
        assert alerts.border_subtitle == "1 origin · 2 · 2 checks"
        labels = [str(alerts.get_option_at_index(i).prompt) for i in range(3)]
        assert "NaN" in labels[0] and "+1 knock-on" in labels[0]
        assert labels[1].split()[:4] == ["0", "≠", "check", "fwd"]
        assert "NaN" not in labels[1] and "outputs: 1 of 1 differ beyond tolerance" in labels[1]
        assert labels[2].split()[:4] == ["0", "✓", "check", "bwd"]
        # the step list counts the NaN alerts only
        store = app.store
        assert store.info(0).n_alerts == 4 and store.nan_alerts(store.info(0)) == 2
        assert "⚠2" in "".join(t for t, _ in main.steps.render_row(0, 40))
        # the detail of a check: its message, the call, what differs
        await pilot.press("a")
        await until(pilot, lambda: alerts.has_focus)
        await pilot.press("j")
        await until(pilot, lambda: main.detail.subject == ("alert", 7), what="the check")
        body = _body(app)
        assert "NaN first appears" not in body and "knock-on" not in body
        assert f"≠ {FWD_MESSAGE}" in body
        assert "eager check · step 0 · outputs (forward)" in body
        assert "not a NaN/Inf origin" in body
        assert "the compiled call: torch.compile:Net #4" in body
        rows = [line.split() for line in body.split("differences", 1)[1].splitlines()[1:4]]
        assert rows[0] == ["of", "max", "|Δ|", "rel", "within"]
        assert rows[1] == ["output", "0", "0.0199", "0.01", "no"]
        assert "rtol 1.3e-06, atol 1e-05" in body
        await pilot.press("j")
        await until(pilot, lambda: main.detail.subject == ("alert", 9), what="the other")
        assert ["fc.weight", "2e-07", "1e-07", "yes"] in [
            line.split() for line in _body(app).splitlines()
        ]
        await pilot.press("enter")  # to the compiled call
        await until(pilot, lambda: (main.detail.event or {}).get("seq") == 4, what="the call")


def test_an_input_alert_after_a_check_is_still_counted_under_its_nan_origin():
    from torchscope.tui.widgets.alert_list import group_alerts

    store = EventStore()
    store.ingest(compiled_trace())
    groups = group_alerts(store.alerts)
    assert [(o["seq"], [a["seq"] for a in k]) for o, k in groups] == [
        (3, [10]),
        (7, []),
        (9, []),
    ]
    assert sum(store.checks.values()) == 2


# -- @ and E: asking a live job for more in its next step -----------------------------------
def _arms(job: FakeJob) -> list[dict]:
    return [fields for cmd, fields in job.received if cmd == "arm"]


@sync
async def test_at_and_E_arm_the_next_step_beside_the_uis_own_hold():
    job = FakeJob(compiled_trace())
    app = TorchscopeApp(job)
    notes = notes_of(app)
    async with app.run_test(size=SIZE) as pilot:
        main, tl = app.main, app.main.timeline
        await _shown(pilot, app)
        bar = main.status_bar
        # inside the selected row's module
        tl.move_cursor(0, user=True)
        await pilot.press("at")
        await until(pilot, lambda: len(_arms(job)) == 1, what="the first arm")
        fields = _arms(job)[0]
        assert fields == {"aten": r"^blocks\.0\.attn(\.|$)", "next": 1, "also": True}
        scope = re.compile(fields["aten"])
        assert scope.search(ATTN) and scope.search(ATTN + ".q") and not scope.search(ATTN + "2")
        text = f"asked: next step at the aten level, inside {ATTN}"
        await until(pilot, lambda: text in bar.full_text, what="the status line")
        assert notes[-1] == f"asked the job: next step at the aten level, inside {ATTN}"
        # the root module: every call
        tl.move_cursor(1, user=True)
        await pilot.press("at")
        await until(pilot, lambda: len(_arms(job)) == 2, what="the second arm")
        assert _arms(job)[1] == {"aten": "", "next": 1, "also": True}
        await until(pilot, lambda: "next step at the aten level, everywhere" in bar.full_text)
        # eager-checked
        await pilot.press("E")
        await until(pilot, lambda: len(_arms(job)) == 3, what="the third arm")
        assert _arms(job)[2] == {"eager_check": True, "next": 1, "also": True}
        text = "asked: next step: compiled modules checked against eager"
        await until(pilot, lambda: text in bar.full_text, what="the status line")
        assert app.is_running and app.fatal is None
        # help lists both keys for a live job
        await pilot.press("question_mark")
        await until(pilot, lambda: isinstance(app.screen, HelpScreen), what="help")
        text = " ".join(str(w.render()) for w in app.screen.query("#help-keys, .help-column"))
        assert "trace the job's next step at the aten level" in text
        assert "run the next step's torch.compile'd modules once more eagerly" in text


@sync
async def test_the_asked_step_leaves_the_status_bar_once_the_job_is_past_it():
    job = FakeJob(compiled_trace(), status={"step": 3})
    app = TorchscopeApp(job)
    async with app.run_test(size=SIZE) as pilot:
        main = app.main
        await _shown(pilot, app)
        await pilot.press("E")
        await until(pilot, lambda: main.asked is not None and main.asked[1], what="answered")
        assert main.asked[2] == 3
        app.lane.status["step"] = 4  # the asked step, being traced
        main.refresh_status()
        assert "compiled modules checked against eager" in main.status_bar.full_text
        app.lane.status["step"] = 5  # over
        main.refresh_status()
        assert "compiled modules checked" not in main.status_bar.full_text
        assert main.asked is None


@sync
async def test_a_job_that_cannot_be_armed_says_so_in_one_line():
    refusal = "command 'arm' is not supported by this job"
    job = FakeJob(compiled_trace(), refuse={"arm": refusal})
    app = TorchscopeApp(job)
    notes = notes_of(app)
    async with app.run_test(size=SIZE) as pilot:
        main = app.main
        await _shown(pilot, app)
        await pilot.press("E")
        await until(pilot, lambda: notes, what="the refusal")
        assert len(notes) == 1 and "\n" not in notes[0]
        assert notes[0] == (
            "next step: compiled modules checked against eager: refused: "
            f"arm: {refusal} (a trace(live=True) block cannot be armed)"
        )
        assert main.asked is None and "asked" not in main.status_bar.full_text


@sync
async def test_a_recording_answers_at_and_E_in_one_line():
    app = TorchscopeApp(ScriptedSource(compiled_trace(), mode="replay"), at_origin=False)
    notes = notes_of(app)
    async with app.run_test(size=SIZE) as pilot:
        await _shown(pilot, app)
        await pilot.press("at", "E")
        await until(pilot, lambda: len(notes) == 2, what="two notes")
        assert notes == [
            "@: tracing the next step at the aten level needs a live job (this is a recording)",
            "E: checking the next step's compiled modules against eager needs a live job "
            "(this is a recording)",
        ]
        assert app.sent == [] and app.main.asked is None
        stepping = dict(dict(help_sections(None, live=False, aten=True, sources=False))[STEPPING])
        assert "@" not in stepping and "E" not in stepping  # a replay's help lists neither


# -- through the live source (a fake client) ------------------------------------------------
class TracedBlockClient:
    """SessionClient's surface for a ``trace(live=True)`` block: every ``arm`` refused."""

    calls: list[tuple[str, dict]] = []
    alive = True

    def connect(self, target, timeout):
        return {"session": {"pid": 7, "kind": "session", "seq": 0}, "step": 0}

    def snapshot(self, n, timeout):
        return {"events": compiled_trace()}

    def recv(self, timeout_ms):
        time.sleep(timeout_ms / 1000)
        return []

    def request(self, cmd: str, timeout: float = 2.0, **fields: Any) -> dict:
        from torchscope.protocol.client import SessionRefused

        self.calls.append((cmd, fields))
        if cmd == "arm":
            raise SessionRefused("command 'arm' is not supported by this job")
        return {"state": {"paused": None, "mode": "run", "breakpoints": []}}

    def close(self):
        pass


@sync
async def test_the_live_source_sends_the_fields_and_relays_the_refusal():
    TracedBlockClient.calls = []
    source = LiveSource("ipc://job", client_factory=TracedBlockClient, recv_timeout_ms=10)
    app = TorchscopeApp(source)
    notes = notes_of(app)
    async with app.run_test(size=SIZE) as pilot:
        await _shown(pilot, app)
        app.main.timeline.move_cursor(0, user=True)
        await pilot.press("at")
        await until(pilot, lambda: notes, what="the refusal")
        sent = ("arm", {"next": 1, "also": True, "aten": r"^blocks\.0\.attn(\.|$)"})
        assert sent in TracedBlockClient.calls
        assert notes == [
            f"next step at the aten level, inside {ATTN}: refused: command 'arm' is not "
            "supported by this job (a trace(live=True) block cannot be armed)"
        ]
