"""Navigation: `/` search with ctrl+n / ctrl+p between matches (the stepping keys `space s n c`
keep their meaning), vim `j`/`k`, the `:` command line, and `torchscope demo`."""

from __future__ import annotations

from tui_pilot import SIZE, sync, until

from torchscope.cli import build_parser, main
from torchscope.tui.app import TorchscopeApp
from torchscope.tui.demo.demo import NAN_STEP, START_STEP, DemoApp, demo_source
from torchscope.tui.demo.fakejob import FakeJob
from torchscope.tui.demo.synthetic import make_trace
from torchscope.tui.sources.scripted import ScriptedSource

TRACE = make_trace(3, 2, nan_step=1)


def replay() -> ScriptedSource:
    return ScriptedSource(TRACE, mode="replay")


async def shown(pilot, app: TorchscopeApp, step: int) -> None:
    await until(
        pilot,
        lambda: app.main.current_step == step and app.main.timeline.row_count() > 0,
        what=f"step {step} shown",
    )


def gelu_rows(app: TorchscopeApp) -> list[int]:
    tl = app.main.timeline
    return [
        i
        for i in range(tl.row_count())
        if "gelu" in tl.row(i).name.lower() or "gelu" in (tl.row(i).module or "")
    ]


@sync
async def test_search_moves_between_matches_and_keeps_every_row():
    app = TorchscopeApp(replay(), at_origin=False)
    async with app.run_test(size=SIZE) as pilot:
        main, tl = app.main, app.main.timeline
        await shown(pilot, app, 0)
        total = tl.row_count()
        matches = gelu_rows(app)
        assert len(matches) >= 3
        await pilot.press("slash", *"gelu")
        assert app.focused is main.filter and main.filter.mode.name == "search"
        assert tl.cursor == matches[0] and tl.row_count() == total  # moved, nothing hidden
        await pilot.press("enter")
        assert app.focused is tl and not main.filter.display
        assert f"search /gelu/ 1/{len(matches)}" in tl.border_subtitle
        assert "^n ^p match" in main.key_bar.text
        await pilot.press("ctrl+n")
        assert tl.cursor == matches[1]
        await pilot.press("ctrl+n")
        assert tl.cursor == matches[2]
        await pilot.press("ctrl+p", "ctrl+p", "ctrl+p")  # wraps to the last match
        assert tl.cursor == matches[-1]
        await pilot.press("ctrl+n")  # and back to the first
        assert tl.cursor == matches[0]
        # ] keeps the search: ctrl+n finds the next match in the next step
        await pilot.press("right_square_bracket")
        await shown(pilot, app, 1)
        await pilot.press("ctrl+n")
        assert "gelu" in tl.current_row().name.lower()
        # esc in the timeline ends the search
        await pilot.press("escape")
        assert main.search is None and "search" not in tl.border_subtitle
        # a search with no match says so and moves nothing
        await pilot.press("home", "slash", *"zzz")
        assert "no match" in main.filter.border_title and tl.cursor == 0
        await pilot.press("escape")  # esc in the box: back where the search started
        assert main.search is None and tl.cursor == 0 and app.focused is tl


@sync
async def test_stepping_keys_are_not_taken_by_search_and_vim_keys_move():
    tenth = [e["seq"] for e in TRACE if e.get("step") == 0 and e.get("kind") == "op"][10]
    job = FakeJob(TRACE, pause_at=tenth)
    app = TorchscopeApp(job)
    async with app.run_test(size=SIZE) as pilot:
        tl = app.main.timeline
        await until(pilot, lambda: app.store.stepper.paused is not None, what="pause")
        await pilot.press("home", "j", "j")
        assert tl.cursor == 2
        await pilot.press("k")
        assert tl.cursor == 1
        await pilot.press("end")
        assert tl.cursor == tl.row_count() - 1
        await pilot.press("slash", *"linear", "enter")
        assert app.main.search is not None
        await pilot.press("n")  # still: run to the next training step
        await until(pilot, lambda: [c for c, _ in job.received][-1:] == ["next"], what="next")
        await until(pilot, lambda: (app.store.stepper.paused or {}).get("step") == 1)


@sync
async def test_a_key_typed_after_enter_is_not_part_of_the_command():
    # a fast typist's next key reaches the box before the box's submit is handled
    app = TorchscopeApp(replay(), at_origin=False)
    async with app.run_test(size=SIZE) as pilot:
        main = app.main
        await shown(pilot, app, 0)
        await pilot.press("colon", "2")
        await main.filter.action_submit()
        main.filter.insert_text_at_cursor("y")
        await shown(pilot, app, 2)
        assert "unknown command" not in (main.filter.border_title or "")


@sync
async def test_colon_goes_to_a_step_an_event_seq_or_a_node_and_says_what_is_wrong():
    app = TorchscopeApp(replay(), at_origin=False)
    async with app.run_test(size=SIZE) as pilot:
        main, tl = app.main, app.main.timeline
        await shown(pilot, app, 0)
        await pilot.press("colon", "2", "enter")
        await shown(pilot, app, 2)
        assert not main.filter.display and app.focused is tl
        seq = [e["seq"] for e in TRACE if e.get("step") == 1 and e.get("kind") == "op"][5]
        await pilot.press("colon", *f"#{seq}", "enter")
        await until(pilot, lambda: tl.current_row() is not None and tl.current_row().seq == seq)
        assert main.current_step == 1
        grad = next(e for e in TRACE if e.get("step") == 1 and e.get("kind") == "grad")
        await pilot.press("colon", *f"node {grad['node_id']}", "enter")
        assert tl.current_row().kind == "grad" and tl.current_row().node_id == grad["node_id"]
        await pilot.press("backspace")  # a jump like any other
        assert tl.current_row().seq == seq
        # bad commands: one line in the box, which stays open; nothing moves
        for text, said in (
            ("99", "no step 99 (steps 0-2)"),
            ("#999999", "no op, node or aten call with event seq #999999"),
            ("node 999999", "no backward node id 999999"),
            ("frobnicate", "unknown command 'frobnicate'"),
        ):
            await pilot.press("colon", *text, "enter")
            assert main.filter.display and main.filter.has_class("-invalid")
            assert said in main.filter.border_title and "\n" not in main.filter.border_title
            assert main.current_step == 1 and tl.current_row().seq == seq
            await pilot.press("escape")
            assert not main.filter.display


@sync
async def test_demo_opens_paused_and_c_stops_at_the_nan_then_n_and_s_step():
    job = demo_source()
    app = DemoApp(job)
    async with app.run_test(size=(80, 24)) as pilot:
        stepper = app.store.stepper
        await until(pilot, lambda: stepper.paused is not None, what="the demo's first pause")
        assert stepper.paused["step"] == START_STEP and stepper.paused["phase"] == "before"
        assert "c: run to the NaN" in "".join(str(n.message) for n in app._notifications)
        await pilot.press("c")
        await until(
            pilot,
            lambda: (stepper.paused or {}).get("step") == NAN_STEP,
            what="the nan breakpoint",
        )
        assert "breakpoint 1" in stepper.paused["reason"]
        assert app.main.current_step == NAN_STEP and app.main.timeline.cursor_visible()
        # the origin's alert came with it, as a job sends it before it pauses
        await until(pilot, lambda: len(app.store.alerts) == 1, what="the alert at the pause")
        await pilot.press("s")
        await until(pilot, lambda: (stepper.paused or {}).get("reason") == "step")
        await pilot.press("n")
        await until(pilot, lambda: (stepper.paused or {}).get("step") == NAN_STEP + 1)
        await pilot.press("B")  # the nan breakpoint off, then the job runs to its end
        await until(pilot, lambda: app.screen is not app.main, what="B")
        await pilot.press("space", "escape")
        await until(pilot, lambda: not stepper.breakpoints[0]["enabled"], what="bp off")
        await pilot.press("c")
        await until(pilot, lambda: "session ended" in app.screen_text(), what="the end said")
        await pilot.press("q")
    assert [c for c, _ in job.received][:3] == ["continue", "step", "next"]


def test_demo_command_is_a_subcommand_and_needs_a_terminal(capsys):
    assert build_parser().parse_args(["demo"]).command == "demo"
    assert main(["demo"]) == 2  # pytest's output is no terminal: one line, before any screen
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a terminal" in err


@sync
async def test_f_in_a_replay_says_why_and_an_ops_nodes_are_named_by_node_id():
    app = TorchscopeApp(replay(), at_origin=False)
    notes: list[str] = []
    notify = app.notify
    app.notify = lambda message, *a, **k: (notes.append(str(message)), notify(message, *a, **k))
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app, 0)
        await pilot.press("f")
        assert any("a recording does not grow" in n for n in notes), notes
        op = next(e for e in TRACE if e.get("kind") == "op" and e.get("nodes"))
        await pilot.press("colon", *f"#{op['seq']}", "enter")
        await pilot.pause()
        text = str(app.main.detail.body.render())
        node = op["nodes"][0]
        assert f"{node['name']} node id {node['id']}" in text and " ? " not in text
        assert "(no backward yet)" not in text


# -- item 9 of issue 12: esc, f, the help, the detail's links, the two numbering schemes -----


def linear_op(step: int = 0) -> dict:
    """An op that created two nodes (F.linear: AddmmBackward0 and TBackward0)."""
    return next(
        e
        for e in TRACE
        if e.get("kind") == "op" and e.get("step") == step and len(e.get("nodes") or ()) > 1
    )


@sync
async def test_detail_lists_an_ops_nodes_and_each_link_is_followed_with_enter():
    app = TorchscopeApp(replay(), at_origin=False)
    async with app.run_test(size=SIZE) as pilot:
        main, tl, detail = app.main, app.main.timeline, app.main.detail
        await shown(pilot, app, 0)
        op = linear_op()
        await pilot.press("colon", *f"#{op['seq']}", "enter")
        await until(pilot, lambda: detail.links and detail.event.get("seq") == op["seq"])
        texts = detail.link_texts()
        assert [n["id"] for n in op["nodes"]] == [link.target for link in detail.links]
        for node, text in zip(op["nodes"], texts, strict=True):
            assert text.startswith(f"{node['name']} node id {node['id']}")
        body = str(detail.body.render())
        assert f"op · event #{op['seq']}" in body  # the seq says it is an event seq
        # tab to the detail, down to the second node, enter: its gradient in the timeline
        detail.focus()
        await pilot.pause()
        assert "↑↓ link" in main.key_bar.text and "enter follow" in main.key_bar.text
        await pilot.press("down")
        assert detail.link_cursor == 1
        await pilot.press("enter")
        second = op["nodes"][1]["id"]
        row = tl.current_row()
        assert app.focused is tl
        if row.kind == "grad":
            assert row.node_id == second
        else:  # the node did not run: the graph, on it
            assert main.center == "graph" and main.graph.current_node_id() == second
        await pilot.press("backspace")
        await until(pilot, lambda: tl.current_row().seq == op["seq"])
        # the first node's gradient, then its "created by" link back to the op
        first = op["nodes"][0]["id"]
        await until(pilot, lambda: detail.event is not None and detail.event["seq"] == op["seq"])
        detail.focus()
        await pilot.press("up", "up")
        assert detail.link_cursor == 0
        await pilot.press("enter")
        await until(pilot, lambda: tl.current_row().kind == "grad")
        assert tl.current_row().node_id == first
        await until(pilot, lambda: detail.event is not None and detail.event.get("kind") == "grad")
        body = str(detail.body.render())
        assert f"backward node id {first}" in body and "event #" in body
        assert any("created by" in t and f"event #{op['seq']}" in t for t in detail.link_texts())
        created_by = next(i for i, t in enumerate(detail.link_texts()) if "created by" in t)
        detail.focus()
        detail.link_cursor = created_by
        await pilot.press("enter")
        assert tl.current_row().kind == "op" and tl.current_row().seq == op["seq"]


@sync
async def test_a_click_on_a_detail_link_follows_it():
    app = TorchscopeApp(replay(), at_origin=False)
    async with app.run_test(size=SIZE) as pilot:
        tl, detail = app.main.timeline, app.main.detail
        await shown(pilot, app, 0)
        op = linear_op()
        await pilot.press("colon", *f"#{op['seq']}", "enter")
        await until(pilot, lambda: detail.links and detail.event.get("seq") == op["seq"])
        await pilot.pause()
        lines = app.screen_text().splitlines()
        name = op["nodes"][0]["name"]
        y = next(i for i, line in enumerate(lines) if f"{name} node id" in line)
        await pilot.click(offset=(lines[y].index(f"{name} node id") + 2, y))
        await until(pilot, lambda: tl.current_row().kind == "grad")
        assert tl.current_row().node_id == op["nodes"][0]["id"]


@sync
async def test_the_alert_detail_links_to_its_event():
    app = TorchscopeApp(replay(), at_origin=False)
    async with app.run_test(size=SIZE) as pilot:
        main, tl, detail = app.main, app.main.timeline, app.main.detail
        await shown(pilot, app, 0)
        await pilot.press("a")
        alert = app.store.alerts[0]
        await until(pilot, lambda: detail.subject == ("alert", alert["seq"]))
        assert detail.link_texts() == [f"the event: #{alert['event_seq']} (event seq)"]
        detail.focus()  # done later, by a callback: enter must not reach the alerts list
        await until(pilot, lambda: app.focused is detail, what="the detail focused")
        # the timeline's deferred refresh for a move made for the user (showing step 0 set
        # one off) lands late on a loaded machine: it must not take the alert away
        main._show_followed_detail()
        assert detail.subject == ("alert", alert["seq"])
        await pilot.press("enter")
        await until(pilot, lambda: main.current_step == alert["step"])
        await until(pilot, lambda: tl.current_row() and tl.current_row().seq == alert["event_seq"])
        assert app.focused is tl


@sync
async def test_a_jump_from_an_alert_shows_its_row_with_an_earlier_refresh_still_to_come():
    app = TorchscopeApp(replay(), at_origin=False)
    async with app.run_test(size=SIZE) as pilot:
        main, tl, detail = app.main, app.main.timeline, app.main.detail
        await shown(pilot, app, 0)
        # the deferred refresh of an earlier move, not yet run (seconds late on a loaded
        # machine) when the user opens an alert and jumps to its event
        main._detail_pending, main._detail_pending_over = True, detail.subject
        await pilot.press("a")
        alert = app.store.alerts[0]
        await until(pilot, lambda: detail.subject == ("alert", alert["seq"]))
        await pilot.press("enter")
        await until(pilot, lambda: tl.current_row() and tl.current_row().seq == alert["event_seq"])
        main._show_followed_detail()  # that refresh, at last
        assert detail.subject[:2] == ("row", alert["event_seq"])


@sync
async def test_esc_goes_back_to_the_timeline_from_every_panel():
    app = TorchscopeApp(replay(), at_origin=False)
    async with app.run_test(size=SIZE) as pilot:
        main, tl = app.main, app.main.timeline
        await shown(pilot, app, 0)
        for widget in (main.steps, main.alerts, main.detail):
            widget.focus()
            await pilot.pause()
            assert app.focused is widget
            await pilot.press("escape")
            assert app.focused is tl, widget
        await pilot.press("g")
        assert app.focused is main.graph
        await pilot.press("escape")
        assert main.center == "timeline" and app.focused is tl
        main.detail.focus()
        await pilot.press("plus")
        assert main.maximised == "detail"
        await pilot.press("escape")
        assert main.maximised is None
        await pilot.press("escape")
        assert app.focused is tl


@sync
async def test_f_while_following_keeps_following_as_the_help_says():
    src = ScriptedSource(TRACE)
    app = TorchscopeApp(src)
    notes: list[str] = []
    notify = app.notify
    app.notify = lambda message, *a, **k: (notes.append(str(message)), notify(message, *a, **k))
    async with app.run_test(size=SIZE) as pilot:
        main, tl = app.main, app.main.timeline
        await until(pilot, lambda: main.current_step == 2 and tl.row_count() > 0)
        assert main.follow
        await pilot.press("f")
        assert main.follow and tl.cursor == tl.row_count() - 1
        assert any("following the newest step" in n for n in notes)
        await pilot.press("up")
        assert not main.follow
        await pilot.press("f")
        assert main.follow and tl.cursor == tl.row_count() - 1
        from torchscope.tui.keys import key

        f_help = key("f").help
        assert "stays on" in f_help and "any move" in f_help


@sync
async def test_help_says_the_lease_only_as_the_job_knows_it():
    app = TorchscopeApp(replay(), at_origin=False)
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app, 0)
        await pilot.press("question_mark")

        def about() -> str:
            return str(app.screen.query_one("#help-about").render())

        assert "after its lease." in about() and "10 s" not in about()
        await pilot.press("escape")
        app.status["lease"] = 7
        await pilot.press("question_mark")
        assert "after its lease (7 s)." in about()
        await pilot.press("escape")
        app.store.stepper.on_state({"lease_s": 3.0})  # what a live job's state replies say
        await pilot.press("question_mark")
        assert "after its lease (3 s)." in about()
