"""Paper 004 Tables II-IV / Fig. 7 on the embedded data: per-centre and GTA rows of every method.

    python bench/flbt_tables.py                                  # preset, 3 centres, 7 methods
    python bench/flbt_tables.py --quick                          # tiny-cnn, 3 rounds: a smoke run
    python bench/flbt_tables.py --methods flbt,ssl-flbt --seeds 0,1,2 --set 'num-server-rounds=20'
    python bench/flbt_tables.py --cv-folds 5                     # 004's cross-centre 5-fold CV, mean ± SD
    python bench/flbt_tables.py --costs                          # + Table XII counts for the preset's model

Each method runs ``sim.py`` once per seed (a separate process) with ``presets/flbt-tables-2-4.toml``
plus ``method=...``; the script prints, per centre, accuracy / precision / recall / F1 / AP of
every method (Tables II-IV: "C1".."Cn") and their mean over centres (GTA, Fig. 7).  With
``--cv-folds k`` every method runs k times (``cv-folds=k cv-fold=f``: fold f tests on group f of
every centre, 004 §IV-B) and the cells are mean ± SD over folds; several ``--seeds`` likewise give
mean ± SD over re-drawn random splits.  Results go to ``--out`` (one run folder per method, seed and
fold, and tables.md).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("local", "fedavg", "fedprox", "fedbn", "moon", "flbt", "ssl-flbt")
LABELS = {"local": "Single-centre", "fedavg": "FedAvg", "fedprox": "FedProx", "fedbn": "FedBN", "moon": "MOON",
          "flbt": "FL-BT", "ssl-flbt": "SSL-FL-BT"}
COLUMNS = (("accuracy", "Accuracy"), ("precision", "Precision"), ("recall", "Recall"), ("f1", "F1-score"),
           ("ap", "AP"))
QUICK = ["model=\"tiny-cnn\"", "num-server-rounds=3", "synthetic-per-class=20", "ssl.gan-steps=100",
         "ssl.pseudo-per-centre=100", "ssl.epochs=2"]


def run_one(method: str, seed: int, fold: int | None, args, extra: list[str]) -> tuple[Path, float]:
    """One ``sim.py`` run in its own process; the preset and the overrides go in one TOML file."""
    sys.path.insert(0, str(ROOT))
    from sim import parse_overrides

    name = f"{method}-seed{seed}" + (f"-fold{fold}" if fold is not None else "")
    config = {**parse_overrides([args.preset]), **(parse_overrides(extra) if extra else {}),
              "method": method, "seed": seed, "output-dir": str(args.out), "run-name": name,
              "cache-dir": str(args.out / "cache")}
    if fold is not None:
        config.update({"cv-folds": args.cv_folds, "cv-fold": fold})
    toml = args.out / f"{name}.toml"
    toml.write_text("".join(f"{json.dumps(k)} = {json.dumps(v)}\n" for k, v in config.items()))
    cmd = [sys.executable, str(ROOT / "sim.py"), "--num-supernodes", str(args.num_supernodes),
           "--run-config", str(toml)]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    seconds = time.monotonic() - start
    (args.out / f"{name}.log").write_text(proc.stdout + proc.stderr)
    found = re.findall(r"^results: (.+)$", proc.stdout, flags=re.M)
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"{name} failed; see {args.out / (name + '.log')}")
    return Path(found[-1]), seconds


def cell(values: list[float]) -> str:
    values = [v for v in values if v is not None and v == v]
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"{100 * values[0]:.2f}"
    return f"{100 * np.mean(values):.2f}±{100 * np.std(values, ddof=1):.2f}"


def tables(results: dict[str, list[dict]]) -> str:
    """Markdown: one table per centre (rows = methods) and a GTA table (mean over centres)."""
    centres = sorted({c for runs in results.values() for r in runs for c in r["final"]["per_client"]}, key=int)
    out = []
    header = "| Algorithm | " + " | ".join(label for _, label in COLUMNS) + " |"
    rule = "|---|" + "---|" * len(COLUMNS)
    for c in centres:
        out += [f"\nC{int(c) + 1} (client {c}), test split, unit %", header, rule]
        for m, runs in results.items():
            vals = [[r["final"]["per_client"][c].get(k) for r in runs] for k, _ in COLUMNS]
            out.append(f"| {LABELS.get(m, m)} | " + " | ".join(cell(v) for v in vals) + " |")
    out += ["\nGTA (mean over centres), unit %", header, rule]
    for m, runs in results.items():
        vals = [[r["final"].get(k) for r in runs] for k, _ in COLUMNS]
        out.append(f"| {LABELS.get(m, m)} | " + " | ".join(cell(v) for v in vals) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default=str(ROOT / "presets" / "flbt-tables-2-4.toml"))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--seeds", default="0", help="comma-separated seeds; several give mean ± SD")
    parser.add_argument("--cv-folds", type=int, default=0, help="k >= 3: cross-centre k-fold CV, mean ± SD")
    parser.add_argument("--num-supernodes", type=int, default=3, help="centres (the preset asks for 3)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/fedderm-flbt-tables"))
    parser.add_argument("--quick", action="store_true", help="tiny-cnn, 3 rounds, small GAN stage")
    parser.add_argument("--set", nargs="*", default=[], help="more run-config overrides, key=value (TOML)")
    parser.add_argument("--costs", action="store_true", help="also print Table XII counts")
    args = parser.parse_args(argv)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    extra = (QUICK if args.quick else []) + list(args.set)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    seeds = [int(s) for s in args.seeds.split(",")]

    results: dict[str, list[dict]] = {}
    total = time.monotonic()
    folds = list(range(args.cv_folds)) if args.cv_folds else [None]
    for m in methods:
        for seed, fold in [(s, f) for s in seeds for f in folds]:
            run_dir, seconds = run_one(m, seed, fold, args, extra)
            summary = json.loads((run_dir / "summary.json").read_text())
            results.setdefault(m, []).append(summary)
            print(f"{m:9s} seed {seed} fold {fold}: {seconds:6.1f} s  GTA accuracy {100 * summary['final']['accuracy']:.2f} %"
                  f"  -> {run_dir}", flush=True)
    text = tables(results)
    print(text)
    print(f"\ntotal {time.monotonic() - total:.0f} s for {len(methods)} methods x {len(seeds)} seed(s)"
          f" x {len(folds)} fold(s)")
    (args.out / "tables.md").write_text(text + "\n")
    if args.costs:
        sys.path.insert(0, str(ROOT))
        from fedderm.costs import cost_table
        from sim import parse_overrides, resolved_run_config

        rc = resolved_run_config({**parse_overrides([args.preset]), **parse_overrides(extra)} if extra else
                                 parse_overrides([args.preset]))
        rows = cost_table(rc["model"], 5, rc["image-size"], args.num_supernodes, rc["num-server-rounds"],
                          rc["flbt.proj-dim"], rc["ssl.pseudo-per-centre"])
        print("\nTable XII | comm rounds | comm params/round | params | MACs/image")
        for r in rows:
            print(f"{r['method']:17s} | {r['comm_rounds']:4d} | {r['comm_params_per_round'] / 1e6:8.2f}M"
                  f" | {r['params'] / 1e6:7.2f}M | {r['macs'] / 1e9:7.3f}G")
    return 0


if __name__ == "__main__":
    sys.exit(main())
