"""A sweep's figure beside its table.md: each arm's validation curve over rounds, with the seeds'
spread (``val_curves.png``), and the ``provenance.json`` that says where the sweep ran.

One panel per combination of every axis but the last, one line per label of the last axis (the
arms): the mean over the completed replicates of the mean validation metric per round, and a band
from the lowest to the highest replicate.  The metric is the sweep's first column when it is a
per-round metric (balanced accuracy, accuracy, ...), else balanced accuracy.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedderm.metrics import METRIC_NAMES

CURVES_PNG = "val_curves.png"


def curve_metric(table: Mapping[str, Any]) -> str:
    keys = [m["key"] for m in table["metrics"]]
    return keys[0] if keys and keys[0] in METRIC_NAMES else "balanced_accuracy"


def val_curve(summary: Mapping[str, Any], key: str) -> dict[int, float]:
    """round -> mean validation ``key`` of one run, from summary.json's ``rounds`` or a record's
    ``curves``."""
    if "curves" in summary:
        c = summary["curves"]
        return {r: v for r, v in zip(c["round"], c["mean"].get(key, [])) if v is not None}
    out = {}
    for entry in summary.get("rounds") or []:
        value = (entry.get("metrics") or {}).get(key)
        if entry.get("split") == "val" and isinstance(value, (int, float)):
            out[int(entry["round"])] = float(value)
    return out


def curve_data(table: Mapping[str, Any], runs: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """What the figure draws: ``panels`` (title -> arm -> {round, mean, low, high, n}).

    ``runs``: run name -> its summary (or record); the table says which runs are done."""
    key = curve_metric(table)
    axes = table["axes"]
    panels: dict[str, dict[str, Any]] = {}
    for row in table["rows"]:
        labels = row["axes"]
        panel = " · ".join(str(labels[a]) for a in axes[:-1]) or table["title"]
        arm = str(labels[axes[-1]]) if axes else "run"
        curves = [
            val_curve(runs[r["name"]], key)
            for r in row["runs"]
            if r["status"] == "done" and r["name"] in runs
        ]
        curves = [c for c in curves if c]
        if not curves:
            continue
        rounds = sorted(set.intersection(*(set(c) for c in curves)))
        panels.setdefault(panel, {})[arm] = {
            "round": rounds,
            "mean": [statistics.fmean(c[r] for c in curves) for r in rounds],
            "low": [min(c[r] for c in curves) for r in rounds],
            "high": [max(c[r] for c in curves) for r in rounds],
            "n": len(curves),
        }
    return {"metric": key, "panels": panels}


def plot_curves(data: Mapping[str, Any], path: Path, title: str = "") -> bool:
    """Write the figure (matplotlib, Agg); False when there is nothing to draw."""
    fig = curves_figure(data, title)
    if fig is None:
        return False
    fig.savefig(path, dpi=100, metadata={"Software": None})
    return True


def curves_figure(data: Mapping[str, Any], title: str = ""):
    """The figure :func:`plot_curves` writes, or None.  A sweep with one axis has one panel, named by
    the sweep's title (:func:`curve_data`): the title then heads the figure once, not the panel too."""
    import textwrap

    panels = data["panels"]
    if not panels:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n = len(panels)
    cols = min(n, 3)
    rows = (n + cols - 1) // cols
    fig = Figure(figsize=(4.6 * cols, 3.4 * rows + 0.6))
    FigureCanvasAgg(fig)
    for k, (name, arms) in enumerate(panels.items()):
        ax = fig.add_subplot(rows, cols, k + 1)
        for arm, c in arms.items():
            (line,) = ax.plot(c["round"], [100 * v for v in c["mean"]], lw=1.6, label=f"{arm} (n = {c['n']})")
            if c["n"] > 1:
                ax.fill_between(
                    c["round"], [100 * v for v in c["low"]], [100 * v for v in c["high"]],
                    color=line.get_color(), alpha=0.18, lw=0,
                )  # fmt: skip
        if name != title:
            ax.set_title(textwrap.fill(name, width=60), fontsize=9)
        ax.set_xlabel("round")
        ax.set_ylabel(f"validation {data['metric'].replace('_', ' ')} (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        head = textwrap.fill(title, width=int(55 * cols))
        fig.suptitle(f"{head}\nmean over seeds; band: lowest to highest seed", fontsize=9)
    fig.tight_layout()
    return fig


def write_curves(table: Mapping[str, Any], results: list[Mapping[str, Any]], folder: Path) -> Path | None:
    """``val_curves.png`` in the sweep folder from the runs' summaries; None when nothing ran."""
    runs = {Path(r["dir"]).name: r["summary"] for r in results if r.get("summary") and r.get("dir")}
    data = curve_data(table, runs)
    path = Path(folder) / CURVES_PNG
    return path if plot_curves(data, path, table.get("title", "")) else None


def write_provenance(folder: Path) -> dict[str, Any]:
    """``provenance.json``: the commit, machine and versions of the first writer; a later writer at
    another commit (a resumed sweep) is added under ``also``."""
    from fedderm.ledger.records import PROVENANCE, provenance_here

    path = Path(folder) / PROVENANCE
    here = provenance_here()
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        saved = None
    if saved is None:
        saved = here
    elif here["commit"] != saved.get("commit") and here["commit"] not in saved.get("also", []):
        saved.setdefault("also", []).append(here["commit"])
    path.write_text(json.dumps(saved, indent=1) + "\n", encoding="utf-8")
    return saved
