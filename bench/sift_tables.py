"""SiFT paper (002) Table 1 / Table 2 style tables: one ``sim.py`` run per method (or per variant).

    python -m bench.sift_tables --preset presets/sift-table1.toml --num-supernodes 4
    python -m bench.sift_tables --preset presets/sift-ablation.toml --ablation
    python -m bench.sift_tables --preset presets/sift-table1.toml --quick      # tiny, minutes on a CPU

Table 1: final test balanced accuracy (mean over clients of the best-on-val model; mean ± std
over seeds when several are given).  Table 2: rounds until the mean validation balanced accuracy
first reaches each of ``targets`` ('-' = never), plus the model traffic per round.  The tables
are printed and written to ``<out>/tables.md``; each run's folder is under ``<out>``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

METHODS = ("sift", "fedavg", "fedprox", "scaffold", "feddyn")
VARIANTS = ("full", "single", "trainable-head", "random-head", "trainable-projector")
#: --quick: the embedded data at 32 px with the tiny CNN, 10 rounds of 2 local epochs.
QUICK = {"model": "tiny-cnn", "image-size": 32, "synthetic-per-class": 40, "num-server-rounds": 10,
         "local-epochs": 2, "batch-size": 32}


def _fmt(values: list[float]) -> str:
    if not values:
        return "n/a"
    mean = 100 * statistics.fmean(values)
    return f"{mean:.1f} ± {100 * statistics.stdev(values):.1f}" if len(values) > 1 else f"{mean:.1f}"


def tables(rows: dict[str, list[dict]], targets: list[str], what: str) -> str:
    """Markdown tables from ``{row name: [summary.json of each seed]}``."""
    t1 = [f"Table 1 style: test balanced accuracy (%), {what}", "",
          "| method | balanced accuracy | best round |", "|---|---|---|"]
    t2 = [f"Table 2 style: rounds to reach the mean val balanced accuracy, {what}", "",
          "| method | " + " | ".join(f"{float(t):.0%}" for t in targets) + " | MB / round |",
          "|---|" + "---|" * (len(targets) + 1)]
    for name, summaries in rows.items():
        scores = [s["final"]["balanced_accuracy"] for s in summaries
                  if s.get("final") and s["final"].get("balanced_accuracy") is not None]
        best = ", ".join(str(s.get("best_round")) for s in summaries)
        t1.append(f"| {name} | {_fmt(scores)} | {best} |")
        cells = []
        for t in targets:
            reached = [s.get("rounds_to_target", {}).get(t) for s in summaries]
            cells.append(", ".join("-" if r is None else str(r) for r in reached))
        traffic = [b["bytes"] for s in summaries for b in s.get("bytes_per_round", [])]
        mb = f"{statistics.fmean(traffic) / 2**20:.2f}" if traffic else "n/a"
        t2.append(f"| {name} | " + " | ".join(cells) + f" | {mb} |")
    return "\n".join(t1 + [""] + t2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", required=True, help="a presets/*.toml file (flat run-config keys)")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated methods (Table 1 rows)")
    parser.add_argument("--ablation", action="store_true", help="rows are the sift.variant values instead")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="with --ablation: variants to run")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (mean ± std over them)")
    parser.add_argument("--num-supernodes", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="override with a tiny setting: " + json.dumps(QUICK))
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="more run-config overrides (TOML values), e.g. num-server-rounds=20")
    parser.add_argument("--out", default="/tmp/fedderm-sift-tables", help="folder for run folders and tables.md")
    args = parser.parse_args(argv)

    import sim

    base = sim.parse_overrides([args.preset])
    if args.quick:
        base.update(QUICK)
    base.update(sim.parse_overrides(args.set) if args.set else {})
    out = Path(args.out).expanduser().resolve()
    rows = ([(v, {"method": "sift", "sift.variant": v}) for v in args.variants.split(",")] if args.ablation
            else [(m, {"method": m}) for m in args.methods.split(",")])
    seeds = [int(s) for s in args.seeds.split(",")]
    results: dict[str, list[dict]] = {}
    started = time.monotonic()
    for name, extra in rows:
        for seed in seeds:
            overrides = {**base, **extra, "seed": seed, "output-dir": str(out), "run-name": f"{name}-seed{seed}"}
            t0 = time.monotonic()
            run_dir = sim.simulate(overrides, num_supernodes=args.num_supernodes)
            summary = json.loads((run_dir / "summary.json").read_text())
            results.setdefault(name, []).append(summary)
            print(f"[sift_tables] {name} seed {seed}: balanced accuracy "
                  f"{summary['final']['balanced_accuracy']:.3f} in {time.monotonic() - t0:.0f} s ({run_dir})",
                  flush=True)
    resolved = sim.resolved_run_config({**base, **rows[0][1]})
    targets = [f"{float(t):g}" for t in resolved["targets"].split(",") if t.strip()]
    what = (f"{resolved['dataset']} data, partition={resolved['partition']} α={resolved['dirichlet-alpha']}, "
            f"{args.num_supernodes} clients, {resolved['model']}, {resolved['num-server-rounds']} rounds × "
            f"{resolved['local-epochs']} local epochs, seeds {args.seeds}")
    text = tables(results, targets, what)
    text += f"\n\nwall time: {time.monotonic() - started:.0f} s for {len(rows) * len(seeds)} runs\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "tables.md").write_text(text)
    print(text)
    print(f"tables: {out / 'tables.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
