"""The import graph of the shipped code has no cycle and no import that runs up the layer order of
docs/architecture.md ("The layers").  The graph is read with ``ast``: ``import`` and ``from ...
import`` at module level and inside functions (not under ``if TYPE_CHECKING``), the packages an
import runs on the way (``a.b.c`` runs ``a/b/__init__.py``), and ``importlib.import_module("...")``
with a literal name."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: docs/architecture.md's layers, lowest first.  A module may import its own column and anything in
#: the layers below, never a layer above nor another column of its own layer.  A name covers
#: itself and everything under it; the longest matching name places a module.  ``flwr`` is Flower.
LAYERS: list[list[tuple[str, ...]]] = [
    [("fedderm",)],  # the core: pure PyTorch/numpy, and fedderm.methods (each method's specification)
    # Flower, and what drives it (fedderm.flower_private: the app's only private Flower names)
    [("flwr", "fedderm.accel", "fedderm.console", "fedderm.flower_private")],
    [("wire",)],
    [("registry",)],
    [("strategies",), ("clients",)],  # the two sides never import each other
    [("server_app",), ("client_app",)],
    [("sim", "config_docs", "bench", "deploy", "docker")],  # entry points and tools
    [("tests",)],
]

#: Imports the order forbids that stay, each with the reason (the test fails once one is gone).
EXCEPTIONS: dict[tuple[str, str], str] = {}

#: Modules below the apps that import a module whose name they compute (the graph cannot see where
#: to), each with the reason; the apps and the tools above them may.
DYNAMIC: dict[str, str] = {
    "fedderm.accel.gate": "it imports the Flower internals it checks, and each role's stock Flower command",
    "fedderm.sift": "the installed text-model package that sift.text-model names",
    "clients.probe": "the backbone mapping that Method.probe names (in fedderm.probes)",
    "fedderm.inference": "the function that rebuilds a method's own network, which Method.rebuild names",
    "registry": "the function that derives a method's defaults from the rest of the run config, which "
    "Method.resolve names (FedMAE's decoder sized to its encoder, in fedderm.mae)",
    "fedderm.methods": "the package imports every module found in it (each registers its method), so that a "
    "new fedderm/methods/<m>.py needs no edit elsewhere; those modules import only fedderm.methods and fedderm.config",
}

_SKIP_DIRS = {"tests", "site", "build", "dist", "__pycache__"}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def shipped_files(root: Path) -> list[Path]:
    """Every ``.py`` file of the project but the tests (and virtual environments, build output)."""

    def skipped(path: Path) -> bool:
        rel = path.relative_to(root).parts[:-1]
        return any(p in _SKIP_DIRS or p.startswith(".") or p.endswith(".egg-info") for p in rel) or any(
            (root.joinpath(*rel[: i + 1]) / "pyvenv.cfg").exists() for i in range(len(rel))
        )

    return sorted(p for p in root.rglob("*.py") if not skipped(p))


class _Imports(ast.NodeVisitor):
    """The names one module imports, relative imports made absolute against ``package``."""

    def __init__(self, package: str):
        self.package, self.names, self.computed = package, set(), 0

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
            isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
        ):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.names.update(alias.name for alias in node.names)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            parts = self.package.split(".") if self.package else []
            parts = parts[: len(parts) - node.level + 1]
            base = ".".join(parts + ([base] if base else []))
        self.names.add(base)
        self.names.update(f"{base}.{alias.name}" for alias in node.names)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name == "import_module" and node.args:
            if isinstance(node.args[0], ast.Constant):
                self.names.add(str(node.args[0].value))
            else:
                self.computed += 1
        self.generic_visit(node)


def import_graph(
    root: Path, extra_modules: set[str] = frozenset(), computed: set[str] | None = None
) -> dict[str, set[str]]:
    """module -> the modules it imports, for every shipped module under ``root``.  Targets are
    shipped modules, ``extra_modules`` (the tests) or ``flwr``; other libraries are left out.
    ``computed`` collects the modules that call ``import_module`` with a computed name."""
    files = {module_name(p, root): p for p in shipped_files(root)}
    known = set(files) | set(extra_modules)

    def resolve(name: str) -> str | None:
        if name == "flwr" or name.startswith("flwr."):
            return "flwr"
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        visitor = _Imports(package)
        visitor.visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
        if visitor.computed and computed is not None:
            computed.add(module)
        edges = set()
        for name in visitor.names:
            target = resolve(name)
            if target is None:
                continue
            edges.add(target)
            parent = target  # importing a.b.c runs a/__init__.py and a/b/__init__.py first
            while "." in parent:
                parent = parent.rpartition(".")[0]
                if parent in known and not (module + ".").startswith(parent + "."):
                    edges.add(parent)
        graph[module] = edges - {module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def place(module: str) -> tuple[int, int] | None:
    """(layer, column) of ``module``: the longest name in :data:`LAYERS` that covers it."""
    best, where = -1, None
    for layer, columns in enumerate(LAYERS):
        for column, names in enumerate(columns):
            for name in names:
                if (module == name or module.startswith(name + ".")) and len(name) > best:
                    best, where = len(name), (layer, column)
    return where


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """The imports that run up :data:`LAYERS` or across columns of one layer."""
    bad = []
    for module, targets in sorted(graph.items()):
        here = place(module)
        for target in sorted(targets):
            there = place(target)
            if here and there and (there[0] > here[0] or (there[0] == here[0] and there[1] != here[1])):
                bad.append((module, target))
    return bad


@functools.cache
def _shipped() -> tuple[dict[str, set[str]], frozenset[str]]:
    """The shipped code's import graph and its modules that import by computed name."""
    tests = {module_name(p, ROOT) for p in (ROOT / "tests").rglob("*.py")}
    computed: set[str] = set()
    return import_graph(ROOT, tests, computed), frozenset(computed)


def test_the_shipped_code_has_no_import_cycle():
    graph = _shipped()[0]
    assert len(graph) > 100 and "fedderm.data" in graph["sim"] | graph["server_app"]  # it sees the code
    assert cycles(graph) == []


def test_no_import_runs_up_the_layers_of_docs_architecture():
    graph = _shipped()[0]
    unplaced = sorted(m for m in graph if place(m) is None)
    assert unplaced == [], "modules in no layer: add them to LAYERS and docs/architecture.md"
    bad = upward_imports(graph)
    assert [b for b in bad if b not in EXCEPTIONS] == []
    assert sorted(EXCEPTIONS) == [b for b in bad if b in EXCEPTIONS], "an exception is gone: drop it"


def test_imports_by_computed_name_below_the_apps_are_the_listed_ones():
    computed = _shipped()[1]
    apps = place("server_app")[0]
    assert sorted(m for m in computed if place(m)[0] < apps) == sorted(DYNAMIC)


def test_the_checker_finds_a_cycle_and_an_upward_import(tmp_path):
    """A synthetic project: a cycle through a function-level import, a package ``__init__`` and an
    ``importlib.import_module`` literal, and a core module importing Flower and the registry."""
    (tmp_path / "fedderm" / "data").mkdir(parents=True)
    (tmp_path / "fedderm" / "data" / "__init__.py").write_text("from .. import testset\n")
    (tmp_path / "fedderm" / "data" / "pool.py").write_text("X = 1\n")
    (tmp_path / "fedderm" / "testset.py").write_text("def f():\n    from .data.pool import X\n    return X\n")
    (tmp_path / "fedderm" / "models.py").write_text(
        "import importlib\nfrom flwr.app import Message\n\n"
        "def g(name):\n    importlib.import_module(name)\n    return importlib.import_module('registry')\n"
    )
    (tmp_path / "fedderm" / "typed.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import registry\n"
    )
    (tmp_path / "registry.py").write_text("import fedderm.models\n")
    (tmp_path / "sim.py").write_text("import registry\nfrom fedderm.data import pool\n")
    computed: set[str] = set()
    graph = import_graph(tmp_path, computed=computed)
    assert computed == {"fedderm.models"}
    assert graph["fedderm.testset"] == {"fedderm.data", "fedderm.data.pool"}
    assert graph["fedderm.typed"] == set()
    assert cycles(graph) == [["fedderm.data", "fedderm.testset"], ["fedderm.models", "registry"]]
    assert upward_imports(graph) == [("fedderm.models", "flwr"), ("fedderm.models", "registry")]
