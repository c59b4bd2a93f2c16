"""Reproduce 000's Table I / Table II / Fig. 6 with fedderm: run every row of a table through
``sim.simulate`` and print balanced accuracy (= mean recall) and mean precision, each the mean
over clients of the final test metrics, next to the paper's numbers.

    python bench/fedclf_tables.py --preset presets/fedclf-fig6-small.toml
    python bench/fedclf_tables.py --preset presets/fedclf-table2.toml --columns 0.1 0.2

The preset gives the common settings (flat run-config keys); the rows (methods and switches)
and columns (label fractions) come from ``bench/fedclf_rows.toml``, section ``table1``,
``table2`` or ``fig6``, chosen from the preset's name (``fedclf-<table>[-small].toml``) or
``--table``.  The number of simulated clients is the preset's ``min-clients``.  Each run's
folder is ``<out>/<table>-<row>-L<pct>``; the table is also written to ``<out>/<table>.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ROWS_FILE = ROOT / "bench" / "fedclf_rows.toml"


def table_name(preset: Path) -> str:
    match = re.fullmatch(r"fedclf-(table1|table2|fig6)(-.*)?", preset.stem)
    if not match:
        raise SystemExit(f"cannot tell the table from the preset name {preset.name!r}; pass --table")
    return match.group(1)


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def pct(x: float) -> str:
    return "n/a" if x is None or x != x else f"{100 * x:.2f}"


def render(title: str, columns: list[float], results: dict, paper: dict, seconds: dict) -> str:
    """Markdown table: per column, our balanced accuracy / precision, then the paper's."""
    head = ["method"]
    for c in columns:
        head += [f"L={100 * c:g}% BAcc", f"L={100 * c:g}% Prec", "paper (R / P)"]
    head.append("run time (s)")
    lines = [f"### {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, per_col in results.items():
        cells = [name]
        for i, c in enumerate(columns):
            bacc, prec = per_col.get(c, (None, None))
            p = paper.get(name, [])
            ref = " / ".join("–" if (v != v) else f"{v:.2f}" for v in p[2 * i:2 * i + 2]) if p else "–"
            cells += [pct(bacc), pct(prec), ref]
        cells.append(f"{sum(seconds[name].values()):.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "BAcc = balanced accuracy (mean recall over classes), Prec = mean precision; both the "
              "unweighted mean over clients of the test metrics after fine-tuning, in %. Paper: 000 (R = recall)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", type=Path, required=True, help="a presets/fedclf-*.toml file")
    parser.add_argument("--table", choices=["table1", "table2", "fig6"], help="default: from the preset name")
    parser.add_argument("--rows", nargs="*", help="only these rows (names as in the table)")
    parser.add_argument("--columns", nargs="*", type=float, help="only these label fractions")
    parser.add_argument("--out", type=Path, default=Path("/tmp/fedclf-tables"), help="run folders go here")
    parser.add_argument("--cpus-per-client", type=int, default=1)
    args = parser.parse_args(argv)

    import sim

    table = args.table or table_name(args.preset)
    spec = tomllib.loads(ROWS_FILE.read_text())[table]
    base = sim.parse_overrides([str(args.preset)])
    num_clients = int(base.get("min-clients", 2))
    columns = [c for c in spec["columns"] if not args.columns or any(math.isclose(c, a) for a in args.columns)]
    rows = [r for r in spec["rows"] if not args.rows or r["name"] in args.rows]
    results: dict[str, dict[float, tuple]] = {}
    seconds: dict[str, dict[float, float]] = {}
    start = time.monotonic()
    for row in rows:
        for column in columns:
            overrides = {**base, **row["set"], "label-fraction": column, "output-dir": str(args.out.resolve()),
                         "run-name": f"{table}-{slug(row['name'])}-L{round(100 * column)}"}
            t0 = time.monotonic()
            run_dir = sim.simulate(overrides, num_supernodes=num_clients, cpus_per_client=args.cpus_per_client)
            final = json.loads((run_dir / "summary.json").read_text())["final"] or {}
            results.setdefault(row["name"], {})[column] = (final.get("balanced_accuracy"), final.get("precision"))
            seconds.setdefault(row["name"], {})[column] = time.monotonic() - t0
            print(f"[{table}] {row['name']} L={column:g}: balanced accuracy {pct(final.get('balanced_accuracy'))}, "
                  f"precision {pct(final.get('precision'))} ({seconds[row['name']][column]:.0f} s) -> {run_dir}",
                  flush=True)
    total = time.monotonic() - start
    text = render(f"{spec['title']} — preset {args.preset.name}, {num_clients} clients", columns, results,
                  {r["name"]: r.get("paper", []) for r in spec["rows"]}, seconds)
    text += f"\n\nTotal run time: {total:.0f} s for {len(rows) * len(columns)} runs."
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{table}.md").write_text(text + "\n")
    print("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
