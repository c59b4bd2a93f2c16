"""The accelerated loopback federation: one SuperLink on 127.0.0.1 behind the proxy and three
SuperNodes as real processes (TLS, SuperNode authentication, fedderm's warm launcher, each
hospital's allow-list), started once for this module: methods through `flwr run`, a refused
bundle, an outsider refused at the public address, a SuperNode killed mid-round, FedCLF killed
and resumed, and stopping it."""

from __future__ import annotations

import json
import threading

import pytest
from proc_helpers import alive, group_members, skip_loopback, wait_for
from test_adversary_deploy import assert_outsider_refused

pytestmark = [pytest.mark.federation, skip_loopback]


@pytest.fixture(scope="module")
def loopback(tmp_path_factory):
    """One SuperLink + 3 SuperNodes (TLS, node auth, fedderm's warm launcher, each hospital with
    an allow-list holding this app's hash), started once for the loopback tests of this module."""
    from deploy.loopback import APP_DIR, Loopback
    from fedderm.accel.allow import app_hash

    root = tmp_path_factory.mktemp("loopback")
    lines: list[str] = []
    approved = root / "approved.txt"
    approved_hash = app_hash(APP_DIR)
    approved.write_text(f"# this checkout\n{approved_hash}\n")
    fed = Loopback(
        root / "fed",
        3,
        per_class=8,
        echo=lines.append,
        allow_lists={f"hospital-{c}": approved for c in "abc"},
    )
    fed.lines, fed.approved_hash = lines, approved_hash
    try:
        fed.start()
        yield fed
    finally:
        fed.stop()


def test_loopback_federation_tls_node_auth(loopback, tmp_path):
    """FedAvg and SiFT via `flwr run`; an unregistered node refused; an app bundle that no
    hospital approved refused by every hospital before any of its code runs; each run's
    TensorBoard events (written by the ServerApp under `flwr run`) read back equal to its rounds.csv."""
    from test_tracking import assert_events_match_csv

    from deploy.loopback import BASE_RUN_CONFIG, METHODS, available_methods
    from fedderm.accel.allow import app_hash, copy_bundle_files

    fed, approved_hash = loopback, loopback.approved_hash
    methods, _ = available_methods(list(METHODS))
    assert len(fed.node_ids) == 3 and fed.online() == set(fed.node_ids.values())
    assert any(line.startswith("nodes connected: 3/3 online") for line in fed.lines)
    outsider = fed.try_outsider()
    assert outsider["refused"], outsider
    assert "Failed to activate SuperNode" in outsider["reason"]
    for method in methods:
        out = fed.run(method, {"num-server-rounds": 1, **METHODS[method]}, timeout=600)
        assert out.ok, "\n".join(out.problems)
        assert out.status == "finished:completed"
        assert set(out.summary["final"]["per_client"]) == {"0", "1", "2"}
        assert [r["round"] for r in out.summary["rounds"] if r["split"] == "val"] == [0, 1]
        # each hospital's own data (node config), as it named it, in config.json and summary.json
        config = json.loads((out.run_dir / "config.json").read_text())
        assert config["client-data"] == out.summary["config"]["client-data"]
        for pid, name in enumerate(fed.hospitals):
            entry = config["client-data"][str(pid)]
            assert (entry["dataset"], entry["data-path"], entry["source"], entry["site"]) == (
                "folder",
                str(fed.data[name]),
                "node-config",
                name,
            )
            assert entry["images"] == entry["train"] + entry["val"] + entry["test"] > 0
            assert entry["torch-threads"] == 1  # the loopback's SuperNodes run with OMP_NUM_THREADS=1
        # TensorBoard: the `flwr run` ServerApp's event file holds rounds.csv's numbers
        assert len(list(out.run_dir.glob("events.out.tfevents.*"))) == 1
        checked, scalars = assert_events_match_csv(out.run_dir)
        assert checked > 0 and "val/balanced_accuracy/mean" in scalars
    # each hospital's node config was honoured: its decoded images are cached in its state-dir
    for name in fed.hospitals:
        assert any((fed.workdir / "state" / name / "cache").iterdir())
    # an app bundle no hospital approved (one changed line) is refused before its code runs
    changed = copy_bundle_files(fed.app_dir, tmp_path / "changed-app")
    (changed / "client_app.py").write_text((changed / "client_app.py").read_text() + "\n# changed\n")
    digest = app_hash(changed)
    config = {
        **BASE_RUN_CONFIG,
        "min-clients": 3,
        "num-server-rounds": 1,
        "method": "fedavg",
        "output-dir": str(tmp_path / "refused"),
        "run-name": "refused",
    }
    _, status, _ = fed.flwr_run(changed, config, "run-refused", timeout=300)
    assert status == "finished:failed"
    run_log = (fed.workdir / "logs" / "run-refused.log").read_text()
    assert "not on this hospital's allow-list" in run_log  # the server saw the error replies
    for name in fed.hospitals:
        node_log = (fed.workdir / "logs" / f"supernode-{name}.log").read_text()
        assert f"refused: app bundle sha256 {digest}" in node_log
        home = fed.workdir / "homes" / name
        assert list(home.rglob(f"*.{approved_hash[:8]}"))  # Flower unpacks an approved bundle here
        assert not list(home.rglob(f"*.{digest[:8]}"))  # ... and never unpacked the refused one
    assert not (tmp_path / "refused" / "refused" / "model.pt").exists()


def test_an_outsider_with_the_ca_certificate_is_refused_at_the_public_address(loopback):
    """fedderm-superlink behind the proxy: an outsider holding the CA certificate registers no
    node, lists, stops and submits nothing at the address the hospitals use (403 for every API but
    the Fleet API), while the coordinator's flwr and the hospitals' SuperNodes work."""
    assert_outsider_refused(loopback)


def _flwr_run_in_thread(fed, config: dict, log_name: str) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def target():
        try:
            result["run"] = fed.flwr_run(fed.app_dir, config, log_name, timeout=900)
        except BaseException as err:  # noqa: BLE001 - the test reads it
            result["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, result


def test_loopback_supernode_killed_mid_round_rejoins(loopback):
    """Hospital c's SuperNode (and its ClientApp) is SIGKILLed while it handles round 1's train
    message and started again: it rejoins under its registered key, and the run completes with
    all three hospitals in round 2 and the final test. Round 1 differs by Flower version: up to
    1.42 it goes on without hospital c (Flower answers for the dead node once its heartbeat
    expires); from 1.43 a message stays pending until the SuperNode acknowledges it, so the
    restarted SuperNode receives round 1's train message again and answers it."""
    from deploy.loopback import RunOutcome, check_results

    fed = loopback
    config = fed.run_config("fedavg", {"num-server-rounds": 2}, "killed-node")
    log = fed.workdir / "logs" / "supernode-hospital-c.log"
    seen = log.read_text(errors="replace").count("Receiving: train message")
    thread, result = _flwr_run_in_thread(fed, config, "run-killed-node")
    trains = lambda: log.read_text(errors="replace").count("Receiving: train message")  # noqa: E731
    wait_for(lambda: trains() > seen, "hospital c receiving a train message")
    fed.kill("supernode-hospital-c")
    fed.restart_supernode("hospital-c")
    thread.join(timeout=900)
    assert "error" not in result, result.get("error")
    run_id, status, wall = result["run"]
    out = RunOutcome("fedavg", run_id, status, fed.workdir / "results" / "killed-node", wall)
    problems = check_results(out, 3, 2)
    assert not problems, problems
    summary = out.summary
    missing = summary.get("missing_clients", [])
    if _flower_redelivers():
        assert missing == [], missing  # round 1's reply from hospital c came from the restarted SuperNode
    else:
        assert any(m["round"] == 1 and m["partition-id"] == "2" for m in missing), missing
    assert not any(m.get("round") == 2 for m in missing), missing
    assert set(summary["final"]["per_client"]) == {"0", "1", "2"}
    assert any(line.startswith("hospital-c: restarted") for line in fed.lines)


def _flower_redelivers() -> bool:
    """From 1.43 Flower keeps a message pending until its SuperNode acknowledges it."""
    import flwr
    from packaging.version import Version

    return Version(flwr.__version__) >= Version("1.43.0.dev0")


def test_loopback_fedclf_killed_and_resumed_is_bit_identical(loopback):
    """FedCLF on the loopback federation; the SuperLink and every SuperNode are SIGKILLed after
    round 1's checkpoint (of 2 pre-training rounds), the federation is started again (the SuperLink
    on its database file: the hospitals' registrations are kept, nobody registers again) and the run
    continued with ``resume``: the same final metrics, rounds and weights as the uninterrupted run
    of the same hospitals' data in one process (bench/loop_grid.py, one thread per client, as the
    loopback's processes run), i.e. the deployment computes the simulation's numbers."""
    import json

    import torch

    from bench.loop_grid import run_app

    fed = loopback
    # a deployment relays raw features only when told (fedclf.feature-sharing = "auto" would stop it)
    extra = {
        "num-server-rounds": 2,
        "finetune-rounds": 1,
        "fedclf.queue-size": 24,
        "fedclf.feature-sharing": True,
    }
    nodes = [
        {**fed.node_config_values(i, name), "state-dir": str(fed.workdir / "state-in-process" / name)}
        for i, name in enumerate(fed.hospitals)
    ]
    full = run_app(fed.run_config("fedclf", extra, "fedclf-full"), len(fed.hospitals), node_configs=nodes)
    cut_dir = fed.workdir / "results" / "fedclf-cut"
    thread, result = _flwr_run_in_thread(fed, fed.run_config("fedclf", extra, "fedclf-cut"), "run-fedclf-cut")
    wait_for(lambda: any(cut_dir.glob("checkpoint*-round-1.pt")), "the round-1 checkpoint")
    before = fed.processes()  # the ServerApp runs in a session of its own (the SuperLink's SuperExec)
    assert any("flwr-serverapp" in cmd for cmd in before.values()), before
    fed.kill()  # the SuperLink, its ServerApp, every SuperNode and ClientApp, the flwr CLI
    thread.join(timeout=120)
    assert not any(alive(pid) for pid in before), {p: c for p, c in before.items() if alive(p)}
    assert json.loads((cut_dir / "summary.json").read_text()).get("final") is None  # not finished
    registered = dict(fed.node_ids)
    fed.restart()  # the same --database: the hospitals' registrations carry over, none registers again
    assert fed.node_ids == registered and fed.online() == set(registered.values())
    resumed = fed.run("fedclf", {**extra, "resume": str(cut_dir)}, run_name="fedclf-cut")
    assert resumed.ok, "\n".join(resumed.problems)
    a, b = (json.loads((d / "summary.json").read_text()) for d in (full, cut_dir))
    assert a["final"] == b["final"] and a["rounds"] == b["rounds"] and a["best_round"] == b["best_round"]
    for name in ("model.pt", "model-best.pt"):
        wa, wb = torch.load(full / name), torch.load(cut_dir / name)
        assert wa.keys() == wb.keys()
        for key in wa:
            if isinstance(wa[key], torch.Tensor):
                assert torch.equal(wa[key], wb[key]), (name, key)
            else:
                assert wa[key] == wb[key], (name, key)


def test_loopback_stop_leaves_no_process(loopback):
    """Last: stopping the federation ends every process it started and every process those
    started: the SuperNodes' SuperExecs (same process groups) and the SuperLink's SuperExec
    (a session of its own)."""
    fed = loopback
    groups = {p.popen.pid for p in fed.procs}
    running = {p.name for p in fed.procs if p.popen.poll() is None and p.name.startswith("super")}
    assert running == {"superlink", *(f"supernode-{h}" for h in fed.hospitals)}  # outsider already gone
    assert len(group_members(groups)) > 4  # their SuperExecs live in the same groups
    started = fed.processes()  # also the SuperLink's SuperExec, in a session of its own
    assert any("flower-superexec" in cmd for cmd in started.values()), started
    assert sum("fedderm.accel superexec" in cmd for cmd in started.values()) >= len(fed.hospitals)
    fed.stop()
    assert group_members(groups) == [] and fed.procs == [] and fed.processes() == {}
    assert not any(alive(pid) for pid in started), {p: c for p, c in started.items() if alive(p)}
