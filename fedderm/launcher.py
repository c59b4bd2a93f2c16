"""A warm, approval-checking ClientApp launcher for a hospital's SuperNode (deployment only).

Flower 1.41/1.42 start one fresh ``flwr-clientapp`` process per message (Python, torch and the
app imported every time) and wait on several fixed sleeps (SuperNode pull 3 s, reply wait 0.5 s,
object-pull back-off 1, 2, 4, 8 s).  This module keeps Flower's own task loop and per-task
token, and changes three things, each through the narrowest hook the installed Flower offers:

* ``fedderm-superexec`` (``python -m fedderm.launcher superexec``) is Flower's
  ``flower-superexec`` with its executor replaced by :class:`ForkExecutor`: a parent that has
  imported torch, torchvision, timm and Flower once (no torch op runs in it) forks one child per
  task; the child calls Flower's own ``run_clientapp`` with the task's token, exactly what
  ``flwr-clientapp --token`` does, and exits.  One message = one token = one child, as in Flower.
* Before any app code runs, the child checks the received app bundle (FAB) against the
  hospital's allow-list of sha256 hashes (``--allow-list FILE`` or ``FEDDERM_ALLOW_LIST``).  A
  bundle that is not on it is refused with one log line and an error reply to the server.  The
  check sits outside the app, so the shipped app cannot skip it.
* ``fedderm-supernode`` (``python -m fedderm.launcher supernode``) is ``flower-supernode`` with
  its idle sleeps clamped to ``FEDDERM_POLL_INTERVAL`` (default 0.05 s) and its SuperExec
  started as ``fedderm-superexec``, which it wakes through a pipe when a message's task exists
  (:class:`_WakeableTime`) instead of being asked for tasks 20 times a second.

Only Flower internals verified for the versions in :data:`VERIFIED_FLOWER` are touched;
:func:`check_flower_internals` names any that moved (tests/test_launcher.py runs it).
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import sys
import threading
import time as _time
from pathlib import Path

from fedderm.atomic import atomic_write_bytes

#: Flower versions whose internals, self-tests and deployment tests passed (compared at start)
VERIFIED_FLOWER = ("1.41.0", "1.42.0", "1.43.0.dev20261026")
DEFAULT_POLL_INTERVAL = 0.05
#: set by fedderm-superlink for the processes it starts: server_app.py then calls fast_object_pulls
ACCELERATED_ENV = "FEDDERM_ACCELERATED"
REFUSAL = "refused: app bundle sha256 {digest} is not on this hospital's allow-list ({source})"
_log = logging.getLogger("flwr")  # Flower's console format, next to the SuperNode's own lines

# (module, attribute) pairs of Flower internals this module relies on
_INTERNALS = (
    ("flwr.supercore.superexec.run_superexec", "get_executor"),
    ("flwr.supercore.superexec.run_superexec", "run_superexec"),
    ("flwr.supercore.superexec.executor.subprocess_executor", "SubprocessExecutor"),
    ("flwr.supercore.superexec.executor.types", "LaunchResult"),
    ("flwr.supercore.cli.flower_superexec", "flower_superexec"),
    ("flwr.supernode.runtime.run_clientapp", "run_clientapp"),
    ("flwr.supernode.runtime.run_clientapp", "install_from_fab"),
    ("flwr.supercore.utils", "get_flwr_home"),
    ("flwr.supernode.start_client_internal", "time"),
    ("flwr.supernode.start_client_internal", "subprocess"),
    ("flwr.supernode.cli.flower_supernode", "flower_supernode"),
    ("flwr.supercore.inflatable.inflatable_utils", "pull_objects"),
    ("flwr.supercore.inflatable.inflatable_utils", "pull_and_inflate_object_from_tree"),
    ("flwr.supercore.exit.exit_handler", "registered_exit_handlers"),
    ("flwr.supercore.constant", "TaskType"),
    ("flwr.superlink.main", "get_objectstore_linkstate_factories"),
    ("flwr.superlink.config_loader", "LinkStateFactory"),
    ("flwr.superlink.cli.flower_superlink", "flower_superlink"),
    ("flwr.supercore.object_store", "ObjectStoreFactory"),
    ("flwr.supercore.superexec.run_superexec", "time"),
    ("flwr.supernode.start_client_internal", "pull_objects"),
    ("flwr.server.superlink.linkstate.in_memory_linkstate", "InMemoryLinkState"),
    ("flwr.server.superlink.linkstate.linkstate_factory", "LinkStateFactory"),
    ("flwr.server.superlink.linkstate.sql_linkstate", "SqlLinkState"),
    ("flwr.superlink.federation.noop_federation_manager", "NoOpFederationManager"),
    ("flwr.proto.node_pb2", "NodeInfo"),
    ("flwr.supercore.constant", "NodeStatus"),
    ("flwr.common.constant", "SUPERLINK_NODE_ID"),
)
#: what fedderm.node_registry reads and writes on Flower's in-memory link state and its factory
_LINKSTATE_ATTRIBUTES = ("nodes", "node_public_key_to_node_id", "owner_to_node_ids", "lock")
_FACTORY_ATTRIBUTES = ("state_instance",)


def check_flower_internals() -> list[str]:
    """The Flower internals this launcher patches that are missing in the installed flwr."""
    missing = []
    for module, attr in _INTERNALS:
        try:
            if not hasattr(importlib.import_module(module), attr):
                missing.append(f"{module}.{attr}")
        except ImportError:
            missing.append(f"{module} (module)")
    try:  # what HeldPulls wraps on the SuperLink's link state
        linkstate = importlib.import_module("flwr.server.superlink.linkstate").LinkState
        for method in ("get_message_ins", "store_message_ins", "store_message_and_object_tree"):
            if not callable(getattr(linkstate, method, None)):
                missing.append(f"flwr.server.superlink.linkstate.LinkState.{method}")
    except (ImportError, AttributeError):
        missing.append("flwr.server.superlink.linkstate.LinkState")
    for fn_name in ("pull_objects", "pull_and_inflate_object_from_tree"):
        try:
            fn = getattr(importlib.import_module("flwr.supercore.inflatable.inflatable_utils"), fn_name)
            if not {"initial_backoff", "backoff_cap"} <= set(fn.__kwdefaults__ or {}):
                missing.append(
                    f"flwr.supercore.inflatable.inflatable_utils.{fn_name}(initial_backoff=, backoff_cap=)"
                )
        except (ImportError, AttributeError):
            pass
    try:  # instance attributes fedderm.node_registry relies on
        from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState
        from flwr.server.superlink.linkstate.linkstate_factory import LinkStateFactory
        from flwr.supercore.object_store import ObjectStoreFactory
        from flwr.superlink.federation.noop_federation_manager import NoOpFederationManager

        objects = ObjectStoreFactory()
        state = InMemoryLinkState(NoOpFederationManager(), objects.store())
        factory = LinkStateFactory(":flwr-in-memory:", NoOpFederationManager(), objects)
        missing += [f"InMemoryLinkState().{a}" for a in _LINKSTATE_ATTRIBUTES if not hasattr(state, a)]
        missing += [f"LinkStateFactory().{a}" for a in _FACTORY_ATTRIBUTES if not hasattr(factory, a)]
    except (ImportError, AttributeError, TypeError):
        pass  # the module-level entries above name what is gone
    return missing


def _env_seconds(name: str, default: float, low: float, high: float, who: str) -> float:
    """The environment variable ``name`` as seconds in ``[low, high]`` (``default`` when unset);
    anything else stops ``who`` with one line naming the variable."""
    raw = os.environ.get(name, "")
    try:
        value = float(raw) if raw else default
    except ValueError:
        raise SystemExit(f"{who}: {name}={raw!r} is not a number of seconds") from None
    if not low <= value <= high:
        raise SystemExit(f"{who}: {name}={value} must be in [{low:g}, {high:g}] seconds")
    return value


def poll_interval() -> float:
    """``FEDDERM_POLL_INTERVAL`` in seconds (default 0.05), the cap on every idle wait patched here."""
    return _env_seconds("FEDDERM_POLL_INTERVAL", DEFAULT_POLL_INTERVAL, 0.001, 10, "fedderm launcher")


def fast_object_pulls(interval: float | None = None) -> None:
    """Start Flower's object-pull retry back-off at ``interval`` and cap it at 4× that.

    Flower retries an object that is not there yet after 1, 2, 4, 8 s (``PULL_INITIAL_BACKOFF``,
    ``PULL_BACKOFF_CAP``); a message whose objects arrive a moment after its header then waits
    up to 15 s.  The defaults live on the function objects, shared by every caller.
    """
    interval = poll_interval() if interval is None else interval
    from flwr.supercore.inflatable import inflatable_utils

    for fn in (inflatable_utils.pull_objects, inflatable_utils.pull_and_inflate_object_from_tree):
        fn.__kwdefaults__["initial_backoff"] = interval
        fn.__kwdefaults__["backoff_cap"] = 4 * interval


#: the SuperExec's task poll when the SuperNode wakes it (:class:`_WakeableTime`): only a fallback
WOKEN_TASK_POLL = 1.0


class _WakeableTime:
    """The ``time`` module of Flower's SuperExec loop, whose ``sleep`` ends as soon as the SuperNode
    writes to the pipe ``fd`` (:func:`wake_superexec`: a message's header came, its task exists).

    The SuperExec then asks for tasks once per wake-up (and every :data:`WOKEN_TASK_POLL` s as a
    fallback) instead of every ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` s: a task's ClientApp is
    forked as soon as the task exists (while the SuperNode still pulls the message's objects, as
    with polling), and an idle SuperExec does not ask its SuperNode 10-20 times a second.  When
    the SuperNode is gone (end of file), ``sleep`` sleeps."""

    def __init__(self, fd: int, fallback: float = WOKEN_TASK_POLL):
        self.fd, self.fallback = fd, fallback

    def sleep(self, seconds: float) -> None:
        import select

        if self.fd < 0:
            _time.sleep(seconds)
            return
        ready, _, _ = select.select([self.fd], [], [], max(seconds, self.fallback))
        if ready:
            try:
                data = os.read(self.fd, 4096)  # every pending wake-up: one AcquireTask serves them
            except BlockingIOError:
                data = b"x"
            if not data:  # the SuperNode closed its end
                os.close(self.fd)
                self.fd = -1

    def __getattr__(self, name):
        return getattr(_time, name)


#: write ends of the pipes to the SuperExecs this SuperNode started (:class:`_SuperExecPopen`)
_WAKE_FDS: list[int] = []


def wake_superexec() -> None:
    """Tell this SuperNode's SuperExec that a task is waiting (a byte on its wake-up pipe)."""
    for fd in list(_WAKE_FDS):
        try:
            os.write(fd, b"x")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups the SuperExec has not read yet: it will ask anyway
        except OSError:  # the SuperExec is gone
            _WAKE_FDS.remove(fd)


def _waking_object_pull(pull_objects):
    """Flower's ``pull_objects`` as the SuperNode's message loop calls it (right after it created
    the message's task), preceded by :func:`wake_superexec`: the ClientApp is forked while the
    SuperNode pulls the message's objects from the SuperLink."""

    def wake_then_pull_objects(*args, **kwargs):
        wake_superexec()
        return pull_objects(*args, **kwargs)

    return wake_then_pull_objects


class _ClampedTime:
    """The ``time`` module with ``sleep`` clamped to an upper bound (the SuperNode's idle waits)."""

    def __init__(self, cap: float):
        self.cap = cap

    def sleep(self, seconds: float) -> None:
        _time.sleep(min(seconds, self.cap))

    def __getattr__(self, name):
        return getattr(_time, name)


# ---------------------------------------------------------------------------------------------
# the hospital's allow-list


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


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
    """The sha256 of the app bundle (FAB) that ``flwr run <app_dir>`` ships: what a hospital pins."""
    from flwr.cli.build import build_fab_from_disk

    return sha256_hex(build_fab_from_disk(Path(app_dir)))


def _guard_install(allowed: set[str] | None, source: str, warm: WarmApp | None = None) -> None:
    """Wrap Flower's FAB installation in the child: refuse a bundle not on the allow-list.

    ``warm``: the app the parent imported; dropped unless it is this very bundle (its sha256)."""
    rc = importlib.import_module("flwr.supernode.runtime.run_clientapp")
    original = rc.install_from_fab

    def install_checked(fab_content: bytes, *args, **kwargs):
        digest = sha256_hex(fab_content)
        if warm is not None and warm.digest != digest:
            warm.drop()  # another bundle than the one the parent imported: none of its modules
        if allowed is not None and digest not in allowed:
            message = REFUSAL.format(digest=digest, source=source)
            _log.error("fedderm launcher: %s", message)
            raise PermissionError(message)
        _log.info(
            "fedderm launcher: app bundle sha256 %s approved%s",
            digest[:16],
            " (imported once in the launcher)" if warm is not None and warm.digest == digest else "",
        )
        marker = _installed_marker(digest, *args, **kwargs)
        if marker.is_file() and Path(marker.read_text()).is_dir():
            return Path(marker.read_text())  # unpacked and verified by Flower for this very hash
        installed = original(fab_content, *args, **kwargs)
        if isinstance(installed, (str, Path)) and Path(installed).is_dir():
            marker.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(marker, str(installed).encode())
        return installed

    rc.install_from_fab = install_checked


def _installed_marker(digest: str, install_dir=None, *args, **kwargs) -> Path:
    """Where the launcher notes that Flower installed the bundle with this full sha256.

    Flower's ``install_from_fab`` unzips and re-hashes the whole bundle for every message, then
    keeps the folder it installed the first time (``apps/<publisher>.<name>.<version>.<hash8>``);
    the marker lets the next message skip the unzip (the same trust: Flower reuses that folder)."""
    from flwr.supercore.utils import get_flwr_home

    base = Path(install_dir).expanduser() if install_dir else get_flwr_home()
    return base / "apps" / ".fedderm-installed" / digest


# ---------------------------------------------------------------------------------------------
# the forking executor


def prewarm() -> None:
    """Import what every ClientApp needs, once, in the parent (no torch op runs here: fork-safe)."""
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


#: torch functions an app may call at import without making the parent unsafe to fork: they
#: build small tensors or read the build, none starts a thread pool (``torch.overrides`` names)
IMPORT_SAFE_TORCH = frozenset({"tensor", "as_tensor", "device", "_cuda_version", "get_default_dtype"})


def _drop_modules(names) -> None:
    for name in list(names):
        sys.modules.pop(name, None)


def _fedderm_modules() -> list[str]:
    """The launcher's own copy of fedderm (never run as app code), this module excepted."""
    return [m for m in sys.modules if (m == "fedderm" or m.startswith("fedderm.")) and m != __name__]


class _TorchCalls:
    """Record the torch functions called inside ``with`` (a ``TorchFunctionMode``)."""

    def __init__(self):
        self.names: list[str] = []

    def __enter__(self):
        from torch.overrides import TorchFunctionMode

        names = self.names

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                names.append(getattr(func, "__name__", str(func)))
                return func(*args, **(kwargs or {}))

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


class WarmApp:
    """The approved app bundle's ClientApp module, imported once in the launcher's parent.

    Flower's ``load_app`` reuses a module already in ``sys.modules``, so every forked child skips
    the app's import (~1 s per message on a loaded 2-core machine).  The modules the bundle's
    ``pyproject.toml`` lists under ``[tool.fedderm] preload`` (``package.*``: every module of the
    package) are imported right after it: what its handlers import only when a message comes
    (fedderm: each method's ``clients/<method>.py``).  Only a bundle that is on the
    allow-list (or any, without one) and that Flower already installed and verified (the marker of
    :func:`_installed_marker`) is imported, from the folder Flower installed it in; an import that
    runs a torch op other than :data:`IMPORT_SAFE_TORCH` is undone (the parent must stay safe to
    fork) and that bundle stays cold: each child imports it, as before."""

    def __init__(self):
        self.digest: str | None = None
        self.folder: Path | None = None
        self.modules: set[str] = set()

    def load(self, digest: str, folder: Path) -> bool:
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
                "fedderm launcher: app bundle %s kept cold: no clientapp in %s (%s)",
                digest[:16],
                folder / "pyproject.toml",
                err,
            )
            return False
        _drop_modules(_fedderm_modules())  # the bundle brings its own fedderm
        before = set(sys.modules)
        sys.path.insert(0, str(folder))
        self.digest, self.folder = digest, folder
        calls = _TorchCalls()
        try:
            with calls:
                importlib.import_module(module)
                for name in preload:  # what the app's handlers import only when a message comes
                    _import_preload(name)
        except Exception as err:  # noqa: BLE001 - the child imports it again and reports the error
            self.modules = self._bundled(set(sys.modules) - before)
            _log.warning(
                "fedderm launcher: app bundle %s kept cold: importing %s failed (%r)",
                digest[:16],
                module,
                err,
            )
            self.drop()
            return False
        self.modules = self._bundled(set(sys.modules) - before)
        unsafe = sorted(set(calls.names) - IMPORT_SAFE_TORCH)
        if unsafe:
            _log.warning(
                "fedderm launcher: app bundle %s kept cold: its import runs torch ops (%s)",
                digest[:16],
                ", ".join(unsafe),
            )
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
        _drop_modules(self.modules)
        if self.folder is not None and str(self.folder) in sys.path:
            sys.path.remove(str(self.folder))
        self.digest, self.folder, self.modules = None, None, set()


def _import_preload(name: str) -> None:
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


class ForkExecutor:
    """Flower's ``Executor`` protocol: one forked, pre-warmed child per ClientApp task.

    Other task types fall back to Flower's own :class:`SubprocessExecutor`.
    """

    def __init__(self, allowed: set[str] | None, source: str):
        from flwr.supercore.superexec.executor.subprocess_executor import SubprocessExecutor

        self.allowed, self.source = allowed, source
        self.fallback = SubprocessExecutor()
        self.children: set[int] = set()
        self.warm = WarmApp()
        self.cold: set[str] = set()  # bundles whose import cannot be kept in the parent

    def warm_up(self, digest: str | None) -> None:
        """Import the app of bundle ``digest`` in the parent if it is approved and installed."""
        if not digest or digest == self.warm.digest or digest in self.cold:
            return
        if self.allowed is not None and digest not in self.allowed:
            return  # the child refuses it; nothing of it is imported here
        marker = _installed_marker(digest)
        folder = Path(marker.read_text()) if marker.is_file() else None
        if folder is None or not folder.is_dir():
            return  # the first child installs it (Flower verifies it) and writes the marker
        if not self.warm.load(digest, folder):
            self.cold.add(digest)

    def get_eligible_capacity(self, supported_task_types, **kwargs):
        return self.fallback.get_eligible_capacity(supported_task_types, **kwargs)

    def wait_for_capacity(self, *args, **kwargs) -> None:
        return None

    def launch(self, spec):
        from flwr.supercore.constant import TaskType
        from flwr.supercore.superexec.executor.types import LaunchResult

        if spec.task_type != TaskType.CLIENT_APP:
            return self.fallback.launch(spec)
        started = _time.monotonic()
        self.warm_up(spec.fab_hash)
        pid = os.fork()
        if pid == 0:  # the child never returns
            self._child(spec)
        self.children.add(pid)
        _log.debug(
            "fedderm launcher: task %s forked as pid %d in %.3f s",
            spec.task_id,
            pid,
            _time.monotonic() - started,
        )
        return LaunchResult.accepted()

    def _child(self, spec) -> None:
        code = 1
        try:
            import signal

            from flwr.supercore.exit import exit_handler

            exit_handler.registered_exit_handlers[:] = []  # the parent's Runtime client is not ours
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_DFL)
            # the app bundle brings its own fedderm: never run the launcher's copy as app code; the
            # app the parent imported is kept only for its own bundle (checked again on the bytes)
            if spec.fab_hash != self.warm.digest:
                self.warm.drop()
            _drop_modules(_fedderm_modules() if self.warm.digest is None else [])
            _guard_install(self.allowed, self.source, self.warm)
            from flwr.supercore.tls import validate_and_resolve_root_certificates
            from flwr.supernode.runtime.run_clientapp import run_clientapp

            certificates = validate_and_resolve_root_certificates(spec.root_certificates_path, spec.insecure)
            run_clientapp(
                runtime_api_address=spec.runtime_api_address,
                token=spec.token,
                insecure=spec.insecure,
                certificates=certificates,
                parent_pid=os.getppid(),
                runtime_dependency_install=False,
            )
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # noqa: BLE001 - a child must never return into the parent's loop
            _log.exception("fedderm launcher: task child failed")
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    def reconcile(self) -> None:
        """Reap finished children (no zombies)."""
        for pid in list(self.children):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                self.children.discard(pid)

    def close(self) -> None:
        self.reconcile()
        self.fallback.close()


def _pop_option(argv: list[str], name: str) -> str | None:
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


def _allow_list_from(argv: list[str]) -> tuple[set[str] | None, str]:
    path = _pop_option(argv, "--allow-list") or os.environ.get("FEDDERM_ALLOW_LIST", "")
    if not path:
        return None, ""
    return read_allow_list(path), str(Path(path).expanduser())


def superexec_main(argv: list[str]) -> None:
    """``fedderm-superexec``: ``flower-superexec`` arguments plus ``--allow-list FILE``."""
    argv = list(argv)
    allowed, source = _allow_list_from(argv)
    wake_fd = _pop_option(argv, "--wake-fd")
    interval = poll_interval()
    os.environ.setdefault("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", str(max(interval, 0.01)))
    fast_object_pulls(interval)
    prewarm()
    # the packages re-export functions under the modules' names: import the modules themselves
    cli = importlib.import_module("flwr.supercore.cli.flower_superexec")
    rs = importlib.import_module("flwr.supercore.superexec.run_superexec")

    rs.get_executor = lambda *a, **k: ForkExecutor(allowed, source)
    if wake_fd is not None:
        rs.time = _WakeableTime(int(wake_fd))
    if allowed is not None:
        _log.warning("fedderm launcher: only app bundles on %s (%d hashes) will run", source, len(allowed))
    sys.argv = ["fedderm-superexec", *argv]
    cli.flower_superexec()


class _SuperExecPopen:
    """``subprocess`` for the SuperNode module: its ``flower-superexec`` becomes ours."""

    def __init__(self, extra: list[str]):
        import subprocess

        self._subprocess, self.extra = subprocess, extra

    def Popen(self, command, *args, **kwargs):  # noqa: N802 - mirrors subprocess.Popen
        if not command or command[0] != "flower-superexec":
            return self._subprocess.Popen(command, *args, **kwargs)
        # a pipe on which the SuperNode wakes its SuperExec when a task waits (_WakeableTime)
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        command = [
            sys.executable, "-m", "fedderm.launcher", "superexec", *command[1:], *self.extra,
            "--wake-fd", str(read_fd),
        ]  # fmt: skip
        kwargs["pass_fds"] = (*kwargs.get("pass_fds", ()), read_fd)
        try:
            popen = self._subprocess.Popen(command, *args, **kwargs)
        except BaseException:
            os.close(write_fd)
            raise
        finally:
            os.close(read_fd)
        _WAKE_FDS.append(write_fd)
        return popen

    def __getattr__(self, name):
        return getattr(self._subprocess, name)


def supernode_main(argv: list[str]) -> None:
    """``fedderm-supernode``: ``flower-supernode`` arguments plus ``--allow-list FILE``."""
    argv = list(argv)
    allow_list = _pop_option(argv, "--allow-list")
    extra = []
    if allow_list:
        read_allow_list(allow_list)  # fail at start, not at the first message
        extra = ["--allow-list", str(Path(allow_list).expanduser().resolve())]
    interval = poll_interval()
    fast_object_pulls(interval)
    sci = importlib.import_module("flwr.supernode.start_client_internal")
    cli = importlib.import_module("flwr.supernode.cli.flower_supernode")

    sci.time = _ClampedTime(interval)
    sci.subprocess = _SuperExecPopen(extra)
    sci.pull_objects = _waking_object_pull(sci.pull_objects)
    sys.argv = ["fedderm-supernode", *argv]
    cli.flower_supernode()


def app_hash_main(argv: list[str]) -> None:
    """``fedderm-app-hash [APP_DIR]``: print the sha256 a hospital puts on its allow-list."""
    app_dir = argv[0] if argv else "."
    if not (Path(app_dir) / "pyproject.toml").is_file():
        raise SystemExit(f"fedderm-app-hash: {app_dir} has no pyproject.toml (give the app's folder)")
    print(app_hash(app_dir))


# ---------------------------------------------------------------------------------------------
# the SuperLink: link state and objects in memory, the registered SuperNodes in --database


def link_state_in_memory() -> None:
    """Make ``flower-superlink --database FILE`` keep its link state (runs, message headers, node
    liveness) and the messages' objects (the model arrays) in memory, and only the registered
    SuperNodes in the SQLite FILE (:class:`fedderm.node_registry.RegisteredNodesLinkState`).
    Flower keeps all of it in FILE: every ResNet-18 message (43 MB) is written to and read back
    from SQLite, and every request's link-state queries go through SQLAlchemy (docs/deploy.md,
    "ResNet-18: where a round goes").  ``:flwr-in-memory:`` and non-SQLite URLs are left to Flower."""
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.superlink import config_loader
    from flwr.superlink import main as superlink_main

    from fedderm.node_registry import link_state_factory

    flower_factories = config_loader.get_objectstore_linkstate_factories

    def factories(database: str, federation_manager):
        if database.startswith(":flwr-in-memory:") or "://" in database:
            return flower_factories(database, federation_manager)
        objects = ObjectStoreFactory()  # Flower's in-memory store
        return objects, link_state_factory(database, federation_manager, objects)

    superlink_main.get_objectstore_linkstate_factories = factories


#: how long the SuperLink holds a SuperNode's pull when no message is waiting (``FEDDERM_PULL_HOLD``)
DEFAULT_PULL_HOLD = 1.0
#: at most this many pulls held at once: each holds one of the SuperLink's 40 request threads
MAX_HELD_PULLS = 16


def pull_hold() -> float:
    """``FEDDERM_PULL_HOLD`` in seconds (default 1; 0 answers every pull at once, as Flower)."""
    return _env_seconds("FEDDERM_PULL_HOLD", DEFAULT_PULL_HOLD, 0, 10, "fedderm-superlink")


class HeldPulls:
    """Long polling of the Fleet API's PullMessages, inside the SuperLink's link state.

    An idle SuperNode asks for a message every ``FEDDERM_POLL_INTERVAL`` (0.05 s): 20 TLS requests
    a second per hospital, each authenticated and answered from SQLite, which on two cores took
    ~40 % of a core at the SuperLink while nothing happened (docs/deploy.md).  Here a pull that
    finds nothing waits up to ``hold`` seconds for a message to be stored (any node's: the pull
    then asks again) before it answers "nothing", so an idle SuperNode asks about once per
    ``hold`` and a new message is delivered as soon as it is stored.  The SuperNode is unchanged
    (Flower's SuperNode, too, gets its messages sooner).  At most ``max_held`` pulls wait at once
    (each holds a request thread); beyond that a pull answers at once, as in Flower.
    """

    def __init__(self, hold: float, max_held: int = MAX_HELD_PULLS):
        self.hold = hold
        self.stored = 0  # messages stored so far (a counter, so that no wake-up is lost)
        self._cond = threading.Condition()
        self._slots = threading.BoundedSemaphore(max_held)

    def wrap(self, state):
        """Hold ``state``'s pulls of a SuperNode's messages; returns ``state``.

        Flower 1.42's Fleet API pulls through ``get_message_ins(node_id, limit)``; 1.43's through
        ``get_messages(dst_node_id=, limit=)`` (messages stay pending until acknowledged). Each
        method the installed link state has is wrapped; :func:`self_test_held_pull` checks the
        one Flower's own Fleet handler calls."""
        from flwr.common.constant import SUPERLINK_NODE_ID

        def stored() -> None:
            with self._cond:
                self.stored += 1
                self._cond.notify_all()

        def held(fetch, node_pull: bool):
            with self._cond:
                seen = self.stored
            messages = fetch()
            # the ServerApp's own pulls (SUPERLINK_NODE_ID, a run_id, replies) are answered at once
            if messages or not node_pull or self.hold <= 0:
                return messages
            if not self._slots.acquire(blocking=False):
                return messages
            try:
                deadline = _time.monotonic() + self.hold
                while not messages:
                    with self._cond:
                        while self.stored == seen:
                            left = deadline - _time.monotonic()
                            if left <= 0:
                                return messages
                            self._cond.wait(left)
                        seen = self.stored
                    messages = fetch()
                return messages
            finally:
                self._slots.release()

        if callable(getattr(state, "get_message_ins", None)):  # Flower 1.42
            get_message_ins = state.get_message_ins

            def get(node_id, limit, *, run_id=None):
                node_pull = node_id != SUPERLINK_NODE_ID and run_id is None
                return held(lambda: get_message_ins(node_id, limit, run_id=run_id), node_pull)

            state.get_message_ins = get
        if callable(getattr(state, "get_messages", None)):  # Flower 1.43
            get_messages = state.get_messages

            def get_pending(*, dst_node_id, run_id=None, reply_to_message_ids=None, limit=None):
                node_pull = (
                    dst_node_id != SUPERLINK_NODE_ID and run_id is None and reply_to_message_ids is None
                )
                return held(
                    lambda: get_messages(
                        dst_node_id=dst_node_id,
                        run_id=run_id,
                        reply_to_message_ids=reply_to_message_ids,
                        limit=limit,
                    ),
                    node_pull,
                )

            state.get_messages = get_pending
        if callable(getattr(state, "store_message_ins", None)):
            store_message_ins = state.store_message_ins

            def store(message):
                message_id = store_message_ins(message)
                if message_id is not None:
                    stored()
                return message_id

            state.store_message_ins = store
        if callable(getattr(state, "store_messages", None)):  # Flower 1.43
            store_messages = state.store_messages

            def store_many(messages):
                accepted = store_messages(messages)
                if any(ok for ok, m in zip(accepted, messages) if not m.metadata.reply_to_message_id):
                    stored()
                return accepted

            state.store_messages = store_many
        store_with_tree = state.store_message_and_object_tree

        def store_and_tree(message, object_tree, session_id):
            # the ServerApp's push: its transaction is committed when this returns (the wake-up
            # from the store inside it may come before the row is visible)
            result = store_with_tree(message, object_tree, session_id)
            if result[0] and not message.metadata.reply_to_message_id:
                stored()
            return result

        state.store_message_and_object_tree = store_and_tree
        return state


def hold_pulls(hold: float | None = None) -> None:
    """Make the SuperLink's link state (file or ``:flwr-in-memory:``) hold idle pulls (:class:`HeldPulls`)."""
    hold = pull_hold() if hold is None else hold
    if hold <= 0:
        return
    from flwr.superlink import main as superlink_main

    held = HeldPulls(hold)
    factories = superlink_main.get_objectstore_linkstate_factories

    def held_factories(database: str, federation_manager):
        objects, links = factories(database, federation_manager)
        make_state = links.state
        wrapped = []

        def state():
            instance = make_state()
            if not wrapped:  # Flower's factory makes one instance and returns it every time
                wrapped.append(held.wrap(instance))
            return instance

        links.state = state
        return objects, links

    superlink_main.get_objectstore_linkstate_factories = held_factories


def superlink_main_(argv: list[str]) -> None:
    """``fedderm-superlink``: ``flower-superlink`` (same options) with :func:`link_state_in_memory`
    and :func:`hold_pulls`."""
    from flwr.superlink.cli.flower_superlink import flower_superlink

    link_state_in_memory()
    hold_pulls()
    os.environ[ACCELERATED_ENV] = "1"  # the ServerApp it starts shortens its object pulls too
    sys.argv = ["flower-superlink", *argv]
    flower_superlink()


#: each role's stock Flower command, run when the launcher steps aside
STOCK_COMMANDS = {
    "supernode": ("flwr.supernode.cli.flower_supernode", "flower_supernode", "flower-supernode"),
    "superexec": ("flwr.supercore.cli.flower_superexec", "flower_superexec", "flower-superexec"),
    "superlink": ("flwr.superlink.cli.flower_superlink", "flower_superlink", "flower-superlink"),
}


def flower_version() -> str:
    import flwr

    return str(flwr.__version__)


def self_test_held_pull(hold: float = 0.2) -> str | None:
    """A SuperNode's pull through Flower's own Fleet handler, on Flower's in-memory link state
    wrapped by :class:`HeldPulls`, with nothing waiting: it must be held for ``hold`` seconds.
    Returns what failed, or ``None``."""
    from flwr.proto.fleet_pb2 import PullMessagesRequest  # pylint: disable=no-name-in-module
    from flwr.proto.node_pb2 import Node  # pylint: disable=no-name-in-module
    from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.superlink.federation.noop_federation_manager import NoOpFederationManager
    from flwr.superlink.servicer.fleet import fleet_handlers

    store = ObjectStoreFactory().store()
    state = HeldPulls(hold).wrap(InMemoryLinkState(NoOpFederationManager(), store))
    start = _time.monotonic()
    reply = fleet_handlers.pull_messages(PullMessagesRequest(node=Node(node_id=4242)), state, store)
    waited = _time.monotonic() - start
    if list(reply.messages_list) or waited < 0.8 * hold:
        return f"held pull: an idle pull through Flower's Fleet handler answered after {waited:.3f} s, not {hold} s"
    return None


def self_test_refusal() -> str | None:
    """Flower's ``install_from_fab``, as the launcher's child wraps it, refuses a bundle that is
    not on the allow-list before installing anything. Returns what failed, or ``None``."""
    rc = importlib.import_module("flwr.supernode.runtime.run_clientapp")
    original = rc.install_from_fab
    calls = []
    rc.install_from_fab = lambda *a, **k: calls.append(a)
    quiet, _log.disabled = _log.disabled, True  # the refusal's error line is expected here
    try:
        _guard_install({"0" * 64}, "self-test")
        try:
            rc.install_from_fab(b"not an approved bundle")
        except PermissionError:
            return None if not calls else "refusal: the bundle was installed before it was refused"
        return "refusal: a bundle off the allow-list was installed"
    finally:
        rc.install_from_fab, _log.disabled = original, quiet


#: the behavioural self-tests each role runs at start (all must pass, or nothing is patched)
SELF_TESTS = {
    "superlink": (self_test_held_pull,),
    "supernode": (self_test_refusal,),
    "superexec": (self_test_refusal,),
}


def why_stock(role: str) -> str:
    """Why ``role`` must run stock Flower (``""``: the launcher may patch it): an unverified
    Flower version, a Flower internal that moved, or a failed self-test."""
    version = flower_version()
    if version not in VERIFIED_FLOWER:
        return (
            f"flwr {version} is not a version the launcher was verified with ({', '.join(VERIFIED_FLOWER)})"
        )
    missing = check_flower_internals()
    if missing:
        return f"flwr {version} lacks the internals the launcher was verified with: {', '.join(missing)}"
    for test in SELF_TESTS.get(role, ()):
        failure = test()
        if failure:
            return f"self-test failed on flwr {version}: {failure}"
    return ""


def run_stock(role: str, argv: list[str], why: str) -> None:
    """Run ``role``'s stock Flower command with ``argv`` and one warning line; never a half-patched one.

    The allow-list is the launcher's: with one requested, stock Flower cannot honour it, so the
    SuperNode refuses to start instead of running unapproved bundles."""
    argv = list(argv)
    # a SuperNode's allow-list is --allow-list or FEDDERM_ALLOW_LIST (read by its SuperExec child)
    allow_list = _pop_option(argv, "--allow-list") or (
        os.environ.get("FEDDERM_ALLOW_LIST", "") if role != "superlink" else ""
    )
    _pop_option(argv, "--wake-fd")
    if allow_list:
        raise SystemExit(
            f"fedderm-{role}: {why}; stock Flower cannot enforce the allow-list {allow_list}, so this "
            "SuperNode does not start (install a verified Flower, or start flower-supernode without one)"
        )
    module, function, command = STOCK_COMMANDS[role]
    _log.warning("fedderm-%s: %s: running stock %s, nothing patched", role, why, command)
    sys.argv = [command, *argv]
    getattr(importlib.import_module(module), function)()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    commands = {
        "superexec": superexec_main,
        "supernode": supernode_main,
        "superlink": superlink_main_,
        "app-hash": app_hash_main,
    }
    if not argv or argv[0] not in commands:
        raise SystemExit("usage: python -m fedderm.launcher {superexec|supernode|superlink|app-hash} ...")
    role, rest = argv[0], argv[1:]
    if role != "app-hash":
        why = why_stock(role)
        if why:
            run_stock(role, rest, why)
            return
    commands[role](rest)


def supernode_entry() -> None:
    main(["supernode", *sys.argv[1:]])


def superexec_entry() -> None:
    main(["superexec", *sys.argv[1:]])


def superlink_entry() -> None:
    main(["superlink", *sys.argv[1:]])


def app_hash_entry() -> None:
    main(["app-hash", *sys.argv[1:]])


if __name__ == "__main__":
    main()
