"""fedderm ServerApp: parse the run config once, meet the clients, run the method, write results."""

from __future__ import annotations

import importlib
import json
import os
import sys
import threading
from datetime import datetime
from logging import INFO, WARNING
from pathlib import Path

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.common import log
from flwr.serverapp import Grid, ServerApp

import registry
from fedderm import flower_private
from fedderm.config import CHOICES, ConfigError
from fedderm.console import one_line_config_errors, stop_children
from fedderm.data.checks import check_union
from fedderm.lora import load_init_checkpoint
from fedderm.models import create_classifier
from fedderm.paths import inside, is_safe_component, safe_component
from fedderm.results import RunRecorder
from fedderm.train import seed_everything
from strategies.common import StateClock, run_federated
from strategies.fastpoll import FastPollGrid
from strategies.holdout import HoldoutGrid, finetune_holdout, holdout_nodes
from strategies.nodes import SentTo, wait_for_nodes
from strategies.screening import info_problem, short_reason
from wire import ray_out_of_band, to_record

app = ServerApp()
HANDSHAKE_TIMEOUT = 1800.0


def meet_clients(grid: Grid, node_ids: list[int], cfg, timeout: float = 600) -> dict[int, ConfigRecord]:
    """Hand every client the resolved run config and ask for its class list and split sizes
    (``query.info``); check that they agree."""
    msgs = [
        Message(RecordDict({"config": ConfigRecord(cfg.to_flat())}), dst_node_id=n, message_type="query.info")
        for n in node_ids
    ]
    infos, failed, rejected = {}, [], {}
    sent = SentTo(msgs)  # a dead node's error reply comes from the SuperLink: map by message id
    for reply in grid.send_and_receive(msgs, timeout=timeout):
        node = sent.node_of(reply)
        if reply.has_error():
            reason = " ".join(short_reason(reply.error.reason, 2000).split())  # data errors name the client
            failed.append(reason if reason.startswith("client ") else f"node {node}: {reason}")
        elif problem := info_problem(reply.content.config_records.get("info")):
            rejected[node] = problem
        else:
            infos[node] = reply.content["info"]
    if failed:
        raise RuntimeError("clients refused the run or could not load their data: " + "; ".join(failed))
    for node, problem in rejected.items():  # left out of the federation: its later replies are rejected
        log(
            WARNING, "node %d: handshake reply rejected: %s; the node takes no part in the run", node, problem
        )
    silent = sorted(set(node_ids) - set(infos) - set(rejected))
    if silent:
        log(WARNING, "nodes %s did not answer the handshake within %.0f s", silent, timeout)
    held = holdout_nodes(cfg, infos)  # a centre kept out of the federation (holdout-centre)
    if len(infos) - len(held) < cfg.min_clients:
        raise RuntimeError(
            f"only {len(infos) - len(held)} of {len(node_ids) - len(held)} federated clients answered "
            f"the handshake within {timeout:.0f} s (min-clients={cfg.min_clients})"
            + "".join(f"; node {n}'s reply was rejected: {p}" for n, p in rejected.items())
        )
    by_pid: dict[int, list[int]] = {}
    for nid, info in infos.items():
        by_pid.setdefault(int(info["partition-id"]), []).append(nid)
    clashes = {pid: nids for pid, nids in by_pid.items() if len(nids) > 1}
    if clashes:
        raise RuntimeError(
            f"several clients report the same partition-id {clashes} (partition-id: node ids); "
            "give each SuperNode its own --node-config 'partition-id=N'"
        )
    classes = {tuple(info["classes"]) for nid, info in infos.items() if nid not in held}
    if len(classes) != 1:
        raise RuntimeError(
            f"clients disagree on the class list: {sorted(classes)}; set the run-config "
            "key 'classes' so that every hospital maps labels the same way"
        )
    counts = {
        f"client {info['partition-id']}": list(info["class-counts"])
        for nid, info in infos.items()
        if nid not in held and "class-counts" in info
    }
    if counts:  # every class must have images somewhere (docs/data-checks.md)
        check_union(counts, list(next(iter(classes))))
    for nid, info in sorted(infos.items(), key=lambda kv: kv[1]["partition-id"]):
        site = f" {info['site']!r}" if info.get("site") else ""
        own = info.get("data-source") == "node-config"
        log(
            INFO,
            "client %d%s (node %d): train %d (labelled %d) · val %d · test %d%s%s",
            info["partition-id"],
            site,
            nid,
            info["train"],
            info["labelled"],
            info["val"],
            info["test"],
            f" · {info['skipped-files']} bad files skipped" if info["skipped-files"] else "",
            f" · node-config data: {info['dataset']} {info['data-path']}".rstrip() if own else "",
        )
    return infos


def client_data(infos: dict) -> dict[str, dict]:
    """Each client's data as it reported it in the handshake, by partition id: ``dataset``,
    ``data-path`` (as its node config or the run config names it), ``source`` (``node-config`` or
    ``run-config``), ``site``, its image counts, and the PyTorch version, intra-op threads and
    device it trains with (config.json and summary.json ``client-data``)."""
    out = {}
    for info in sorted(infos.values(), key=lambda i: int(i["partition-id"])):
        split = {k: int(info[k]) for k in ("train", "labelled", "val", "test")}
        out[str(info["partition-id"])] = {
            "dataset": str(info.get("dataset", "")),
            "data-path": str(info.get("data-path", "")),
            "source": str(info.get("data-source", "run-config")),
            "site": str(info.get("site", "")),
            "images": split["train"] + split["val"] + split["test"],
            **split,
            "skipped-files": int(info["skipped-files"]),
            "torch": str(info["torch"]),
            "torch-threads": int(info["torch-threads"]),
            "device": str(info["device"]),
        }
    return out


def data_label(cfg, data: dict | None) -> str:
    """The data part of a run folder's name: ``node-config-<formats>`` when hospitals named their
    own data in node config, else the run config's ``dataset``.  The formats are what the clients
    reported: any that is not a known format is left out of the name (a client's word never
    becomes a path)."""
    known = set(CHOICES["dataset"])
    own = {str(c.get("dataset")) for c in (data or {}).values() if c.get("source") == "node-config"}
    if not own:
        return cfg.dataset
    named = sorted(own & known) + (["other"] if own - known else [])
    return f"node-config-{'-'.join(named)}"


def record_classes(recorder: RunRecorder, cfg, method, classes: list[str], infos: dict) -> None:
    """Print the class list (label order) with images per class per client and split, and record it
    in summary.json and the model files' metadata (fedderm.inference reads it)."""
    splits = ("train", "labelled", "val", "test")
    counts = {
        str(info["partition-id"]): {s: [int(v) for v in info[f"counts-{s}"]] for s in splits}
        for info in infos.values()
        if f"counts-{splits[0]}" in info
    }
    meta = {
        "method": cfg.method,
        "model": cfg.model,
        "image_size": cfg.image_size,
        "network": method.network,
        "vit_pool": cfg.vit_pool,
    }
    if "flbt.proj-dim" in cfg.options:
        meta["proj_dim"] = int(cfg.option("flbt.proj-dim"))
    own = getattr(importlib.import_module(method.strategy), "model_metadata", None)
    if own is not None:  # the method's own network (SiFT's text head): fedderm.inference rebuilds it
        meta.update(own(cfg))
    recorder.set_classes(classes, counts, meta)
    log(INFO, "classes (label order): %s", ", ".join(f"{i}={name}" for i, name in enumerate(classes)))
    for pid, per_split in sorted(counts.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else kv[0]):
        log(
            INFO,
            "  client %s images per class: %s",
            pid,
            " · ".join(f"{s} {per_split[s]}" for s in ("train", "val", "test")),
        )


def run_dir_for(cfg, run_id: int, data: str | None = None) -> Path:
    """``<output-dir>/<run-name>``, by default ``<method>-<data>-<time>-<run id>`` (``data``: see
    :func:`data_label`; default the run config's ``dataset``).  The folder is one level inside
    ``output-dir``: a ``run-name`` that is no single safe folder name is refused (the config check
    refuses it first), and a default name is made safe (:func:`fedderm.paths.safe_component`)."""
    data = data or cfg.dataset
    if cfg.run_name:
        name = cfg.run_name
        if not is_safe_component(name):
            raise ConfigError(
                f"run-config key 'run-name' must be one folder name inside output-dir, got {name!r}"
            )
    else:
        name = safe_component(f"{cfg.method}-{data}-{datetime.now():%Y%m%d-%H%M%S}-{run_id % 10000:04d}")
    path, suffix = inside(cfg.output_path, name), 1
    while path.exists():
        suffix += 1
        path = inside(cfg.output_path, f"{name}-{suffix}")
    return path


def run_supervised(grid: Grid, cfg, recorder: RunRecorder, classes: list[str]) -> None:
    """The default plan: the method's strategy trains ``cfg.model`` from scratch, then test."""
    model = create_classifier(cfg, len(classes))
    if cfg.init_checkpoint:  # the backbone from a local file (fedderm/lora.py)
        log(INFO, "init-checkpoint: %s", load_init_checkpoint(model, cfg.init_checkpoint))
    strategy = importlib.import_module(registry.get_method(cfg.method).strategy).build_strategy(cfg, recorder)
    run_federated(strategy, grid, to_record(model.state_dict()))


#: What the console run (``sim.py``) tells the ServerApp about the user's command line: a
#: ConfigRecord in the server context's state with ``preset`` (a path or "") and ``overrides``
#: (JSON of the ``key=value`` pairs).  ``flwr run`` has none: its overrides come from the Run.
CLI_RECORD = "fedderm.cli"
#: set by ``fedderm-superlink`` (:mod:`fedderm.accel`, the optional accelerator) in the environment
#: of the processes it starts, this ServerApp's included; unset under Flower's own SuperLink
ACCELERATED = "FEDDERM_ACCELERATED"
#: Keys a resumed run may change, and the ones config.json adds about the command line and the
#: clients' data (no run-config keys).
_RESUME_FREE = ("resume", "run-name", "output-dir")
_CLI_KEYS = ("preset", "overrides", "client-data")
#: The recorder of the run in progress (the console's Ctrl-C handler records the interruption in it).
CURRENT: dict[str, RunRecorder] = {}


def saved_run_config(folder: Path) -> dict:
    """A run folder's config.json as run-config keys (without the ``preset``/``overrides``/
    ``client-data`` records)."""
    return {
        k: v for k, v in json.loads((Path(folder) / "config.json").read_text()).items() if k not in _CLI_KEYS
    }


def user_overrides(grid: Grid, context: Context) -> tuple[dict, str]:
    """(the run-config keys the user gave, the preset file or ""): from ``sim.py``'s record in the
    context state, else the Run's ``override_config`` (``flwr run --run-config``)."""
    if CLI_RECORD in context.state:
        rec = context.state[CLI_RECORD]
        return json.loads(str(rec["overrides"])), str(rec["preset"])
    try:
        return dict(grid.run.override_config or {}), ""
    except (AttributeError, RuntimeError):
        return {}, ""


def resolve_config(run_config: dict, overrides: dict | None = None):
    """The run config; with ``resume`` set, the resumed run's own config.json (a resumed run
    must continue with the settings it started with).  The warning lists the keys the user set
    (``overrides``; default: every key of ``run_config``) whose value differs from the saved one."""
    cfg = registry.load_config(run_config)
    if not cfg.resume:
        return cfg
    folder = Path(cfg.resume).expanduser().resolve()
    saved_path = folder / "config.json"
    if not saved_path.exists():
        raise FileNotFoundError(
            f"resume={cfg.resume!r}: no config.json in {folder}; name a fedderm run folder"
        )
    saved = saved_run_config(folder)
    given = run_config if overrides is None else overrides
    changed = sorted(k for k, v in given.items() if k not in _RESUME_FREE and saved.get(k) != v)
    if changed:
        log(
            WARNING,
            "resume: ignoring %s; the run continues with the settings in %s",
            ", ".join(f"{k}={given[k]!r} (saved {saved.get(k)!r})" for k in changed),
            saved_path,
        )
    return registry.load_config({**saved, "resume": str(folder)})


def make_recorder(
    cfg, run_id: int, preset: str = "", overrides: dict | None = None, data: dict | None = None
) -> RunRecorder:
    """The run folder's recorder; ``data`` (:func:`client_data`) names the clients' data in its
    name and in config.json (``client-data``)."""
    run_dir = Path(cfg.resume) if cfg.resume else run_dir_for(cfg, run_id, data_label(cfg, data))
    # config.json records the run's settings (not the resume), and the preset and overrides it came from
    config = {**cfg.to_flat(), "resume": ""}
    if cfg.resume and (run_dir / "config.json").exists():
        saved = json.loads((run_dir / "config.json").read_text())
        preset, overrides = saved.get("preset", ""), saved.get("overrides", {})
    config.update(preset=preset, overrides=dict(overrides or {}))
    if data:
        config["client-data"] = data
    return RunRecorder(run_dir, cfg.method, config)


def record_end(recorder: RunRecorder, status: str, error: str) -> bool:
    """Record how the run ended (``status``, ``error``) unless an end is already recorded: the
    first error stays, never replaced by a later one or by a signal.  True when recorded."""
    if recorder.extra.get("status", "running") != "running":
        return False
    recorder.update_extra({"status": status, "error": error})
    return True


#: how a run whose process Flower ended is recorded (its exit handlers do not say why)
STOPPED = (
    "stopped",
    "the ServerApp's process was ended before the run (flwr stop or a signal, or Flower's runtime "
    "failed: flwr log says which)",
)
#: the process that registered :func:`_on_flower_exit`; whether Flower's exit path ran in it
_EXIT: dict[str, int | bool | None] = {"pid": None, "flower": False}


def _on_flower_exit() -> None:
    """Flower ends the ServerApp's process: record the run in progress as stopped (a run that had
    already ended keeps its record) and stop the processes this one started (Ray's GCS, raylet,
    agents and ClientApp actors), which Flower's exit would leave behind."""
    _EXIT["flower"] = True  # Flower's force-exit timer ends the process
    recorder = CURRENT.get("recorder")
    if recorder is not None and record_end(recorder, *STOPPED):
        log(
            WARNING, "the run was stopped; its folder records it (summary.json: status): %s", recorder.run_dir
        )
    stop_children()


def _after_main_thread() -> None:
    """Wait for the main thread to end; if the ServerApp (in a thread of its own) still runs then,
    the process is leaving without Flower's exit path: a SIGTERM to ``flwr-simulation`` meets the
    handler ``ray.init`` installed in place of Flower's.  Record the stop, stop the children and
    end the process, which the ServerApp's thread would hold until its round timeout."""
    threading.main_thread().join()
    if "recorder" in CURRENT and not _EXIT["flower"]:
        _on_flower_exit()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def stop_on_flower_exit() -> None:
    """Under ``flwr run``: :func:`_on_flower_exit` runs when Flower ends this process, and when the
    ServerApp runs off the main thread (a simulation), :func:`_after_main_thread` watches for an
    exit that bypasses Flower's (once per process).  ``sim.py`` handles its signals itself
    (:func:`fedderm.console.stop_on_signals`)."""
    if _EXIT["pid"] != os.getpid():
        _EXIT.update(pid=os.getpid(), flower=False)
        flower_private.on_flower_exit(_on_flower_exit)
        if threading.current_thread() is not threading.main_thread():
            threading.Thread(target=_after_main_thread, name="fedderm-exit-watch", daemon=True).start()


def one_line(err: BaseException) -> str:
    """``err`` as one line (its type and the first line of its message)."""
    return f"{type(err).__name__}: {' '.join(str(err).split())}".rstrip(": ")


@app.main()
def main(grid: Grid, context: Context) -> None:
    if os.environ.get(ACCELERATED):  # started by fedderm-superlink: the optional accelerator
        from fedderm.accel.waits import fast_object_pulls

        fast_object_pulls()  # its object pulls back off at 0.05 s, not Flower's 1, 2, 4, 8 s
    # the whole run config first: a mistake ends the run with one line naming the key (Flower
    # prints it without the traceback, then its own exit code)
    one_line_config_errors()
    grid = FastPollGrid(
        grid
    )  # replies within 0.1 s (simulation: 0.02 s) instead of Flower's 3 s pull interval
    overrides, preset = user_overrides(grid, context)
    cfg = resolve_config(context.run_config, overrides)
    method = registry.get_method(cfg.method)
    grid.transport = cfg.transport_dtype  # arrays travel in transport-dtype, arrive as float32
    seed_everything(cfg.seed)
    log(INFO, "fedderm: method %s · model %s · %s", cfg.method, cfg.model, method.description)
    if CLI_RECORD not in context.state:  # flwr run: Flower's exit path ends the process
        stop_on_flower_exit()
    recorder = None
    CURRENT["grid"] = grid  # sim.py stops it when the simulation runtime fails (Ray did not start)
    try:
        infos = handshake(grid, cfg)
        # the run folder opens once the clients said whose data they train on (its name, config.json)
        recorder = open_run(grid, context, cfg, preset, overrides, client_data(infos))
        run_dir = run_plan(grid, cfg, method, recorder, infos)
    except BaseException as err:  # the run folder records why the run stopped
        if recorder is None:
            recorder = open_run(grid, context, cfg, preset, overrides, None)
        record_end(recorder, "failed", one_line(err))
        raise
    finally:
        if "recorder" in CURRENT:
            CURRENT["last"] = CURRENT.pop("recorder")
        CURRENT.pop("grid", None)
        if getattr(grid, "state_clock", None) is not None:
            grid.state_clock.close()  # the simulation's client-state registration
        if recorder is not None:
            recorder.close()  # summary.json, and the TensorBoard writer's thread, also after a failure
    log(INFO, "\n%s", recorder.table())
    if CLI_RECORD not in context.state:  # sim.py prints this line itself, as its last
        log(INFO, "results: %s", run_dir)


def open_run(grid, context: Context, cfg, preset: str, overrides: dict, data: dict | None) -> RunRecorder:
    """Open the run folder (status ``running``) and, with the clients' ``data`` (after the
    handshake), start the client-state clock; ``data`` None: the run failed before the handshake
    ended, and the folder only records why."""
    recorder = make_recorder(cfg, context.run_id, preset, overrides, data)
    context.state["fedderm"] = ConfigRecord({"run-dir": str(recorder.run_dir)})
    CURRENT["recorder"] = recorder
    recorder.update_extra({"status": "running", "error": ""})
    if data is None:
        return recorder
    # client state (fedderm.state_store): keyed by the run folder's name, rolled back on resume
    grid.state_clock = StateClock.for_run(recorder.run_dir, cfg, grid.kind == "simulation")
    if cfg.resume:
        log(
            INFO,
            "resume: clients continue from their state at step %d (the newest checkpoint)",
            grid.state_clock.resume,
        )
    log(
        INFO,
        "results %s %s (on the host running the ServerApp)",
        "continue in" if cfg.resume else "will be written to",
        recorder.run_dir,
    )
    return recorder


def handshake(grid: Grid, cfg) -> dict:
    """Wait for the clients and meet them (``query.info``): their class lists, splits and data."""
    # wait for min-clients SuperNodes at most round-timeout; the first message also loads (and on
    # first use decodes) every client's data: its replies may take longer
    handshake_timeout = max(cfg.round_timeout, HANDSHAKE_TIMEOUT)
    held_out = 1 if cfg.holdout_centre else 0
    return meet_clients(
        grid, wait_for_nodes(grid, cfg.min_clients + held_out, cfg.round_timeout), cfg, handshake_timeout
    )


def run_plan(grid: Grid, cfg, method, recorder: RunRecorder, infos: dict) -> Path:
    """Run the method's plan with the clients met (``infos``), fine-tune a held-out centre; return
    the run folder."""
    # `flwr run` simulation: this process is also Ray's driver (up now that the clients answered), which
    # sends every message to the ClientApp actors: Arrays out of band, as sim.py does (wire.py)
    ray_out_of_band(only_in_ray=True)
    recorder.node_partitions = {nid: int(info["partition-id"]) for nid, info in infos.items()}
    # what each client's replies are screened against (strategies/screening.py)
    recorder.node_sizes = {
        nid: {k: int(info[k]) for k in ("train", "labelled", "val", "test")} for nid, info in infos.items()
    }
    held = holdout_nodes(cfg, infos)
    skipped = {
        str(info["partition-id"]): int(info["skipped-files"])
        for info in infos.values()
        if info["skipped-files"]
    }
    if skipped:
        recorder.update_extra({"skipped_files": skipped})
    classes = list(next(info for nid, info in infos.items() if nid not in held)["classes"])
    record_classes(recorder, cfg, method, classes, infos)
    # A strategy module runs the default plan (federated training, then test) unless it
    # defines its own ``run(grid, cfg, recorder, classes)`` (e.g. pre-train -> fine-tune -> test).
    # A held-out centre is invisible to it (HoldoutGrid) and fine-tunes the result afterwards.
    federation = HoldoutGrid(grid, held) if held else grid
    getattr(importlib.import_module(method.strategy), "run", run_supervised)(
        federation, cfg, recorder, classes
    )
    for nid in held:
        finetune_holdout(grid, cfg, recorder, nid, list(infos[nid]["classes"]))
    run_dir = recorder.finish()
    if recorder.final is None and cfg.finetune != "none":  # finetune="none": pre-training only, no test
        raise RuntimeError(
            "the run ended without final test metrics: every client failed or left "
            "(summary.json: missing_clients)"
        )
    record_end(recorder, "done", "")
    return run_dir
