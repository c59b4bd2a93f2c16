"""The documentation: a short README whose links resolve, every docs page in the site's nav, and (with
the docs extra installed) a site that builds under ``mkdocs build --strict``."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _nav_pages(nav) -> list[str]:
    """Every page path in mkdocs.yml's nav (nested sections included)."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [p for item in nav for p in _nav_pages(item)]
    if isinstance(nav, dict):
        return [p for value in nav.values() for p in _nav_pages(value)]
    return []


def test_readme_is_at_most_250_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail into docs/ (limit 250)"


def test_readme_relative_links_resolve():
    text = (ROOT / "README.md").read_text()
    targets = [t for t in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text) if "://" not in t]
    assert any(t.startswith("docs/") for t in targets), "the README links into the docs"
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_readme_setup_commands_are_the_ones_ci_runs():
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    for command in (
        "python -m fedderm.install && FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 flwr run . --stream",
        "pip install -e '.[test]' && pytest",
    ):
        assert command in readme and command in ci, command


def test_every_docs_page_is_in_the_nav_and_every_nav_page_exists():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = _nav_pages(config["nav"])
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(set(nav)) == pages, (
        f"not in mkdocs.yml nav: {sorted(set(pages) - set(nav))}; "
        f"in the nav but missing: {sorted(set(nav) - set(pages))}"
    )


def test_mkdocs_build_strict(tmp_path):
    """The docs site builds with no warning (broken links, anchors, pages missing from the nav)."""
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "site" / "index.html").exists()


# -- the run-config reference, generated from the code (config_docs.py; tests/test_config.py checks
# that the checked-in page and pyproject.toml table are the generated ones) --


def test_key_docs_names_only_keys_that_exist():
    import registry
    from fedderm.config import KEY_DOCS, default_config

    unknown = sorted(set(KEY_DOCS) - set(default_config()) - set(registry.method_options()))
    assert not unknown, f"KEY_DOCS describes keys that are in neither Config nor the registry: {unknown}"


def test_generated_page_rows_carry_default_type_choices_and_description():
    import config_docs
    from fedderm.config import KEY_DOCS

    page = config_docs.render({"fedavg": {}, "demo": {}})
    rows = {line.split("|")[1].strip(): line for line in page.splitlines() if line.startswith("| `")}
    assert rows["`lr`"].startswith("| `lr` | `0.001` | float |")
    assert "`iid`, `dirichlet`, `source`" in rows["`partition`"]
    assert rows["`skip-bad-files`"].startswith("| `skip-bad-files` | `false` | bool |")
    assert KEY_DOCS["seed"] in rows["`seed`"]
    assert page.index("### Data") < page.index("`data-path`") < page.index("### Partitions and splits")


def test_a_key_without_a_one_line_description_fails_the_generation(monkeypatch):
    import config_docs

    with pytest.raises(KeyError, match="demo.undocumented"):
        config_docs.render({"demo": {"demo.undocumented": 1}})
    monkeypatch.setitem(config_docs.KEY_DOCS, "demo.k", "two\nlines")
    with pytest.raises(ValueError, match="demo.k"):
        config_docs.render({"demo": {"demo.k": 1}})
