"""Experiment sweeps, the tables: read each run's ``summary.json``, aggregate the replicates of a
row into mean ± SD and render the paper-style Markdown table (``sim.py --sweep`` writes it as
``table.md``).  Parsing a sweep file and expanding it into runs is :mod:`fedderm.sweep`.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedderm.results import client_sort_key
from fedderm.sweep import Metric, Run, Sweep


def is_complete(summary: Mapping[str, Any] | None) -> bool:
    """A run is done when its summary.json has final (test) metrics."""
    return bool(summary) and summary.get("final") is not None


def read_summary(run_dir: Path) -> dict | None:
    path = Path(run_dir) / "summary.json"
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def lookup(obj: Any, path: str) -> Any:
    """Value at a dotted ``path`` of summary.json (greedy on keys holding dots); None if absent.

    A list of records on the way gives the mean of the rest of the path over the records."""
    if path == "":
        return obj
    if isinstance(obj, list):
        values = [_number_or_none(lookup(item, path)) for item in obj]
        values = [v for v in values if v is not None]
        return statistics.fmean(values) if values else None
    if not isinstance(obj, Mapping):
        return None
    if path in obj:
        return obj[path]
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        head = ".".join(parts[:i])
        if head in obj:
            return lookup(obj[head], ".".join(parts[i:]))
    return None


def _number_or_none(value: Any) -> float | None:
    """A finite number as float; None for missing, non-numeric or NaN (left out of mean ± SD)."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return None if math.isnan(value) else float(value)


def metric_value(summary: Mapping[str, Any], metric: Metric, client: str | None = None) -> float | None:
    """The number a run contributes to a column (None when missing / undefined)."""
    final = summary.get("final") or {}
    if metric.is_final:
        source = final if client is None else (final.get("per_client") or {}).get(client, {})
        return _number_or_none(source.get(metric.key))
    return _number_or_none(lookup(summary, metric.key))


#: metric keys (last dotted part) whose chance level is 1/K: sklearn's balanced accuracy and the macro
#: recall (the same number unless a class is absent from the test set)
CHANCE_KEYS = ("balanced_accuracy", "recall")
#: how many standard errors above 1/K still count as chance
CHANCE_Z = 2.0


def chance_info(
    summary: Mapping[str, Any], metric: Metric, client: str | None = None
) -> tuple[int, int] | None:
    """(K classes, n test images) behind a run's value of ``metric``; None when the metric has no 1/K
    chance level (:data:`CHANCE_KEYS`) or the summary lacks either number."""
    if metric.key.rsplit(".", 1)[-1] not in CHANCE_KEYS:
        return None
    classes = summary.get("classes") or []
    if isinstance(classes, Mapping):  # summary.json: {"names": [...], "counts": {...}}
        classes = classes.get("names") or []
    k = len(classes)
    if metric.is_final:
        source = summary.get("final") or {}
        if client is not None:
            source = (source.get("per_client") or {}).get(client, {})
        n = source.get("num-examples")
    else:
        head = metric.key.rsplit(".", 1)[0] if "." in metric.key else ""
        n = lookup(summary, f"{head}.num-examples" if head else "num-examples")
    n = _number_or_none(n)
    return (k, int(n)) if k >= 2 and n and n > 0 else None


def chance_margin(k: int, n: int, sd: float | None) -> float:
    """How far above 1/K a mean balanced accuracy still lies within noise of chance:
    ``max(CHANCE_Z · sqrt(p(1 − p)/n), CHANCE_Z · SD over the replicates)``, p = 1/K.

    sqrt(p(1 − p)/n) is the standard error of the balanced accuracy of random guessing on n test
    images split evenly over K classes (the mean of K per-class recalls, each Binomial(n/K, p)/(n/K))."""
    p = 1.0 / k
    return max(CHANCE_Z * math.sqrt(p * (1 - p) / n), CHANCE_Z * (sd or 0.0))


def mark_chance(cell: dict[str, Any], infos: list[tuple[int, int]]) -> None:
    """Add ``chance`` (1/K), ``chance_margin`` and ``at_chance`` to an aggregated cell, from the
    (K, n) of its runs (the smallest n: the widest margin)."""
    if cell["mean"] is None or not infos:
        return
    k = infos[0][0]
    n = min(n for _, n in infos)
    cell["chance"] = 1.0 / k
    cell["chance_margin"] = chance_margin(k, n, cell["sd"])
    cell["at_chance"] = cell["mean"] <= cell["chance"] + cell["chance_margin"]


def mean_sd(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and sample SD (ddof = 1, as the papers report over runs); SD None for one value."""
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


#: two-sided confidence level of the paired differences against the reference row
CI_LEVEL = 0.95


def paired_difference(pairs: list[tuple[float, float]]) -> dict[str, Any]:
    """Mean, sample SD and the t confidence interval (:data:`CI_LEVEL`) of the differences
    d_i = x_i − r_i of paired replicates (same seed and fold): mean ± t_{n−1} · SD/√n.
    With one pair the SD and the interval are None."""
    diffs = [x - r for x, r in pairs]
    mean, sd = mean_sd(diffs)
    out: dict[str, Any] = {"n": len(diffs), "mean": mean, "sd": sd, "ci": None, "values": diffs}
    if sd is not None:
        from scipy.stats import t

        half = float(t.ppf(0.5 + CI_LEVEL / 2, len(diffs) - 1)) * sd / math.sqrt(len(diffs))
        out["ci"] = [mean - half, mean + half]
    return out


#: appended to a cell within noise of chance (:func:`mark_chance`)
CHANCE_MARK = "≈chance"


def format_cell(cell: Mapping[str, Any], metric: Metric) -> str:
    """``12.34 ± 0.56`` (scaled); ``(2/3)`` appended when some runs lack the value."""
    if cell["mean"] is None:
        return "n/a"
    text = f"{metric.scale * cell['mean']:.{metric.digits}f}"
    if cell["sd"] is not None:
        text += f" ± {metric.scale * cell['sd']:.{metric.digits}f}"
    if cell["n"] < cell["runs"]:
        text += f" ({cell['n']}/{cell['runs']})"
    if cell.get("at_chance"):
        text += f" {CHANCE_MARK}"
    return text


def aggregate(sweep: Sweep, results: list[Mapping[str, Any]]) -> dict[str, Any]:
    """table.json content from the runs' results.

    ``results``: one per run of ``sweep.runs()``, each ``{"run": index, "dir": str | None,
    "status": "done" | "failed", "reason": str, "seconds": float, "summary": dict | None}``.
    Every row gets, per metric (and per client in ``per-client`` mode), the mean ± SD over its
    completed replicates; failed runs are listed with their reason and left out of the numbers.
    """
    runs = sweep.runs()
    by_row: dict[int, list[tuple[Run, Mapping[str, Any]]]] = {}
    for result in results:
        run = runs[result["run"]]
        by_row.setdefault(run.row.index, []).append((run, result))
    clients: list[str] = []
    if sweep.table == "per-client":
        ids = {
            c
            for r in results
            if is_complete(r.get("summary"))
            for c in (r["summary"]["final"].get("per_client") or {})
        }
        clients = sorted(ids, key=client_sort_key)

    def cells(done: list[Mapping[str, Any]], client: str | None) -> dict[str, dict]:
        out = {}
        for m in sweep.metrics:
            values = [v for r in done if (v := metric_value(r["summary"], m, client)) is not None]
            mean, sd = mean_sd(values)
            out[m.label] = {"mean": mean, "sd": sd, "n": len(values), "runs": len(done), "values": values}
            infos = [i for r in done if (i := chance_info(r["summary"], m, client)) is not None]
            mark_chance(out[m.label], infos)
        return out

    def replicates(row_index: int) -> dict[tuple, Mapping[str, Any]]:
        """(seed, fold) -> summary of the row's completed runs."""
        return {
            (run.seed, run.fold): r["summary"]
            for run, r in by_row.get(row_index, [])
            if r["status"] == "done" and is_complete(r.get("summary"))
        }

    def versus(row, ref) -> dict[str, Any] | None:
        if ref is None:
            return None
        mine, theirs = replicates(row.index), replicates(ref.index)
        out: dict[str, Any] = {"row": ref.index, "axes": ref.labels, "metrics": {}}
        for m in sweep.metrics:
            pairs = []
            for key in sorted(set(mine) & set(theirs), key=str):
                x, r = metric_value(mine[key], m), metric_value(theirs[key], m)
                if x is not None and r is not None:
                    pairs.append((x, r))
            out["metrics"][m.label] = paired_difference(pairs)
        return out

    rows = []
    for row in sweep.rows():
        entries = by_row.get(row.index, [])
        done = [r for _, r in entries if r["status"] == "done" and is_complete(r.get("summary"))]
        rows.append(
            {
                "row": row.index,
                "axes": row.labels,
                "overrides": row.overrides,
                "runs": [
                    {
                        "name": run.name,
                        "seed": run.seed,
                        "fold": run.fold,
                        "dir": r.get("dir"),
                        "status": r["status"],
                        "reason": r.get("reason", ""),
                        "seconds": r.get("seconds"),
                    }
                    for run, r in entries
                ],
                "done": len(done),
                "planned": len(sweep.seeds) * max(sweep.cv_folds, 1),
                "metrics": cells(done, None),
                "per_client": {c: cells(done, c) for c in clients},
                "vs_reference": versus(row, sweep.reference_of(row)),
            }
        )
    return {
        "title": sweep.title,
        "sweep": sweep.source,
        "quick": sweep.quick,
        "gpu": sweep.gpu,
        "table": sweep.table,
        "num-supernodes": sweep.num_supernodes,
        "seeds": sweep.seeds,
        "cv-folds": sweep.cv_folds,
        "axes": list(sweep.axes),
        "reference": sweep.reference,
        "clients": clients,
        "metrics": [
            {"key": m.key, "label": m.label, "scale": m.scale, "digits": m.digits} for m in sweep.metrics
        ],
        "rows": rows,
    }


def _md_table(table: Mapping[str, Any], metrics: list[Metric], client: str | None) -> list[str]:
    axes = table["axes"]
    head = [*axes, *(m.label for m in metrics), "runs"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in table["rows"]:
        cells_of = row["metrics"] if client is None else row["per_client"].get(client, {})
        failed = [r for r in row["runs"] if r["status"] != "done"]
        if row["done"] == 0 and failed:
            values = ["failed"] * len(metrics)
        else:
            values = [format_cell(cells_of[m.label], m) if m.label in cells_of else "n/a" for m in metrics]
        count = f"{row['done']}/{row['planned']}"
        if failed:
            count += "; failed: " + "; ".join(f"{r['name']}: {_short(r['reason'])}" for r in failed)
        lines.append("| " + " | ".join([*(_cell(row["axes"][a]) for a in axes), *values, count]) + " |")
    return lines


def format_difference(diff: Mapping[str, Any], metric: Metric) -> str:
    """``+1.23 [−0.45, +2.91]`` (scaled; the CI in brackets); ``(n = 1)`` without an interval."""
    if not diff["n"]:
        return "n/a"
    s, d = metric.scale, metric.digits
    text = f"{s * diff['mean']:+.{d}f}"
    if diff["ci"] is None:
        return text + f" (n = {diff['n']})"
    lo, hi = diff["ci"]
    return text + f" [{s * lo:+.{d}f}, {s * hi:+.{d}f}]"


def _md_differences(table: Mapping[str, Any], metrics: list[Metric]) -> list[str]:
    """The paired differences of every row from its reference row, one column per metric."""
    axes = table["axes"]
    head = [*axes, *(f"Δ {m.label}" for m in metrics), "pairs"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in table["rows"]:
        vs = row.get("vs_reference")
        if vs is None:
            values, pairs = ["reference"] * len(metrics), ""
        else:
            values = [format_difference(vs["metrics"][m.label], m) for m in metrics]
            pairs = str(max(vs["metrics"][m.label]["n"] for m in metrics))
        lines.append("| " + " | ".join([*(_cell(row["axes"][a]) for a in axes), *values, pairs]) + " |")
    return lines


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|")


def _short(reason: str, width: int = 160) -> str:
    line = " ".join(str(reason).split())
    return _cell(line if len(line) <= width else line[: width - 1] + "…")


def chance_note(table: Mapping[str, Any]) -> str:
    """The rule behind the ``≈chance`` marks, with the numbers of this table; '' when no column has a
    chance level."""
    cells = [
        c
        for row in table["rows"]
        for group in (row["metrics"], *row["per_client"].values())
        for c in group.values()
        if "chance" in c
    ]
    if not cells:
        return ""
    marked = sum(bool(c["at_chance"]) for c in cells)
    levels = sorted({round(100 * c["chance"], 2) for c in cells})
    return (
        f"`{CHANCE_MARK}`: within noise of chance ({marked} of {len(cells)} balanced-accuracy/recall cells): "
        f"mean ≤ 1/K + max({CHANCE_Z:g}·√(p(1−p)/n), {CHANCE_Z:g}·SD over replicates), p = 1/K "
        f"({', '.join(f'{v:g} %' for v in levels)} here), n = the run's test images (the smallest "
        "over replicates): random guessing stays below this line about 98 % of the time."
    )


def differences_sentence(table: Mapping[str, Any]) -> str:
    ref = ", ".join(f"{a} = {v}" for a, v in table["reference"].items())
    return (
        f"**Paired differences from the reference row** ({ref}; the other axes as the row's): "
        f"mean of (row − reference) over the replicates both completed (same seed and fold), "
        f"with its {100 * CI_LEVEL:g} % t-interval [mean ± t(n−1)·SD/√n]; `pairs` = n. An interval "
        "that contains 0 is no evidence of a difference."
    )


def markdown_tables(table: Mapping[str, Any]) -> list[str]:
    """The tables of :func:`render_markdown` without its title, notes and footer: one table per
    client then the GTA (``per-client``), or the one table; then the paired differences."""
    metrics = [Metric(m["key"], m["label"], m["scale"], m["digits"]) for m in table["metrics"]]
    lines: list[str] = []
    if table["table"] == "per-client":
        for i, client in enumerate(table["clients"], start=1):
            lines += [f"**C{i}** (client {client}, test split)", "", *_md_table(table, metrics, client), ""]
        lines += ["**GTA** (mean over clients)", ""]
    lines += _md_table(table, metrics, None)
    if table.get("reference"):
        lines += ["", differences_sentence(table), "", *_md_differences(table, metrics)]
    return lines


def render_markdown(table: Mapping[str, Any], footer: str = "") -> str:
    """Paper-style Markdown: one row per axes combination, metric columns as mean ± SD.

    ``per-client`` tables give one table per client (C1, C2, …, as 004 Tables II–IV) and then the
    mean over clients (004's GTA)."""
    metrics = [Metric(m["key"], m["label"], m["scale"], m["digits"]) for m in table["metrics"]]
    reps = f"{len(table['seeds'])} seed(s)" + (
        f" × {table['cv-folds']} cv-folds" if table["cv-folds"] else ""
    )
    unit = (
        "Final metrics (test split, best-on-val model, mean over clients) in %, other columns as labelled"
        if any(m.is_final for m in metrics)
        else "Values"
    )
    note = (
        f"{unit}, mean ± SD over {reps}; `runs` = completed/planned replicates. "
        f"{table['num-supernodes']} simulated clients{', --quick settings' if table['quick'] else ''}"
        f"{', --gpu settings' if table.get('gpu') else ''}."
    )
    lines = [f"### {table['title']}", ""]
    if table["table"] == "per-client":
        for i, client in enumerate(table["clients"], start=1):
            lines += [f"**C{i}** (client {client}, test split)", "", *_md_table(table, metrics, client), ""]
        lines += ["**GTA** (mean over clients)", ""]
    lines += [*_md_table(table, metrics, None), "", note]
    if table.get("reference"):
        lines += ["", differences_sentence(table), "", *_md_differences(table, metrics)]
    rule = chance_note(table)
    if rule:
        lines += ["", rule]
    if footer:
        lines += ["", footer]
    return "\n".join(lines) + "\n"
