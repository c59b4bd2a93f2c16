"""fedderm ServerApp: parse the run config once, meet the clients, run the method, write results."""

from __future__ import annotations

import time
from datetime import datetime
from logging import INFO
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common import log
from flwr.serverapp import Grid, ServerApp

import registry
from fedderm.models import create_model
from fedderm.results import RunRecorder
from fedderm.train import seed_everything
from strategies.common import FastPollGrid, run_federated

app = ServerApp()


def wait_for_nodes(grid: Grid, n: int, poll: float = 1.0) -> list[int]:
    """Block until at least ``n`` SuperNodes are connected; log while waiting."""
    last = -1
    while len(ids := sorted(grid.get_node_ids())) < n:
        if len(ids) != last:
            log(INFO, "waiting for clients: %d connected, %d needed (min-clients)", len(ids), n)
            last = len(ids)
        time.sleep(poll)
    return ids


def meet_clients(grid: Grid, node_ids: list[int], timeout: float = 600) -> dict[int, ConfigRecord]:
    """Ask every client for its class list and split sizes (``query.info``); check they agree."""
    msgs = [Message(RecordDict({"config": ConfigRecord()}), dst_node_id=n, message_type="query.info")
            for n in node_ids]
    infos, failed = {}, []
    for reply in grid.send_and_receive(msgs, timeout=timeout):
        if reply.has_error():
            failed.append(f"node {reply.metadata.src_node_id}: {reply.error.reason}")
        else:
            infos[reply.metadata.src_node_id] = reply.content["info"]
    if failed:
        raise RuntimeError("clients could not load their data:\n  " + "\n  ".join(failed))
    by_pid: dict[int, list[int]] = {}
    for nid, info in infos.items():
        by_pid.setdefault(int(info["partition-id"]), []).append(nid)
    clashes = {pid: nids for pid, nids in by_pid.items() if len(nids) > 1}
    if clashes:
        raise RuntimeError(f"several clients report the same partition-id {clashes} (partition-id: node ids); "
                           "give each SuperNode its own --node-config 'partition-id=N'")
    classes = {tuple(info["classes"]) for info in infos.values()}
    if len(classes) != 1:
        raise RuntimeError(f"clients disagree on the class list: {sorted(classes)}; set the run-config "
                           "key 'classes' so that every hospital maps labels the same way")
    for nid, info in sorted(infos.items(), key=lambda kv: kv[1]["partition-id"]):
        site = f" {info['site']!r}" if info.get("site") else ""
        log(INFO, "client %d%s (node %d): train %d (labelled %d) · val %d · test %d", info["partition-id"], site,
            nid, info["train"], info["labelled"], info["val"], info["test"])
    return infos


def run_dir_for(cfg, run_id: int) -> Path:
    name = cfg.run_name or f"{cfg.method}-{cfg.dataset}-{datetime.now():%Y%m%d-%H%M%S}-{run_id % 10000:04d}"
    path = cfg.output_path / name
    suffix = 1
    while path.exists():
        suffix += 1
        path = cfg.output_path / f"{name}-{suffix}"
    return path


def run_supervised(grid: Grid, cfg, recorder: RunRecorder, classes: list[str]) -> None:
    """The default plan: the method's strategy trains ``cfg.model`` from scratch, then test."""
    model = create_model(cfg.model, num_classes=len(classes), image_size=cfg.image_size)
    strategy = registry.get_method(cfg.method).strategy_module().build_strategy(cfg, recorder)
    run_federated(strategy, grid, ArrayRecord(model.state_dict()))


@app.main()
def main(grid: Grid, context: Context) -> None:
    grid = FastPollGrid(grid)  # replies within 0.1 s instead of Flower's 3 s pull interval
    cfg = registry.load_config(context.run_config)
    method = registry.get_method(cfg.method)
    seed_everything(cfg.seed)
    recorder = RunRecorder(run_dir_for(cfg, context.run_id), cfg.method, cfg.to_flat())
    context.state["fedderm"] = ConfigRecord({"run-dir": str(recorder.run_dir)})
    log(INFO, "fedderm: method %s · %s", cfg.method, method.description)
    log(INFO, "results will be written to %s (on the host running the ServerApp)", recorder.run_dir)

    infos = meet_clients(grid, wait_for_nodes(grid, cfg.min_clients))
    classes = list(next(iter(infos.values()))["classes"])
    # A strategy module runs the default plan (federated training, then test) unless it
    # defines its own ``run(grid, cfg, recorder, classes)`` (e.g. pre-train -> fine-tune -> test).
    getattr(method.strategy_module(), "run", run_supervised)(grid, cfg, recorder, classes)

    run_dir = recorder.finish()
    log(INFO, "\n%s", recorder.table())
    log(INFO, "results: %s", run_dir)
