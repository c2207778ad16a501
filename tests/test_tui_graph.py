"""Issue 12: the backward graph grouped by module (``M``: a module tree, issue 21),
searched (``/`` in the graph: its nodes; ``ctrl+n`` / ``ctrl+p`` between matches) and
filtered (``|`` in the graph: only the nodes that match, by module)."""

from __future__ import annotations

from tui_pilot import SIZE, sync, until

from torchscope.tui.app import TorchscopeApp
from torchscope.tui.demo.synthetic import make_trace
from torchscope.tui.sources.scripted import ScriptedSource

TRACE = make_trace(2, 3, nan_step=1)


def replay() -> ScriptedSource:
    return ScriptedSource(TRACE, mode="replay")


async def graph_open(pilot, app: TorchscopeApp) -> None:
    main = app.main
    # step 0 (a recording with a NaN opens at its origin's step: step 1 here)
    await until(pilot, lambda: main.current_step is not None and main.timeline.row_count() > 0)
    while main.current_step != 0:
        was = main.current_step
        await pilot.press("left_square_bracket")
        await until(pilot, lambda was=was: main.current_step != was, what="step 0")
    await until(pilot, lambda: main.timeline.row_count() > 0)
    await pilot.press("g")
    await until(pilot, lambda: main.graph.model is not None, what="the graph")


def graph_node_ids(step: int = 0) -> list[dict]:
    graph = next(e for e in TRACE if e.get("kind") == "graph" and e.get("step") == step)
    return graph["nodes"]


def module_items(graph) -> list:
    """Every module entry of the module tree (M), as the tree shows them."""
    out, stack = [], list(reversed(graph.root.children))
    while stack:
        item = stack.pop()
        if item.data and item.data.get("kind") == "module" and not item.data.get("own"):
            out.append(item)
        stack.extend(reversed(item.children))
    return out


def shown_nodes(graph) -> list:
    """The keys of the nodes in view (every item above them expanded)."""
    out, stack = [], list(reversed(graph.root.children))
    while stack:
        item = stack.pop()
        if item.data and item.data.get("kind") == "node":
            out.append(item.data["key"])
        if item.is_expanded:
            stack.extend(reversed(item.children))
    return out


@sync
async def test_M_groups_the_graph_by_module_and_back_keeping_the_node():
    app = TorchscopeApp(replay())
    async with app.run_test(size=SIZE) as pilot:
        main, graph = app.main, app.main.graph
        await graph_open(pilot, app)
        assert "M " in main.key_bar.text
        here = graph.current_node_id()
        await pilot.press("M")
        assert graph.by_module and graph.current_node_id() == here
        assert "by module" in graph.border_subtitle
        items = module_items(graph)
        modules = [item.data["group"][1] for item in items]
        # the modules of the ops that created the nodes, each once, and the modules above
        # them; parameters' nodes with their module
        assert len(modules) == len(set(modules))
        assert {"blocks", "blocks.0", "blocks.0.fc", "blocks.1.fc", "blocks.2.act"} <= set(modules)
        # a leaf module holds its nodes, and opens with →
        group = next(item for item in items if item.data["group"][1] == "blocks.0.fc")
        assert group.parent.data["group"][1] == "blocks.0"
        graph.move_cursor(group)
        await pilot.press("right")
        names = sorted(str(c.label).split(" node ")[0] for c in group.children)
        assert "AddmmBackward0" in names and "AccumulateGrad" in names
        # enter on a node in a group: the op that created it, as in the chain view
        addmm = next(c for c in group.children if str(c.label).startswith("AddmmBackward0"))
        graph.move_cursor(addmm)
        await pilot.press("enter")
        row = main.timeline.current_row()
        assert main.center == "timeline" and row.kind == "op" and row.module == "blocks.0.fc"
        await pilot.press("g")  # back in the graph: still by module, on that node
        assert graph.by_module
        await pilot.press("M")
        assert not graph.by_module and graph.current_node_id() is not None


@sync
async def test_slash_in_the_graph_searches_its_nodes_and_ctrl_n_moves():
    app = TorchscopeApp(replay())
    async with app.run_test(size=SIZE) as pilot:
        main, graph = app.main, app.main.graph
        await graph_open(pilot, app)
        want = [n["id"] for n in graph_node_ids() if n["name"] == "GeluBackward0"]
        assert len(want) == 3
        await pilot.press("slash")
        assert main.filter.mode.name == "graph" and main.center == "graph"
        await pilot.press(*"gelu")
        assert graph.current_node_id() in want
        await pilot.press("enter")
        assert app.focused is graph and not main.filter.display
        assert f"search /gelu/ 1/{len(want)}" in graph.border_subtitle
        seen = {graph.current_node_id()}
        await pilot.press("ctrl+n")
        seen.add(graph.current_node_id())
        await pilot.press("ctrl+n")
        seen.add(graph.current_node_id())
        assert seen == set(want) and f"3/{len(want)}" in graph.border_subtitle
        await pilot.press("ctrl+n")  # wraps
        assert "1/3" in graph.border_subtitle
        await pilot.press("ctrl+p")
        assert "3/3" in graph.border_subtitle
        # by node id, and in the module view too
        await pilot.press("M", "slash", *"node 2$", "enter")
        assert graph.current_node_id() == 2 and graph.by_module
        # the module: every node of blocks.1 (its ops' nodes and its parameters')
        await pilot.press("slash", *r"blocks\.1\.", "enter")
        assert len(graph.matches) >= 4
        # no match: one line in the box
        await pilot.press("slash", *"zzz")
        assert "no node matches /zzz/" in main.filter.border_title
        await pilot.press("escape")
        assert graph.search is None and app.focused is graph and main.center == "graph"


@sync
async def test_bar_in_the_graph_keeps_only_the_matching_nodes_and_esc_brings_all_back():
    app = TorchscopeApp(replay())
    async with app.run_test(size=SIZE) as pilot:
        main, graph = app.main, app.main.graph
        await graph_open(pilot, app)
        await pilot.press("vertical_line")
        assert main.filter.mode.name == "graph-filter" and main.center == "graph"
        await pilot.press(*"accumulate", "enter")
        assert app.focused is graph and graph.node_filter is not None
        params = [n for n in graph_node_ids() if n["name"] == "AccumulateGrad"]
        assert graph.shown_count() == len(params) == 6
        shown = [key[1] for key in shown_nodes(graph)]
        assert sorted(shown) == sorted(n["id"] for n in params)  # all in view, nothing else
        assert "filter /accumulate/ 6 nodes" in graph.border_subtitle
        assert graph.current_node_id() in shown
        await pilot.press("vertical_line", "escape")  # | then esc: the whole graph again
        assert graph.node_filter is None and not graph.grouped
        assert "filter" not in graph.border_subtitle
