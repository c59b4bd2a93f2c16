"""One hospital sends a scaled update among honest ones: how far each aggregation rule lets the
global model move, and what it costs in accuracy (run-config ``aggregation``, docs/benchmarks.md).

    python -m bench.robust                                  # 7 clients, x100, 5 rounds, every rule
    python -m bench.robust --rules mean,median --scale 10 --out /tmp/robust.md

Every run is fedderm's ServerApp and ClientApps in this process (``bench/loop_grid.py``) on
scikit-learn's bundled digits (real images, 7 IID clients), supervised FedAvg with the same seed.
The attacker (the last partition) trains honestly, then replies ``w_sent + scale · (w − w_sent)``
with its true ``num-examples``: a well-formed reply that screening accepts (no ``max-update-norm``).
For every round the benchmark takes the replies the strategy accepted and computes the honest-only
aggregate (the FedAvg mean of the other clients' replies of that round); it prints the L2 distance of
the round's global model from it (round 1, where every rule starts from the same model, and the
last), the final test accuracy with the attacker, and the final test accuracy of the same rule
without one (what the rule costs when nobody attacks).
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from bench import benchlib  # noqa: E402

RULES = ("mean", "median", "trimmed-mean", "krum", "multi-krum", "bulyan")
SETTINGS = {
    "method": "fedavg",
    "dataset": "digits",
    "partition": "iid",
    "model": "tiny-cnn",
    "image-size": 16,
    "batch-size": 32,
    "optimizer": "sgd",
    "lr": 0.05,
    "local-epochs": 1,
    "byzantine-clients": 1,
    "trimmed-mean-beta": 0.2,
    "tensorboard": False,
}


def attacker_app(attacker: int, scale: float):
    """fedderm's ClientApp whose partition ``attacker`` scales its train updates by ``scale``."""
    import numpy as np
    from flwr.app import ArrayRecord

    import wire
    from client_app import app

    def call(msg, context):
        reply = app(msg, context)
        if (
            scale != 1.0
            and context.node_config["partition-id"] == attacker
            and msg.metadata.message_type.startswith("train")
            and not reply.has_error()
        ):
            sent, got = msg.content["arrays"], reply.content["arrays"]
            out = {}
            for key in got.keys():
                v = wire.values(got[key])
                if v.dtype.kind == "f":
                    s = wire.values(sent[key])
                    v = (s + scale * (v - s)).astype(v.dtype)
                out[key] = wire.to_array(np.require(v, requirements="C"))
            reply.content["arrays"] = ArrayRecord(out)
        return reply

    return call


def watch_distances(attacker: int) -> tuple[dict[int, float], callable]:
    """Record, per round, the L2 distance of the aggregate from the honest-only FedAvg mean of the
    replies the strategy accepted; returns (the record, a function that undoes the patch)."""
    import numpy as np

    import wire
    from strategies.common import Tracked, cast_like

    distances: dict[int, float] = {}
    original = Tracked.aggregate_train

    def aggregate_train(self, server_round, replies):
        arrays, metrics = original(self, server_round, replies)
        honest = [m for m in self.accepted if self.reply_partition(m, m.content["metrics"]) != str(attacker)]
        if arrays is not None and honest:
            weights = [float(m.content["metrics"]["num-examples"]) for m in honest]
            reference = cast_like(
                wire.weighted_mean([m.content["arrays"] for m in honest], weights), self.sent
            )
            total = 0.0
            for key in reference.keys():
                a, b = wire.values(arrays[key]), wire.values(reference[key])
                if a.dtype.kind == "f":
                    d = a.astype(np.float64) - b
                    total += float(np.dot(d.ravel(), d.ravel()))
            distances[server_round] = math.sqrt(total)
        return arrays, metrics

    Tracked.aggregate_train = aggregate_train
    return distances, lambda: setattr(Tracked, "aggregate_train", original)


def one_run(rule: str, scale: float, clients: int, rounds: int, out: Path, seed: int) -> dict:
    """One run of ``rule`` with the last partition scaling its update by ``scale`` (1: no attack)."""
    from bench.loop_grid import run_app

    attacker = clients - 1
    overrides = {
        **SETTINGS,
        "aggregation": rule,
        "min-clients": clients,
        "num-server-rounds": rounds,
        "seed": seed,
        "output-dir": str(out),
        "run-name": f"{rule}-x{scale:g}",
        "cache-dir": str(out / "cache"),
    }
    distances, undo = watch_distances(attacker)
    t0 = time.perf_counter()
    try:
        run_dir = run_app(overrides, clients, client_app=attacker_app(attacker, scale))
    finally:
        undo()
    summary = json.loads((run_dir / "summary.json").read_text())
    final = summary.get("final") or {}
    return {
        "rule": rule,
        "scale": scale,
        "l2_round1": distances.get(1),
        "l2_last": distances.get(max(distances)) if distances else None,
        "accuracy": final.get("accuracy"),
        "balanced_accuracy": final.get("balanced_accuracy"),
        "status": summary.get("status"),
        "rounds_aggregated": len(distances),
        "seconds": time.perf_counter() - t0,
    }


def fmt(v, spec: str = ".3f") -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def table(rows: list[dict], clean: dict[str, dict], scale: float) -> str:
    lines = [
        f"| aggregation | L2 from honest-only, round 1 (x{scale:g}) | L2, last round | accuracy (x{scale:g}) "
        "| balanced accuracy | accuracy, no attacker | wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        c = clean.get(r["rule"], {})
        lines.append(
            f"| `{r['rule']}` | {fmt(r['l2_round1'], '.3g')} | {fmt(r['l2_last'], '.3g')} | {fmt(r['accuracy'])} "
            f"| {fmt(r['balanced_accuracy'])} | {fmt(c.get('accuracy'))} | {r['seconds'] + c.get('seconds', 0):.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rules", default=",".join(RULES), help="aggregation rules, comma-separated")
    p.add_argument("--scale", type=float, default=100.0, help="the attacker's update factor")
    p.add_argument("--clients", type=int, default=7, help="clients (bulyan with f = 1 needs 7)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-clean", action="store_true", help="skip the runs without an attacker")
    p.add_argument("--out", default="", help="also write the Markdown table (and JSON next to it) here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    info = benchlib.print_machine()
    rows, clean = [], {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fedderm-robust-") as tmp:
        for rule in args.rules.split(","):
            row = one_run(rule, args.scale, args.clients, args.rounds, Path(tmp), args.seed)
            print(json.dumps(row), flush=True)
            rows.append(row)
            if not args.no_clean:
                clean[rule] = one_run(rule, 1.0, args.clients, args.rounds, Path(tmp), args.seed)
                print(json.dumps(clean[rule]), flush=True)
    wall = time.perf_counter() - t0
    benchlib.report(table(rows, clean, args.scale), info, wall, args.out, {"rows": rows, "clean": clean})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
