"""The app speaks Flower's public API only.

Every shipped module of the app outside the deployment accelerator (the package
``fedderm/accel/``) may import from Flower (and Ray) only the names Flower (and Ray)
document, listed in :data:`PUBLIC` from Flower's API reference
(https://flower.ai/docs/framework/ref-api/flwr.html: ``flwr.app``, ``flwr.clientapp`` with
``flwr.clientapp.mod``, ``flwr.serverapp`` with ``flwr.serverapp.strategy``, ``flwr.simulation``,
``flwr.common``), and patch no Flower or Ray object.  The one exception module,
``fedderm/flower_private.py``, holds what has no public equivalent, each name in its
``EXCEPTIONS`` table with the reason; ``tests/test_flower_private.py`` checks what Flower must
still do for each to be right.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: the deployment accelerator: may use Flower's internals (it checks them itself when it starts)
ACCELERATOR = "fedderm/accel"
#: the one module allowed Flower's private names, each listed in its EXCEPTIONS table
EXCEPTIONS_MODULE = "fedderm/flower_private.py"
#: the shipped app: the entry points, the two sides, the wire protocol and the core
APP = (
    "server_app.py",
    "client_app.py",
    "sim.py",
    "wire.py",
    "registry.py",
    "strategies",
    "clients",
    "fedderm",
)

#: Flower's public API as its reference documents it (flwr 1.42), and Ray's public names the app
#: uses.  ``None``: every name of the module that does not start with an underscore.
PUBLIC: dict[str, frozenset[str] | None] = {
    "flwr": frozenset({"app", "clientapp", "serverapp", "simulation", "common"}),
    "flwr.app": frozenset(
        {
            "Array",
            "ArrayRecord",
            "ConfigRecord",
            "ConfigRecordValues",
            "ConfigScalar",
            "ConfigScalarList",
            "Context",
            "DEFAULT_TTL",
            "Error",
            "Message",
            "MessageType",
            "Metadata",
            "MetricRecord",
            "MetricRecordValues",
            "MetricScalar",
            "MetricScalarList",
            "RecordDict",
            "UserConfig",
            "UserConfigValue",
        }
    ),
    "flwr.clientapp": frozenset({"ClientApp", "mod"}),
    "flwr.clientapp.mod": frozenset(
        {"LocalDpMod", "adaptiveclipping_mod", "arrays_size_mod", "fixedclipping_mod", "message_size_mod"}
    ),
    "flwr.serverapp": frozenset(
        {
            "GaussianPrivacyEvent",
            "Grid",
            "NeighboringRelation",
            "PrivacyAccountant",
            "PrivacyConfig",
            "PrivacySpent",
            "RdpAccountant",
            "SamplingMethod",
            "ServerApp",
            "strategy",
        }
    ),
    "flwr.serverapp.strategy": frozenset(
        {
            "Bulyan",
            "DifferentialPrivacyClientSideAdaptiveClipping",
            "DifferentialPrivacyClientSideFixedClipping",
            "DifferentialPrivacyServerSideAdaptiveClipping",
            "DifferentialPrivacyServerSideFixedClipping",
            "FedAdagrad",
            "FedAdam",
            "FedAvg",
            "FedAvgM",
            "FedMedian",
            "FedProx",
            "FedTrimmedAvg",
            "FedXgbBagging",
            "FedXgbCyclic",
            "FedYogi",
            "Krum",
            "MultiKrum",
            "QFedAvg",
            "Result",
            "Strategy",
        }
    ),
    "flwr.simulation": frozenset(
        {"run_simulation", "run_simulation_process", "start_simulation", "SimulationIoConnection"}
    ),
    # the functions and classes of https://flower.ai/docs/framework/ref-api/flwr.common.html
    "flwr.common": frozenset(
        {
            "array_from_numpy",
            "bytes_to_ndarray",
            "configure",
            "event",
            "log",
            "ndarray_to_bytes",
            "ndarrays_to_parameters",
            "now",
            "parameters_to_ndarrays",
            "Array",
            "ArrayRecord",
            "ClientMessage",
            "Code",
            "Config",
            "ConfigRecord",
            "ConfigsRecord",
            "Context",
            "DisconnectRes",
            "Error",
            "EvaluateIns",
            "EvaluateRes",
            "EventType",
            "FitIns",
            "FitRes",
            "GetParametersIns",
            "GetParametersRes",
            "GetPropertiesIns",
            "GetPropertiesRes",
            "Message",
            "MessageType",
            "MessageTypeLegacy",
            "Metadata",
            "MetricRecord",
            "Metrics",
            "MetricsAggregationFn",
            "MetricsRecord",
            "NDArray",
            "NDArrays",
            "Parameters",
            "ParametersRecord",
            "Properties",
            "ReconnectIns",
            "RecordDict",
            "RecordSet",
            "ServerMessage",
            "Status",
        }
    ),
    # Flower Datasets (https://flower.ai/docs/datasets/ref-api/flwr_datasets.html)
    "flwr_datasets": None,
    "flwr_datasets.partitioner": None,
    "flwr_datasets.preprocessor": None,
    # Ray (https://docs.ray.io/en/latest/ray-core/api/): what the app uses
    "ray": frozenset({"init", "is_initialized", "shutdown", "util"}),
    "ray.util": frozenset({"register_serializer", "deregister_serializer"}),
}
ROOTS = ("flwr", "flwr_datasets", "ray")


@dataclass(frozen=True, order=True)
class Use:
    """One use of a Flower/Ray name in a file: ``kind`` is ``import`` (a non-public name imported
    or reached as a module attribute), ``patch`` (an attribute of a Flower/Ray object written) or
    ``private-member`` (a private member of a Flower base class used)."""

    path: str
    line: int
    kind: str
    module: str
    name: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.kind} {self.module}{'.' if self.name else ''}{self.name}"


def is_public(module: str, name: str = "") -> bool:
    """Whether ``module`` (and ``name`` in it, when given) is in :data:`PUBLIC`."""
    if module not in PUBLIC:
        return False
    names = PUBLIC[module]
    if not name:
        return True
    return not name.startswith("_") if names is None else name in names


def _dotted(node: ast.AST) -> list[str] | None:
    """``a.b.c`` as ["a", "b", "c"], else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def flower_private_members() -> frozenset[str]:
    """Single-underscore members (methods, class attributes) of Flower's public classes that an
    app subclass could reach through ``self`` or ``super()``, e.g. ``FedAvg._check_and_log_replies``."""
    found = set()
    for module, names in PUBLIC.items():
        if not module.startswith("flwr.") or names is None:
            continue
        mod = importlib.import_module(module)
        for name in names:
            obj = getattr(mod, name, None)
            if inspect.isclass(obj):
                for klass in obj.__mro__:
                    if (klass.__module__ or "").split(".")[0] == "flwr":
                        found.update(a for a in vars(klass) if a.startswith("_") and not a.endswith("_"))
    return frozenset(found)


def _reached(full: list[str], path: str, line: int) -> list[Use]:
    """The non-public name an attribute chain ``full`` (``flwr.common.logger.x``) reaches through
    the deepest public module it starts with."""
    for i in range(len(full) - 1, 0, -1):
        module = ".".join(full[:i])
        if module in PUBLIC:
            name = full[i]
            if not is_public(module, name) and f"{module}.{name}" not in PUBLIC:
                return [Use(path, line, "import", module, name)]
            return []
    return []


def scan(source: str, path: str, private_members: frozenset[str] = frozenset()) -> list[Use]:
    """Every non-public Flower/Ray name ``source`` imports or reaches, every attribute of a
    Flower/Ray object it writes (``x.attr = ...``, ``x.__kwdefaults__[...] = ...``, ``setattr``),
    and every use of one of ``private_members`` that the source does not define itself."""
    tree = ast.parse(source, path)
    uses: list[Use] = []
    bound: dict[str, str] = {}  # local name -> the Flower/Ray module or object it stands for
    unlisted = set()  # local names bound to a non-public name (reported once, at the import)
    defined = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            defined.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                root = alias.name.split(".")[0]
                if root not in ROOTS:
                    continue
                local = alias.asname or root
                if not is_public(alias.name):
                    uses.append(Use(path, node.lineno, "import", alias.name, ""))
                    unlisted.add(local)
                bound[local] = alias.name if alias.asname else root
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] not in ROOTS:
                continue
            for alias in node.names:
                local = alias.asname or alias.name
                if not is_public(node.module, alias.name) and not is_public(f"{node.module}.{alias.name}"):
                    uses.append(Use(path, node.lineno, "import", node.module, alias.name))
                    unlisted.add(local)
                bound[local] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            parts = _dotted(node)
            if parts and parts[0] in bound:
                full = [*bound[parts[0]].split("."), *parts[1:]]
                if isinstance(node.ctx, ast.Store):
                    uses.append(Use(path, node.lineno, "patch", ".".join(full[:-1]), full[-1]))
                elif parts[0] not in unlisted:
                    uses += _reached(full, path, node.lineno)
            if node.attr == "__kwdefaults__":  # no app code has a reason to touch one
                owner = (
                    ".".join([*bound[parts[0]].split("."), *parts[1:-1]])
                    if parts and parts[0] in bound
                    else "?"
                )
                uses.append(Use(path, node.lineno, "patch", owner, "__kwdefaults__"))
            elif node.attr in private_members and node.attr not in defined:
                uses.append(Use(path, node.lineno, "private-member", "flwr", node.attr))
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Subscript):  # mod.TABLE[k] = ...
                    parts = _dotted(target.value)
                    if parts and parts[0] in bound and len(parts) > 1 and parts[-1] != "__kwdefaults__":
                        full = [*bound[parts[0]].split("."), *parts[1:]]
                        uses.append(Use(path, node.lineno, "patch", ".".join(full[:-1]), full[-1]))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("setattr", "delattr")
        ):
            parts = _dotted(node.args[0]) if node.args else None
            if parts and parts[0] in bound:
                uses.append(Use(path, node.lineno, "patch", bound[parts[0]], f"({node.func.id})"))
    return sorted(set(uses))


def app_files() -> list[Path]:
    files = []
    for entry in APP:
        p = ROOT / entry
        files += [p] if p.is_file() else sorted(p.rglob("*.py"))
    return [f for f in files if not f.is_relative_to(ROOT / ACCELERATOR)]


def app_uses() -> list[Use]:
    members = flower_private_members()
    return [u for f in app_files() for u in scan(f.read_text(), str(f.relative_to(ROOT)), members)]


def _exceptions() -> dict[tuple[str, str], str]:
    from fedderm import flower_private

    return flower_private.EXCEPTIONS


def test_the_public_list_names_what_flower_and_ray_export():
    """The list is Flower's reference, not wishful: every name is there in the installed Flower."""
    for module, names in PUBLIC.items():
        mod = importlib.import_module(module)
        for name in names or ():
            assert hasattr(mod, name), f"{module}.{name}"


def test_the_app_uses_only_flowers_public_api_outside_the_listed_exceptions():
    allowed = _exceptions()
    offenders = [
        str(u)
        for u in app_uses()
        if not (
            u.path == EXCEPTIONS_MODULE and u.kind in ("import", "patch") and (u.module, u.name) in allowed
        )
    ]
    assert offenders == [], "private Flower/Ray names or patches outside the accelerator:\n" + "\n".join(
        offenders
    )


def test_every_listed_exception_is_used_and_has_a_reason():
    """The table does not go stale: each entry is still used, and says why."""
    used = {(u.module, u.name) for u in app_uses() if u.path == EXCEPTIONS_MODULE}
    for key, why in _exceptions().items():
        assert key in used, f"{key} is listed in {EXCEPTIONS_MODULE} but no longer used"
        assert len(why.split()) >= 5, f"{key}: say why"


@pytest.mark.parametrize(
    ("snippet", "expected"),
    [
        ("from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords", "import"),
        ("from flwr.common.constant import SType", "import"),
        ("import ray._private.utils as u", "import"),
        ("import flwr.common\nflwr.common.logger.console_handler", "import"),
        ("from flwr.serverapp.strategy import FedAvg\nFedAvg.__init__.__kwdefaults__['x'] = 1", "patch"),
        ("from flwr.serverapp.strategy import FedAvg\nFedAvg.aggregate_train = None", "patch"),
        ("from flwr.serverapp import Grid\nsetattr(Grid, 'pull_messages', None)", "patch"),
        (
            "class S:\n    def f(self):\n        return self._check_and_log_replies([], True)",
            "private-member",
        ),
    ],
)
def test_the_checker_catches_an_offending_snippet(snippet, expected):
    uses = scan(textwrap.dedent(snippet), "snippet.py", flower_private_members())
    assert [u.kind for u in uses] and {u.kind for u in uses} == {expected}, uses


def test_the_checker_passes_public_code():
    snippet = """
        import ray
        from flwr.app import ArrayRecord, Message
        from flwr.common import log
        from flwr.serverapp.strategy import FedAvg
        from ray.util import register_serializer

        class S(FedAvg):
            def _own(self):
                return self._own

            def aggregate_train(self, server_round, replies):
                return super().aggregate_train(server_round, replies)

        ray.is_initialized()
    """
    assert scan(textwrap.dedent(snippet), "snippet.py", flower_private_members()) == []
