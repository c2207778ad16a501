"""Issue 12: copy (``y``, OSC 52) a source path:line, a ``--break-on`` spec, a name or values;
export (``e``) the step or the filtered rows to JSON lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tui_pilot import SIZE, notes_of, sync, until

from torchscope.protocol.breakpoints import parse_break_spec
from torchscope.tui.app import TorchscopeApp
from torchscope.tui.demo.fakejob import FakeJob
from torchscope.tui.demo.synthetic import make_trace
from torchscope.tui.screens.copy import CopyScreen, copy_choices, values_text
from torchscope.tui.sources.scripted import ScriptedSource

TRACE = make_trace(3, 2, nan_step=1)


def replay() -> ScriptedSource:
    return ScriptedSource(TRACE, mode="replay")


def first(kind: str, name: str, step: int = 0) -> dict:
    key = "name" if kind == "op" else "node"
    return next(
        e for e in TRACE if e.get("kind") == kind and e.get("step") == step and e[key] == name
    )


async def on_seq(pilot, app: TorchscopeApp, seq: int) -> None:
    await until(pilot, lambda: app.main.timeline.row_count() > 0, what="rows")
    await pilot.press("colon", *f"#{seq}", "enter")
    await until(pilot, lambda: app.main.timeline.current_row().seq == seq, what=f"#{seq}")


# -- copy --------------------------------------------------------------------------------------


def test_values_text_nests_a_whole_tensor_and_labels_the_rows_of_a_slice():
    assert values_text([1.0, 2.0, 3.0, float("nan")], [2, 2]) == "[[1.0, 2.0], [3.0, nan]]"
    assert values_text([1, 2, 3], [3]) == "[1, 2, 3]"
    # a slice of a [4, 3] tensor starting inside row 1
    assert values_text([5.0, 6.0, 7.0, 8.0], [4, 3], start=4) == (
        "[1,1:] [5.0, 6.0]\n[2,:] [7.0, 8.0]"
    )


def test_copy_choices_of_an_op_and_of_a_node():
    op = first("op", "torch.nn.functional.linear")
    keys = {k: text for k, _, text in copy_choices(op)}
    assert keys["s"] == op["source"]
    assert keys["b"] == r"op:^torch\.nn\.functional\.linear$"
    assert keys["m"] == r"module:^blocks\.0\.fc$"
    assert keys["l"] == f"line:{op['source']}"
    for k in "bml":  # each one is a --break-on spec the job takes
        parse_break_spec(keys[k])
    assert json.loads(keys["j"])["seq"] == op["seq"]
    grad = first("grad", "GeluBackward0")
    keys = {k: text for k, _, text in copy_choices(grad, module="blocks.1.act")}
    assert keys["b"] == "op:^GeluBackward0$" and keys["m"] == r"module:^blocks\.1\.act$"


@sync
async def test_y_copies_the_source_line_and_a_break_on_spec_with_osc52():
    app = TorchscopeApp(replay(), at_origin=False)
    notes = notes_of(app)
    async with app.run_test(size=SIZE) as pilot:
        op = first("op", "torch.nn.functional.linear")
        await on_seq(pilot, app, op["seq"])
        await pilot.press("y")
        assert isinstance(app.screen, CopyScreen)
        await pilot.press("s")
        assert not isinstance(app.screen, CopyScreen)
        assert app.clipboard == op["source"]
        assert notes[-1] == f"copied the source path:line: {op['source']}"
        await pilot.press("y", "b")
        assert app.clipboard == r"op:^torch\.nn\.functional\.linear$"
        assert "copied a --break-on spec (same name)" in notes[-1]
        await pilot.press("y", "escape")  # esc copies nothing
        assert app.clipboard == r"op:^torch\.nn\.functional\.linear$"
        # a backward node: its module is that of the op that created it
        grad = first("grad", "GeluBackward0")
        await on_seq(pilot, app, grad["seq"])
        await pilot.press("y", "m")
        op = next(e for e in TRACE if e.get("seq") == grad["op_seq"])
        assert app.clipboard == f"module:^{op['module'].replace('.', chr(92) + '.')}$"
        # the graph: the node under the cursor
        await pilot.press("g")
        await pilot.press("y", "n")
        assert app.clipboard == "GeluBackward0"
        assert "y copy" in app.main.key_bar.text


@sync
async def test_y_on_a_paused_op_copies_the_values_fetched_from_the_job():
    gelu = first("op", "torch.nn.functional.gelu")
    job = FakeJob(TRACE, pause_at=gelu["seq"])
    app = TorchscopeApp(job)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.store.stepper.paused is not None, what="pause")
        await pilot.press("v")
        main = app.main
        await until(pilot, lambda: main.values is not None and main.values.result is not None)
        await pilot.press("y", "v")
        rows = json.loads(app.clipboard.replace("nan", "NaN"))
        assert len(rows) == 8 and all(len(r) == 32 for r in rows)  # [8, 32]: by row
        assert rows[0][:3] == main.values.result["values"][:3]


# -- export ------------------------------------------------------------------------------------


@sync
async def test_e_exports_the_step_to_json_lines_with_a_default_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    app = TorchscopeApp(replay(), at_origin=False)
    notes = notes_of(app)
    async with app.run_test(size=SIZE) as pilot:
        main = app.main
        await until(pilot, lambda: main.current_step == 0 and main.timeline.row_count() > 0)
        await pilot.press("e")
        assert main.filter.display and main.filter.mode.name == "export"
        default = tmp_path / "torchscope-step0.jsonl"
        assert main.filter.value == str(default)
        await pilot.press("enter")
        await until(pilot, lambda: any(n.startswith("exported") for n in notes), what="export")
        lines = default.read_text().splitlines()
        want = sorted(e["seq"] for e in TRACE if e.get("step") == 0 and e["kind"] != "session")
        assert [json.loads(line)["seq"] for line in lines] == want
        assert notes[-1] == f"exported {len(want)} events of step 0 to {default}"
        assert "\n" not in notes[-1]
        # NaN-free here, but the encoder is dump's: a NaN goes out as "nan"
        step1 = [json.loads(x) for x in lines]
        assert {e["kind"] for e in step1} >= {"op", "grad", "graph"}


@sync
async def test_e_with_a_filter_exports_the_rows_it_keeps_and_asks_before_overwriting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.chdir(tmp_path)
    app = TorchscopeApp(replay(), at_origin=False)
    notes = notes_of(app)
    async with app.run_test(size=SIZE) as pilot:
        main = app.main
        await until(pilot, lambda: main.current_step == 0 and main.timeline.row_count() > 0)
        await pilot.press("vertical_line", *"gelu", "enter")
        kept = main.timeline.row_count()
        await pilot.press("e")
        path = tmp_path / "torchscope-step0-filtered.jsonl"
        assert main.filter.value == str(path)
        path.write_text("old\n")  # appeared meanwhile: enter asks first
        await pilot.press("enter")
        assert main.filter.display and "exists: enter again to overwrite" in (
            main.filter.border_title
        )
        await pilot.press("enter")
        await until(pilot, lambda: any(n.startswith("exported") for n in notes), what="export")
        rows = [json.loads(x) for x in path.read_text().splitlines()]
        assert len(rows) == kept and all(
            "gelu" in (r.get("name") or r.get("node") or "").lower() or "act" in str(r)
            for r in rows
        )
        assert f"exported {kept} filtered rows of step 0 to {path}" == notes[-1]
        # a directory that does not exist: one line in the box, nothing written
        await pilot.press("e")
        main.filter.value = str(tmp_path / "nope" / "x.jsonl")
        await pilot.press("enter")
        assert "no such directory" in main.filter.border_title
        await pilot.press("escape")
        assert not main.filter.display


# -- a real terminal: the copy reaches it as OSC 52 -------------------------------------------


@pytest.mark.skipif(__import__("shutil").which("tmux") is None, reason="needs tmux")
def test_y_copies_through_osc52_into_a_real_terminals_clipboard(tmp_path: Path, tmux) -> None:
    """tmux with ``set-clipboard on`` takes an application's OSC 52 into its paste buffer:
    what ``y`` copied is what the terminal got."""
    import sys
    import time

    from torchscope.protocol.tracefile import TraceWriter

    trace = tmp_path / "t.tsc"
    with TraceWriter(trace) as w:
        w.write(TRACE)
    op = first("op", "torch.nn.functional.linear")
    script = tmp_path / "ui.py"
    script.write_text(
        "import sys; sys.modules['torch'] = None\n"
        "from torchscope.tui import run_tui, FileSource\n"
        f"run_tui(FileSource({str(trace)!r}), at_origin=False)\n"
    )
    root = Path(__file__).resolve().parents[1]

    def wait_for_buffer(text: str, timeout: float = 60.0) -> None:
        # the paste buffer itself, not the toast saying so: a toast can come and go between
        # two looks at a loaded machine's screen
        deadline = time.monotonic() + timeout
        while tmux("show-buffer", check=False) != text:
            screen = tmux.screen("ui")
            assert time.monotonic() < deadline, f"the buffer never held {text!r}:\n{screen}"
            time.sleep(0.1)

    env = f"env -u COLUMNS -u LINES PYTHONPATH={root} TERM=xterm-256color"
    tmux.new_session("ui", (120, 35), "sh")
    tmux("set-option", "-s", "set-clipboard", "on")  # a server of its own: its options are ours
    tmux.keys("ui", f"{env} {sys.executable} {script}", "Enter")
    tmux.wait("ui", "F.linear")
    tmux.keys("ui", ":")
    tmux.wait("ui", "go to · enter")
    tmux.keys("ui", "-l", f"#{op['seq']}")
    tmux.keys("ui", "Enter")
    tmux.wait("ui", "go to · enter", gone=True)  # the box closed: the next key is the table's
    tmux.wait("ui", f"event #{op['seq']}")
    tmux.keys("ui", "y")
    tmux.wait("ui", "Copy · F.linear")
    tmux.keys("ui", "s")
    wait_for_buffer(op["source"])
    tmux.wait("ui", "Copy · F.linear", gone=True)  # the menu closed: the next y opens a new one
    tmux.keys("ui", "y")
    tmux.wait("ui", "Copy · F.linear")
    tmux.keys("ui", "b")
    wait_for_buffer(r"op:^torch\.nn\.functional\.linear$")
    tmux.keys("ui", "q")


@sync
async def test_copy_menu_and_export_prompt_fit_80x24(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    app = TorchscopeApp(replay())
    async with app.run_test(size=(80, 24)) as pilot:
        op = first("op", "torch.nn.functional.linear")
        await on_seq(pilot, app, op["seq"])
        assert ("y", "copy") in [
            h[:2] for h in app.main.hints()
        ]  # the key bar shows it where there is room
        await pilot.press("y")
        await pilot.pause()
        lines = app.screen_text().splitlines()
        assert len(lines) == 24 and all(len(line) <= 80 for line in lines)
        for key in "sbmlnj":  # every choice on its own line, whole
            assert any(line.strip(" │▊▎").startswith(f"{key}  ") for line in lines), key
        await pilot.press("escape", "e")
        await pilot.pause()
        text = app.screen_text()
        assert "export to JSON lines" in text and "torchscope-step0" in text
