"""The app's only uses of Flower's private names: what its public API does not offer (flwr 1.42).

Everything else in the app (outside the deployment accelerator, the package ``fedderm/accel/``)
imports only Flower's documented modules; ``tests/test_flower_api.py``
fails on any other private name or patch, and ``tests/test_flower_private.py`` checks, for each
entry of :data:`EXCEPTIONS`, what Flower must still do for it to be right.  Flower is imported
inside the functions: importing this module costs nothing.
"""

from __future__ import annotations

import secrets
from pathlib import Path

#: (module, name) -> why there is no public way (tests/test_flower_api.py keeps the list exact)
EXCEPTIONS: dict[tuple[str, str], str] = {
    ("flwr.simulation.run_simulation", "_run_simulation"): (
        "the in-process simulation entry that takes a prepared ServerApp Context, a Run whose "
        "overrides reach every ClientApp's run config, and returns the final Context; the public "
        "run_simulation (deprecated in 1.42) takes none of them and returns nothing"
    ),
    ("flwr.supercore.run", "Run"): "the Run that flwr run would register, carrying the run-config overrides",
    (
        "flwr.simulation.run_simulation",
        "NOOP_FEDERATION_ID",
    ): "the federation id Flower gives a simulated Run",
    ("flwr.common.constant", "SUPERLINK_NODE_ID"): "the node id the ServerApp's messages come from",
    ("flwr.supercore.task_identity", "TaskIdentity"): (
        "every Message the ServerApp creates reads its run, task and node id from it; Flower sets "
        "it only when it creates the Run itself"
    ),
    ("flwr.supercore.task_identity.TaskIdentity", "task_id"): "set as Flower's own run_simulation sets it",
    ("flwr.supercore.task_identity.TaskIdentity", "run_id"): "set to the prepared Run's id, as Flower does",
    ("flwr.supercore.task_identity.TaskIdentity", "node_id"): "set to SUPERLINK_NODE_ID, as Flower does",
    ("flwr.common.config", "get_fused_config_from_dir"): (
        "the run config exactly as flwr run fuses pyproject defaults and --run-config overrides"
    ),
    ("flwr.superlink.grid", "InMemoryGrid"): (
        "simulation or deployment: the ServerApp's Context and Grid carry no public marker of it, "
        "and client state lives beside the run folder only in a simulation"
    ),
    ("flwr.superlink.grid", "HttpGrid"): (
        "a deployment's grid moves every record, Array and chunk as one HTTP object per hop: "
        "only there are a message's records packed into one"
    ),
    ("flwr.supercore.exit", "add_exit_handler"): (
        "flwr stop reaches a flwr run process as a SIGINT its heartbeat raises; Flower's signal "
        "handler then runs only the handlers registered here and ends the process (os._exit after "
        "5 s): the ServerApp's thread, atexit and the app's own signal handlers never run there"
    ),
    ("flwr.common.serde", "recorddict_to_proto"): (
        "the audit's message sizes are the size of Flower's serialised content (protobuf "
        "ByteSize); records' public count_bytes counts the arrays' and values' bytes only"
    ),
}


def fused_run_config(app_dir: str | Path, overrides: dict) -> dict:
    """The app's pyproject run config with ``overrides``, as ``flwr run`` fuses them."""
    from flwr.common.config import get_fused_config_from_dir

    return dict(get_fused_config_from_dir(Path(app_dir), overrides))


def simulation_run(overrides: dict):
    """The ``Run`` that ``flwr run`` would register, carrying ``overrides``; sets the task identity
    the ServerApp's messages are created with (as Flower's ``run_simulation`` does for its Run)."""
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.simulation.run_simulation import NOOP_FEDERATION_ID
    from flwr.supercore.run import Run
    from flwr.supercore.task_identity import TaskIdentity

    run = Run.create_empty(_random_id())
    run.primary_task_id = _random_id()
    run.federation_id = NOOP_FEDERATION_ID
    run.override_config = dict(overrides)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, run.run_id, SUPERLINK_NODE_ID
    return run


def _random_id() -> int:
    """A run or task id: a random positive 63-bit integer (an id only names the Run)."""
    return secrets.randbits(63) or 1


def run_simulation_in_process(
    *,
    server_app,
    client_app,
    num_supernodes: int,
    context,
    run,
    backend_config: dict,
    app_dir: str | Path,
    verbose: bool = False,
):
    """Run ``server_app`` with ``context`` (its run config already fused) and ``num_supernodes``
    ClientApps whose contexts carry ``app_dir``'s run config fused with ``run``'s overrides (as
    ``flwr run`` gives them); return the ServerApp's final Context."""
    from flwr.common import EventType
    from flwr.simulation.run_simulation import _run_simulation

    result = _run_simulation(
        num_supernodes=num_supernodes,
        exit_event=EventType.PYTHON_API_RUN_SIMULATION_LEAVE,
        client_app=client_app,
        server_app=server_app,
        server_app_context=context,
        backend_config=backend_config,
        app_dir=str(app_dir),
        is_app=True,
        run=run,
        verbose_logging=verbose,
    )
    return result.context


def grid_kind(grid) -> str:
    """``"simulation"`` for the simulation runtime's in-memory grid, ``"deployment"`` for a
    SuperLink's; any other grid (the tests' in-process ones) says what it stands for in its
    ``fedderm_grid_kind`` attribute, else ``"other"``."""
    from flwr.superlink.grid import HttpGrid, InMemoryGrid

    if isinstance(grid, InMemoryGrid):
        return "simulation"
    if isinstance(grid, HttpGrid):
        return "deployment"
    return str(getattr(grid, "fedderm_grid_kind", "other"))


def on_flower_exit(handler) -> None:
    """Call ``handler()`` when Flower ends this process through its own exit path (``flwr stop``,
    a signal to a ``flwr-simulation``/``flwr-serverapp`` process, the end of the run), before the
    process leaves; Flower's force-exit timer (5 s) runs meanwhile, so a hung handler cannot hold
    the process."""
    from flwr.supercore.exit import add_exit_handler

    add_exit_handler(handler)


def content_size(content) -> int:
    """Bytes of ``content`` (a RecordDict) as Flower serialises it (protobuf ``ByteSize``)."""
    from flwr.common.serde import recorddict_to_proto

    return int(recorddict_to_proto(content).ByteSize())
