"""The import graph of `splitserve/`: no cycles, and no module past the size the style allows.

What counts as an edge A -> B (B a module of splitserve; `from pkg import name` is an edge to the
submodule `pkg.name` when there is one, else to `pkg`, i.e. its `__init__`; when `pkg` is a package it is
an edge to `pkg` as well, since the name is read off the package: if `pkg/__init__.py` imports A, that
is a cycle through the `__init__`):
  - runtime imports: at module level, and inside functions (a deferred import is how a cycle hides;
    it still runs, in the order of whoever calls first). These must form no cycle at all.
  - type-only imports (under `if TYPE_CHECKING:`). They never run, but a cycle among them is still two
    modules that each need the other to be read; the few left are listed in TYPE_ONLY_CYCLES with
    what would remove them. A new one fails, and so does a listed one that no longer exists (drop it
    from the list).
Layer rules (one package per process): the router imports no engine, core, model, transport or kernel
code and no worker code; the worker front end no router code; the engine core no router or worker code
and no HTTP framework. A module breaks a rule by what it imports itself (at module level, inside a
function or for type checking) and by everything those imports load in turn (their module-level
imports and the `__init__` of every package on the way).
Static (ast): nothing is imported, so the test takes well under a second.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "splitserve"
MAX_LINES = 400  # STYLE.md: past this a module must be split
# Modules still past MAX_LINES, each with what splits it. Shrink this list; never grow it.
TOO_LONG: dict[str, str] = {}
# Cycles among type-only imports (sets of modules), with what removes each.
TYPE_ONLY_CYCLES: dict[frozenset[str], str] = {}
HTTP_FRAMEWORKS = ("fastapi", "starlette", "uvicorn", "aiohttp", "httpx")
# What each process's package may not import (prefixes of module names, splitserve's or third parties').
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "splitserve.router": (
        "splitserve.engine",
        "splitserve.core",
        "splitserve.model",
        "splitserve.transport",
        "splitserve.kernels",
        "splitserve.worker",
    ),
    "splitserve.worker": ("splitserve.router",),
    "splitserve.core": ("splitserve.router", "splitserve.worker", *HTTP_FRAMEWORKS),
}
# Imports that still break a layer rule, as (importing module, forbidden module), each with what would
# remove it. Shrink this list; never grow it.
ALLOWED: dict[tuple[str, str], str] = {}


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


def _statements(module: str, path: Path) -> list[tuple[str, str | None, str]]:
    """(imported name, the package a `from` import reads it off or None, how) for every import statement
    in `path`; how: "top" (module level), "deferred" (inside a function) or "type" (under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, str | None, str]] = []

    def visit(node: ast.AST, how: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for stmt in child.body:
                    visit_stmt(stmt, "type")
                for stmt in child.orelse:
                    visit_stmt(stmt, how)
                continue
            visit_stmt(child, how)

    def visit_stmt(node: ast.AST, how: str) -> None:
        if isinstance(node, ast.Import):
            found.extend((a.name, None, how) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found.extend((f"{base}.{a.name}", base, how) for a in node.names)
        inner = (
            "deferred" if how == "top" and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else how
        )
        visit(node, inner)

    visit(tree, "top")
    return found


def _is_package(name: str) -> bool:
    return name in MODULES and MODULES[name].name == "__init__.py"


def _imports(module: str, path: Path) -> list[tuple[str, bool]]:
    """(imported splitserve module, type-only?) for every import statement in `path`."""
    out = []
    for name, base, how in _statements(module, path):
        if not name.startswith("splitserve"):
            continue
        targets = {_resolve(name)}
        if base is not None and _is_package(base):  # `from pkg import name` reads `name` off pkg/__init__
            targets.add(base)
        out.extend((t, how == "type") for t in targets if t is not None and t != module)
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
    assert "splitserve.transport.channel" in runtime["splitserve.transport.stream.tcp"]  # module level
    assert "splitserve.worker.app" in runtime["splitserve.worker.main"]  # inside a function
    # `from splitserve.router import endpoints`: the submodule, and the package it is read off
    assert {"splitserve.router.endpoints", "splitserve.router"} <= runtime["splitserve.router.routes"]
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


def _loads(module: str) -> set[str]:
    """What importing `module` loads: its module-level imports, theirs in turn, and the `__init__` of every
    package on the way (splitserve's modules and third parties' top-level names)."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name not in MODULES:
            continue
        todo.extend(_parents(name))
        for imported, _, how in _statements(name, MODULES[name]):
            if how == "top":
                todo.append(_target(imported))
    return seen


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _target(imported: str) -> str:
    """The splitserve module an imported name is (or lives in); a third party's top-level package."""
    if imported.startswith("splitserve"):
        return _resolve(imported) or "splitserve"
    return imported.split(".")[0]


def _breaks(module: str, forbidden: tuple[str, ...]) -> dict[str, str]:
    """The forbidden packages `module` reaches, each with the path: its own import -> the module reached."""
    out: dict[str, str] = {}
    for imported, _, _ in _statements(module, MODULES[module]):
        direct = _target(imported)
        for reached in sorted(_loads(direct) | set(_parents(direct))):
            for bad in forbidden:
                if reached == bad or reached.startswith(bad + "."):
                    out.setdefault(bad, f"{direct} -> {reached}" if reached != direct else direct)
    return out


def _layer_violations() -> list[tuple[str, str, str]]:
    found = []
    for module in sorted(MODULES):
        for layer, forbidden in FORBIDDEN.items():
            if module == layer or module.startswith(layer + "."):
                found.extend((module, bad, path) for bad, path in _breaks(module, forbidden).items())
    return found


def test_the_layer_rules_see_deep_imports():
    # a sanity check of the layer walk: loading a module loads its package's __init__ and what that loads
    assert "splitserve.transport.channel" in _loads("splitserve.transport.stream.tcp")
    assert "splitserve.config" in _loads("splitserve.config.worker")  # its package's __init__
    # which loads the manifest (pydantic) lazily: an engine core and a front end read only their config
    assert "splitserve.config.manifest" not in _loads("splitserve.config.worker")
    assert "torch" in _loads("splitserve.engine.engine") and "fastapi" in _loads("splitserve.router.routes")


def test_each_process_imports_only_its_layers():
    found = _layer_violations()
    new = [f"{m} imports {bad} ({path})" for m, bad, path in found if (m, bad) not in ALLOWED]
    assert not new, "layer rules broken:\n  " + "\n  ".join(new)
    gone = sorted(set(ALLOWED) - {(m, bad) for m, bad, _ in found})
    assert not gone, f"these imports are gone: drop them from ALLOWED: {gone}"
