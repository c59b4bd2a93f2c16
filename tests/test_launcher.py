"""fedderm.launcher: the warm ClientApp launcher's hooks into Flower, the allow-list, the app hash.

The launcher end to end (forked ClientApps answering real messages, a refused app bundle) is in
tests/test_deploy.py's loopback federation test.
"""

from __future__ import annotations

import hashlib
import importlib
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedderm import launcher

APP_DIR = Path(__file__).resolve().parents[1]


def test_the_flower_internals_the_launcher_patches_exist():
    """Fails loudly, naming the internal, when a flwr release moves one of them."""
    import flwr

    assert launcher.check_flower_internals() == [], (
        f"flwr {flwr.__version__}: fedderm.launcher was verified with {launcher.VERIFIED_FLOWER}"
    )


def test_fast_object_pulls_sets_the_shared_backoff_defaults():
    from flwr.supercore.inflatable import inflatable_utils as iu

    fns = (iu.pull_objects, iu.pull_and_inflate_object_from_tree)
    saved = [dict(fn.__kwdefaults__) for fn in fns]
    try:
        for fn in fns:  # Flower's defaults (another test may have patched them in this process)
            fn.__kwdefaults__.update(initial_backoff=1, backoff_cap=10)
        launcher.fast_object_pulls(0.05)
        for fn in fns:
            assert fn.__kwdefaults__["initial_backoff"] == 0.05
            assert fn.__kwdefaults__["backoff_cap"] == pytest.approx(0.2)
    finally:
        for fn, kw in zip(fns, saved):
            fn.__kwdefaults__.update(kw)


def test_clamped_time_caps_sleep_and_delegates_the_rest():
    clamped = launcher._ClampedTime(0.01)
    start = time.monotonic()
    clamped.sleep(3)  # Flower's idle SuperNode pull
    assert time.monotonic() - start < 0.5
    assert clamped.monotonic() >= start and clamped.time() > 0


def test_poll_interval_from_environment(monkeypatch):
    monkeypatch.delenv("FEDDERM_POLL_INTERVAL", raising=False)
    assert launcher.poll_interval() == launcher.DEFAULT_POLL_INTERVAL
    monkeypatch.setenv("FEDDERM_POLL_INTERVAL", "0.2")
    assert launcher.poll_interval() == 0.2
    for bad in ("fast", "0", "100"):
        monkeypatch.setenv("FEDDERM_POLL_INTERVAL", bad)
        with pytest.raises(SystemExit, match="FEDDERM_POLL_INTERVAL"):
            launcher.poll_interval()


def test_allow_list_parsing_and_errors_name_the_file_and_line(tmp_path):
    good = hashlib.sha256(b"app").hexdigest()
    path = tmp_path / "approved.txt"
    path.write_text(f"# fedderm 0.1.0, reviewed 2026-11-20\n\n{good.upper()}  # v0.1.0\n")
    assert launcher.read_allow_list(path) == {good}
    path.write_text(f"{good}\nnot-a-hash\n")
    with pytest.raises(SystemExit, match=r"approved.txt:2: 'not-a-hash' is not a sha256"):
        launcher.read_allow_list(path)
    with pytest.raises(SystemExit, match="missing.txt does not exist"):
        launcher.read_allow_list(tmp_path / "missing.txt")


def _copy_app(dst: Path) -> Path:
    ignore = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info", ".pytest_cache", "site")
    shutil.copytree(APP_DIR, dst, ignore=ignore)
    return dst


def test_app_hash_is_the_sha256_of_the_bundle_flwr_run_ships(tmp_path):
    from flwr.cli.build import build_fab_from_disk

    app = _copy_app(tmp_path / "app")
    digest = launcher.app_hash(app)
    assert digest == hashlib.sha256(build_fab_from_disk(app)).hexdigest()
    assert launcher.app_hash(app) == digest  # the same files, the same hash
    (app / "client_app.py").write_text((app / "client_app.py").read_text() + "\n# changed\n")
    assert launcher.app_hash(app) != digest  # any edit to shipped code changes what must be approved
    out = subprocess.run(
        [sys.executable, "-m", "fedderm.launcher", "app-hash", str(app)],
        capture_output=True,
        text=True,
        check=True,
        cwd=APP_DIR,
    )
    assert out.stdout.strip() == launcher.app_hash(app)
    bad = subprocess.run(
        [sys.executable, "-m", "fedderm.launcher", "app-hash", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=APP_DIR,
    )
    assert bad.returncode != 0 and "has no pyproject.toml" in bad.stderr


def test_install_guard_refuses_a_bundle_off_the_list_before_installing_it(monkeypatch, caplog):
    rc = importlib.import_module("flwr.supernode.runtime.run_clientapp")

    installed = []
    monkeypatch.setattr(rc, "install_from_fab", lambda content, **kw: installed.append(content))
    approved = b"approved bundle"
    launcher._guard_install({hashlib.sha256(approved).hexdigest()}, "/etc/fedderm/approved.txt")
    with pytest.raises(PermissionError, match="not on this hospital's allow-list"):
        rc.install_from_fab(b"something else", skip_prompt=True)
    assert installed == []  # nothing unpacked, so no app code can have run
    assert any("refused: app bundle sha256" in r.getMessage() for r in caplog.records)
    rc.install_from_fab(approved, skip_prompt=True)
    assert installed == [approved]


def test_no_allow_list_approves_everything(monkeypatch):
    rc = importlib.import_module("flwr.supernode.runtime.run_clientapp")

    installed = []
    monkeypatch.setattr(rc, "install_from_fab", lambda content, **kw: installed.append(content))
    launcher._guard_install(None, "")
    rc.install_from_fab(b"any", skip_prompt=True)
    assert installed == [b"any"]


def test_superexec_popen_is_redirected_to_the_launcher():
    popen = launcher._SuperExecPopen(["--allow-list", "/x"])
    seen = []
    popen._subprocess = type(
        "S", (), {"Popen": staticmethod(lambda cmd, *a, **k: seen.append(cmd)), "PIPE": -1}
    )()
    popen.Popen(["flower-superexec", "--insecure", "--runtime-api-address", "127.0.0.1:1"])
    popen.Popen(["other", "x"])
    assert seen[0] == [
        sys.executable,
        "-m",
        "fedderm.launcher",
        "superexec",
        "--insecure",
        "--runtime-api-address",
        "127.0.0.1:1",
        "--allow-list",
        "/x",
    ]
    assert seen[1] == ["other", "x"] and popen.PIPE == -1


def test_install_guard_unpacks_an_approved_bundle_once(monkeypatch, tmp_path):
    """Flower unzips and re-hashes the bundle for every message; the launcher skips that once
    Flower has installed this exact sha256 (and only then)."""
    rc = importlib.import_module("flwr.supernode.runtime.run_clientapp")
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    calls = []

    def install(content, **kw):
        calls.append(content)
        folder = tmp_path / "apps" / f"x.y.1.{hashlib.sha256(content).hexdigest()[:8]}"
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    monkeypatch.setattr(rc, "install_from_fab", install)
    launcher._guard_install(None, "")
    first = rc.install_from_fab(b"bundle one", skip_prompt=True)
    assert rc.install_from_fab(b"bundle one", skip_prompt=True) == first and calls == [b"bundle one"]
    rc.install_from_fab(b"bundle two", skip_prompt=True)  # another hash: installed by Flower
    assert calls == [b"bundle one", b"bundle two"]
    shutil.rmtree(first)  # the installed folder gone: Flower installs it again
    rc.install_from_fab(b"bundle one", skip_prompt=True)
    assert calls == [b"bundle one", b"bundle two", b"bundle one"]
