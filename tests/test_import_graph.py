"""The import graph of `splitserve/`: no cycles, and no module past the size the style allows.

What counts as an edge A -> B (B a module of splitserve; `from pkg import name` is an edge to the
submodule `pkg.name` when there is one, else to `pkg`, i.e. its `__init__`):
  - runtime imports: at module level, and inside functions (a deferred import is how a cycle hides;
    it still runs, in the order of whoever calls first). These must form no cycle at all.
  - type-only imports (under `if TYPE_CHECKING:`). They never run, but a cycle among them is still two
    modules that each need the other to be read; the few left are listed in TYPE_ONLY_CYCLES with
    what would remove them. A new one fails, and so does a listed one that no longer exists (drop it
    from the list).
Static (ast): nothing is imported, so the test takes well under a second.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "splitserve"
MAX_LINES = 500  # STYLE.md aims at ~400; past this a module must be split
# Modules still past MAX_LINES, each with what splits it. Shrink this list; never grow it.
TOO_LONG: dict[str, str] = {}
# Cycles among type-only imports (sets of modules), with what removes each.
TYPE_ONLY_CYCLES: dict[frozenset[str], str] = {}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> list[tuple[str, bool]]:
    """(imported splitserve module, type-only?) for every import statement in `path`."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for stmt in child.body:
                    visit_stmt(stmt, True)
                for stmt in child.orelse:
                    visit_stmt(stmt, type_only)
                continue
            visit_stmt(child, type_only)

    def visit_stmt(node: ast.AST, type_only: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend((a.name, type_only) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found.extend((f"{base}.{a.name}", type_only) for a in node.names)
        visit(node, type_only)

    visit(tree, False)
    out = []
    for name, type_only in found:
        target = _resolve(name) if name.startswith("splitserve") else None
        if target is not None and target != module:
            out.append((target, type_only))
    return out


def _graph(with_type_only: bool) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        for target, type_only in _imports(module, path):
            if with_type_only or not type_only:
                graph[module].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[frozenset[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(frozenset(component))
    return out


def _short(component: frozenset[str]) -> frozenset[str]:
    return frozenset(m.removeprefix("splitserve.") for m in component)


def _describe(component: frozenset[str], graph: dict[str, set[str]]) -> str:
    edges = [f"{a} -> {b}" for a in sorted(component) for b in sorted(graph[a]) if b in component]
    return "; ".join(e.replace("splitserve.", "") for e in edges)


def test_the_graph_sees_the_imports():
    # a sanity check of the parser: known edges of each kind are found
    edges = dict.fromkeys(MODULES, None)
    assert "splitserve.transport.channel" in edges and "splitserve" in edges
    runtime = _graph(with_type_only=False)
    assert "splitserve.transport.channel" in runtime["splitserve.transport.tcp"]  # module level
    assert "splitserve.worker.app" in runtime["splitserve.worker.main"]  # inside a function
    assert "splitserve.engine.engine" in _graph(with_type_only=True)["splitserve.engine.kv_connector"]


def test_no_import_cycles_at_run_time():
    graph = _graph(with_type_only=False)
    cycles = _cycles(graph)
    assert not cycles, "import cycles: " + " | ".join(_describe(c, graph) for c in cycles)


def test_type_only_cycles_are_the_known_few():
    graph = _graph(with_type_only=True)
    found = {_short(c): c for c in _cycles(graph)}
    new = [_describe(c, graph) for short, c in found.items() if short not in TYPE_ONLY_CYCLES]
    assert not new, "new import cycles (through TYPE_CHECKING imports): " + " | ".join(new)
    gone = [sorted(c) for c in TYPE_ONLY_CYCLES if c not in found]
    assert not gone, f"these cycles are gone: drop them from TYPE_ONLY_CYCLES: {gone}"


@pytest.mark.parametrize("path", sorted(MODULES.values()), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_size(path: Path):
    name = str(path.relative_to(ROOT))
    lines = len(path.read_text().splitlines())
    if name in TOO_LONG:
        assert lines > MAX_LINES, f"{name} is {lines} lines now: drop it from TOO_LONG"
        return
    assert lines <= MAX_LINES, f"{name} is {lines} lines (at most {MAX_LINES}): split it by responsibility"
