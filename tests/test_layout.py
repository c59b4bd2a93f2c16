"""Layout: the two sides of the app meet only in ``wire.py`` (and the layers below it):
``strategies/`` never imports ``clients``, ``clients/`` never imports ``strategies``, and the
core ``fedderm/`` imports neither side, nor ``wire`` nor ``flwr`` (only the docs generator
``fedderm/config_docs.py`` reads ``registry`` for the method options it documents, and the
hospital-side launcher ``fedderm/launcher.py``, a SuperNode process installed with fedderm for its
console scripts, drives Flower itself)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
APP_MODULES = {"clients", "strategies", "wire", "records", "sim", "server_app", "client_app"}


def imported_roots(path: Path) -> set[str]:
    """The top-level names ``path`` imports (absolute imports; relative ones stay in the package)."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize(("package", "forbidden"), [("strategies", "clients"), ("clients", "strategies")])
def test_server_and_client_sides_never_import_each_other(package, forbidden):
    offenders = sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / package).rglob("*.py") if forbidden in imported_roots(p)
    )
    assert offenders == []
    # the check itself sees imports: both sides do import the shared wire module
    assert any("wire" in imported_roots(p) for p in (ROOT / package).rglob("*.py"))


#: core modules allowed to import flwr, and why (none may import the app's modules)
FLWR_ALLOWED = {
    "fedderm/launcher.py": "the SuperNode-side launcher wraps Flower's own SuperNode and SuperExec",
    "fedderm/console.py": "sim.py's console quiets Flower's logger (imported inside functions)",
    "fedderm/node_registry.py": "fedderm-superlink's link state subclasses Flower's InMemoryLinkState",
}


def test_core_imports_neither_side_nor_flwr():
    def forbidden(p: Path) -> set[str]:
        allowed = {"flwr"} if str(p.relative_to(ROOT)) in FLWR_ALLOWED else set()
        return APP_MODULES | ({"flwr"} - allowed)

    offenders = sorted(
        f"{p.relative_to(ROOT)}: {sorted(bad)}"
        for p in (ROOT / "fedderm").rglob("*.py")
        if (bad := imported_roots(p) & forbidden(p))
    )
    assert offenders == []
    assert "flwr" in imported_roots(ROOT / "fedderm" / "launcher.py")  # the check sees its imports


def test_records_module_is_gone():
    """One home for the wire protocol: the old ``records.py`` does not come back beside it."""
    assert (ROOT / "wire.py").exists() and not (ROOT / "records.py").exists()
