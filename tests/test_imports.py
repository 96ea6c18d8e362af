"""The import graph of mdsl, read from the source (every `import` and `from ... import`, at module level and
inside functions): no cycles inside mdsl, and the two backends never import each other (both are emitters
of mdsl.lowering's lowered form, run by mdsl.gpu)."""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mdsl"

#: packages whose private names nobody outside imports, and which import no private name from elsewhere
PRIVATE_CHECKED = ("mdsl.backend", "mdsl.lowering", "mdsl.gpu")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.lru_cache(maxsize=None)
def _modules() -> dict:
    """Module name -> its source file, for every module of mdsl."""
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imported(node: ast.AST, module: str, is_package: bool, known: dict) -> list:
    """The mdsl modules an import statement of `module` imports."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in known]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:   # relative: from the module's package (or the package itself)
        base = module.split(".")
        base = base[:len(base) - node.level + (1 if is_package else 0)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    # `from package import submodule` depends on the submodule; any other name, on the module it is in
    submodules = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known]
    others = target in known and len(submodules) < len(node.names)
    return submodules + ([target] if others else [])


@functools.lru_cache(maxsize=None)
def _trees() -> dict:
    """Module name -> (its syntax tree, whether it is a package's __init__)."""
    return {name: (ast.parse(path.read_text(encoding="utf-8"), filename=str(path)), path.name == "__init__.py")
            for name, path in _modules().items()}


@functools.lru_cache(maxsize=None)
def import_graph() -> dict:
    """Module name -> the set of mdsl modules it imports (anywhere in its source)."""
    known = _modules()
    graph = {}
    for name, (tree, is_package) in _trees().items():
        graph[name] = {m for node in ast.walk(tree) for m in _imported(node, name, is_package, known) if m != name}
    return graph


def cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []

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
                out.append(tuple(sorted(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def _path(graph: dict, start: str) -> list:
    """One cycle through `start`, as the modules along it (for the failure message)."""
    parents, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    path = [v]
                    while parents[path[-1]] is not None:
                        path.append(parents[path[-1]])
                    return list(reversed(path)) + [start]
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    return []


def test_the_graph_sees_module_and_function_level_imports():
    graph = import_graph()
    assert "mdsl.lowering.kernel" in graph["mdsl.backend.cuda.block"]          # module level
    assert "mdsl.search.variants" in graph["mdsl.backend.cuda.autotune"]       # inside a function
    assert "mdsl.backend.cuda" not in graph["mdsl.gpu.generators"]             # named in a string only


def test_the_cycles_are_the_strongly_connected_components():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e", "d"}}
    assert cycles(graph) == [("a", "b", "c")]
    assert _path(graph, "b") == ["b", "c", "a", "b"]


def test_no_import_cycles_inside_mdsl():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles inside mdsl:\n" + "\n".join(
        f"  {' -> '.join(_path(graph, c[0]))}  (component: {', '.join(c)})" for c in found)


@pytest.mark.parametrize("importer, imported", [("mdsl.backend.ptx", "mdsl.backend.cuda"),
                                                ("mdsl.backend.cuda", "mdsl.backend.ptx")])
def test_the_backends_do_not_import_each_other(importer, imported):
    graph = import_graph()
    crossing = sorted(f"{m} imports {i}" for m, deps in graph.items() if m == importer or m.startswith(importer + ".")
                      for i in deps if i == imported or i.startswith(imported + "."))
    assert not crossing, "\n".join(crossing)


@pytest.mark.parametrize("package", ["mdsl.backend.cuda", "mdsl.backend.ptx"])
def test_the_backends_import_the_lowering_and_the_runtime_and_nothing_of_another_backend(package):
    graph = import_graph()
    other = {"mdsl.backend.cuda": "mdsl.backend.ptx", "mdsl.backend.ptx": "mdsl.backend.cuda"}[package]
    lowering = {i for m, deps in graph.items() if m.startswith(package) for i in deps if i.startswith("mdsl.lowering")}
    assert lowering, f"{package} does not emit mdsl.lowering's lowered form"
    assert not any(i.startswith(other) for m, deps in graph.items() if m.startswith(package) for i in deps)


def test_the_lowering_and_the_runtime_import_no_backend_emitter():
    graph = import_graph()
    emitters = ("mdsl.backend.cuda", "mdsl.backend.ptx")
    bad = sorted(f"{m} imports {i}" for m, deps in graph.items() if m.startswith(("mdsl.lowering", "mdsl.gpu"))
                 for i in deps if i.startswith(emitters))
    assert not bad, "\n".join(bad)


def test_no_private_names_are_imported_across_packages():
    """`from a.b import _name` only inside a.b's own package, where the importer or a.b is in PRIVATE_CHECKED."""
    known = _modules()
    bad = []
    for name, (tree, is_package) in _trees().items():
        package = name if is_package else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("mdsl"):
                source_package = node.module if node.module in known and (
                    known[node.module].name == "__init__.py") else node.module.rpartition(".")[0]
                checked = name.startswith(PRIVATE_CHECKED) or node.module.startswith(PRIVATE_CHECKED)
                for a in node.names:
                    private = a.name.startswith("_") and not a.name.startswith("__")
                    if checked and private and source_package != package:
                        bad.append(f"{name} imports {node.module}.{a.name}")
    assert not bad, "\n".join(sorted(bad))
