"""No import cycles between the project's own modules (issue 33).

The graph is built from the source with `ast`, nothing is imported: every `import` and
`from ... import` anywhere in a module counts (module level, under `if TYPE_CHECKING:`, inside
functions), since a function-local import only hides a cycle until someone moves it. The
generated protobuf stubs are left out.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (directory scanned, directory its module names are relative to)
SOURCE_TREES = [
    (ROOT / "services", ROOT),
    (ROOT / "kernels", ROOT),
    (ROOT / "clients/python/pagedserve_client", ROOT / "clients/python"),
]


def _is_generated(path: Path) -> bool:
    return "pb" in path.parts or path.name.endswith(("_pb2.py", "_pb2_grpc.py"))


def _module_name(path: Path, base: Path) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every .py of the scanned trees, generated ones included."""
    modules: dict[str, Path] = {}
    for tree, base in SOURCE_TREES:
        for path in sorted(tree.rglob("*.py")):
            modules[_module_name(path, base)] = path
    return modules


def _imported_modules(module: str, path: Path, known: set[str]) -> set[str]:
    """Modules of `known` that `module` (defined in `path`) imports, at any depth of its AST.

    `from pkg import name` is the submodule pkg.name when that is in `known`, else pkg.
    """
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, node.module] if node.module else anchor)
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return found & known


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of the tree it imports; generated stubs are neither nodes nor
    targets (an import of a stub is not an import of the package that holds it)."""
    everything = source_modules()
    modules = {name: path for name, path in everything.items()
               if not _is_generated(path.relative_to(ROOT))}
    return {name: _imported_modules(name, path, set(everything)) & set(modules)
            for name, path in modules.items()}


def find_cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of size > 1, plus self-imports, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    cycles: list[list[str]] = []
    nodes = sorted(set(graph) | {m for targets in graph.values() for m in targets})

    def successors(node: str) -> list[str]:
        return sorted(graph.get(node, ()))

    for root in nodes:
        if root in index:
            continue
        # Iterative DFS (the real graph is deep enough to worry about the recursion limit).
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work = [(root, iter(successors(root)))]
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(successors(child))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.get(node, ()):
                    cycles.append(sorted(component))
    return sorted(cycles)


def test_find_cycles_on_a_synthetic_graph():
    assert find_cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert find_cycles({"a": {"a"}, "b": {"c"}, "c": {"d"}, "d": {"b"}}) == [["a"],
                                                                               ["b", "c", "d"]]


def test_imports_are_found_anywhere_and_resolved(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    source = pkg / "mod.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "import os\n"
        "from . import sub\n"  # a relative import of a submodule
        "from .other import helper\n"  # a name of a module: the module
        "from pkg import helper_pkg_name\n"  # a name of the package: the package
        "if TYPE_CHECKING:\n"
        "    from pkg.typed import T\n"
        "def f():\n"
        "    import pkg.lazy.deep\n"  # a function-local import
        "    from ..outside import x\n")  # above the package: not a module of the tree
    known = {"pkg", "pkg.mod", "pkg.sub", "pkg.other", "pkg.typed", "pkg.lazy",
             "pkg.lazy.deep"}
    found = _imported_modules("pkg.mod", source, known)
    assert found == {"pkg", "pkg.sub", "pkg.other", "pkg.typed", "pkg.lazy.deep"}


def test_the_real_graph_leaves_the_generated_stubs_out():
    graph = import_graph()
    assert {"services.router.server", "kernels", "pagedserve_client"} <= set(graph)
    assert not any(".pb." in m or m.endswith(("_pb2", "_pb2_grpc")) for m in graph)
    assert all(target in graph for targets in graph.values() for target in targets)
    assert "services.router.openai.http" in graph["services.router.server"]


def test_no_import_cycles():
    graph = import_graph()
    cycles = find_cycles(graph)
    report = []
    for component in cycles:
        members = set(component)
        edges = [f"    {m} -> {t}" for m in component for t in sorted(graph[m] & members)]
        report.append(f"  cycle: {', '.join(component)}\n" + "\n".join(edges))
    assert not cycles, "import cycles between the project's modules:\n" + "\n".join(report)
