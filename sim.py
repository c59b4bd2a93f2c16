"""Run the fedderm ServerApp/ClientApp in-process (Flower's simulation runtime, no SuperLink).

    python sim.py --num-supernodes 4 --run-config 'method="fedprox" proximal-mu=0.01'
    python sim.py --num-supernodes 4 --run-config presets/my-run.toml

Same run-config keys and TOML value syntax as ``flwr run --run-config``; same results folder.
The last line printed is ``results: <absolute path of the run folder>``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

APP_DIR = Path(__file__).resolve().parent


def parse_overrides(run_config: list[str] | None) -> dict:
    """``k=v`` strings (TOML values) or one ``.toml`` file -> flat run-config overrides."""
    from flwr.common.config import parse_config_args

    return parse_config_args(run_config)


def resolved_run_config(overrides: dict) -> dict:
    """pyproject defaults fused with ``overrides``, validated (raises ConfigError naming the key)."""
    from flwr.common.config import get_fused_config_from_dir

    import registry

    registry.load_config(overrides)  # names an unknown or mistyped key before Flower's terser check
    fused = get_fused_config_from_dir(APP_DIR, overrides)
    registry.load_config(fused)
    return fused


def _simulation_run(overrides: dict):
    """The ``Run`` that ``flwr run`` would register, carrying ``overrides``.

    Flower's public ``run_simulation`` leaves ``context.run_config`` empty; its internal
    ``_run_simulation`` accepts a ``Run`` whose overrides every ClientApp context is fused with
    (pyproject defaults + overrides, exactly as ``flwr run``).  These internals are the same in
    flwr 1.41 and 1.42, the versions pyproject.toml admits.
    """
    from flwr.common.constant import RUN_ID_NUM_BYTES, SUPERLINK_NODE_ID, TASK_ID_NUM_BYTES
    from flwr.server.superlink.linkstate.utils import generate_rand_int_from_bytes
    from flwr.simulation.run_simulation import NOOP_FEDERATION_ID
    from flwr.supercore.run import Run
    from flwr.supercore.task_identity import TaskIdentity

    run = Run.create_empty(generate_rand_int_from_bytes(RUN_ID_NUM_BYTES))
    run.primary_task_id = generate_rand_int_from_bytes(TASK_ID_NUM_BYTES)
    run.federation_id = NOOP_FEDERATION_ID
    run.override_config = dict(overrides)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, run.run_id, SUPERLINK_NODE_ID
    return run


def simulate(overrides: dict, num_supernodes: int = 2, cpus_per_client: int = 1,
             gpus_per_client: float = 0.0, verbose: bool = False, client_app=None) -> Path:
    """Run one simulation with ``num_supernodes`` virtual hospitals; return the run folder.

    ``client_app`` replaces fedderm's ClientApp (tests use it to inject faults)."""
    from flwr.app import Context, RecordDict
    from flwr.supercore.telemetry import EventType as Ev
    from flwr.simulation.run_simulation import _run_simulation

    from server_app import app as server_app

    if client_app is None:
        from client_app import app as client_app

    run_config = resolved_run_config(overrides)
    run = _simulation_run(overrides)
    run_id = run.run_id
    context = Context(run_id=run_id, node_id=0, node_config={}, state=RecordDict(), run_config=run_config)
    result = _run_simulation(
        num_supernodes=num_supernodes, exit_event=Ev.PYTHON_API_RUN_SIMULATION_LEAVE,
        client_app=client_app, server_app=server_app, server_app_context=context,
        backend_config={"client_resources": {"num_cpus": cpus_per_client, "num_gpus": gpus_per_client},
                        "init_args": {"num_cpus": max(os.cpu_count() or 1, cpus_per_client)}},
        app_dir=str(APP_DIR), is_app=True, run=run, verbose_logging=verbose,
    )
    state = result.context.state
    if "fedderm" not in state:
        raise RuntimeError("the run ended without writing results (see the log above)")
    return Path(state["fedderm"]["run-dir"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-supernodes", type=int, default=2, help="number of simulated hospitals")
    parser.add_argument("--run-config", nargs="*", default=None,
                        help="overrides 'key=value ...' (TOML values, strings quoted) or one .toml file")
    parser.add_argument("--cpus-per-client", type=int, default=1, help="CPU cores reserved per client")
    parser.add_argument("--gpus-per-client", type=float, default=0.0, help="GPU share per client")
    parser.add_argument("--verbose", action="store_true", help="Flower debug logging")
    args = parser.parse_args(argv)

    from fedderm.config import ConfigError

    try:
        overrides = parse_overrides(args.run_config)
        run_dir = simulate(overrides, args.num_supernodes, args.cpus_per_client, args.gpus_per_client,
                           args.verbose)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"results: {run_dir}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(APP_DIR))
    sys.exit(main())
