"""Bytes and balanced accuracy of the rows of a LoRA sweep (sweeps/lora-digits.toml), per seed and
as mean ± SD, next to full fine-tuning's (docs/methods/lora.md).

    python -m bench.lora_bytes /tmp/lora/sweep
    python -m bench.lora_bytes /tmp/lora/sweep-lr /tmp/lora/sweep   # baseline: the other sweep's first row

Per run folder (``summary.json``): the fine-tuning rounds' bytes (``bytes_per_round``, stage
``finetune``: server -> clients + clients -> server), the one-time frozen-backbone transfer
(``peft.backbone-transfer``), the final balanced accuracy (test, mean over clients).  The ratio
is LoRA's bytes per fine-tuning round over full fine-tuning's, same seed; the accuracy
difference is paired by seed.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def run_figures(summary: dict) -> dict:
    rounds = [e for e in summary.get("bytes_per_round", []) if e.get("stage") == "finetune"]
    peft = summary.get("peft") or {}
    final = summary.get("final") or {}
    return {
        "bytes_per_round": statistics.fmean(e["bytes"] for e in rounds) if rounds else float("nan"),
        "finetune_bytes": sum(e["bytes"] for e in rounds),
        "backbone_once": (peft.get("backbone-transfer") or {}).get("bytes", 0),
        "balanced_accuracy": final.get("balanced_accuracy", float("nan")),
    }


def mean_sd(values: list[float]) -> str:
    if not values:
        return "-"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.4g} ± {sd:.2g}"


def read_rows(folder: str) -> dict[str, dict[int, dict]]:
    """Row name -> seed -> :func:`run_figures` of a sweep folder's finished runs."""
    table = json.loads((Path(folder) / "table.json").read_text())
    rows: dict[str, dict[int, dict]] = defaultdict(dict)
    for row in table["rows"]:
        name = " ".join(str(v) for v in row["axes"].values())
        for run in row["runs"]:
            summary = Path(run["dir"]) / "summary.json"
            if summary.exists() and json.loads(summary.read_text()).get("final"):
                rows[name][run["seed"]] = run_figures(json.loads(summary.read_text()))
    return rows


def main(folder: str, baseline: str | None = None) -> None:
    rows = read_rows(folder)
    if baseline is not None:
        first, *_ = (base := read_rows(baseline))
        rows = {first: base[first], **rows}
    names = list(rows)
    full = rows[names[0]]
    print(f"baseline (first row): {names[0]}\n")
    print(
        "| row | seeds | bytes / fine-tuning round | % of full (same seed) | backbone once | "
        "fine-tuning total (incl. backbone) | balanced accuracy | paired diff vs full |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in names:
        runs = rows[name]
        seeds = sorted(runs)
        ratio = [100 * runs[s]["bytes_per_round"] / full[s]["bytes_per_round"] for s in seeds if s in full]
        diff = [runs[s]["balanced_accuracy"] - full[s]["balanced_accuracy"] for s in seeds if s in full]
        total = [runs[s]["finetune_bytes"] + runs[s]["backbone_once"] for s in seeds]
        print(
            f"| {name} | {','.join(map(str, seeds))} | {mean_sd([runs[s]['bytes_per_round'] for s in seeds])} | "
            f"{mean_sd(ratio)} | {mean_sd([runs[s]['backbone_once'] for s in seeds])} | {mean_sd(total)} | "
            f"{mean_sd([runs[s]['balanced_accuracy'] for s in seeds])} | {mean_sd(diff)} |"
        )
    print("\nper seed (balanced accuracy):")
    for name in names:
        print(
            f"  {name}: "
            + ", ".join(f"s{s} {rows[name][s]['balanced_accuracy']:.4f}" for s in sorted(rows[name]))
        )


if __name__ == "__main__":
    main(*sys.argv[1:3])
