"""Packaging: installing fedderm adds only the ``fedderm`` package to site-packages, and no code
edits ``sys.path`` (the app's top-level modules run from the project directory, as ``flwr run .``
runs them; pytest finds them through its ``pythonpath`` setting)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
APP_NAMES = (
    "clients",
    "strategies",
    "registry",
    "records",
    "sim",
    "server_app",
    "client_app",
    "wire",
)
_SKIP = shutil.ignore_patterns(
    ".git",
    ".venv",
    "__pycache__",
    "*.egg-info",
    "build",
    "results",
    "site",
    ".flwr-ci",
    "deploy-secrets",
    ".pytest_cache",
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """fedderm's wheel, built from a copy of the checkout (the checkout stays free of build files)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=_SKIP)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(tmp / "dist"),
            str(src),
        ],
        capture_output=True,
        text=True,
        env=_clean_env(),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (whl,) = (tmp / "dist").glob("fedderm-*.whl")
    return whl


def _clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def test_wheel_holds_only_the_fedderm_package(wheel):
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert tops == {"fedderm", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}
    names = zipfile.ZipFile(wheel).namelist()
    assert "fedderm/config.py" in names and "fedderm/data/__init__.py" in names


def test_installed_fedderm_exposes_no_app_modules(wheel, tmp_path):
    """In a venv where fedderm is installed, from outside the checkout, ``import clients`` (and the
    other app modules) fails while ``import fedderm.config`` works."""
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(py),
            "install",
            "--no-deps",
            "--no-index",
            "-q",
            str(wheel),
        ],
        capture_output=True,
        text=True,
        env=_clean_env(),
    )
    if out.returncode and "no such option: --python" in out.stderr:  # pip < 22.3
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--no-deps",
                "--no-index",
                "-q",
                "--prefix",
                str(env_dir),
                str(wheel),
            ],
            capture_output=True,
            text=True,
            env=_clean_env(),
        )
    assert out.returncode == 0, out.stderr[-3000:]
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    probe = (
        "import importlib, json\n"
        "res = {}\n"
        f"for name in {APP_NAMES!r} + ('fedderm.config',):\n"
        "    try:\n"
        "        m = importlib.import_module(name)\n"
        "        res[name] = getattr(m, '__file__', '?')\n"
        "    except ImportError:\n"
        "        res[name] = None\n"
        "print(json.dumps(res))\n"
    )
    run = subprocess.run(
        [str(py), "-c", probe], cwd=outside, capture_output=True, text=True, env=_clean_env()
    )
    assert run.returncode == 0, run.stderr[-3000:]
    import json

    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert {name: found[name] for name in APP_NAMES} == dict.fromkeys(APP_NAMES)
    assert found["fedderm.config"] and str(env_dir) in found["fedderm.config"]


_SYS_PATH_EDIT = re.compile(r"sys\.path\.(insert|append|extend|remove)\(|sys\.path\s*(\+?=|\[)")


def test_no_code_edits_sys_path():
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        # hidden folders are environments and Flower homes (.venv, .flwr-ci: copies of shipped apps)
        if rel.parts[0].startswith(".") or rel.parts[0] in ("build", "site") or "site-packages" in rel.parts:
            continue
        if rel == Path("tests/test_packaging.py"):  # the pattern above
            continue
        for no, line in enumerate(path.read_text().splitlines(), 1):
            if _SYS_PATH_EDIT.search(line):
                offenders.append(f"{rel}:{no}: {line.strip()}")
    assert offenders == []
