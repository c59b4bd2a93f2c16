"""Run the rows of a FedMAE / Fed-MAE table through ``sim.simulate`` and print the table.

    python bench/fedmae_tables.py --preset table5                 # 000 Table V, small size (runs here)
    python bench/fedmae_tables.py --preset table3 --rows fed-mae  # 003 Table III, Fed-MAE row only
    python bench/fedmae_tables.py --preset table5 --scale paper --set 'data-path="/data/isic.csv"'

* ``table5`` (000 Table V, "global and local knowledge split"): FedMAE pre-training with each
  ``fedmae.exclude`` preset, then federated fine-tuning; columns recall (= balanced accuracy),
  precision, F1, specificity, AUC, accuracy on the clients' test splits (mean over clients, %).
* ``table3`` (003 Table III): test accuracy (%) after federated fine-tuning for the Dirichlet
  splits α = 100 (Split-1, IID), 1.0 (Split-2), 0.5 (Split-3); rows Fed-MAE, Fed-BEiT and no
  pre-training (ViT from scratch).  The "Central" column and the ImageNet rows are not run
  (``fedmae.init-checkpoint`` + ``fedmae.pretrain=false`` gives the "MAE ImageNet" row when an
  MAE checkpoint is at hand).

``--scale small`` uses ``presets/*-small.toml`` (synthetic data, vit-micro, 32 px), ``paper``
the ``presets/*-paper.toml`` settings (real data and a GPU needed).  Each cell is one
simulation; run times are printed per cell.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

METRICS = [("balanced_accuracy", "Recall"), ("precision", "Precision"), ("f1", "F1"),
           ("specificity", "Specificity"), ("auc", "AUC"), ("accuracy", "Accuracy")]

TABLES = {
    "table5": {
        "title": "000 Table V: global and local knowledge split (federated fine-tuning)",
        "supernodes": {"small": 3, "paper": 10},
        "rows": [  # (row id, label, base preset, overrides)
            ("none", "Encoder+Decoder", "fedmae", {"fedmae.exclude": "none"}),
            ("decoder", "W/o Decoder", "fedmae", {"fedmae.exclude": "decoder"}),
            ("patch-embed", "W/o Linear Projection", "fedmae", {"fedmae.exclude": "patch-embed"}),
            ("decoder-embed", "W/o Decoder Projection", "fedmae", {"fedmae.exclude": "decoder-embed"}),
            ("cls-token", "W/o Class Token (ours)", "fedmae", {"fedmae.exclude": "cls-token"}),
        ],
        "columns": [(key, label, {}) for key, label in METRICS],
    },
    "table3": {
        "title": "003 Table III: test accuracy of federated fine-tuning vs. data heterogeneity",
        "supernodes": {"small": 5, "paper": 5},
        "rows": [
            ("scratch", "None (ViT scratch)", "fed-mae", {"fedmae.pretrain": False}),
            ("fed-beit", "Fed-BEiT", "fedbeit", {}),
            ("fed-mae", "Fed-MAE", "fed-mae", {}),
        ],
        "columns": [("accuracy", f"Split-{i} (a={a:g})", {"partition": "dirichlet", "dirichlet-alpha": a})
                    for i, a in enumerate((100.0, 1.0, 0.5), start=1)],
    },
}


def preset(name: str, scale: str) -> dict:
    import sim

    return sim.parse_overrides([str(ROOT / "presets" / f"{name}-{scale}.toml")])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(TABLES), required=True)
    parser.add_argument("--scale", choices=("small", "paper"), default="small")
    parser.add_argument("--rows", nargs="*", help="row ids to run (default: all)")
    parser.add_argument("--num-supernodes", type=int, help="clients (default: the table's)")
    parser.add_argument("--set", nargs="*", default=[], help="extra run-config overrides 'key=value' (TOML values)")
    parser.add_argument("--out", default="/tmp/fedderm-bench/fedmae", help="where runs and table.json go")
    args = parser.parse_args(argv)

    import sim

    table = TABLES[args.preset]
    extra = sim.parse_overrides(args.set) if args.set else {}
    rows = [r for r in table["rows"] if not args.rows or r[0] in args.rows]
    if not rows:
        parser.error(f"no row matches {args.rows}; rows: {[r[0] for r in table['rows']]}")
    n = args.num_supernodes or table["supernodes"][args.scale]
    out = Path(args.out) / f"{args.preset}-{args.scale}"
    results: dict[str, dict[str, float]] = {}
    finals: dict[str, dict[str, float]] = {}  # run name -> final mean metrics (one run serves several columns)
    times: dict[str, float] = {}
    for row_id, label, base, overrides in rows:
        results[label] = {}
        for col_key, col_label, col_overrides in table["columns"]:
            name = row_id + "".join(f"-{k}{v}" for k, v in col_overrides.items() if k != "partition")
            if name not in finals:
                run_config = {**preset(base, args.scale), **overrides, **col_overrides, **extra,
                              "output-dir": str(out), "run-name": name}
                start = time.monotonic()
                run_dir = sim.simulate(run_config, num_supernodes=n)
                times[name] = time.monotonic() - start
                final = json.loads((run_dir / "summary.json").read_text())["final"]
                finals[name] = {k: v for k, v in final.items() if isinstance(v, (int, float))}
                print(f"[{args.preset}] {label} / {col_label}: {times[name]:.0f} s -> {run_dir}", flush=True)
            results[label][col_label] = finals[name].get(col_key, float("nan"))

    labels = [c[1] for c in table["columns"]]
    width = max(len(r[1]) for r in rows) + 2
    lines = [table["title"] + f" ({args.scale}, {n} clients; mean over clients, %)",
             "Method".ljust(width) + "".join(label.rjust(max(12, len(label) + 2)) for label in labels)]
    for _, label, _, _ in rows:
        cells = [results[label].get(c) for c in labels]
        lines.append(label.ljust(width) + "".join(
            (f"{100 * v:.2f}" if v is not None and v == v else "n/a").rjust(max(12, len(c) + 2))
            for v, c in zip(cells, labels)))
    lines.append(f"run time: {sum(times.values()):.0f} s for {len(times)} simulations "
                 f"({', '.join(f'{k} {v:.0f} s' for k, v in times.items())})")
    print("\n".join(lines))
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.json").write_text(json.dumps({"table": args.preset, "scale": args.scale, "clients": n,
                                                "results": results, "seconds": times}, indent=2))
    (out / "table.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
