"""The hospital's allow-list: app bundles (FABs) by sha256, checked in each ClientApp's process
before Flower installs the bundle, so that an unapproved bundle runs no code at the hospital."""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from fedderm.atomic import atomic_write_bytes

_log = logging.getLogger("flwr")  # Flower's console format, next to the SuperNode's own lines


REFUSAL = "refused: app bundle sha256 {digest} is not on this hospital's allow-list ({source})"


def read_allow_list(path: str | Path) -> set[str]:
    """sha256 hex digests, one per line (``#`` comments and blank lines ignored)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise SystemExit(f"fedderm launcher: allow-list file {path} does not exist")
    digests = set()
    for number, line in enumerate(path.read_text().splitlines(), 1):
        token = line.split("#", 1)[0].strip().lower()
        if not token:
            continue
        if len(token) != 64 or any(c not in "0123456789abcdef" for c in token):
            raise SystemExit(f"fedderm launcher: {path}:{number}: {token!r} is not a sha256 hex digest")
        digests.add(token)
    return digests


def app_hash(app_dir: str | Path = ".") -> str:
    """The sha256 of the app bundle (FAB) that ``flwr run <app_dir>`` ships: what a hospital pins.

    Built from :func:`copy_bundle_files`'s copy: the same bundle, without walking the folders the
    app's ``.gitignore`` leaves out (a virtual environment inside the checkout)."""
    from flwr.cli.build import build_fab_from_disk

    with tempfile.TemporaryDirectory(prefix="fedderm-app-") as tmp:
        return hashlib.sha256(build_fab_from_disk(copy_bundle_files(app_dir, Path(tmp) / "app"))).hexdigest()


def copy_bundle_files(app_dir: str | Path, dst: str | Path) -> Path:
    """Copy ``app_dir`` to ``dst`` without the symlinks and the paths its ``.gitignore`` excludes.

    ``flwr run`` and Flower's bundle build read every file under the app folder before they apply
    ``.gitignore`` (75,000 files for a ``.venv`` in the checkout); the bundle built from this copy
    is the same, byte for byte, since Flower's own filter leaves out the same paths."""
    import pathspec

    src, dst = Path(app_dir).expanduser().resolve(), Path(dst)
    ignore_file = src / ".gitignore"
    lines = ignore_file.read_text().splitlines() if ignore_file.is_file() else []
    ignored = pathspec.GitIgnoreSpec.from_lines(lines)
    for folder, dirs, files in os.walk(src, followlinks=False):
        rel = Path(folder).relative_to(src)
        dirs[:] = [d for d in dirs if not ignored.match_file(f"{(rel / d).as_posix()}/")]
        for name in files:
            path = Path(folder) / name
            if path.is_symlink() or ignored.match_file((rel / name).as_posix()):
                continue
            (dst / rel).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, dst / rel / name)
    return dst


def guard_install(allowed: set[str] | None, source: str) -> None:
    """Wrap Flower's FAB installation in the child: refuse a bundle not on the allow-list."""
    rc = importlib.import_module("flwr.supernode.runtime.run_clientapp")
    original = rc.install_from_fab

    def install_checked(fab_content: bytes, *args, **kwargs):
        digest = hashlib.sha256(fab_content).hexdigest()
        if allowed is not None and digest not in allowed:
            message = REFUSAL.format(digest=digest, source=source)
            _log.error("fedderm launcher: %s", message)
            raise PermissionError(message)
        _log.info("fedderm launcher: app bundle sha256 %s approved", digest[:16])
        marker = installed_marker(digest, *args, **kwargs)
        if marker.is_file() and Path(marker.read_text()).is_dir():
            return Path(marker.read_text())  # unpacked and verified by Flower for this very hash
        installed = original(fab_content, *args, **kwargs)
        if isinstance(installed, (str, Path)) and Path(installed).is_dir():
            marker.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(marker, str(installed).encode())
        return installed

    rc.install_from_fab = install_checked


def installed_marker(digest: str, install_dir=None, *args, **kwargs) -> Path:
    """Where the launcher notes that Flower installed the bundle with this full sha256.

    Flower's ``install_from_fab`` unzips and re-hashes the whole bundle for every message, then
    keeps the folder it installed the first time (``apps/<publisher>.<name>.<version>.<hash8>``);
    the marker lets the next message skip the unzip (the same trust: Flower reuses that folder)."""
    from flwr.supercore.utils import get_flwr_home

    base = Path(install_dir).expanduser() if install_dir else get_flwr_home()
    return base / "apps" / ".fedderm-installed" / digest


def self_test_refusal() -> str | None:
    """Flower's ``install_from_fab``, as the launcher's child wraps it, refuses a bundle that is
    not on the allow-list before installing anything. Returns what failed, or ``None``."""
    rc = importlib.import_module("flwr.supernode.runtime.run_clientapp")
    original = rc.install_from_fab
    calls = []
    rc.install_from_fab = lambda *a, **k: calls.append(a)
    quiet, _log.disabled = _log.disabled, True  # the refusal's error line is expected here
    try:
        guard_install({"0" * 64}, "self-test")
        try:
            rc.install_from_fab(b"not an approved bundle")
        except PermissionError:
            return None if not calls else "refusal: the bundle was installed before it was refused"
        return "refusal: a bundle off the allow-list was installed"
    finally:
        rc.install_from_fab, _log.disabled = original, quiet


def pop_option(argv: list[str], name: str) -> str | None:
    """Remove ``--name VALUE`` / ``--name=VALUE`` from ``argv`` and return VALUE."""
    for i, token in enumerate(argv):
        if token == name and i + 1 < len(argv):
            value = argv[i + 1]
            del argv[i : i + 2]
            return value
        if token.startswith(name + "="):
            del argv[i]
            return token.split("=", 1)[1]
    return None


def allow_list_from(argv: list[str]) -> tuple[set[str] | None, str]:
    path = pop_option(argv, "--allow-list") or os.environ.get("FEDDERM_ALLOW_LIST", "")
    if not path:
        return None, ""
    return read_allow_list(path), str(Path(path).expanduser())
