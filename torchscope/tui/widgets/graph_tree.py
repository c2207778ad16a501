"""The step's backward graph as a tree, each node linked to the forward op that created it.

Read top to bottom, the tree follows the gradient from the loss to the parameters. A chain
(a node whose gradient goes on to one node, then to the next...) is drawn as one line of
nodes joined by ``↓`` at one indentation, so a long chain does not indent once per node. A
node with several inputs (next functions) is a branch: its largest input continues the chain
on the next ``↓`` line, its other inputs nest under it, one level deeper (a one-node input as
the node itself, a longer one as an entry ``⤷ first … last (n nodes)`` holding its chain).
A node reachable along several paths is shown once; other places show a link (``↪``) to it.

Branches start expanded when the step's graphs have at most ``_OPEN_ALL`` nodes in all (every
node in view); in larger graphs they start collapsed and are filled when opened (``right``
expands, ``left`` collapses; ``reveal`` opens the way to a node), so graphs of any size open
at once. ``h`` / ``l`` scroll sideways (long labels, deep branches); the detail panel shows the
node under the cursor in full.

Each label: node name and id, executed or not, the norm of the gradient that arrived, the
parameter for AccumulateGrad, the op that created it, its module and ``file:line``.

``M`` shows the nodes by module instead, as a module tree (``blocks`` > ``blocks.0`` >
``blocks.0.attn``): each module with a heat bar and the norm of the gradients its parameters
received in the step (see :mod:`torchscope.session.module_norms`), and a sparkline of that norm
over the steps in memory.
"""

from __future__ import annotations

import math
import re
from collections import deque
from typing import Any, ClassVar

from rich.segment import Segment
from rich.text import Text
from textual.binding import Binding, BindingType
from textual.strip import Strip
from textual.widgets import Tree
from textual.widgets.tree import TreeNode

from torchscope.protocol.events import Event
from torchscope.session import module_norms
from torchscope.session.format import SPARK, compact_stat, fnum, plural, short_name, source_cell
from torchscope.session.search import FieldPattern
from torchscope.session.steps import StepData
from torchscope.session.store import EventStore

_CHAIN_CAP = 500  # nodes shown at once along one chain; "… more" entries move the window
# A step's graphs with at most this many nodes in all open with every branch expanded.
_OPEN_ALL = 300
# The module tree (M) opens its modules' hierarchy when it has at most this many modules.
_OPEN_MODULES = 80
_FLOW = "↓"  # drawn instead of the tree's sibling guide before a node that continues a chain
_BAR = 8  # cells of a module's heat bar
_BLOCKS = " ▏▎▍▌▋▊▉█"
_SPARK_STEPS = 16  # steps in a module's sparkline
_NO_MODULE = "(no module: outside any, or not known)"

Key = tuple[int, int]  # (call index, node id)


class _Model:
    """Spanning tree of one step's graphs, cut into chains."""

    def __init__(self, graphs: list[Event]) -> None:
        self.graphs = graphs
        self.nodes: dict[Key, dict] = {}
        self.children: dict[Key, list[Key]] = {}
        self.main: dict[Key, Key | None] = {}
        self.side: dict[Key, list[Key]] = {}
        self.head: dict[Key, Key] = {}  # node -> first node of its chain
        self.holder: dict[Key, Key | int] = {}  # chain head -> node holding it, or call index
        self.chains: dict[Key, list[Key]] = {}
        self.index: dict[Key, int] = {}  # node -> position in its chain
        self.roots: dict[int, list[Key]] = {}
        self.by_id: dict[int, list[Key]] = {}
        self.first_parent: dict[Key, Key | int] = {}
        self.links: dict[Key, list[Key]] = {}  # edges to nodes shown under another parent
        for ci, graph in enumerate(graphs):
            self._build(ci, graph)

    def _build(self, ci: int, graph: Event) -> None:
        nodes = {
            n["id"]: n
            for n in graph.get("nodes") or ()
            if isinstance(n, dict) and type(n.get("id")) is int
        }
        for nid, n in nodes.items():
            self.nodes[(ci, nid)] = n
            self.by_id.setdefault(nid, []).append((ci, nid))
        roots = [r for r in graph.get("roots") or () if r in nodes]
        if not roots and nodes:  # no roots recorded: nodes nothing points to
            pointed = {
                e[0] for n in nodes.values() for e in n.get("next") or () if isinstance(e, list)
            }
            roots = [nid for nid in nodes if nid not in pointed]
        self.roots[ci] = [(ci, r) for r in roots]
        # BFS spanning tree: each node under the first parent that reaches it.
        seen: set[int] = set(roots)
        order: list[Key] = []
        queue = deque(roots)
        while queue:
            nid = queue.popleft()
            key = (ci, nid)
            order.append(key)
            kids = []
            links = []
            for edge in nodes[nid].get("next") or ():
                target = edge[0] if isinstance(edge, list) and edge else None
                if not isinstance(target, int) or target not in nodes:
                    continue
                if target in seen:
                    links.append((ci, target))
                    continue
                seen.add(target)
                kids.append((ci, target))
                self.first_parent[(ci, target)] = key
                queue.append(target)
            self.children[key] = kids
            if links:
                self.links[key] = links
        for r in roots:
            self.first_parent[(ci, r)] = ci
        # Unreached nodes (no path from a root): their own chains at the top.
        for nid in nodes:
            if nid not in seen:
                self.roots[ci].append((ci, nid))
                self.first_parent[(ci, nid)] = ci
                self.children.setdefault((ci, nid), [])
                order.append((ci, nid))
        size: dict[Key, int] = {}
        for key in reversed(order):
            size[key] = 1 + sum(size.get(k, 1) for k in self.children.get(key, ()))
        for key in order:
            kids = self.children.get(key, [])
            if kids:
                main = max(kids, key=lambda k: size.get(k, 1))
                self.main[key] = main
                self.side[key] = [k for k in kids if k != main]
            else:
                self.main[key] = None
                self.side[key] = []
        for r in self.roots[ci]:
            self._chain(r, ci)

    def display_order(self) -> list[Key]:
        """Every node in the order the tree shows them with everything expanded: each
        chain top to bottom, a node's side branches right after it."""
        out: list[Key] = []
        for ci in range(len(self.graphs)):
            stack = [iter(self.chains.get(r, [r])) for r in reversed(self.roots.get(ci, []))]
            while stack:
                key = next(stack[-1], None)
                if key is None:
                    stack.pop()
                    continue
                out.append(key)
                for s in reversed(self.side.get(key, ())):
                    stack.append(iter(self.chains.get(s, [s])))
        return out

    def _chain(self, head: Key, holder: Key | int) -> None:
        """Record the chain starting at ``head`` and, recursively, its side chains."""
        stack = [(head, holder)]
        while stack:
            start, hold = stack.pop()
            chain: list[Key] = []
            key: Key | None = start
            while key is not None:
                self.index[key] = len(chain)
                chain.append(key)
                self.head[key] = start
                for s in self.side.get(key, ()):
                    stack.append((s, key))
                key = self.main.get(key)
            self.chains[start] = chain
            self.holder[start] = hold


def _natural(name: str) -> tuple:
    """Sort key: ``blocks.2`` before ``blocks.10``."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split("."))


def _depth(module: str) -> int:
    return module.count(".") if module else 0


def _module_name(module: str) -> str:
    return module or "(no module)"


def _module_text(module: str, width: int) -> Text:
    """``blocks.0.attn``: the path to it dim, its own name bold; padded to ``width`` so that
    the heat bars of siblings line up."""
    if not module:
        return Text("(no module)".ljust(width), "bold cyan")
    above, dot, leaf = module.rpartition(".")
    return Text.assemble(
        (above + dot, "cyan"), (leaf, "bold cyan"), " " * max(0, width - len(module))
    )


def _heat_style(frac: float) -> str:
    if frac >= 0.75:
        return "bold red"
    if frac >= 0.5:
        return "dark_orange"
    if frac >= 0.25:
        return "yellow"
    return "green"


def _heat_bar(norm: float | None, scale: float) -> Text:
    """``█████▍··``: ``norm`` against ``scale`` (the largest at its depth), coloured by it;
    ``!!!!!!!!`` for a NaN/Inf norm; blank for a module without parameters."""
    if norm is None:
        return Text(" " * _BAR)
    if not math.isfinite(norm):
        return Text("!" * _BAR, "bold red")
    frac = min(1.0, norm / scale) if scale > 0 else 0.0
    eighths = round(frac * _BAR * 8)
    if norm > 0 and eighths == 0:
        eighths = 1
    full, part = divmod(eighths, 8)
    bar = "█" * full + (_BLOCKS[part] if part else "")
    return Text.assemble((bar, _heat_style(frac)), ("·" * (_BAR - len(bar)), "dim"))


def _spark(values: list[float | None] | None, at: int) -> Text:
    """A module's norm over the steps in memory, the current step underlined: ``·`` where
    it had no gradient, ``!`` where it was NaN/Inf. Nothing for fewer than two steps."""
    if not values or len(values) < 2:
        return Text()
    finite = [v for v in values if v is not None and math.isfinite(v)]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 0.0)
    out = Text("  ")
    for i, v in enumerate(values):
        under = " underline" if i == at else ""
        if v is None:
            out.append("·", "dim" + under)
        elif not math.isfinite(v):
            out.append("!", "bold red" + under)
        else:
            level = 0.5 if hi <= lo else (v - lo) / (hi - lo)
            out.append(SPARK[min(len(SPARK) - 1, int(level * len(SPARK)))], "cyan" + under)
    return out


class GraphTree(Tree[dict], inherit_bindings=False):
    """Backward graph of the selected step.

    Tree's own bindings minus ``space`` (kept free for pause/step), plus ``right``/``left``
    to expand and collapse and ``h``/``l`` to scroll sideways.
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter", "select_cursor", "Select", show=False),
        Binding("up,k", "cursor_up", "Cursor up", show=False),
        Binding("down,j", "cursor_down", "Cursor down", show=False),
        Binding("pageup", "page_up", "Page up", show=False),
        Binding("pagedown", "page_down", "Page down", show=False),
        Binding("home", "scroll_home", "Home", show=False),
        Binding("end", "scroll_end", "End", show=False),
        Binding("right", "expand", "Expand", show=False),
        Binding("left", "collapse", "Collapse", show=False),
        Binding("shift+left", "cursor_parent", "Cursor to parent", show=False),
        Binding("shift+up", "cursor_previous_sibling", "Previous sibling", show=False),
        Binding("shift+down", "cursor_next_sibling", "Next sibling", show=False),
        Binding("h", "scroll_sideways(-1)", "Scroll left", show=False),
        Binding("l", "scroll_sideways(1)", "Scroll right", show=False),
    ]

    def __init__(self, *, id: str | None = None) -> None:
        self._branches: dict[Key, TreeNode[dict]] = {}
        super().__init__("backward graph", id=id)
        self.show_root = False
        self.auto_expand = False
        self.guide_depth = 2
        self.store: EventStore | None = None
        self.data: StepData | None = None
        self.model: _Model | None = None
        self.cwd: str | None = None
        # graph node -> its tree item (not Tree's own _tree_nodes, which is keyed by NodeID)
        self._items: dict[Key, TreeNode[dict]] = {}
        self._containers: dict[Key, TreeNode[dict]] = {}  # chain head -> tree node holding it
        self._populated: set[int] = set()  # TreeNode ids whose side branches were added
        self._shown: tuple = (None, -1, False, None)
        self.by_module = False  # M: the module tree instead of chains
        # |: only the nodes it matches
        self.node_filter: re.Pattern[str] | FieldPattern | None = None
        # (call, module) -> the item that holds the module's own nodes
        self._groups: dict[tuple[int, str], TreeNode[dict]] = {}
        self._group_of: dict[Key, tuple[int, str]] = {}
        self._group_keys: dict[tuple[int, str], list[Key]] = {}  # a module's own nodes
        self._group_order: list[tuple[int, str]] = []  # module items as the tree shows them
        self._modules: dict[tuple[int, str], TreeNode[dict]] = {}  # (call, module) -> its item
        self.norms: dict[str, float] = {}  # M: module -> its parameters' gradient norm
        self.history: tuple[list[int], dict[str, list[float | None]]] = ([], {})
        self.open_all = False  # the step's graph is small: every branch starts expanded
        self._to_open: list[TreeNode[dict]] = []  # items to fill and expand (open_all)
        self.search: re.Pattern[str] | FieldPattern | None = None
        self.matches: list[Key] = []
        self.match_at = -1
        self._hay: dict[Key, str] = {}

    # -- drawing -----------------------------------------------------------------------------
    def render_line(self, y: int) -> Strip:
        """The tree's line, with ``↓`` instead of the sibling guide (``├``/``└``) before a
        node that continues a chain: the chain reads as the gradient's way down."""
        strip = super().render_line(y)
        scroll_x, scroll_y = self.scroll_offset
        item = self.get_node_at_line(y + scroll_y)
        if item is None or not item.data or not item.data.get("flow"):
            return strip
        depth = 0  # items under the root: 1 (no guide: the root is hidden)
        up = item
        while up.parent is not None:
            depth += 1
            up = up.parent
        x = (depth - 2) * self.guide_depth - scroll_x  # where the tree drew the guide
        if depth < 2 or not 0 <= x < strip.cell_length:
            return strip
        cell = list(strip.crop(x, x + 1))
        style = cell[0].style if cell else None
        return Strip.join(
            [
                strip.crop(0, x),
                Strip([Segment(_FLOW, style)], 1),
                strip.crop(x + 1, strip.cell_length),
            ]
        )

    def action_scroll_sideways(self, direction: int) -> None:
        """``h`` / ``l``: a third of the width left or right (long labels, deep branches)."""
        step = max(4, self.size.width // 3)
        self.scroll_to(x=self.scroll_x + direction * step, animate=False)

    # -- model -------------------------------------------------------------------------------
    def set_step(self, store: EventStore, data: StepData | None, message: str = "") -> None:
        # Rebuilt when the step or its graphs change (a graph event comes once its backward
        # call returned, after that call's grad events), not on every new event.
        key = (
            None if data is None else data.step,
            -1 if data is None else len(data.graphs),
            self.by_module,
            None if self.node_filter is None else self.node_filter.pattern,
        )
        if key == self._shown and data is self.data:
            return
        same_step = data is not None and self.data is not None and data.step == self.data.step
        here = self.current_node_id() if same_step else None
        if data is not self.data or key[:2] != self._shown[:2]:
            self._hay.clear()
            self.matches = []
            self.match_at = -1
        self._shown = key
        self.store, self.data = store, data
        self.clear()
        self._branches.clear()
        self._items.clear()
        self._containers.clear()
        self._populated.clear()
        self._groups.clear()
        self._group_of.clear()
        self._group_keys.clear()
        self._group_order.clear()
        self._modules.clear()
        self._to_open.clear()
        self.norms = {}
        self.history = ([], {})
        self.model = None
        if data is None:
            self.root.add_leaf(Text(message or "no step selected", style="dim"))
            return
        if not data.graphs:
            text = "no backward graph in this step yet" if data.ops else "no backward graph"
            self.root.add_leaf(Text(text, style="dim"))
            return
        self.model = model = _Model(data.graphs)
        self.open_all = len(model.nodes) <= _OPEN_ALL
        if self.grouped:
            self.norms = module_norms.step_norms(data)
        for ci, graph in enumerate(data.graphs):
            nodes = graph.get("nodes") or []
            ran = sum(1 for n in nodes if isinstance(n, dict) and n.get("executed"))
            label = Text.assemble(
                (str(graph.get("call", "backward")), "bold"),
                f"  {plural(len(nodes), 'node')}, {ran} executed",
                (f", {len(nodes) - ran} not executed" if ran < len(nodes) else "", "yellow"),
                (f"  {source_cell(graph.get('source'))}", "dim"),
            )
            if self.grouped and "" in self.norms:
                label.append(f"  ∇ params {fnum(self.norms[''])} (step)", "bold")
            call = self.root.add(label, data={"kind": "call", "call": ci}, expand=True)
            if self.grouped:
                self._fill_modules(call, ci)
                continue
            roots = model.roots[ci]
            if len(roots) == 1:
                self._fill_chain(call, roots[0], 0)
            else:  # several roots (or unreachable nodes): one branch each
                for r in roots:
                    self._add_side(call, r)
        self._open_pending()
        if self.search is not None:  # the graph grew (or regrouped): its matches again
            self.matches = self._matching(self.search)
            self.match_at = -1
        # The cursor on a node (the detail shows the node under it): the one it was on when
        # the same step's graph grew, else the first.
        if here is None or not self.reveal(here):
            self._cursor_to_first()

    def _cursor_to_first(self) -> None:
        """The cursor on the first node in view (else the first entry: a module, a branch)."""
        first = None
        stack = list(reversed(self.root.children))
        while stack:
            item = stack.pop()
            kind = item.data.get("kind") if item.data else None
            if kind == "node":
                first = item
                break
            if first is None and kind in ("module", "branch"):
                first = item
            if item.is_expanded:
                stack.extend(reversed(item.children))
        if first is not None:
            self._tree_lines  # noqa: B018 - lay the lines out: items get their line
            self.move_cursor(first, animate=False)
            self.call_after_refresh(self._scroll_to_top, first)

    def _scroll_to_top(self, item: TreeNode[dict]) -> None:
        """With the cursor on the first node, the lines above it in view too (the cursor
        moved while the tree had no size yet scrolled them away)."""
        if self.cursor_node is item:
            self.scroll_to(0, 0, animate=False)
            self.scroll_to_node(item, animate=False)

    def _open_pending(self) -> None:
        """Fill and expand the items queued while the tree was built (a small graph opens
        with every branch expanded). A loop, not recursion: branches nest deeply."""
        while self._to_open:
            item = self._to_open.pop()
            self._populate(item)
            item.expand()

    def _label(self, key: Key) -> Text:
        assert self.model is not None and self.data is not None
        node = self.model.nodes[key]
        nid = key[1]
        data = self.data
        text = Text()
        executed = bool(node.get("executed"))
        text.append(str(node.get("name", "?")), "bold" if executed else "dim")
        text.append(f" node {nid}", "dim")
        grads = data.grads_of_node(nid)
        if executed:
            text.append(" ✓", "green")
        else:
            text.append(" not executed", "yellow")
        if grads and self.store is not None:
            go = self.store.event(grads[0]).get("grad_outputs") or []
            if go and isinstance(go[0], dict):
                stat = compact_stat(go[0])
                text.append(f"  ∇ {stat}", "red" if "NaN" in stat or "Inf" in stat else "")
        if node.get("param"):
            text.append(f"  {node['param']}", "cyan")
        op = data.op(node.get("op_seq")) if type(node.get("op_seq")) is int else None
        if op is not None:
            text.append(f"  ← {short_name(op.name)} #{op.seq}", "magenta")
            if op.module:
                text.append(f" {op.module}", "cyan")
        src = node.get("source") or (op.source if op is not None else None)
        if src:  # file:line (the detail has the full path)
            text.append(f"  {source_cell(src)}", "dim")
        return text

    def _add_link(self, parent: TreeNode[dict], key: Key) -> TreeNode[dict]:
        assert self.model is not None
        node = self.model.nodes[key]
        label = Text.assemble(
            ("↪ ", "dim"),
            str(node.get("name", "?")),
            (f" node {key[1]} (shown elsewhere)", "dim"),
        )
        return parent.add_leaf(label, data={"kind": "link", "key": key})

    def _add_item(self, parent: TreeNode[dict], key: Key, flow: bool = False) -> TreeNode[dict]:
        """A node's item; ``flow``: it continues a chain (drawn with ``↓``)."""
        assert self.model is not None
        expandable = bool(self.model.side.get(key) or self.model.links.get(key))
        data = {"kind": "node", "key": key, "flow": flow}
        item = parent.add(self._label(key), data=data, allow_expand=expandable)
        self._items[key] = item
        if expandable and self.open_all:
            self._to_open.append(item)
        return item

    def _fill_chain(self, container: TreeNode[dict], head: Key, start: int) -> None:
        """Show a window of at most _CHAIN_CAP nodes of the chain starting at ``head``."""
        assert self.model is not None
        chain = self.model.chains[head]
        for child in list(container.children):
            self._forget(child)
        container.remove_children()
        self._containers[head] = container
        start = max(0, min(start, len(chain) - 1))
        end = min(len(chain), start + _CHAIN_CAP)
        if start > 0:
            container.add_leaf(
                Text(f"… {start} earlier nodes (enter)", style="dim"),
                data={"kind": "window", "head": head, "start": max(0, start - _CHAIN_CAP)},
            )
        for i, key in enumerate(chain[start:end], start):
            self._add_item(container, key, flow=i > 0)
        if end < len(chain):
            container.add_leaf(
                Text(f"… {len(chain) - end} more nodes (enter)", style="dim"),
                data={"kind": "window", "head": head, "start": end},
            )

    def _forget(self, item: TreeNode[dict]) -> None:
        """Drop index entries of a subtree about to be removed."""
        stack = [item]
        while stack:
            node = stack.pop()
            data = node.data or {}
            if data.get("kind") == "node" and self._items.get(data["key"]) is node:
                del self._items[data["key"]]
            elif data.get("kind") == "branch":
                self._branches.pop(data["head"], None)
                self._containers.pop(data["head"], None)
            self._populated.discard(id(node))
            stack.extend(node.children)

    def _add_side(self, parent: TreeNode[dict], head: Key) -> None:
        """An input branch of a node: the node itself when its chain is one node long, else an
        entry that holds the chain (open from the start in a small graph, else on demand)."""
        assert self.model is not None
        chain = self.model.chains[head]
        if len(chain) == 1:
            self._add_item(parent, head)
            return
        first = self.model.nodes[head].get("name", "?")
        end = self.model.nodes[chain[-1]]
        label = Text.assemble(
            ("⤷ ", "dim"),
            f"{first} … {end.get('param') or end.get('name', '?')}",
            (f"  ({plural(len(chain), 'node')})", "dim"),
        )
        branch = parent.add(label, data={"kind": "branch", "head": head})
        self._branches[head] = branch
        if self.open_all:
            self._to_open.append(branch)

    def _populate(self, item: TreeNode[dict]) -> None:
        """Add what an item holds (once): a node's other inputs, or a branch's chain."""
        if id(item) in self._populated or self.model is None or not item.data:
            return
        kind = item.data.get("kind")
        if kind == "module":
            self._populate_module(item)
            return
        if kind == "branch":
            self._populated.add(id(item))
            self._fill_chain(item, item.data["head"], 0)
            return
        if kind != "node":
            return
        self._populated.add(id(item))
        key = item.data["key"]
        for s in self.model.side.get(key, ())[:_CHAIN_CAP]:
            self._add_side(item, s)
        for link in self.model.links.get(key, ())[:_CHAIN_CAP]:
            self._add_link(item, link)

    def on_tree_node_expanded(self, event: Tree.NodeExpanded[dict]) -> None:
        self._populate(event.node)

    def action_expand(self) -> None:
        node = self.cursor_node
        if node is not None and node.allow_expand and not node.is_expanded:
            self._populate(node)
            node.expand()

    def action_collapse(self) -> None:
        node = self.cursor_node
        if node is None:
            return
        if node.is_expanded and node.children:
            node.collapse()
        elif node.parent is not None and node.parent is not self.root:
            self.move_cursor(node.parent)

    # -- by module (M) -----------------------------------------------------------------------
    def module_of(self, key: Key) -> str:
        """The module a node belongs to: that of the op that created it; for a parameter's
        AccumulateGrad, the parameter's module; else ""."""
        assert self.model is not None
        node = self.model.nodes[key]
        data = self.data
        op = (
            data.op(node.get("op_seq"))
            if data is not None and type(node.get("op_seq")) is int
            else None
        )
        if op is not None and op.module:
            return op.module
        param = node.get("param")
        if isinstance(param, str) and param:
            return param.rpartition(".")[0]
        return ""

    def _fill_modules(self, call: TreeNode[dict], ci: int) -> None:
        """The module tree of one backward call (``blocks`` > ``blocks.0`` > ...): each module
        holds its submodules, then its own nodes (added when it is opened); siblings in
        forward order (the first op that made one of their nodes). A filter keeps the modules
        of the nodes it matches, all open."""
        assert self.model is not None and self.data is not None
        model = self.model
        keep = self.node_filter
        own: dict[str, list[Key]] = {}
        for key in model.display_order():
            if key[0] != ci or (keep is not None and not keep.search(self._haystack(key))):
                continue
            own.setdefault(self.module_of(key), []).append(key)
        count: dict[str, int] = {}
        ran: dict[str, int] = {}
        bad: dict[str, bool] = {}
        first: dict[str, float] = {}
        kids: dict[str | None, list[str]] = {}  # parent module (None: the call) -> modules
        for module, keys in own.items():
            n_ran = sum(1 for k in keys if model.nodes[k].get("executed"))
            n_bad = any(self._bad(k) for k in keys)
            seqs = [model.nodes[k].get("op_seq") for k in keys]
            at = min((q for q in seqs if type(q) is int), default=math.inf)
            path = module_norms.parents(module)[:-1] if module else [""]
            for i, m in enumerate(path):
                if m not in count:
                    count[m], ran[m], bad[m], first[m] = 0, 0, False, math.inf
                    kids.setdefault(path[i + 1] if i + 1 < len(path) else None, []).append(m)
                count[m] += len(keys)
                ran[m] += n_ran
                bad[m] = bad[m] or n_bad
                first[m] = min(first[m], at)
        for children in kids.values():
            children.sort(key=lambda m: (first[m], _natural(m)))
        norms = {m: self._module_norm(m) for m in count}
        scale: dict[int, float] = {}  # heat bars compare the modules at the same depth
        for m, n in norms.items():
            if n is not None and math.isfinite(n):
                d = _depth(m)
                scale[d] = max(scale.get(d, 0.0), n)
        history_keys = {m: module_norms.MODEL_OWN if m == "" else m for m in count}
        steps, history = (
            module_norms.norm_history(
                self.store, self.data.step, history_keys.values(), _SPARK_STEPS
            )
            if self.store is not None
            else ([], {})
        )
        self.history = (steps, history)
        at_step = steps.index(self.data.step) if self.data.step in steps else -1
        open_tree = keep is not None or len(count) <= _OPEN_MODULES
        parent_of = {m: p for p, children in kids.items() for m in children}
        width = {p: max(len(_module_name(m)) for m in ms) for p, ms in kids.items()}
        order: list[str] = []  # pre-order: as the tree shows them
        stack = list(reversed(kids.get(None, [])))
        while stack:
            m = stack.pop()
            order.append(m)
            stack.extend(reversed(kids.get(m, [])))
        for m in order:
            gid = (ci, m)
            parent = parent_of[m]
            holder = call if parent is None else self._modules[(ci, parent)]
            label = Text.assemble(
                _module_text(m, width[parent]),
                "  ",
                _heat_bar(norms[m], scale.get(_depth(m), 0.0)),
                (f" {fnum(norms[m])}" if norms[m] is not None else " no parameters", ""),
                _spark(history.get(history_keys[m]), at_step),
                (f"  {plural(count[m], 'node')}", "dim"),
                (f", {count[m] - ran[m]} not executed" if ran[m] < count[m] else "", "yellow"),
                ("  NaN/Inf" if bad[m] else "", "bold red"),
            )
            if m in kids:  # its own nodes in an entry after its submodules
                item = holder.add(label, data={"kind": "module", "group": gid, "holds": "modules"})
            else:
                item = self._groups[gid] = holder.add(label, data={"kind": "module", "group": gid})
            self._modules[gid] = item
            self._group_keys[gid] = own.get(m, [])
            for key in own.get(m, ()):
                self._group_of[key] = gid
            self._group_order.append(gid)
        for m in order:
            if m in kids and own.get(m):
                n = len(own[m])
                label = Text.assemble(
                    ("⋯ ", "dim"),
                    plural(n, "node"),
                    (f" in {m} itself", "dim"),
                )
                data = {"kind": "module", "group": (ci, m), "own": True}
                self._groups[(ci, m)] = self._modules[(ci, m)].add(label, data=data)
        # Open: with a filter, everything (every match in view); else the modules that hold
        # others (their own nodes stay in their closed entry), or the only module there is.
        top = kids.get(None, [])
        for m in order:
            gid = (ci, m)
            if m in kids and (open_tree or keep is not None):
                self._modules[gid].expand()
            if gid in self._groups and (keep is not None or len(top) == 1 == len(count)):
                self._populate_module(self._groups[gid])
                self._groups[gid].expand()

    def _module_norm(self, module: str) -> float | None:
        """The gradient norm of a module's parameters in the step (the model's own ones for
        the nodes of no module); None: it has none."""
        return self.norms.get(module_norms.MODEL_OWN if module == "" else module)

    def _bad(self, key: Key) -> bool:
        data = self.data
        if data is None:
            return False
        grads = data.grads_of_node(key[1])
        return bool(grads and grads[0].flags)

    def _populate_module(self, item: TreeNode[dict]) -> None:
        if id(item) in self._populated or not item.data or item.data.get("holds"):
            return
        self._populated.add(id(item))
        keys = self._group_keys.get(item.data["group"], [])
        for key in keys[:_CHAIN_CAP]:
            leaf = item.add_leaf(self._label(key), data={"kind": "node", "key": key})
            self._items[key] = leaf
        if len(keys) > _CHAIN_CAP:
            item.add_leaf(
                Text(f"… {len(keys) - _CHAIN_CAP} more nodes (/ finds them)", style="dim"),
                data={"kind": "more"},
            )

    @property
    def grouped(self) -> bool:
        """Nodes shown by module (``M``, or a filter: a filtered graph has no chains)."""
        return self.by_module or self.node_filter is not None

    def set_filter(self, pattern: re.Pattern[str] | FieldPattern | None) -> int:
        """``|`` in the graph: only the nodes ``pattern`` matches (name, node id, parameter,
        op, module, source), by module, all in view; None: the whole graph again. Returns
        how many nodes it keeps."""
        here = self.current_node_id()
        self.node_filter = pattern
        if self.store is not None:
            self.set_step(self.store, self.data)
        if here is not None:
            self.reveal(here)
        if pattern is None or self.model is None:
            return 0
        return self.shown_count()

    def shown_count(self) -> int:
        """Nodes in the module groups (with a filter: the nodes it kept)."""
        return sum(len(keys) for keys in self._group_keys.values())

    def toggle_grouping(self) -> bool:
        """M: modules ⇄ chains, keeping the node under the cursor. Returns the new mode."""
        here = self.current_node_id()
        self.by_module = not self.by_module
        if self.store is not None:
            self.set_step(self.store, self.data)
        if here is not None:
            self.reveal(here)
        return self.by_module

    # -- search (/ in the graph) -------------------------------------------------------------
    def _haystack(self, key: Key) -> str:
        hay = self._hay.get(key)
        if hay is None:
            assert self.model is not None
            node = self.model.nodes[key]
            data = self.data
            op = (
                data.op(node.get("op_seq"))
                if data is not None and type(node.get("op_seq")) is int
                else None
            )
            hay = "\n".join(
                (
                    str(node.get("name", "")),
                    f"node {key[1]}",
                    str(node.get("param") or ""),
                    op.name if op is not None else "",
                    self.module_of(key),
                    str(node.get("source") or (op.source if op is not None else "")),
                )
            )
            self._hay[key] = hay
        return hay

    def set_search(self, pattern: re.Pattern[str] | FieldPattern | None) -> int:
        """Search the nodes (name, node id, parameter, op, module, source): the matches in
        the order the tree shows them; the cursor goes to the first. Returns how many."""
        self.search = pattern
        self.matches = []
        self.match_at = -1
        if pattern is None or self.model is None:
            return 0
        self.matches = self._matching(pattern)
        if self.matches:
            self.match_at = 0
            self._reveal_and_move(self.matches[0])
        return len(self.matches)

    def _matching(self, pattern: re.Pattern[str] | FieldPattern) -> list[Key]:
        if self.model is None:
            return []
        order = self.model.display_order()
        if self.grouped:
            order = [k for gid in self._group_order for k in self._group_keys.get(gid, ())]
        return [k for k in order if pattern.search(self._haystack(k))]

    def next_match(self, direction: int) -> tuple[int, int, bool] | None:
        """The next (1) or previous (-1) match, wrapping: (position, count, wrapped)."""
        if not self.matches:
            return None
        n = len(self.matches)
        i = self.match_at + direction
        wrapped = not 0 <= i < n
        self.match_at = i % n
        self._reveal_and_move(self.matches[self.match_at])
        return self.match_at + 1, n, wrapped

    def _reveal_and_move(self, key: Key) -> None:
        item = self._reveal_key(key)
        if item is not None:
            self._tree_lines  # noqa: B018
            self.move_cursor(item, animate=False)
            self.call_after_refresh(self._scroll_to_item, item)

    # -- navigation --------------------------------------------------------------------------
    def _reveal_key(self, key: Key) -> TreeNode[dict] | None:
        model = self.model
        if model is None or key not in model.nodes:
            return None
        found = self._items.get(key)
        if found is not None:
            return found
        if self.grouped:
            where = self._group_of.get(key)
            group = self._groups.get(where) if where is not None else None
            if group is None:
                return None
            self._populate_module(group)
            up: TreeNode[dict] | None = group
            while up is not None and up is not self.root:  # the modules above it open too
                up.expand()
                up = up.parent
            return self._items.get(key)
        head = model.head.get(key)
        if head is None:
            return None
        container = self._containers.get(head)
        if container is None:
            holder = model.holder.get(head)
            if not isinstance(holder, tuple):
                return None
            parent_item = self._reveal_key(holder)
            if parent_item is None:
                return None
            self._populate(parent_item)
            parent_item.expand()
            branch = self._branches.get(head)
            if branch is None:  # a one-node side branch: an item of the parent
                return self._items.get(key)
            self._populate(branch)
            branch.expand()
            container = branch
        found = self._items.get(key)
        if found is None:  # outside the window: move the window
            self._fill_chain(container, head, model.index[key] - _CHAIN_CAP // 2)
            self._open_pending()
            found = self._items.get(key)
        return found

    def reveal(self, node_id: int) -> bool:
        """Expand down to the node with this id and put the cursor on it."""
        if self.model is None:
            return False
        for key in self.model.by_id.get(node_id, ()):
            item = self._reveal_key(key)
            if item is not None:
                # Node lines are laid out lazily; build them so the item has its line number.
                self._tree_lines  # noqa: B018
                self.move_cursor(item, animate=False)
                self.call_after_refresh(self._scroll_to_item, item)
                return True
        return False

    def _scroll_to_item(self, item: TreeNode[dict]) -> None:
        if self.cursor_node is item:
            self.scroll_to_node(item, animate=False)

    def node_at_cursor(self) -> tuple[dict, Event | None] | None:
        """(graph node map, graph event) under the cursor, following links."""
        item = self.cursor_node
        if item is None or not item.data or self.model is None:
            return None
        kind = item.data.get("kind")
        if kind in ("node", "link"):
            key = item.data["key"]
            return self.model.nodes[key], self.model.graphs[key[0]]
        return None

    def current_node_id(self) -> int | None:
        hit = self.node_at_cursor()
        return hit[0].get("id") if hit else None

    def on_tree_node_selected(self, event: Tree.NodeSelected[dict]) -> None:
        data: Any = event.node.data
        if not data:
            return
        kind = data.get("kind")
        if kind == "window":
            event.stop()
            container = event.node.parent
            if container is not None:
                self._fill_chain(container, data["head"], data["start"])
                self._open_pending()
                self._tree_lines  # noqa: B018
                first = next(
                    (c for c in container.children if c.data and c.data.get("kind") == "node"),
                    None,
                )
                if first is not None:
                    self.move_cursor(first)
        elif kind == "link":
            event.stop()
            self.reveal(data["key"][1])
        elif kind in ("branch", "module"):
            event.stop()
            self._populate(event.node)
            event.node.toggle()
