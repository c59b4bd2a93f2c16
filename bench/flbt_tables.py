"""Paper 004 Tables II-IV / Fig. 7 on the embedded data: per-centre and GTA rows of every method.

    python bench/flbt_tables.py                                  # preset, 3 centres, 7 methods
    python bench/flbt_tables.py --quick                          # tiny-cnn, 3 rounds: a smoke run
    python bench/flbt_tables.py --methods flbt,ssl-flbt --seeds 0,1,2 --set 'num-server-rounds=20'
    python bench/flbt_tables.py --cv-folds 5                     # 004's cross-centre 5-fold CV, mean ± SD
    python bench/flbt_tables.py --costs                          # + Table XII counts for the preset's model
    python bench/flbt_tables.py --table 5-7 --quick              # ablations: SSL-C-FL-BT, SSL-R-FL-BT
    python bench/flbt_tables.py --table 8-10 --quick             # SSL-L-FT, SSL-Fed-R/S, FedSSL-R/S, SSL-FL
    python bench/flbt_tables.py --table 11 --quick               # + a 4th centre held out, fine-tuned (Table XI)

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
#: Rows of 004 Tables II-XI: row name -> (method, run-config overrides).  The SSL variants of
#: Tables V-X are keys of ssl-flbt; their stage 2 (after SSL on original images) is FedAvg.
ROWS = {m: (m, {}) for m in METHODS} | {
    "ssl-c-flbt": ("ssl-flbt", {"ssl.tasks": "centre"}),
    "ssl-r-flbt": ("ssl-flbt", {"ssl.tasks": "restoration"}),
    "ssl-fl": ("ssl-flbt", {"ssl.finetune": "fedavg"}),
    "ssl-l-ft": ("ssl-flbt", {"ssl.finetune": "local"}),
    "ssl-fed-r": ("ssl-flbt", {"ssl.pretrain": "local", "ssl.tasks": "restoration", "ssl.finetune": "fedavg"}),
    "ssl-fed-s": ("ssl-flbt", {"ssl.pretrain": "local", "ssl.tasks": "simclr", "ssl.finetune": "fedavg"}),
    "fedssl-r": ("ssl-flbt", {"ssl.pretrain": "federated", "ssl.tasks": "restoration", "ssl.finetune": "fedavg"}),
    "fedssl-s": ("ssl-flbt", {"ssl.pretrain": "federated", "ssl.tasks": "simclr", "ssl.finetune": "fedavg"}),
}
LABELS = {"local": "Single-centre", "fedavg": "FedAvg", "fedprox": "FedProx", "fedbn": "FedBN", "moon": "MOON",
          "flbt": "FL-BT", "ssl-flbt": "SSL-FL-BT", "ssl-c-flbt": "SSL-C-FL-BT", "ssl-r-flbt": "SSL-R-FL-BT",
          "ssl-fl": "SSL-FL", "ssl-l-ft": "SSL-L-FT", "ssl-fed-r": "SSL-Fed-R", "ssl-fed-s": "SSL-Fed-S",
          "fedssl-r": "FedSSL-R", "fedssl-s": "FedSSL-S"}
TABLE_ROWS = {"2-4": METHODS, "5-7": ("flbt", "ssl-c-flbt", "ssl-r-flbt", "ssl-flbt"),
              "8-10": ("local", "ssl-l-ft", "fedavg", "ssl-fed-r", "ssl-fed-s", "fedssl-r", "fedssl-s", "ssl-fl",
                       "ssl-flbt"),
              "11": ("local", "fedavg", "fedprox", "fedbn", "moon", "flbt", "ssl-flbt")}
COLUMNS = (("accuracy", "Accuracy"), ("precision", "Precision"), ("recall", "Recall"), ("f1", "F1-score"),
           ("ap", "AP"))
# --quick: minutes on 2 CPU cores, and every method learns (8 rounds of 2 epochs, SGD lr 0.05)
QUICK = ["model=\"tiny-cnn\"", "synthetic-per-class=40", "num-server-rounds=8", "local-epochs=2", "lr=0.05",
         "ssl.gan-steps=100", "ssl.pseudo-per-centre=100", "ssl.epochs=2", "ssl.rounds=3"]


def run_one(row: str, seed: int, fold: int | None, args, extra: list[str]) -> tuple[Path, float]:
    """One ``sim.py`` run in its own process; the preset and the overrides go in one TOML file."""
    sys.path.insert(0, str(ROOT))
    from sim import parse_overrides

    method, variant = ROWS[row]
    name = f"{row}-seed{seed}" + (f"-fold{fold}" if fold is not None else "")
    config = {**parse_overrides([args.preset]), **(parse_overrides(extra) if extra else {}), **variant,
              "method": method, "seed": seed, "output-dir": str(args.out), "run-name": name,
              "cache-dir": str(args.out / "cache")}
    if args.holdout:  # Table XI: one more centre, kept out of the federation, fine-tunes the global model
        config.update({"holdout-centre": str(args.num_supernodes)})
    if fold is not None:
        config.update({"cv-folds": args.cv_folds, "cv-fold": fold})
    toml = args.out / f"{name}.toml"
    toml.write_text("".join(f"{json.dumps(k)} = {json.dumps(v)}\n" for k, v in config.items()))
    cmd = [sys.executable, str(ROOT / "sim.py"), "--num-supernodes", str(args.num_supernodes + bool(args.holdout)),
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
    held = [r for runs in results.values() for r in runs if r.get("holdout")]
    if held:
        out += [f"\nTable XI: the global model fine-tuned on held-out centre {held[0]['holdout']['centre']} "
                f"({held[0]['holdout']['epochs']} epochs), its test split, unit %", header, rule]
        for m, runs in results.items():
            vals = [[(r.get("holdout") or {}).get("final", {}).get(k) for r in runs] for k, _ in COLUMNS]
            out.append(f"| {LABELS.get(m, m)} | " + " | ".join(cell(v) for v in vals) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default=str(ROOT / "presets" / "flbt-tables-2-4.toml"))
    parser.add_argument("--methods", default=None,
                        help=f"comma-separated rows: methods or variants ({', '.join(ROWS)}); default: --table's")
    parser.add_argument("--table", default="2-4", choices=sorted(TABLE_ROWS),
                        help="004 table(s) whose rows to run; 11 also holds one more centre out (--holdout)")
    parser.add_argument("--holdout", action="store_true",
                        help="Table XI: run one more SuperNode, held out of the federation (holdout-centre)")
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
    methods = [m.strip() for m in (args.methods or ",".join(TABLE_ROWS[args.table])).split(",") if m.strip()]
    unknown = [m for m in methods if m not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; valid: {', '.join(ROWS)}")
    args.holdout = args.holdout or args.table == "11"
    seeds = [int(s) for s in args.seeds.split(",")]

    results: dict[str, list[dict]] = {}
    total = time.monotonic()
    folds = list(range(args.cv_folds)) if args.cv_folds else [None]
    for m in methods:
        for seed, fold in [(s, f) for s in seeds for f in folds]:
            run_dir, seconds = run_one(m, seed, fold, args, extra)
            summary = json.loads((run_dir / "summary.json").read_text())
            results.setdefault(m, []).append(summary)
            held = (summary.get("holdout") or {}).get("final", {}).get("accuracy")
            print(f"{m:10s} seed {seed} fold {fold}: {seconds:6.1f} s  GTA accuracy {100 * summary['final']['accuracy']:.2f} %"
                  + (f"  held-out accuracy {100 * held:.2f} %" if held is not None else "") + f"  -> {run_dir}", flush=True)
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
