"""No import loops among glm53's modules, and the layering of docs/ARCHITECTURE.md
(`server → models, transport, kernels`; `models → kernels`; `transport` and `kernels` below).

The graph is read from the source with `ast`; nothing is imported. Its rules:

* a node is a module of `glm53/` (a package is its `__init__.py`, named by the package);
* an edge is an `import glm53.x.y`, a `from glm53.x import y` (to `glm53.x.y` when that is a
  module, else to `glm53.x`), a relative import resolved the same way, or an
  `importlib.import_module("glm53....")` with a literal name;
* imports anywhere count: module level, inside functions and methods (a lazy import that hides
  a loop still leaves the loop: each module then needs the other to work, and their order of
  import decides whether it does), inside `try`, inside `if` — except the body of an
  `if TYPE_CHECKING:` (its `else:` does run), which only annotations read;
* importing `glm53.p.q` also runs package `glm53.p`'s `__init__`: that is an edge too, unless
  the importer is inside `glm53.p` (its package is then already being imported, and the edge
  would be a loop of every package with itself). An explicit `from glm53.p import x` from
  inside `glm53.p` is still an edge to `glm53.p`'s `__init__` (it reads names the `__init__`
  may not have bound yet).

The layering rules hold for everything a layer's modules reach through runtime edges (so a
lower layer cannot reach an upper one through a third module) and, for direct imports, for
`if TYPE_CHECKING:` imports too (naming an upper layer's types is depending on it).
"""

from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "glm53"


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    file: str  # the source's file, relative to the root
    line: int
    lazy: bool = False  # inside a function
    type_only: bool = False  # inside `if TYPE_CHECKING:`
    parent_of: str | None = None  # the edge runs this package's __init__ for an import of `parent_of`

    def where(self) -> str:
        how = ", ".join(w for w, on in (("lazy", self.lazy), ("TYPE_CHECKING", self.type_only)) if on)
        via = f" (the package of {self.parent_of})" if self.parent_of else ""
        return f"{self.file}:{self.line}{via}{f' [{how}]' if how else ''}"


def modules(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Module name -> file, for every .py under `root/package`."""
    out = {}
    for py in sorted((root / package).rglob("*.py")):
        parts = py.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = py
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


class _Imports(ast.NodeVisitor):
    def __init__(self, name: str, is_package: bool, known: set[str], package: str):
        self.name, self.known, self.package = name, known, package
        self.here = name if is_package else name.rpartition(".")[0]  # the package relative imports start from
        self.lazy = 0
        self.type_only = 0
        self.found: list[tuple[str, int, bool, bool]] = []

    def _add(self, target: str, node: ast.AST) -> None:
        if target == self.package or target.startswith(self.package + "."):
            self.found.append((target, node.lineno, self.lazy > 0, self.type_only > 0))

    def _function(self, node: ast.AST) -> None:
        self.lazy += 1
        self.generic_visit(node)
        self.lazy -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            return self.generic_visit(node)
        self.type_only += 1
        for stmt in node.body:
            self.visit(stmt)
        self.type_only -= 1
        for stmt in node.orelse:
            self.visit(stmt)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            parts = self.here.split(".")
            if node.level - 1 >= len(parts):
                raise ValueError(f"{self.name}:{node.lineno}: relative import beyond the top-level package")
            base = ".".join(parts[:len(parts) - (node.level - 1)])
            base = f"{base}.{node.module}" if node.module else base
        else:
            base = node.module or ""
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            self._add(sub if sub in self.known else base, node)

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
        if (name == "import_module" and node.args and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)):
            self._add(node.args[0].value, node)
        self.generic_visit(node)


def module_imports(name: str, source: str, known: set[str], is_package: bool = False,
                   package: str = PACKAGE) -> list[Edge]:
    """Every import of a `package` module in `source` (module `name`), with the implicit imports
    of the target's packages (see the module docstring)."""
    v = _Imports(name, is_package, known, package)
    v.visit(ast.parse(source, filename=name))
    file = name.replace(".", "/") + ("/__init__.py" if is_package else ".py")
    edges = []
    for target, line, lazy, type_only in v.found:
        edges.append(Edge(name, target, file, line, lazy, type_only))
        parts = target.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if not (name == parent or name.startswith(parent + ".")):
                edges.append(Edge(name, parent, file, line, lazy, type_only, parent_of=target))
    return edges


def import_edges(root: Path = ROOT, package: str = PACKAGE) -> list[Edge]:
    mods = modules(root, package)
    known = set(mods)
    edges = []
    for name, path in mods.items():
        edges += module_imports(name, path.read_text(), known, path.name == "__init__.py", package)
    return edges


def runtime_graph(edges: list[Edge]) -> dict[str, dict[str, Edge]]:
    """source -> {target: the first edge that makes it} over the edges that run (no TYPE_CHECKING)."""
    graph: dict[str, dict[str, Edge]] = {}
    for e in sorted(edges, key=lambda e: (e.source, e.target, e.parent_of is not None, e.lazy, e.line)):
        graph.setdefault(e.target, {})
        if not e.type_only:
            graph.setdefault(e.source, {}).setdefault(e.target, e)
        else:
            graph.setdefault(e.source, {})
    return graph


def _path(graph: dict[str, dict[str, Edge]], start: str, goal, within: set[str] | None = None) -> list[Edge] | None:
    """The shortest chain of edges from `start` to a node for which `goal(node)` holds (at least
    one edge), staying inside `within` when given."""
    back: dict[str, Edge] = {}
    queue = deque([start])
    seen = set()
    while queue:
        node = queue.popleft()
        for target, edge in sorted(graph.get(node, {}).items()):
            if within is not None and target not in within:
                continue
            if goal(target):
                chain = [edge]
                while chain[0].source != start:
                    chain.insert(0, back[chain[0].source])
                return chain
            if target not in seen:
                seen.add(target)
                back[target] = edge
                queue.append(target)
    return None


def strongly_connected(graph: dict[str, dict[str, Edge]]) -> list[list[str]]:
    """Tarjan's components with a loop in them (two or more modules, or one importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        # iterative DFS: (node, iterator over its targets)
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        work = [(root, iter(sorted(graph.get(root, {}))))]
        while work:
            node, targets = work[-1]
            for t in targets:
                if t not in index:
                    index[t] = low[t] = counter
                    counter += 1
                    stack.append(t)
                    on_stack.add(t)
                    work.append((t, iter(sorted(graph.get(t, {})))))
                    break
                if t in on_stack:
                    low[node] = min(low[node], index[t])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    if len(comp) > 1 or node in graph.get(node, {}):
                        out.append(sorted(comp))
    return sorted(out)


def find_cycles(graph: dict[str, dict[str, Edge]]) -> list[list[Edge]]:
    """One shortest loop per strongly connected component: its first module back to itself."""
    cycles = []
    for comp in strongly_connected(graph):
        members = set(comp)
        cycles.append(_path(graph, comp[0], lambda n, s=comp[0]: n == s, within=members))
    return cycles


def describe(chain: list[Edge]) -> str:
    names = " → ".join([chain[0].source] + [e.target for e in chain])
    return names + "\n" + "\n".join(f"    {e.source} → {e.target}: {e.where()}" for e in chain)


# --------------------------------------------------------------------------------------------
# The rules
# --------------------------------------------------------------------------------------------


def in_layer(module: str, layer: str) -> bool:
    return module == layer or module.startswith(layer + ".")


# layer -> the layers none of its modules may import, directly or through others
FORBIDDEN = {
    "glm53.transport": ("glm53.models", "glm53.server"),
    "glm53.models": ("glm53.server",),
    "glm53.kernels": ("glm53.models", "glm53.server", "glm53.transport"),
}
# this package is imported only from inside itself (it may not exist yet)
PRIVATE = ("glm53.support",)


def layering_violations(edges: list[Edge]) -> list[str]:
    graph = runtime_graph(edges)
    out = []
    for layer, banned in FORBIDDEN.items():
        for e in edges:  # direct imports, TYPE_CHECKING ones included
            if in_layer(e.source, layer) and e.parent_of is None:
                for b in banned:
                    if in_layer(e.target, b):
                        out.append(f"{layer} must not import {b}: {e.source} → {e.target} ({e.where()})")
        for module in sorted(m for m in graph if in_layer(m, layer)):  # and nothing reaches them
            for b in banned:
                chain = _path(graph, module, lambda n, b=b: in_layer(n, b))
                if chain and len(chain) > 1:
                    out.append(f"{layer} must not import {b}, but reaches it: {describe(chain)}")
    for private in PRIVATE:
        for e in edges:
            if in_layer(e.target, private) and not in_layer(e.source, private) and e.parent_of is None:
                out.append(f"only {private} may import {private}: {e.source} → {e.target} ({e.where()})")
    return sorted(set(out))


def test_no_import_cycles():
    cycles = find_cycles(runtime_graph(import_edges()))
    assert not cycles, "import cycles among glm53 modules:\n" + "\n".join(describe(c) for c in cycles)


def test_layering():
    bad = layering_violations(import_edges())
    assert not bad, "layering broken:\n" + "\n".join(bad)


def test_graph_sees_the_tree():
    """The parser finds edges we know exist, so an empty graph cannot pass for a clean one."""
    graph = runtime_graph(import_edges())
    assert "glm53.transport.engine" in graph["glm53.transport"]  # `from .engine import TransferEngine`
    assert "glm53.transport.buffers" in graph["glm53.transport.engine"]
    assert "glm53.server.config" in graph["glm53.server.cli"]
    assert "glm53.models" in graph["glm53.server.engine.scheduler"]  # `from glm53.models import GlmConfig, ...`


# --------------------------------------------------------------------------------------------
# The finder itself, on synthetic sources
# --------------------------------------------------------------------------------------------


def _edges(sources: dict[str, str], packages: set[str] = frozenset()) -> list[Edge]:
    known = set(sources)
    return [e for name, src in sources.items()
            for e in module_imports(name, src, known, is_package=name in packages, package="pkg")]


def test_finder_reports_a_cycle_hidden_by_a_lazy_import():
    sources = {
        "pkg": "",
        "pkg.a": "from pkg.b import f\n",
        "pkg.b": "import os\ndef f():\n    from pkg.c import g\n    return g()\n",
        "pkg.c": "from . import a\n",
        "pkg.d": "from pkg.a import f\n",  # reaches the loop, is not in it
    }
    cycles = find_cycles(runtime_graph(_edges(sources, {"pkg"})))
    assert len(cycles) == 1
    text = describe(cycles[0])
    assert text.splitlines()[0] == "pkg.a → pkg.b → pkg.c → pkg.a"
    assert "pkg/b.py:3 [lazy]" in text and "pkg/c.py:1" in text


def test_finder_ignores_type_checking_and_resolves_names():
    sources = {
        "pkg": "from .x import X\n",
        "pkg.x": ("from typing import TYPE_CHECKING\nimport typing\n"
                  "if TYPE_CHECKING:\n    from pkg.y import Y\n"
                  "if typing.TYPE_CHECKING:\n    import pkg.y\nelse:\n    import pkg.z\n"),
        "pkg.y": "from pkg.x import X\n",
        "pkg.z": "",
        "pkg.sub": "",
        "pkg.sub.m": "from .. import z\nfrom ..sub import VALUE\nimport importlib\nimportlib.import_module('pkg.y')\n",
    }
    edges = _edges(sources, {"pkg", "pkg.sub"})
    graph = runtime_graph(edges)
    assert find_cycles(graph) == []
    assert set(graph["pkg.x"]) == {"pkg.z"}
    assert {e.target for e in edges if e.source == "pkg.x" and e.type_only} == {"pkg.y"}
    assert set(graph["pkg.sub.m"]) == {"pkg.z", "pkg.sub", "pkg.y"}
    # a package's own import of its submodule closes no loop: that submodule's parent is loading
    assert "pkg" not in graph["pkg.x"]


def test_finder_counts_package_inits_and_self_imports():
    sources = {
        "pkg": "",
        "pkg.p": "from pkg.q.inner import f\n",
        "pkg.q": "from pkg.p import g\n",  # runs when pkg.p imports pkg.q.inner
        "pkg.q.inner": "",
        "pkg.s": "import pkg.s\n",
    }
    cycles = find_cycles(runtime_graph(_edges(sources, {"pkg", "pkg.q"})))
    assert [describe(c).splitlines()[0] for c in cycles] == ["pkg.p → pkg.q → pkg.p", "pkg.s → pkg.s"]


def test_layering_rules_catch_a_reach_through_a_third_module():
    sources = {
        "glm53.kernels.k": "from glm53.util import h\n",
        "glm53.util": "from glm53.models.m import M\n",
        "glm53.models.m": "",
        "glm53.transport.t": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from glm53.server.s import S\n",
        "glm53.server.s": "from glm53.support import x\n",
    }
    known = set(sources)
    edges = [e for name, src in sources.items() for e in module_imports(name, src, known)]
    bad = layering_violations(edges)
    assert any(b.startswith("glm53.kernels must not import glm53.models, but reaches it") for b in bad), bad
    assert any(b.startswith("glm53.transport must not import glm53.server: glm53.transport.t") for b in bad), bad
    assert any(b.startswith("only glm53.support may import glm53.support: glm53.server.s") for b in bad), bad


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
