"""The warm import: what every ClientApp needs, and the approved app bundle, imported once in
the fork server (:mod:`fedderm.accel.forkserver`) so that each forked task skips those imports.
Nothing imported here may run a torch op (the server must stay safe to fork)."""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
from pathlib import Path

_log = logging.getLogger("flwr")


def prewarm() -> None:
    """Import what every ClientApp needs, once, in the fork server (no torch op runs: fork-safe)."""
    for name in (
        "numpy",
        "torch",
        "torchvision",
        "torchvision.transforms.v2",  # fedderm.augment's policies import it on first use
        "timm",
        "sklearn.metrics",
        "PIL.Image",
        "flwr.clientapp",
        "flwr.app",
        "flwr.supernode.runtime.run_clientapp",
    ):
        try:
            importlib.import_module(name)
        except ImportError:
            pass


#: torch functions an app may call at import without making the fork server unsafe to fork: they
#: build small tensors or read the build, none starts a thread pool (``torch.overrides`` names)
IMPORT_SAFE_TORCH = frozenset({"tensor", "as_tensor", "device", "_cuda_version", "get_default_dtype"})


def drop_modules(names) -> None:
    for name in list(names):
        sys.modules.pop(name, None)


def fedderm_modules() -> list[str]:
    """The launcher's own copy of fedderm (never run as app code), the accelerator excepted."""
    return [m for m in sys.modules if m.partition(".")[0] == "fedderm" and not m.startswith("fedderm.accel")]


@contextlib.contextmanager
def torch_calls():
    """The names of the torch functions called inside ``with`` (a ``TorchFunctionMode``)."""
    from torch.overrides import TorchFunctionMode

    names: list[str] = []

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            names.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    with Mode():
        yield names


class WarmApp:
    """The approved app bundle's ClientApp module, imported once in the fork server.

    Flower's ``load_app`` reuses a module already in ``sys.modules``, so every forked child skips
    the app's import.  The modules the bundle's
    ``pyproject.toml`` lists under ``[tool.fedderm] preload`` (``package.*``: every module of the
    package) are imported right after it: what its handlers import only when a message comes
    (fedderm: each method's ``clients/<method>.py``).  Only a bundle that is on the
    allow-list (or any, without one) and that Flower already installed and verified (the marker of
    :func:`installed_marker`) is imported, from the folder Flower installed it in; an import that
    runs a torch op other than :data:`IMPORT_SAFE_TORCH` is undone (the server must stay safe to
    fork) and that bundle stays cold: each child imports it, as before."""

    def __init__(self):
        self.digest: str | None = None
        self.folder: Path | None = None
        self.modules: set[str] = set()

    def load(self, digest: str, folder: Path) -> bool:
        """Import the ClientApp module (and the preload) of the bundle installed in ``folder``;
        ``False``, nothing kept, if that fails or runs a torch op."""
        import tomllib

        self.drop()
        try:
            config = tomllib.loads((folder / "pyproject.toml").read_text())
            module = config["tool"]["flwr"]["app"]["components"]["clientapp"].partition(":")[0]
            preload = config["tool"].get("fedderm", {}).get("preload", [])
            if not isinstance(preload, list) or not all(isinstance(m, str) for m in preload):
                raise KeyError(f"tool.fedderm.preload must be a list of module names, not {preload!r}")
        except (OSError, KeyError, tomllib.TOMLDecodeError) as err:
            _log.warning(
                "fedderm launcher: app bundle %s kept cold: no clientapp in %s (%s)", digest[:16], folder, err
            )
            return False
        drop_modules(fedderm_modules())  # the bundle brings its own fedderm
        before = set(sys.modules)
        sys.path.insert(0, str(folder))
        self.digest, self.folder = digest, folder
        calls, error = [], ""
        try:
            with torch_calls() as calls:
                importlib.import_module(module)
                for name in preload:  # what the app's handlers import only when a message comes
                    import_preload(name)
        except Exception as err:  # noqa: BLE001 - the child imports it again and reports the error
            error = f"importing {module} failed ({err!r})"
        self.modules = self._bundled(set(sys.modules) - before)
        unsafe = sorted(set(calls) - IMPORT_SAFE_TORCH)
        if error or unsafe:
            why = error or f"its import runs torch ops ({', '.join(unsafe)})"
            _log.warning("fedderm launcher: app bundle %s kept cold: %s", digest[:16], why)
            self.drop()
            return False
        _log.info(
            "fedderm launcher: app bundle %s imported once (%d modules) from %s",
            digest[:16],
            len(self.modules),
            folder,
        )
        return True

    def _bundled(self, names: set[str]) -> set[str]:
        """The modules among ``names`` that are app code: from the bundle's folder, or from any
        folder that is not the interpreter's library (e.g. an app module on ``PYTHONPATH``).
        Libraries it imported (torch, timm) stay: what :func:`prewarm` imports anyway."""
        root = str(self.folder.resolve()) + os.sep
        libraries = _library_roots()
        out = set()
        for name in names:
            module = sys.modules.get(name)
            file = getattr(module, "__file__", None)
            paths = getattr(module, "__path__", None)
            try:  # a package's folders (a namespace package has no __file__)
                files = [file, *(list(paths) if paths is not None and not isinstance(paths, str) else [])]
            except TypeError:  # e.g. torch's _ClassNamespace
                files = [file]
            # (torch registers objects with a made-up relative __file__, e.g. torch.ops: not app code)
            files = [str(Path(f).resolve()) for f in files if isinstance(f, str) and os.path.isabs(f)]
            if any(f.startswith(root) or not f.startswith(libraries) for f in files):
                out.add(name)
        return out

    def drop(self) -> None:
        """Forget the imported app: its modules and its folder on ``sys.path``."""
        drop_modules(self.modules)
        if self.folder is not None and str(self.folder) in sys.path:
            sys.path.remove(str(self.folder))
        self.digest, self.folder, self.modules = None, None, set()


def import_preload(name: str) -> None:
    """Import module ``name``; ``package.*``: the package and each module directly in it."""
    import pkgutil

    if not name.endswith(".*"):
        importlib.import_module(name)
        return
    package = importlib.import_module(name[:-2])
    for info in pkgutil.iter_modules(getattr(package, "__path__", [])):
        importlib.import_module(f"{package.__name__}.{info.name}")


def _library_roots() -> tuple[str, ...]:
    """The interpreter's standard library and site-packages folders (``os.sep``-terminated)."""
    import site
    import sysconfig

    paths = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    paths |= set(site.getsitepackages()) | {site.getusersitepackages()}
    return tuple(str(Path(p).resolve()) + os.sep for p in paths if p)
