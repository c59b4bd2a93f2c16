"""Run the fedderm ServerApp/ClientApp in-process (Flower's simulation runtime, no SuperLink).

    python sim.py --num-supernodes 4 --run-config 'method="fedprox" proximal-mu=0.01'
    python sim.py --num-supernodes 4 --run-config presets/my-run.toml
    python sim.py --sweep sweeps/002-sift-tables-1-2.toml --quick     # every run of a paper table

Same run-config keys and TOML value syntax as ``flwr run --run-config``; same results folder.
The last line printed is ``results: <absolute path of the run folder>`` (with ``--sweep``:
``table: <path of table.md>``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import re
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

APP_DIR = Path(__file__).resolve().parent


def parse_overrides(run_config: list[str] | None) -> dict:
    """``k=v`` strings (TOML values) and/or one ``.toml`` file -> flat run-config overrides (the
    ``k=v`` pairs win); a mistake is a ConfigError naming the key or token (fedderm.cli)."""
    from fedderm.cli import parse_run_config

    return parse_run_config(run_config)[0]


def parse_sets(items: list[str]) -> dict:
    """``--set`` items: each one ``key=value`` with a TOML value, which may hold spaces, lists and
    inline tables (``sweep.axes.data=[{name="a b", dataset="npz"}]``); an item that is not one
    such pair is read like ``--run-config`` (several ``k=v`` separated by spaces)."""
    import tomllib

    out: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().strip('"')
        try:
            if not sep or not key or " " in key:
                raise ValueError(item)
            out[key] = tomllib.loads(f"v = {value}")["v"]
        except (ValueError, tomllib.TOMLDecodeError):
            out.update(parse_overrides([item]))
    return out


def resolved_run_config(overrides: dict) -> dict:
    """pyproject defaults fused with ``overrides``, validated and resolved (an unset ``model`` is the
    method's; raises ConfigError naming the key)."""
    import registry
    from fedderm.data.testset import check_test_data_path
    from fedderm.flower_private import fused_run_config

    registry.load_config(overrides)  # names an unknown or mistyped key before Flower's terser check
    fused = fused_run_config(APP_DIR, overrides)
    cfg = registry.load_config(fused)
    check_test_data_path(cfg)  # local data: a missing test set stops before Ray
    return cfg.to_flat()


def check_before_start(run_config: dict, num_supernodes: int) -> None:
    """What can be checked on this machine before Ray starts: enough clients for ``min-clients``,
    the data and ``resume`` paths exist.  Raises ConfigError naming the key."""
    check_clients(run_config, num_supernodes)
    check_paths(run_config)


def check_clients(run_config: dict, num_supernodes: int, option: str = "--num-supernodes") -> None:
    """``min-clients`` (plus a held-out centre) against the federation's ``num_supernodes``
    (``option`` names where the user sets it); raises ConfigError naming both."""
    from fedderm.config import ConfigError

    need = run_config["min-clients"] + (1 if run_config["holdout-centre"] else 0)
    if need > num_supernodes:
        raise ConfigError(
            f"run-config key 'min-clients' is {run_config['min-clients']}"
            f"{' (+1 held-out centre)' if run_config['holdout-centre'] else ''} but the "
            f"federation has {num_supernodes} clients ({option}): raise {option} "
            f"to {need} or lower min-clients"
        )


def check_paths(run_config: dict) -> None:
    """The data paths (``data-path``, ``image-dir``: not for the built-in data sets) and ``resume``
    exist on this machine; raises ConfigError naming the key."""
    from fedderm.config import EMBEDDED_DATASETS, ConfigError

    keys = ["resume"] + (["data-path", "image-dir"] if run_config["dataset"] not in EMBEDDED_DATASETS else [])
    for key in keys:
        path = str(run_config.get(key) or "")
        if path and not Path(path).expanduser().exists():
            raise ConfigError(f"run-config key {key!r}: {path} does not exist")


def check_gpus(run_config: dict, gpus_per_client: float, ray_address: str = "", cuda=None) -> None:
    """``--gpus-per-client`` and ``precision`` against this machine's CUDA devices, before Ray starts
    (docs/gpu.md).  With ``ray_address`` the clients run on the cluster's nodes, whose GPUs this
    machine cannot see: only the value is checked.  ``cuda`` (tests) stands in for ``torch.cuda``.

    Raises ConfigError naming the option: a GPU share without CUDA, a share above the GPUs
    present, ``precision="fp16"`` on a CPU-only run, or clients whose share of GPU memory is
    smaller than what their model's weights, gradients and optimiser state alone need."""
    from fedderm.config import ConfigError

    if gpus_per_client < 0:
        raise ConfigError(f"--gpus-per-client must be >= 0, got {gpus_per_client}")
    if ray_address:
        return
    if cuda is None:
        import torch

        cuda = torch.cuda
    available = cuda.is_available()
    if gpus_per_client > 0 and not available:
        raise ConfigError(
            f"--gpus-per-client {gpus_per_client:g} asks for a GPU share per client, but CUDA is not "
            "available on this machine (torch.cuda.is_available() is False): leave it at 0 to run on CPU"
        )
    device = run_config.get("device", "auto")
    on_gpu = available and device != "cpu"
    if run_config.get("precision") == "fp16" and not on_gpu:
        raise ConfigError(
            "run-config key 'precision' is \"fp16\", which needs CUDA, but the clients run on CPU "
            f"(device={device!r}, CUDA {'present' if available else 'not available'}): "
            'use precision="bf16" or "fp32"'
        )
    if gpus_per_client <= 0 or not on_gpu:
        return
    count = cuda.device_count()
    if gpus_per_client > count:
        raise ConfigError(
            f"--gpus-per-client {gpus_per_client:g} is more than the {count} GPU(s) of this machine: "
            "Ray could place no client"
        )
    props = cuda.get_device_properties(0)
    share = props.total_memory * min(gpus_per_client, 1.0)
    need = static_training_bytes(run_config)
    if need > share:
        gib = 2.0**30
        raise ConfigError(
            f"--gpus-per-client {gpus_per_client:g}: each client gets about {share / gib:.2f} GiB of the "
            f"{props.total_memory / gib:.1f} GiB of {props.name}, but model {run_config.get('model')!r} "
            f"needs at least {need / gib:.2f} GiB for its weights, gradients and optimiser state "
            "(activations come on top): raise --gpus-per-client or use a smaller model"
        )


def static_training_bytes(run_config: dict) -> int:
    """A lower bound of one client's GPU memory: float32 weights + gradients + optimiser state of the
    run's classifier (Adam/AdamW keep two moments, SGD with momentum one), i.e. 16 (Adam) or 12
    (SGD) bytes per parameter; activations, which grow with ``batch-size``, are not counted."""
    import registry
    from fedderm.models import create_model

    cfg = registry.load_config(run_config)
    model = create_model(cfg.model, 2, cfg.image_size)
    params = sum(p.numel() for p in model.parameters())
    return params * (16 if cfg.optimizer in ("adam", "adamw") else 12)


def backend_config(
    cpus_per_client: int, gpus_per_client: float, ray_address: str = "", verbose: bool = False
) -> dict:
    """Flower's Ray backend config: each client's resources (Ray places a client where they are
    free: ``num_gpus`` 0.25 puts four on one GPU) and ``ray.init``'s arguments: a local Ray
    sized to this machine, or with ``ray_address`` (``host:port`` of a running head node, or
    ``auto``) the existing cluster, whose nodes bring their own CPUs and GPUs."""
    init = (
        {"address": ray_address} if ray_address else {"num_cpus": max(os.cpu_count() or 1, cpus_per_client)}
    )
    if not verbose:  # the clients' output is Ray's per-round chatter; their errors come back in their replies
        init.update({"log_to_driver": False, "logging_level": logging.ERROR})
    return {
        "client_resources": {"num_cpus": cpus_per_client, "num_gpus": gpus_per_client},
        "init_args": init,
    }


def _resumed_config(run_config: dict) -> dict:
    """``run_config``, or with ``resume`` set the resumed run's saved settings (what the run will use)."""
    if not run_config.get("resume"):
        return run_config
    from server_app import saved_run_config

    folder = Path(str(run_config["resume"])).expanduser()
    return {**run_config, **saved_run_config(folder)} if (folder / "config.json").exists() else run_config


def check_data(run_config: dict, num_supernodes: int) -> list:
    """The data checks, once, before Ray starts (the data is local in a simulation): raises
    DataError (or ConfigError from the method's ``Method.data_check``) with one line naming the client and file."""
    import registry
    from fedderm.data import check_federation

    cfg = registry.load_config(run_config)
    if cfg.resume:  # a resumed run continues with its own settings (server_app.resolve_config)
        saved = Path(cfg.resume).expanduser() / "config.json"
        if not saved.is_file():
            return []  # the ServerApp names the missing folder
        from server_app import saved_run_config

        cfg = registry.load_config({**saved_run_config(saved.parent), "resume": cfg.resume})
    clients = check_federation(cfg, num_supernodes)
    data_check = registry.get_method(cfg.method).data_check
    if data_check:  # the method's own check of its options against the data (SiFT's class texts)
        module, name = data_check.split(":")
        getattr(importlib.import_module(module), name)(cfg, clients)
    return clients


def quick_config_check(overrides: dict) -> None:
    """The run config's keys, values and paths with only the typed config imported (no torch,
    Flower or Ray): a mistake is a ConfigError naming the key within about a second."""
    import registry

    check_before_start(registry.load_config(overrides).to_flat(), 1 << 30)


def app_run_config(app_dir: Path = APP_DIR) -> dict:
    """The run config of the app's pyproject.toml (``[tool.flwr.app.config]``, flattened as Flower
    flattens it), read with the standard library only."""
    import tomllib

    from fedderm.cli import flatten

    with open(Path(app_dir) / "pyproject.toml", "rb") as fh:
        return flatten(tomllib.load(fh)["tool"]["flwr"]["app"].get("config", {}))


def check_config(
    overrides: dict, num_supernodes: int | None = None, paths: bool = False, option: str = "--num-supernodes"
) -> dict:
    """What every federation must accept of a run config, in about a second (no torch, Flower or
    Ray): the app's pyproject.toml defaults fused with ``overrides`` as ``flwr run`` fuses them,
    every key known, every value of its type and range, every method's check; with
    ``num_supernodes``, enough clients for ``min-clients`` (``option``: where the user sets the
    federation's size); with ``paths``, the data and
    ``resume`` paths exist on this machine (a local simulation's).  Returns the resolved run
    config; raises ConfigError naming the key (``fedderm-run`` runs it before ``flwr run``)."""
    import registry

    registry.load_config(overrides)  # an unknown key is named as the user wrote it
    run_config = registry.load_config({**app_run_config(), **overrides}).to_flat()
    if num_supernodes is not None:
        check_clients(run_config, num_supernodes, option)
    if paths:
        check_paths(run_config)
    return run_config


def checked_run(
    overrides: dict,
    num_supernodes: int | None = None,
    gpus_per_client: float = 0.0,
    ray_address: str = "",
    data: bool = True,
) -> tuple[dict, int, list]:
    """Everything a simulation checks before it starts: the run config (fused with pyproject.toml
    as ``flwr run`` fuses it), the paths, ``min-clients`` against ``num_supernodes`` (default:
    ``min-clients``, plus one for a held-out centre), the GPUs and, with ``data``, every client's
    data (:func:`check_data`).  Returns (run config, number of clients, the clients' data)."""
    run_config = resolved_run_config(overrides)
    check_before_start(run_config, 1 << 30)  # the paths first: a resume needs its folder
    effective = _resumed_config(run_config)
    if num_supernodes is None:
        num_supernodes = effective["min-clients"] + (1 if effective["holdout-centre"] else 0)
    check_before_start(effective, num_supernodes)
    check_gpus(effective, gpus_per_client, ray_address)
    clients = check_data(run_config, num_supernodes) if data else []
    return run_config, num_supernodes, clients


def check_node_data(run_config: dict, node_config: str) -> list:
    """A hospital's own data as its SuperNode's ``--node-config`` names it (``data-path``,
    ``dataset``, ``partition-id``, ...), loaded and checked as its client will load it; raises
    DataError / NodeConfigError naming the client and the file."""
    import registry
    from fedderm.cli import parse_pairs
    from fedderm.data import load_client_data
    from fedderm.node import NodeConfigError, parse_node_config

    node = parse_node_config(parse_pairs(node_config))
    cfg = registry.load_config(_resumed_config(run_config))
    if node.data_path is None and node.dataset is None:
        raise NodeConfigError(
            "--node-config names no data: give data-path (and dataset) as the SuperNode will"
        )
    return [
        load_client_data(
            cfg, node.partition_id, node.num_partitions, data_path=node.data_path, dataset=node.dataset
        )
    ]


def check_run(
    overrides: dict,
    num_supernodes: int | None = None,
    *,
    data: bool = False,
    node_config: str = "",
    gpus_per_client: float = 0.0,
    ray_address: str = "",
    echo=print,
) -> None:
    """``sim.py --check`` (``fedderm-check``): the checks of a run, without running it.  The run
    config and its paths; with ``data``, the data as a simulation with ``num_supernodes`` clients
    partitions it, or with ``node_config`` one hospital's own data.  Raises on the first problem."""
    run_config, clients, loaded = checked_run(
        overrides, num_supernodes, gpus_per_client, ray_address, data=data and not node_config
    )
    if node_config:
        loaded = check_node_data(run_config, node_config)
    source = run_config["dataset"] + (f" {run_config['data-path']}" if run_config["data-path"] else "")
    if node_config:
        source = "the SuperNode's own (--node-config)"
    echo(
        f"run config ok: method {run_config['method']} · model {run_config['model']} · "
        f"{run_config['num-server-rounds']} rounds · min-clients {run_config['min-clients']} · data {source}"
    )
    for client in loaded:
        split = client.split
        per_split = client.class_counts()
        totals = [sum(per_split[k][i] for k in ("train", "val", "test")) for i in range(client.num_classes)]
        counts = ", ".join(f"{c} {n}" for c, n in zip(client.classes, totals))
        echo(
            f"data ok: client {client.partition_id}: train {len(split.train)} (labelled {len(split.labelled)}) · "
            f"val {len(split.val)} · test {len(split.test)}; classes (label order) {counts}"
        )
    if data and not node_config:
        echo(f"({clients} clients as sim.py --num-supernodes {clients} partitions the data)")


def simulate(
    overrides: dict,
    num_supernodes: int | None = None,
    cpus_per_client: int = 1,
    gpus_per_client: float = 0.0,
    verbose: bool = False,
    client_app=None,
    preset: str = "",
    user_overrides: dict | None = None,
    ray_address: str = "",
) -> Path:
    """Run one simulation with ``num_supernodes`` virtual hospitals (default: ``min-clients``, plus
    one for a held-out centre); return the run folder.

    ``client_app`` replaces fedderm's ClientApp (tests use it to inject faults).  ``preset`` and
    ``user_overrides`` (default: ``overrides``) are what the command line gave: config.json records
    them, and a resume warns only about the keys in ``user_overrides``.  ``ray_address`` joins a
    running Ray cluster instead of starting a local one (:func:`backend_config`)."""
    # every check before Flower's simulation runtime, the apps and Ray are imported or started
    run_config, num_supernodes = checked_run(overrides, num_supernodes, gpus_per_client, ray_address)[:2]

    from fedderm.flower_private import run_simulation_in_process, simulation_run
    from server_app import app as server_app
    from wire import ray_out_of_band

    if client_app is None:
        from client_app import app as client_app

    run = simulation_run(overrides)  # the Run flwr run would register, carrying the overrides
    context = server_context(run.run_id, run_config, overrides, preset, user_overrides)
    ray_out_of_band()  # the messages to the ClientApp actors: Arrays out of band (wire.ray_out_of_band)
    try:
        final = off_main_thread(
            run_simulation_in_process,
            num_supernodes=num_supernodes,
            client_app=client_app,
            server_app=server_app,
            context=context,
            run=run,
            backend_config=backend_config(cpus_per_client, gpus_per_client, ray_address, verbose),
            app_dir=APP_DIR,
            verbose=verbose,
        )
    except BaseException as err:
        _stop_server_app(err)
        raise
    return run_folder(final.state)


def server_context(run_id: int, run_config: dict, overrides: dict, preset: str = "", user_overrides=None):
    """The ServerApp's Context of a simulation: the run config and, in its state, what the command
    line gave (``preset``, ``user_overrides``, default ``overrides``) for config.json and resume."""
    from flwr.app import ConfigRecord, Context, RecordDict

    from server_app import CLI_RECORD

    given = dict(overrides if user_overrides is None else user_overrides)
    state = RecordDict({CLI_RECORD: ConfigRecord({"preset": preset, "overrides": json.dumps(given)})})
    return Context(run_id=run_id, node_id=0, node_config={}, state=state, run_config=run_config)


def run_folder(state) -> Path:
    """The run folder the ServerApp recorded in its context ``state``."""
    if "fedderm" not in state:
        raise RuntimeError("the run ended without writing results (see the log above)")
    return Path(state["fedderm"]["run-dir"])


def off_main_thread(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` run in a worker thread while this (main) thread waits for it.

    Flower's simulation runtime starts Ray from the thread that runs it, and ``ray.init`` on the
    main thread replaces the process's SIGTERM handler with its own (``sys.exit``) and so would
    take SIGTERM from :func:`fedderm.console.stop_on_signals`; from another thread it leaves
    signals alone.  Signals still reach the main thread, which waits in short slices."""
    out: dict = {}

    def target():
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as err:  # re-raised in the caller's thread
            out["error"] = err

    worker = threading.Thread(target=target, name="flower-simulation", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.1)
    if "error" in out:
        raise out["error"]
    return out["value"]


#: seconds the ServerApp has to end after the simulation runtime failed
SERVER_APP_GRACE = 10.0


def _stop_server_app(err: BaseException, grace: float = SERVER_APP_GRACE) -> None:
    """The simulation runtime failed (Ray did not start, ...): Flower raises here while its
    ServerApp thread may still wait for clients that will never answer (an hour by
    ``round-timeout``).  Record the runtime's error as the run's first error, stop the
    ServerApp's grid so that it ends, and wait up to ``grace`` s for it to record its end."""
    from server_app import CURRENT, record_end

    reason = f"the simulation runtime failed: {_failure_line(err)}"
    recorder, grid = CURRENT.get("recorder"), CURRENT.get("grid")
    if recorder is not None:
        record_end(recorder, "failed", reason)
    if grid is None:
        return
    grid.stop(reason)
    deadline = time.monotonic() + grace
    while CURRENT.get("grid") is grid and time.monotonic() < deadline:
        time.sleep(0.05)


# --------------------------------------------------------------------------- sweeps
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_NOT_COMPARED = ("run-name", "output-dir", "resume")


@contextlib.contextmanager
def _output_to(path: Path):
    """Send everything written to fds 1 and 2 (Flower's log, Ray's forwarded client output) to
    ``path`` while a sweep run goes, so the console shows only the progress lines."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def _reason_from_log(path: Path) -> str:
    """The last ERROR line of a run's log, else the last line of its last traceback."""
    try:
        lines = [_ANSI.sub("", line).strip() for line in path.read_text(errors="replace").splitlines()]
    except OSError:
        return ""
    errors = [line for line in lines if "ERROR" in line and line.strip("ERROR: ")]  # noqa: B005 (a set of chars)
    if errors:
        return errors[-1].replace("ERROR :", "").strip()
    raised = [line for line in lines if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", line)]
    return raised[-1] if raised else ""


def _config_mismatch(saved: dict, wanted: dict) -> list[str]:
    return [
        f"{k}: {saved.get(k)!r} there, {v!r} now"
        for k, v in sorted(wanted.items())
        if k not in _NOT_COMPARED and saved.get(k) != v
    ]


def run_sweep(
    path: str,
    quick: bool = False,
    out: str | None = None,
    seeds: list[int] | None = None,
    sets: dict | None = None,
    cpus_per_client: int = 1,
    gpus_per_client: float = 0.0,
    verbose: bool = False,
    echo=print,
    ray_address: str = "",
    gpu: bool = False,
    simulate_fn=None,
) -> Path:
    """Run every row × seed (× fold) of a sweep file through :func:`simulate` (or ``simulate_fn``,
    same signature); write table.md and table.json into the sweep folder; return the table.md path.

    A run whose folder already holds a complete summary.json (same settings) is not run again;
    an incomplete one resumes from its newest checkpoint (or, with none, is moved aside to
    ``<name>.incomplete-<k>`` and run afresh).  A failed run is recorded with its reason.
    """
    spec, folder = sweep_spec(path, quick, out, seeds, sets, gpu)
    runs = spec.runs()
    echo(
        f"sweep {spec.name}{' (--quick)' if quick else ''}{' (--gpu)' if gpu else ''}: "
        f"{len(spec.rows())} rows × {len(spec.seeds)} seed(s)"
        f"{f' × {spec.cv_folds} folds' if spec.cv_folds else ''} = {len(runs)} runs, "
        f"{spec.num_supernodes} clients each -> {folder}"
    )

    def run_one(overrides):
        return (simulate_fn or simulate)(
            overrides, spec.num_supernodes, cpus_per_client, gpus_per_client, verbose, ray_address=ray_address
        )

    started = time.monotonic()
    results = []
    for run in runs:
        result, how = sweep_run(spec, run, folder, run_one, verbose)
        results.append(result)
        echo(f"run {run.index + 1}/{len(runs)}: {run.describe()}{how}")
        _write_tables(spec, results, folder, time.monotonic() - started, path, quick, gpu)
    text, table_md = _write_tables(spec, results, folder, time.monotonic() - started, path, quick, gpu)
    echo("")
    echo(text)
    echo(f"table: {table_md}")
    return table_md


def sweep_spec(path: str, quick=False, out=None, seeds=None, sets=None, gpu=False):
    """The checked sweep of ``path`` (with its ``[quick]`` / ``[gpu]`` layers, ``--set`` and
    ``--seeds``) and its folder (``out``, created)."""
    import registry
    from fedderm import sweep as fs
    from fedderm.config import default_config

    valid = sorted([*default_config(), *registry.method_options()])
    spec = fs.load_sweep(path, quick, sets, seeds, registry.load_config, valid, gpu)
    if out:
        folder = Path(out).expanduser().resolve()
    else:
        root = Path(str({**spec.base, **spec.late}.get("output-dir", default_config()["output-dir"])))
        root = root.expanduser().resolve()
        flags = ("-quick" if quick else "") + ("-gpu" if gpu else "")
        folder = root / "sweeps" / f"{spec.name}{flags}-{datetime.now():%Y%m%d-%H%M%S}"
    (folder / "logs").mkdir(parents=True, exist_ok=True)
    return spec, folder


#: the last line of a failed sweep run's log: this, then why
FAILED_LINE = "sweep: run failed: "


def sweep_run(spec, run, folder: Path, run_one, verbose: bool = False) -> tuple[dict, str]:
    """One run of a sweep in ``folder``: skipped when done before (same settings), resumed from
    its newest checkpoint, else run afresh by ``run_one(overrides)`` (which returns the run folder)
    with its output in ``logs/<run>.log``.  Returns the table's result entry and how it went."""
    from fedderm import sweep as fs
    from fedderm import sweep_tables as ft

    run_dir = folder / run.name
    overrides = {**run.overrides, "output-dir": str(folder), "run-name": run.name}
    summary = ft.read_summary(run_dir)
    if ft.is_complete(summary):
        mismatch = _config_mismatch(summary.get("config") or {}, resolved_run_config(overrides))
        if mismatch:
            raise fs.SweepError(
                f"{run_dir} holds a finished run with other settings ({'; '.join(mismatch)}); "
                f"use another --out, or remove that folder to run it again"
            )
        result = {"run": run.index, "dir": str(run_dir), "status": "done", "seconds": None}
        return {**result, "summary": summary, "reason": ""}, " ... done before, skipped"
    how = ""
    if run_dir.exists():
        if any(run_dir.glob("checkpoint*-round-*.pt")):
            overrides["resume"] = str(run_dir)
            how = " (resumed)"
        else:
            k = 1
            while run_dir.with_name(f"{run.name}.incomplete-{k}").exists():
                k += 1
            run_dir.rename(run_dir.with_name(f"{run.name}.incomplete-{k}"))
    log = folder / "logs" / f"{run.name}.log"
    t0 = time.monotonic()
    reason = ""
    try:
        with contextlib.nullcontext() if verbose else _output_to(log):
            done_dir = run_one(overrides)
        summary = ft.read_summary(done_dir)
    except Exception as err:  # noqa: BLE001 - a failed run is recorded and the sweep goes on
        done_dir, summary, reason = (
            run_dir if run_dir.exists() else None,
            None,
            f"{type(err).__name__}: {err}",
        )
    seconds = time.monotonic() - t0
    ok = ft.is_complete(summary)
    if not ok:
        reason = " ".join((reason or _reason_from_log(log) or "no final metrics (see the log)").split())
        with open(log, "a") as f:
            f.write(f"{FAILED_LINE}{reason}\n")
    result = {
        "run": run.index,
        "dir": str(done_dir) if done_dir else None,
        "seconds": round(seconds, 1),
        "status": "done" if ok else "failed",
        "reason": reason,
        "summary": summary if ok else None,
    }
    return result, f"{how} ... {seconds:.0f} s" + ("" if ok else f" FAILED: {reason} (log: {log})")


def _write_tables(
    spec, results, folder: Path, seconds: float, path: str, quick: bool, gpu: bool = False
) -> tuple[str, Path]:
    from fedderm import sweep_tables as ft

    table = ft.aggregate(spec, results)
    ran = [r for r in results if r.get("seconds") is not None]
    failed = sum(r["status"] != "done" for r in results)
    footer = (
        f"`python sim.py --sweep {path}{' --quick' if quick else ''}{' --gpu' if gpu else ''} --out {folder}`: "
        f"{len(results)} runs ({len(results) - len(ran)} done before, {failed} failed); "
        f"wall time {seconds:.0f} s. Run folders: {folder}/"
    )
    table["wall_time_s"] = round(seconds, 1)
    text = ft.render_markdown(table, footer)
    (folder / "table.json").write_text(json.dumps(table, indent=2, allow_nan=False) + "\n")
    (folder / "table.md").write_text(text)
    from fedderm import sweep_plots

    sweep_plots.write_curves(table, results, folder)  # val_curves.png: each arm's curve, the seeds' spread
    sweep_plots.write_provenance(
        folder
    )  # commit, machine, versions: what `python -m fedderm.ledger import` reads
    return text, folder / "table.md"


def main(argv: list[str] | None = None) -> int:
    from fedderm.cli import plain

    parser = argparse.ArgumentParser(
        description=plain(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--num-supernodes",
        type=int,
        default=None,
        help="number of simulated hospitals (default: min-clients, plus one for a held-out centre)",
    )
    parser.add_argument(
        "--run-config",
        nargs="*",
        default=None,
        help="overrides 'key=value ...' (TOML values, strings quoted) or one .toml file",
    )
    parser.add_argument("--cpus-per-client", type=int, default=1, help="CPU cores reserved per client")
    parser.add_argument(
        "--gpus-per-client",
        type=float,
        default=0.0,
        help="GPU share per client (0.25: four clients per GPU); needs CUDA (docs/gpu.md)",
    )
    parser.add_argument(
        "--ray-address",
        default="",
        metavar="ADDRESS",
        help="join a running Ray cluster (host:port of its head node, or auto) instead of starting "
        "a local Ray (docs/gpu.md)",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="Flower debug logging (with --sweep: the runs' output on the console instead of <out>/logs/)",
    )
    check = parser.add_argument_group("checks only (fedderm-check): nothing is trained, Ray does not start")
    check.add_argument(
        "--check",
        action="store_true",
        help="check the run config and its paths (as sim.py and flwr run would use them), then exit",
    )
    check.add_argument(
        "--check-data",
        action="store_true",
        help="--check, and load and check the data: a simulation's clients (--num-supernodes, "
        "default min-clients), or with --node-config one hospital's own data",
    )
    check.add_argument(
        "--check-config",
        action="store_true",
        help="check only the run config's keys, types and values (what any federation must "
        "accept; no paths, GPUs or data), then exit: fedderm-run runs it before flwr run",
    )
    check.add_argument(
        "--with-paths",
        action="store_true",
        help="with --check-config: also that data-path, image-dir and resume exist on this machine",
    )
    check.add_argument("--size-option", default="--num-supernodes", help=argparse.SUPPRESS)
    check.add_argument(
        "--node-config",
        default="",
        metavar="'KEY=VALUE ...'",
        help="with --check-data: a SuperNode's --node-config (data-path, dataset, partition-id)",
    )
    sweep = parser.add_argument_group('experiment sweeps (README, "Experiment sweeps")')
    sweep.add_argument(
        "--sweep", metavar="FILE", help="a sweeps/*.toml sweep: run every row and seed, write table.md"
    )
    sweep.add_argument("--grid", dest="old_grid", metavar="FILE", help="old name of --sweep (deprecated)")
    sweep.add_argument("--quick", action="store_true", help="with --sweep: apply the file's [quick] section")
    sweep.add_argument(
        "--gpu",
        action="store_true",
        help="with --sweep: apply the file's [gpu] section (the larger scale for a CUDA machine)",
    )
    sweep.add_argument(
        "--out",
        help="with --sweep: the sweep folder (run folders, logs/, table.md, table.json); "
        "the same folder again resumes. Default <output-dir>/sweeps/<name>-<time>",
    )
    sweep.add_argument("--seeds", help="with --sweep: comma-separated seeds, replacing sweep.seeds")
    sweep.add_argument(
        "--set",
        nargs="*",
        default=None,
        metavar="KEY=VALUE",
        help="with --sweep: run-config keys or sweep.<key> / sweep.axes.<axis> (TOML values)",
    )
    args = parser.parse_args(argv)
    if args.old_grid:
        print(
            "sim.py: --grid is deprecated and will be removed: use --sweep (sweep files are in sweeps/)",
            file=sys.stderr,
        )
        args.sweep = args.sweep or args.old_grid

    if not args.sweep and (args.quick or args.gpu or args.out or args.seeds or args.set):
        parser.error("--quick, --gpu, --out, --seeds and --set go with --sweep")
    if args.sweep and args.run_config:
        parser.error("--sweep takes --set for overrides, not --run-config")
    if args.sweep and (args.check or args.check_data):
        parser.error("--check and --check-data check one run's --run-config, not a --sweep")
    if args.node_config and not args.check_data:
        parser.error("--node-config goes with --check-data")
    if args.with_paths and not args.check_config:
        parser.error("--with-paths goes with --check-config")
    if args.check_config:
        if args.sweep:
            parser.error("--check-config checks one run's --run-config, not a --sweep")
        from fedderm.cli import parse_run_config
        from fedderm.config import ConfigError

        try:
            overrides = parse_run_config(args.run_config)[0]
            config = check_config(overrides, args.num_supernodes, args.with_paths, args.size_option)
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(f"run config ok: method {config['method']} · model {config['model']}")
        return 0
    from fedderm.cli import parse_run_config
    from fedderm.config import ConfigError

    if not args.sweep:
        try:  # a config mistake in about a second: before torch, Flower and Ray are imported
            overrides, preset, given = parse_run_config(args.run_config)
            quick_config_check(overrides)
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    from fedderm import console
    from fedderm.data import DataError
    from fedderm.node import NodeConfigError

    console.setup(verbose=args.verbose)
    console.stop_on_signals(_interrupted)
    try:
        if args.check or args.check_data:
            check_run(
                overrides,
                args.num_supernodes,
                data=args.check_data,
                node_config=args.node_config,
                gpus_per_client=args.gpus_per_client,
                ray_address=args.ray_address,
            )
            return 0
        if args.sweep:
            seeds = [int(s) for s in args.seeds.split(",") if s.strip()] if args.seeds else None
            run_sweep(
                args.sweep,
                args.quick,
                args.out,
                seeds,
                parse_sets(args.set) if args.set else None,
                args.cpus_per_client,
                args.gpus_per_client,
                args.verbose,
                ray_address=args.ray_address,
                gpu=args.gpu,
            )
            return 0
        run_dir = simulate(
            overrides,
            args.num_supernodes,
            args.cpus_per_client,
            args.gpus_per_client,
            args.verbose,
            preset=preset,
            user_overrides=given,
            ray_address=args.ray_address,
        )
    except (ConfigError, NodeConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except DataError as err:  # the data checks (docs/data-checks.md), before any round
        print(f"error: {err}", file=sys.stderr)
        return 1
    except Exception as err:  # noqa: BLE001 - one line on the console; the run folder has the rest
        print(f"error: {_failure_line(err)}", file=sys.stderr)
        folder = _current_run_dir()
        if folder:
            print(
                f"the run failed; its folder records why (summary.json: status, error): {folder}",
                file=sys.stderr,
            )
        return 1
    print(f"results: {run_dir}")
    return 0


def _current_run_dir() -> Path | None:
    from server_app import CURRENT

    recorder = CURRENT.get("recorder") or CURRENT.get("last")
    return recorder.run_dir if recorder is not None else None


def _failure_line(err: BaseException) -> str:
    """The innermost cause of ``err`` as one line (Flower wraps the ServerApp's error in its own)."""
    while err.__cause__ is not None:
        err = err.__cause__
    text = " ".join(str(err).split())
    return text if isinstance(err, (ValueError, RuntimeError, OSError)) else f"{type(err).__name__}: {text}"


def _interrupted(signum: int) -> None:
    """Ctrl-C / SIGTERM: record the interruption in the run folder, say how to resume (the newest
    per-round checkpoint is already on disk), and leave at once (130 / 143) without Ray's dumps."""
    import signal

    from server_app import CURRENT, record_end

    name = signal.Signals(signum).name
    recorder = CURRENT.get("recorder")
    lines = [f"interrupted ({name}): the run stopped"]
    if recorder is not None:
        with contextlib.suppress(Exception):  # an end recorded before (the first error) stays
            if not record_end(recorder, "interrupted", f"stopped by {name}"):
                lines.append(
                    f"it had already ended: {recorder.extra.get('error') or recorder.extra.get('status')}"
                )
        saved = sorted(recorder.run_dir.glob("checkpoint*-round-*.pt"), key=lambda p: p.stat().st_mtime)
        ckpt = saved[-1] if saved else None
        if ckpt:
            lines.append(f"last checkpoint: {ckpt}")
            lines.append(f"resume with: python sim.py --run-config 'resume=\"{recorder.run_dir}\"'")
        else:
            lines.append(f"no round finished yet, nothing to resume; run folder: {recorder.run_dir}")
    print("\n".join(lines), file=sys.stderr, flush=True)


#: seconds Ray's processes get to end on SIGTERM after a finished run, before SIGKILL
RAY_GRACE = 5.0


def _leave(code: int, grace: float = SERVER_APP_GRACE) -> None:
    """Exit with ``code`` within ``grace`` s.  After a success, once every process this one started
    (Ray's workers, which Ray's shutdown leaves for 10-30 s) has ended; after a failure, or while
    a thread still runs (a ServerApp whose simulation runtime failed), at once, with those
    processes killed, as on Ctrl-C: nothing holds the process or outlives it."""
    import threading

    from fedderm import console

    deadline = time.monotonic() + grace
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    for thread in others:
        thread.join(max(0.0, deadline - time.monotonic()))
    sys.stdout.flush()
    sys.stderr.flush()
    if code == 0 and not any(t.is_alive() for t in others):
        console.stop_children(grace=RAY_GRACE)
        sys.exit(code)
    console.stop_children()
    os._exit(code)


if __name__ == "__main__":
    from fedderm.console import tag_processes

    tag_processes()  # Ray's processes inherit the tag: none is left behind when sim.py ends
    _leave(main())
