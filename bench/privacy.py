"""Privacy–utility table of FedCLF's private relay: for every noise
multiplier σ, the relay's (ε, δ) per client, the leakage audit's membership-attack ROC-AUC and the
downstream balanced accuracy (FedCLF pre-training, then federated fine-tuning) on real images,
scikit-learn's bundled digits (``dataset="digits"``).

    python -m bench.privacy                                   # σ ∈ {0, 0.5, 1, 2, 4}, tiny settings
    python -m bench.privacy --sigmas 0,1 --rounds 1 --out /tmp/privacy.md

Every σ is one ``sim.simulate`` run (Flower's simulation engine, 2 clients) with the same seed and
settings; only ``fedclf.relay-noise-multiplier`` changes.  The runs set ``insecure-reproducible-noise``
(simulation only): the relay's noise and shuffle are seeded from ``seed``, so that a rerun of one
seed repeats the table to the digit; the ε of such a run holds only against a party that does not
know the run config (docs/privacy.md).  ε is the last round's (``summary.json``
``relay_privacy``, Opacus' RDP accountant, :mod:`fedderm.relay_privacy`), the AUC is the mean over
clients of the last pre-training round's audit (split ``leakage-audit``), the balanced accuracy
the mean over clients of the final test (best-on-val fine-tuned model).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from bench import benchlib  # noqa: E402

SETTINGS = {
    "method": "fedclf",
    "dataset": "digits",
    "partition": "iid",
    "model": "tiny-cnn",
    "image-size": 16,
    "batch-size": 64,
    "lr": 0.03,
    "local-epochs": 1,
    "fedclf.queue-size": 256,
    "fedclf.leakage-audit": True,
    "fedclf.relay-clip": 1.0,
    "fedclf.relay-delta": 1e-5,
    "insecure-reproducible-noise": True,  # a rerun of one seed repeats the table (module docstring)
    "finetune": "federated",
    "finetune-epochs": 2,
    "finetune-lr": 1e-3,
    "tensorboard": False,
}


def one_run(sigma: float, rounds: int, ft_rounds: int, out: Path, seed: int) -> dict:
    """Run FedCLF with relay noise ``sigma``; return ε, AUC, balanced accuracy and wall seconds."""
    import sim

    overrides = {
        **SETTINGS,
        "seed": seed,
        "num-server-rounds": rounds,
        "finetune-rounds": ft_rounds,
        "fedclf.relay-noise-multiplier": float(sigma),
        "output-dir": str(out),
        "run-name": f"sigma-{sigma:g}",
        "cache-dir": str(out / "cache"),
    }
    t0 = time.perf_counter()
    run_dir = sim.simulate(overrides, num_supernodes=2)
    seconds = time.perf_counter() - t0
    summary = json.loads((run_dir / "summary.json").read_text())
    eps = summary["relay_privacy"][-1]["epsilon"] if summary.get("relay_privacy") else None
    audits = [r for r in summary["rounds"] if r["split"] == "leakage-audit"]
    last = audits[-1] if audits else None
    return {
        "sigma": float(sigma),
        "epsilon": None if not eps or None in eps.values() else max(eps.values()),
        "releases": summary["relay_privacy"][-1].get("releases") if summary.get("relay_privacy") else None,
        "auc": None if last is None else last["metrics"]["auc"],
        "auc_round": None if last is None else last["round"],
        "balanced_accuracy": summary["final"]["balanced_accuracy"],
        "seconds": seconds,
        "run_dir": str(run_dir),
    }


def table(rows: list[dict], delta: float) -> str:
    lines = [
        f"| σ | ε (δ = {delta:g}) | attack AUC | balanced accuracy | wall s |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        eps = "∞" if r["epsilon"] is None else f"{r['epsilon']:.2f}"
        auc = "–" if r["auc"] is None else f"{r['auc']:.3f}"
        acc, secs = r["balanced_accuracy"], r["seconds"]
        lines.append(f"| {r['sigma']:g} | {eps} | {auc} | {acc:.3f} | {secs:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sigmas", default="0,0.5,1,2,4", help="noise multipliers, comma-separated")
    p.add_argument("--rounds", type=int, default=2, help="FedCLF pre-training rounds")
    p.add_argument("--finetune-rounds", type=int, default=2, help="federated fine-tuning rounds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="", help="also write the Markdown table (and JSON next to it) here")
    args = p.parse_args(argv)
    info = benchlib.print_machine()
    sigmas = [float(s) for s in args.sigmas.split(",")]
    rows = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fedderm-privacy-") as tmp:
        for sigma in sigmas:
            row = one_run(sigma, args.rounds, args.finetune_rounds, Path(tmp), args.seed)
            print(json.dumps({k: v for k, v in row.items() if k != "run_dir"}), flush=True)
            rows.append(row)
    wall = time.perf_counter() - t0
    benchlib.report(table(rows, SETTINGS["fedclf.relay-delta"]), info, wall, args.out, {"rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
