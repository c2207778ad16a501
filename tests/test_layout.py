"""The package's layout rules, read from the source (every import counts: module level, inside
functions, under TYPE_CHECKING): dependencies point inward to ``protocol``, and no two modules
of ``protocol`` or ``tracer`` need each other, directly or round a longer circle."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

import torchscope

PACKAGE = pathlib.Path(torchscope.__file__).parent


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p) for p in PACKAGE.rglob("*.py")}


def imports_of(path: pathlib.Path) -> set[str]:
    """Every torchscope module ``path`` imports, wherever the import statement stands
    (``from torchscope.tracer import agent``: the module ``torchscope.tracer.agent``)."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base)
    return {m for m in found if m == "torchscope" or m.startswith("torchscope.")}


def graph_of(subpackage: str) -> dict[str, set[str]]:
    modules = {module_name(p): p for p in (PACKAGE / subpackage).rglob("*.py")}
    return {name: imports_of(path) & modules.keys() - {name} for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_two_modules_need_each_other() -> None:
    """Anywhere in the package, the top-level ``torchscope`` included; an import under
    TYPE_CHECKING or inside a function is an edge all the same (``imports_of``)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: imports_of(path) & modules.keys() - {name} for name, path in modules.items()}
    assert cycles(graph) == []


def test_imports_under_type_checking_count() -> None:
    """screens/host.py names the lanes' types only under TYPE_CHECKING: an edge all the same."""
    assert "torchscope.tui.lanes" in imports_of(PACKAGE / "tui" / "screens" / "host.py")


MAIN = "torchscope.tui.screens.main"


def main_screen_parts() -> list[pathlib.Path]:
    """The main screen's parts: every module beside screen.py but the shared context."""
    return [
        p
        for p in sorted((PACKAGE / "tui" / "screens" / "main").glob("*.py"))
        if p.name not in ("screen.py", "__init__.py", "context.py")
    ]


def test_the_main_screens_parts_never_import_the_screen() -> None:
    """screen.py holds the keys and the layout and hands its parts what they use; a part that
    imported the screen (or its package, which imports it) would see all of it."""
    parts = main_screen_parts()
    assert len(parts) >= 10
    wrong = {
        f"{module_name(p)} -> {m}"
        for p in parts
        for m in imports_of(p)
        if m in (MAIN, f"{MAIN}.screen")
    }
    assert wrong == set()


def test_each_part_of_the_main_screen_sees_a_narrow_screen() -> None:
    """Every part declares what it uses of the screen as its own protocol (on top of the
    three members of ``ScreenCore`` that all of them use), and imports no other part: what it
    needs of another part it reaches through a screen method its protocol names, or is
    handed."""
    wrong: set[str] = set()
    for path in main_screen_parts():
        name = path.stem
        protocols = [c for c in ast.walk(ast.parse(path.read_text())) if is_protocol(c)]
        if not protocols:
            wrong.add(f"{name} declares no protocol of the screen")
        wrong |= {
            f"{name} -> {m}"
            for m in imports_of(path)
            if m.startswith(f"{MAIN}.") and m != f"{MAIN}.context"
        }
    core = next(
        c
        for c in ast.walk(ast.parse((PACKAGE / "tui/screens/main/context.py").read_text()))
        if is_protocol(c)
    )
    assert len(protocol_members(core)) <= 3
    assert wrong == set()


def test_a_parts_protocol_names_only_what_the_part_uses() -> None:
    """A member a part declares but never reads is width nobody needs: it would let the part
    grow into the screen again unseen."""
    unused = {
        f"{path.stem}.{member}"
        for path in main_screen_parts()
        for member in unused_members(ast.parse(path.read_text()))
    }
    assert unused == set()


def unused_members(tree: ast.Module) -> set[str]:
    """``Protocol.member`` for each member of a protocol in ``tree`` read nowhere outside it."""
    protocols = [c for c in ast.walk(tree) if is_protocol(c)]
    inside = {id(n) for c in protocols for n in ast.walk(c)}
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and id(n) not in inside}
    return {f"{c.name}.{m}" for c in protocols for m in protocol_members(c) - used}


def is_protocol(node: ast.AST) -> bool:
    return isinstance(node, ast.ClassDef) and any(
        isinstance(b, ast.Name) and b.id == "Protocol" for b in node.bases
    )


def protocol_members(node: ast.ClassDef) -> set[str]:
    return {
        n.target.id if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) else n.name
        for n in node.body
        if isinstance(n, ast.FunctionDef)
        or (isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name))
    }


def test_the_unused_member_check_finds_one() -> None:
    tree = ast.parse(
        "class S(Protocol):\n    a: int\n    def b(self) -> None: ...\n"
        "def f(s: S) -> int:\n    return s.a\n"
    )
    assert unused_members(tree) == {"S.b"}


# Sizes a reader can hold: a class of the tracer, a file of the UI.
MAX_TRACER_CLASS_LINES = 600
MAX_TUI_FILE_LINES = 1200


def test_no_class_of_the_tracer_is_too_long_to_read() -> None:
    long = {
        f"{module_name(p)}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for p in (PACKAGE / "tracer").rglob("*.py")
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.ClassDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_TRACER_CLASS_LINES
    }
    assert long == set()


def test_no_file_of_the_ui_is_too_long_to_read() -> None:
    long = {
        f"{module_name(p)}: {n} lines"
        for p in (PACKAGE / "tui").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_TUI_FILE_LINES
    }
    assert long == set()


def test_the_cycle_finder_finds_a_circle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_protocol_imports_nothing_of_torchscope_outside_it() -> None:
    outside = {
        f"{module_name(p)} -> {m}"
        for p in (PACKAGE / "protocol").rglob("*.py")
        for m in imports_of(p)
        if m != "torchscope.protocol" and not m.startswith("torchscope.protocol.")
    }
    assert outside == set()


@pytest.mark.parametrize(
    ("subpackage", "allowed"),
    [
        ("tracer", ("protocol", "tracer", "analysis")),
        ("tui", ("protocol", "tui", "analysis", "session")),
        ("session", ("protocol", "analysis", "session")),
    ],
)
def test_dependencies_point_inward(subpackage: str, allowed: tuple[str, ...]) -> None:
    """The tracer never imports the UI, the UI never the tracer (it runs without torch); the
    session layer imports neither front end."""
    ok = tuple(f"torchscope.{a}" for a in allowed)
    wrong = {
        f"{module_name(p)} -> {m}"
        for p in (PACKAGE / subpackage).rglob("*.py")
        for m in imports_of(p)
        if not any(m == o or m.startswith(o + ".") for o in ok) and m != "torchscope"
    }
    assert wrong == set()


# The session layer, free of textual (and torch): what both front ends, the terminal UI and
# ``torchscope mcp``, know about a session (its rows, search and filter, the stepper's view,
# its step counts), so the two agree.
SESSION = ("session",)


def _files_of(dotted: str) -> list[pathlib.Path]:
    """The source files of a module or of a package (all of it)."""
    path = PACKAGE / dotted.replace(".", "/")
    return sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")]


def _external_imports(path: pathlib.Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_mcp_reads_only_the_protocol_analysis_and_the_session_layer() -> None:
    """The MCP server runs where the UI does (no torch): it imports the protocol, the analysis
    and the session layer, never the tracer, the CLI or the terminal UI."""
    ok = tuple(f"torchscope.{a}" for a in ("protocol", "analysis", "mcp", *SESSION))
    mcp = list((PACKAGE / "mcp").rglob("*.py"))
    assert mcp
    wrong = {
        f"{module_name(p)} -> {m}"
        for p in mcp
        for m in imports_of(p)
        if not any(m == o or m.startswith(o + ".") for o in ok) and m != "torchscope"
    }
    assert wrong == set()
    heavy = {
        f"{module_name(p)} -> {m}"
        for p in [*mcp, *(f for d in SESSION for f in _files_of(d))]
        for m in _external_imports(p)
        if m in ("torch", "textual", "rich", "numpy")
    }
    assert heavy == set()


def test_the_session_layer_needs_no_front_end_textual_or_torch() -> None:
    """The session layer is what a source feeds and a screen or an MCP tool reads: it imports
    neither front end, nor textual or torch."""
    layer = list((PACKAGE / "session").rglob("*.py"))
    assert layer
    wrong = {
        f"{module_name(p)} -> {m}"
        for p in layer
        for m in imports_of(p)
        if m.startswith(("torchscope.tui", "torchscope.mcp", "torchscope.tracer"))
    }
    heavy = {
        f"{module_name(p)} -> {m}"
        for p in layer
        for m in _external_imports(p)
        if m in ("torch", "textual", "rich", "numpy")
    }
    assert wrong == set() and heavy == set()


def test_the_two_front_ends_never_import_each_other() -> None:
    """The terminal UI and the MCP server share the session layer, not each other's code."""
    wrong = {
        f"{module_name(p)} -> {m}"
        for a, b in (("tui", "mcp"), ("mcp", "tui"))
        for p in (PACKAGE / a).rglob("*.py")
        for m in imports_of(p)
        if m == f"torchscope.{b}" or m.startswith(f"torchscope.{b}.")
    }
    assert wrong == set()


_BROAD = re.compile(
    r"except (Exception|BaseException)( as \w+)?:|suppress\((Exception|BaseException)\)"
)
_REPORTS = re.compile(
    r"\b(say|_say|print|report|record|error|warn|notify|log)\w*\(|\braise\b|\bexc\b"
)


def test_every_broad_handler_says_why_or_reports() -> None:
    """A handler that catches everything either reports what it caught, re-raises, or says in
    a comment (on its line, the line before or its first line) why nothing is lost."""
    silent = []
    for p in PACKAGE.rglob("*.py"):
        lines = p.read_text().splitlines()
        for i, line in enumerate(lines):
            if not _BROAD.search(line):
                continue
            near = [line, lines[i - 1].strip() if i else "", *lines[i + 1 : i + 2]]
            if any("#" in x for x in near) or _REPORTS.search(" ".join(lines[i + 1 : i + 4])):
                continue
            silent.append(f"{module_name(p)}:{i + 1}: {line.strip()}")
    assert silent == []
