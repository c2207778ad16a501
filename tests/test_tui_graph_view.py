"""Issue 21, the graph view: a chain of nodes reads down as a chain (``↓``), a node with
several inputs is a branch that nests them; a small graph opens with every branch expanded
(the seed graph shows DivBackward0 without a key); ``h`` / ``l`` scroll sideways to the end
of a long line; the detail shows the node under the graph's cursor after ``g``; ``M`` is a
module tree with each module's gradient norm (heat bar) and its sparkline over the steps."""

from __future__ import annotations

import math

import pytest
from tui_pilot import SIZE, sync, until

from torchscope.protocol.events import GRAD
from torchscope.session import module_norms
from torchscope.session.format import fnum
from torchscope.session.store import EventStore
from torchscope.tui.app import TorchscopeApp
from torchscope.tui.demo.synthetic import make_trace
from torchscope.tui.sources.file import FileSource
from torchscope.tui.sources.scripted import ScriptedSource
from torchscope.tui.widgets import graph_tree

TRACE = make_trace(3, 3, nan_step=1)


def replay(trace=TRACE) -> ScriptedSource:
    return ScriptedSource(trace, mode="replay")


async def at_step(pilot, app: TorchscopeApp, step: int) -> None:
    """The timeline on ``step`` (a recording with a NaN opens at its origin's step)."""
    main = app.main
    await until(pilot, lambda: main.current_step is not None and main.timeline.row_count() > 0)
    while main.current_step != step:
        was = main.current_step
        await pilot.press("left_square_bracket" if was > step else "right_square_bracket")
        await until(pilot, lambda was=was: main.current_step != was, what=f"step {step}")
    await until(pilot, lambda: main.timeline.row_count() > 0)


async def graph_open(pilot, app: TorchscopeApp, step: int = 0) -> None:
    main = app.main
    await at_step(pilot, app, step)
    await pilot.press("g")
    await until(pilot, lambda: main.graph.model is not None, what="the graph")
    await until(pilot, lambda: main.graph.size.height > 0, what="the graph laid out")


def screen(graph) -> list[str]:
    """The graph's lines as the screen shows them (scrolled as it is)."""
    return [graph.render_line(y).text for y in range(graph.size.height)]


def items(graph):
    """Every item of the tree, as the tree orders them (expanded or not)."""
    stack = list(reversed(graph.root.children))
    while stack:
        item = stack.pop()
        yield item
        stack.extend(reversed(item.children))


def depth(item) -> int:
    d = 0
    while item.parent is not None:
        d += 1
        item = item.parent
    return d


def param_norms(step: int) -> dict[str, float]:
    """The gradient norm each parameter received in ``step``, from the trace's events."""
    out = {}
    for ev in TRACE:
        if ev.get("kind") == GRAD and ev.get("step") == step and ev["node"] == "AccumulateGrad":
            out[ev["param"]] = ev["grad_outputs"][0]["stats"]["norm"]
    return out


def norm_of(module: str, step: int) -> float:
    sq = [n * n for p, n in param_norms(step).items() if p.startswith(module + ".")]
    return math.sqrt(sum(sq))


@sync
async def test_a_chain_reads_down_with_arrows_and_a_branch_nests_its_other_inputs():
    app = TorchscopeApp(replay())
    async with app.run_test(size=SIZE) as pilot:
        graph = app.main.graph
        await graph_open(pilot, app)
        model = graph.model
        assert graph.open_all and len(model.nodes) <= graph_tree._OPEN_ALL
        lines = screen(graph)
        flows = 0
        for item in items(graph):
            data = item.data or {}
            if data.get("kind") != "node" or item.line < 0 or item.line >= len(lines):
                continue
            guide = lines[item.line][(depth(item) - 2) * graph.guide_depth]
            if data["flow"]:
                # ↓: this node is where the gradient of the node above it in the chain goes
                flows += 1
                assert guide == "↓", lines[item.line]
                before = item.parent.children[item.parent.children.index(item) - 1]
                assert model.main[before.data["key"]] == data["key"]
            else:
                assert guide in "├└", lines[item.line]
        assert flows >= 8
        # A branch: AddmmBackward0 has three inputs. The chain goes on to the next layer's
        # node; the bias's AccumulateGrad and the weight's TBackward0 nest under it.
        addmm = next(
            i for i in items(graph) if str(i.label).startswith("AddmmBackward0") and i.children
        )
        assert addmm.is_expanded
        nested = [str(c.label) for c in addmm.children]
        assert any(s.startswith("AccumulateGrad") for s in nested)
        assert any("TBackward0" in s for s in nested)
        line = lines[addmm.line]
        under = lines[addmm.line + 1]
        x = (depth(addmm) - 1) * graph.guide_depth
        assert under[x] in "├└" and line.index("AddmmBackward0") <= x + 2 + 2
        # every node is in view without a key
        shown = {i.data["key"] for i in items(graph) if (i.data or {}).get("kind") == "node"}
        assert shown == set(model.nodes)


@sync
async def test_a_large_graph_opens_with_its_branches_closed():
    trace = make_trace(1, 60)
    app = TorchscopeApp(replay(trace))
    async with app.run_test(size=SIZE) as pilot:
        graph = app.main.graph
        await graph_open(pilot, app)
        assert len(graph.model.nodes) > graph_tree._OPEN_ALL and not graph.open_all
        closed = [i for i in items(graph) if i.allow_expand and not i.is_expanded]
        assert closed and "▶" in "\n".join(screen(graph))
        # → opens one (its inputs added then)
        graph.move_cursor(closed[0])
        await pilot.press("right")
        assert closed[0].is_expanded and closed[0].children


@sync
async def test_the_seed_graph_shows_div_mul_and_add_without_a_key(seed):
    app = TorchscopeApp(FileSource(str(seed)))
    async with app.run_test(size=(80, 24)) as pilot:
        graph = app.main.graph
        await graph_open(pilot, app)
        await until(pilot, lambda: "DivBackward0" in "\n".join(screen(graph)), what="Div")
        lines = screen(graph)
        text = "\n".join(lines)
        assert "▶" not in text, text  # nothing closed
        add = next(i for i, s in enumerate(lines) if "AddBackward0" in s)
        div = next(i for i, s in enumerate(lines) if "DivBackward0" in s)
        mul = next(i for i, s in enumerate(lines) if "MulBackward0" in s)
        # Add, then its second input nested under it, then the chain goes down to Mul
        assert add < div < mul
        assert lines[add].index("AddBackward0") < lines[div].index("DivBackward0")
        assert lines[mul].startswith("↓") and lines[mul].index("MulBackward0") == lines[add].index(
            "AddBackward0"
        )
        assert "seed_grads.py:30" in lines[add] and "/examples/" not in text  # file:line


@sync
async def test_h_and_l_scroll_sideways_to_the_end_of_a_long_line():
    app = TorchscopeApp(replay())
    async with app.run_test(size=(80, 24)) as pilot:
        graph = app.main.graph
        await graph_open(pilot, app)
        await until(pilot, lambda: graph.virtual_size.width > graph.size.width)
        longest = max(
            (i for i in items(graph) if (i.data or {}).get("kind") == "node" and i.line >= 0),
            key=lambda i: graph.get_label_width(i) + depth(i) * graph.guide_depth,
        )
        tail = str(longest.label).split()[-1]  # its file:line
        assert tail.startswith("train.py:")
        graph.move_cursor(longest)
        await until(pilot, lambda: graph.cursor_node is longest)

        def visible() -> str:
            y = longest.line - graph.scroll_offset.y
            return graph.render_line(y).text if 0 <= y < graph.size.height else ""

        assert tail not in visible()
        for _ in range(40):
            if graph.scroll_x >= graph.max_scroll_x:
                break
            x = graph.scroll_x
            await pilot.press("l")
            await until(pilot, lambda x=x: graph.scroll_x > x, what="scrolled right")
        assert tail in visible()
        assert app.focused is graph and graph.cursor_node is longest  # nothing else moved
        for _ in range(40):
            if graph.scroll_x == 0:
                break
            x = graph.scroll_x
            await pilot.press("h")
            await until(pilot, lambda x=x: graph.scroll_x < x, what="scrolled left")
        assert graph.scroll_x == 0 and tail not in visible()


@sync
async def test_after_g_the_detail_shows_the_node_under_the_graphs_cursor():
    app = TorchscopeApp(replay())
    async with app.run_test(size=SIZE) as pilot:
        main, graph, detail = app.main, app.main.graph, app.main.detail
        await at_step(pilot, app, 0)
        # from an op that made no node (the optimizer's update): the graph's first node
        data = app.store.data(0)
        update = next(r for r in map(data.view, data.ops) if r.name == "Tensor.add_")
        main.timeline.select("op", update.seq)
        await until(pilot, lambda: main.timeline.current_row().seq == update.seq)

        def shows_cursor_node() -> bool:
            ev = detail.event
            return bool(ev) and ev.get("node_id") == graph.current_node_id() is not None

        await pilot.press("g")
        await until(pilot, shows_cursor_node, what="the detail on the graph's node")
        assert graph.cursor_node.data["key"] == graph.model.roots[0][0]
        # moving in the graph: the detail follows
        await pilot.press("down", "down")
        await until(pilot, shows_cursor_node, what="the detail following the cursor")


@sync
async def test_M_is_a_module_tree_with_norms_heat_bars_and_sparklines():
    app = TorchscopeApp(replay())
    async with app.run_test(size=SIZE) as pilot:
        main, graph = app.main, app.main.graph
        await graph_open(pilot, app)
        await until(pilot, lambda: all(app.store.is_resident(s) for s in (0, 1, 2)))
        await pilot.press("M")
        assert graph.by_module
        modules = {
            i.data["group"][1]: i
            for i in items(graph)
            if (i.data or {}).get("kind") == "module" and not i.data.get("own")
        }
        top = [str(c.data["group"][1]) for c in graph.root.children[0].children]
        assert "blocks" in top
        blocks = modules["blocks"]
        assert [c.data["group"][1] for c in blocks.children] == ["blocks.0", "blocks.1", "blocks.2"]
        assert blocks.is_expanded and modules["blocks.0"].is_expanded  # the hierarchy open
        # submodules in forward order; a leaf module's nodes closed until →
        b0 = [c.data["group"][1] for c in modules["blocks.0"].children]
        assert b0 == ["blocks.0.fc", "blocks.0.act", "blocks.0.norm"]
        assert not modules["blocks.1.fc"].is_expanded
        # norms: of the gradients the module's parameters received; a heat bar against the
        # largest at the same depth; none for a module without parameters
        for m in ("blocks.0.fc", "blocks.1", "blocks"):
            assert f" {fnum(norm_of(m, 0))} " in str(modules[m].label), modules[m].label
        assert "no parameters" in str(modules["blocks.0.act"].label)
        peers = {m: norm_of(m, 0) for m in ("blocks.0", "blocks.1", "blocks.2")}
        hottest = max(peers, key=peers.get)
        assert "█" * graph_tree._BAR in str(modules[hottest].label)
        coolest = min(peers, key=peers.get)
        assert "█" * graph_tree._BAR not in str(modules[coolest].label)
        # the whole model's: the step's global gradient norm, on the call's line
        total = math.sqrt(sum(n * n for n in param_norms(0).values()))
        assert f"∇ params {fnum(total)}" in str(graph.root.children[0].label)
        # a sparkline of the norm over the steps in memory: step 1's NaN as !
        steps, history = graph.history
        assert steps == [0, 1, 2]
        spark = history["blocks.0.fc"]
        assert math.isnan(spark[1]) and spark[0] == pytest.approx(norm_of("blocks.0.fc", 0))
        label = str(modules["blocks.0.fc"].label)
        assert any(len(w) == 3 and w[1] == "!" for w in label.split()), label
        # the NaN step: red bars of !, nan
        await pilot.press("right_square_bracket")
        await until(pilot, lambda: graph.data is not None and graph.data.step == 1)
        fc = next(
            i
            for i in items(graph)
            if (i.data or {}).get("group", (0, ""))[1] == "blocks.0.fc" and "own" not in i.data
        )
        assert "!" * graph_tree._BAR in str(fc.label) and " nan " in str(fc.label)
        assert main.center == "graph" and graph.by_module


@sync
async def test_M_reveals_the_node_under_the_cursor_inside_its_module():
    app = TorchscopeApp(replay())
    async with app.run_test(size=SIZE) as pilot:
        graph = app.main.graph
        await graph_open(pilot, app)
        gelu = next(
            k
            for k, n in graph.model.nodes.items()
            if n["name"] == "GeluBackward0" and graph.module_of(k) == "blocks.1.act"
        )
        assert graph.reveal(gelu[1])
        await pilot.press("M")
        assert graph.current_node_id() == gelu[1]
        item = graph.cursor_node
        path = []
        while item.parent.data.get("kind") == "module":
            item = item.parent
            path.append(item.data["group"][1])
            assert item.is_expanded
        assert path == ["blocks.1.act", "blocks.1", "blocks"]


def test_step_norms_sum_the_parameters_gradients_by_module():
    store = EventStore()
    store.ingest(TRACE)
    data = store.data(0)
    norms = module_norms.step_norms(data)
    assert norms is module_norms.step_norms(data)  # cached while the step is unchanged
    for m in ("blocks.0.fc", "blocks.0", "blocks"):
        assert norms[m] == pytest.approx(norm_of(m, 0))
    assert norms[""] == pytest.approx(math.sqrt(sum(n * n for n in param_norms(0).values())))
    assert "blocks.0.act" not in norms and module_norms.MODEL_OWN not in norms
    assert math.isnan(module_norms.step_norms(store.data(1))["blocks"])
    assert module_norms.parents("a.b.c") == ["a.b.c", "a.b", "a", ""]
    steps, history = module_norms.norm_history(store, 1, ["blocks", "nowhere"], width=2)
    assert steps == [0, 1] and history["nowhere"] == [None, None]


@sync
async def test_g_again_shows_the_graphs_node_not_the_timelines_op():
    app = TorchscopeApp(replay())
    async with app.run_test(size=SIZE) as pilot:
        main, graph, detail = app.main, app.main.graph, app.main.detail
        await graph_open(pilot, app)
        here = graph.current_node_id()
        await until(pilot, lambda: (detail.event or {}).get("node_id") == here)
        await pilot.press("g")  # back to the timeline, then to an op that made no node
        tl = main.timeline
        index = max(i for i in range(tl.row_count()) if tl.row(i).name == "Tensor.add_")
        tl.move_cursor(index, user=True, center=True)
        await until(pilot, lambda: (detail.event or {}).get("name") == "Tensor.add_")
        await pilot.press("g")
        await until(pilot, lambda: main.center == "graph" and app.focused is graph)
        assert graph.current_node_id() == here
        await until(pilot, lambda: (detail.event or {}).get("node_id") == here, timeout=3)
