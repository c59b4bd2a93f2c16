"""The accelerator's gate and entry points: one per role (``fedderm-supernode``,
``fedderm-superexec``, ``fedderm-superlink``, and ``fedderm-app-hash``).

A role is patched only on a Flower version in :data:`VERIFIED_FLOWER` (compared, not printed)
whose internals are where they were verified (:func:`check_flower_internals`) and whose
behavioural self-tests pass (:data:`SELF_TESTS`); otherwise it runs stock Flower with one
warning line, never half-patched, and a SuperNode asked for an allow-list refuses to start.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from pathlib import Path

from fedderm.accel import forkserver, superlink, supernode
from fedderm.accel.allow import app_hash, pop_option, self_test_refusal
from fedderm.accel.waits import self_test_short_wait

_log = logging.getLogger("flwr")


#: Flower versions whose internals, self-tests and deployment tests passed (compared at start)
VERIFIED_FLOWER = ("1.41.0", "1.42.0", "1.43.0.dev20261026")

#: (module, attribute) pairs of Flower internals the accelerator relies on; what the self-tests
#: exercise (``install_from_fab``, the object-pull back-off, the link state's pull and store
#: methods) fails there when it moves
_INTERNALS = (
    ("flwr.supercore.superexec.run_superexec", "get_executor"),
    ("flwr.supercore.superexec.run_superexec", "run_superexec"),
    ("flwr.supercore.superexec.executor.subprocess_executor", "SubprocessExecutor"),
    ("flwr.supercore.superexec.executor.types", "LaunchResult"),
    ("flwr.supercore.cli.flower_superexec", "flower_superexec"),
    ("flwr.supernode.runtime.run_clientapp", "run_clientapp"),
    ("flwr.supercore.tls", "validate_and_resolve_root_certificates"),
    ("flwr.supercore.utils", "get_flwr_home"),
    ("flwr.supernode.start_client_internal", "time"),
    ("flwr.supernode.start_client_internal", "subprocess"),
    ("flwr.supernode.cli.flower_supernode", "flower_supernode"),
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


#: what fedderm.accel.node_registry reads and writes on Flower's in-memory link state and its factory
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
    try:  # instance attributes fedderm.accel.node_registry relies on
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


#: each role's stock Flower command, run when the launcher steps aside
STOCK_COMMANDS = {
    "supernode": ("flwr.supernode.cli.flower_supernode", "flower_supernode", "flower-supernode"),
    "superexec": ("flwr.supercore.cli.flower_superexec", "flower_superexec", "flower-superexec"),
    "superlink": ("flwr.superlink.cli.flower_superlink", "flower_superlink", "flower-superlink"),
}


def flower_version() -> str:
    import flwr

    return str(flwr.__version__)


#: the behavioural self-tests each role runs at start (all must pass, or nothing is patched)
SELF_TESTS = {
    "superlink": (self_test_short_wait, superlink.self_test_held_pull),
    "supernode": (self_test_short_wait, self_test_refusal),
    "superexec": (self_test_short_wait, self_test_refusal, forkserver.self_test_fork_server),
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
        try:
            failure = test()
        except Exception as err:  # noqa: BLE001 - a self-test that cannot run has failed
            failure = f"{test.__name__}: {err!r}"
        if failure:
            return f"self-test failed on flwr {version}: {failure}"
    return ""


def run_stock(role: str, argv: list[str], why: str) -> None:
    """Run ``role``'s stock Flower command with ``argv`` and one warning line; never a half-patched one.

    The allow-list is the launcher's: with one requested, stock Flower cannot honour it, so the
    SuperNode refuses to start instead of running unapproved bundles."""
    argv = list(argv)
    # a SuperNode's allow-list is --allow-list or FEDDERM_ALLOW_LIST (read by its SuperExec child)
    allow_list = pop_option(argv, "--allow-list") or (
        os.environ.get("FEDDERM_ALLOW_LIST", "") if role != "superlink" else ""
    )
    pop_option(argv, "--wake-fd")
    if allow_list:
        raise SystemExit(
            f"fedderm-{role}: {why}; stock Flower cannot enforce the allow-list {allow_list}, so this "
            "SuperNode does not start (install a verified Flower, or start flower-supernode without one)"
        )
    module, function, command = STOCK_COMMANDS[role]
    _log.warning("fedderm-%s: %s: running stock %s, nothing patched", role, why, command)
    sys.argv = [command, *argv]
    getattr(importlib.import_module(module), function)()


def app_hash_main(argv: list[str]) -> None:
    """``fedderm-app-hash [APP_DIR]``: print the sha256 a hospital puts on its allow-list."""
    app_dir = argv[0] if argv else "."
    if not (Path(app_dir) / "pyproject.toml").is_file():
        raise SystemExit(f"fedderm-app-hash: {app_dir} has no pyproject.toml (give the app's folder)")
    print(app_hash(app_dir))


def main(argv: list[str] | None = None) -> None:
    """``python -m fedderm.accel ROLE ...``: ``ROLE`` patched if the gate lets it, else stock Flower."""
    argv = sys.argv[1:] if argv is None else argv
    commands = {
        "superexec": supernode.superexec_main,
        "supernode": supernode.supernode_main,
        "superlink": superlink.superlink_main,
        "app-hash": app_hash_main,
    }
    if not argv or argv[0] not in commands:
        raise SystemExit(f"usage: python -m fedderm.accel {{{'|'.join(commands)}}} ...")
    role, rest = argv[0], argv[1:]
    if role == "superlink" and (warning := superlink.exposure_warning(rest)):
        _log.warning("fedderm-superlink: %s", warning)
    if role != "app-hash":
        why = why_stock(role)
        if why:
            run_stock(role, rest, why)
            return
    commands[role](rest)


def entry() -> None:
    """The ``fedderm-<role>`` scripts (pyproject.toml): the role is the script's name."""
    main([Path(sys.argv[0]).name.removeprefix("fedderm-"), *sys.argv[1:]])
