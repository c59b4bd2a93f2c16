"""``fedderm-compare RUN_DIR...``: run folders side by side, whatever their methods or numbers of clients.

    fedderm-compare ~/fedderm-results/fedavg-… ~/fedderm-results/fedmae-…   # two runs
    fedderm-compare /tmp/sweep/r0*                                          # a sweep's run folders
    fedderm-compare /tmp/sweep --out /tmp/cmp                               # the same: a sweep's folder
    fedderm-compare RUN_DIR... --metric auc                                 # AUC curves instead

It prints one Markdown table of the final test metrics, the mean over clients (``summary.json``
``final``) with the selection metric (balanced accuracy, which chose each run's best round) first,
and one of each client's balanced accuracy; it writes ``compare.md`` (both tables), ``compare.csv``
(one row per run and client, every metric, the numbers of ``summary.json`` unrounded) and
``compare.png``: each run's validation curve over rounds, the mean over clients.  A method with a
self-supervised pre-training stage (split ``pretrain``: no labels, only its loss) gets its
pre-training loss in a panel of its own and its fine-tuning rounds in the validation panel.

A folder that is not a run folder (no ``summary.json``/``config.json``) stops the command, naming
it (exit 2).  A run still going, failed or stopped is shown as far as it got and named on stderr
with what it lacks (exit 1).  A folder that holds run folders (a sweep's output) stands for them.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedderm.metrics import METRIC_NAMES, SELECTION_METRIC
from fedderm.results import client_sort_key

#: the final metrics in table order: the selection metric first
METRICS = (SELECTION_METRIC, *(m for m in METRIC_NAMES if m != SELECTION_METRIC))
#: the split of a self-supervised pre-training round (fedderm/results.py: only the SSL loss)
PRETRAIN = "pretrain"
#: the split of a validation round (training rounds, or fine-tuning rounds after a pre-training)
VAL = "val"
CSV_COLUMNS = (
    "run",
    "method",
    "folder",
    "status",
    "best_round",
    "test_set",
    "client",
    "num-examples",
    *METRICS,
)


class CompareError(ValueError):
    """A folder cannot be compared; the message names it."""


@dataclass
class Run:
    """One run folder as the comparison reads it."""

    folder: Path
    label: str
    method: str
    status: str  # done | running | failed | stopped | …
    problem: str  # "" for a complete run, else what it lacks (one line)
    summary: dict[str, Any]
    rounds: list[dict[str, Any]]

    @property
    def final(self) -> dict[str, Any]:
        return self.summary.get("final") or {}

    @property
    def clients(self) -> list[str]:
        """Its clients, by id (from the final test, else from its rounds)."""
        ids = set(self.final.get("per_client") or {})
        if not ids:
            ids = {cid for r in self.rounds for cid in r.get("per_client", {})}
        return sorted(ids, key=client_sort_key)


def read_rounds(folder: Path, summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The run's evaluation rounds, each ``{"round", "split", "metrics" (the mean over clients),
    "per_client"}``: ``summary.json``'s ``rounds``, or, where summary.json holds none, ``rounds.csv``
    (appended as each round is evaluated).  The one place this module reads a run's rounds."""
    if summary.get("rounds"):
        return list(summary["rounds"])
    path = folder / "rounds.csv"
    if not path.is_file():
        return []
    rounds: dict[tuple[int, str], dict[str, Any]] = {}
    with open(path, newline="", encoding="utf-8") as fh:
        for row in csv.DictReader(fh):
            try:
                key = (int(row["round"]), row["split"])
            except (KeyError, TypeError, ValueError):
                continue
            if key[1] in ("test", "global-test"):
                continue  # the final test lives in summary.json's final
            entry = rounds.setdefault(
                key, {"round": key[0], "split": key[1], "metrics": {}, "per_client": {}}
            )
            values = {
                k: float(v) for k, v in row.items() if k not in ("round", "split", "client") and _number(v)
            }
            if row.get("client") == "mean":
                entry["metrics"] = values
            else:
                entry["per_client"][str(row.get("client"))] = values
    return list(rounds.values())


def _number(text: Any) -> bool:
    try:
        return text not in (None, "") and math.isfinite(float(text))
    except (TypeError, ValueError):
        return False


def _load_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CompareError(f"{path}: not readable as JSON ({err})") from None
    if not isinstance(data, dict):
        raise CompareError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def is_run_folder(folder: Path) -> bool:
    return (folder / "summary.json").is_file() or (folder / "config.json").is_file()


def expand(folders: Sequence[str | Path]) -> list[Path]:
    """The run folders named: each folder itself, or the run folders directly inside a folder that is
    none (a sweep's output).  A folder that is neither is a :class:`CompareError` naming it."""
    out: list[Path] = []
    for given in folders:
        folder = Path(given).expanduser()
        if not folder.is_dir():
            raise CompareError(f"{folder}: no such folder")
        if is_run_folder(folder):
            out.append(folder)
            continue
        inside = sorted(p for p in folder.iterdir() if p.is_dir() and is_run_folder(p))
        if not inside:
            raise CompareError(
                f"{folder}: not a run folder (no summary.json or config.json) and no run folders inside it"
            )
        out.extend(inside)
    return out


def read_run(folder: Path) -> Run:
    """A run folder: its summary (config.json stands in for a run that died before its first summary),
    its rounds and what it lacks, if anything."""
    if not (folder / "summary.json").is_file():
        config = _load_json(folder / "config.json")
        summary: dict[str, Any] = {
            "method": config.get("method", "?"),
            "config": config,
            "status": "no summary",
        }
    else:
        summary = _load_json(folder / "summary.json")
    rounds = read_rounds(folder, summary)
    method = str(summary.get("method") or (summary.get("config") or {}).get("method") or "?")
    status = str(summary.get("status") or ("done" if summary.get("final") is not None else "unknown"))
    problem = ""
    if summary.get("final") is None or status != "done":
        done = sorted({(r["split"], r["round"]) for r in rounds})
        stages = ", ".join(
            f"{n} {split} round{'s' if n > 1 else ''}"
            for split in dict.fromkeys(s for s, _ in done)
            if (n := sum(1 for s, _ in done if s == split))
        )
        what = {
            "running": "still running (or ended without recording it)",
            "no summary": "ended before its first summary.json",
        }.get(status, status)
        error = str(summary.get("error") or "").strip().splitlines()
        problem = (
            f"{what}: {stages or 'no rounds'} recorded"
            + ("" if summary.get("final") is not None else ", no final test metrics")
            + (f"; error: {error[0][:200]}" if error else "")
        )
    return Run(folder, f"{method} · {folder.name}", method, status, problem, summary, rounds)


def load_runs(folders: Sequence[str | Path]) -> list[Run]:
    """The runs of ``folders`` (see :func:`expand`), labelled ``method · run folder``; two runs with
    the same label get their parent folder's name too."""
    runs = [read_run(f) for f in expand(folders)]
    seen: dict[str, int] = {}
    for r in runs:
        seen[r.label] = seen.get(r.label, 0) + 1
    for r in runs:
        if seen[r.label] > 1:
            r.label = f"{r.method} · {r.folder.parent.name}/{r.folder.name}"
    return runs


# -- tables --------------------------------------------------------------------------------------
def _fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "–"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|")


def mean_table(runs: Sequence[Run]) -> list[str]:
    """Markdown: one row per run, its final test metrics (mean over clients; the global test set's
    where ``test-set="global"``), the selection metric first."""
    head = ["run", "clients", "status", "best round", "test set", *METRICS]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        final = r.final
        cells = [
            _cell(r.label),
            str(len(r.clients)),
            r.status,
            str(r.summary.get("best_round") if r.summary.get("best_round") is not None else "–"),
            final.get("test_set", "–") if final else "–",
            *(_fmt(final.get(m)) for m in METRICS),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def client_table(runs: Sequence[Run], metric: str = SELECTION_METRIC) -> list[str]:
    """Markdown: one row per run, each client's final ``metric`` on its own test split (– where the
    run has no such client)."""
    clients = sorted({c for r in runs for c in r.clients}, key=client_sort_key)
    head = ["run", *(f"client {c}" for c in clients)]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        per = r.final.get("per_client") or {}
        rows.append(
            "| " + " | ".join([_cell(r.label), *(_fmt(per.get(c, {}).get(metric)) for c in clients)]) + " |"
        )
    return rows


def csv_rows(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """One row per run and client (``client`` = ``mean`` first), every final metric as in summary.json."""
    out = []
    for r in runs:
        final = r.final
        base = {
            "run": r.label,
            "method": r.method,
            "folder": str(r.folder),
            "status": r.status,
            "best_round": r.summary.get("best_round"),
            "test_set": final.get("test_set", ""),
        }
        out.append({**base, "client": "mean", "num-examples": final.get("num-examples"), **_metrics(final)})
        for cid in sorted(final.get("per_client") or {}, key=client_sort_key):
            per = final["per_client"][cid]
            out.append({**base, "client": cid, "num-examples": per.get("num-examples"), **_metrics(per)})
    return out


def _metrics(source: dict[str, Any]) -> dict[str, Any]:
    return {m: source.get(m) for m in METRICS}


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow(
            {
                k: "" if row.get(k) is None else (repr(row[k]) if isinstance(row[k], float) else row[k])
                for k in CSV_COLUMNS
            }
        )
    path.write_text(buf.getvalue(), encoding="utf-8")


# -- the figure ------------------------------------------------------------------------------------
def curves(runs: Sequence[Run], metric: str = SELECTION_METRIC) -> dict[str, dict[str, tuple[list, list]]]:
    """What the figure plots, per panel and run label: (rounds, values), the mean over clients.
    ``val``: ``metric`` on the validation splits per round (fine-tuning rounds after a pre-training);
    ``val-loss``: the validation loss; ``pretrain``: the self-supervised loss per pre-training round
    (only runs that have one)."""
    panels: dict[str, dict[str, tuple[list, list]]] = {"val": {}, "val-loss": {}, PRETRAIN: {}}
    for r in runs:
        for panel, split, key in (
            ("val", VAL, metric),
            ("val-loss", VAL, "loss"),
            (PRETRAIN, PRETRAIN, "loss"),
        ):
            points = sorted(
                (int(e["round"]), float(e["metrics"][key]))
                for e in r.rounds
                if e.get("split") == split and _number((e.get("metrics") or {}).get(key))
            )
            if points:
                panels[panel][r.label] = ([x for x, _ in points], [y for _, y in points])
    return {k: v for k, v in panels.items() if v}


_TITLES = {
    "val": "{metric} on validation, mean over clients\n(fine-tuning rounds after a pre-training; * tested)",
    "val-loss": "validation loss, mean over clients",
    PRETRAIN: "self-supervised pre-training loss\nmean over clients",
}


def plot(
    runs: Sequence[Run], path: Path, metric: str = SELECTION_METRIC
) -> dict[str, dict[str, tuple[list, list]]]:
    """``compare.png`` (matplotlib, Agg): a panel per entry of :func:`curves`, one line per run, the
    same colour for a run in every panel; returns the plotted series."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    series = curves(runs, metric)
    panels = list(series) or ["val"]
    fig = Figure(figsize=(5.2 * len(panels), 4.6 + 0.22 * len(runs)))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    colours = {r.label: f"C{i % 10}" for i, r in enumerate(runs)}
    styles = {r.label: ("-", "--", ":", "-.")[(i // 10) % 4] for i, r in enumerate(runs)}
    best = {r.label: r.summary.get("best_round") for r in runs}
    for ax, panel in zip(axes, panels):
        for label, (xs, ys) in series.get(panel, {}).items():
            ax.plot(
                xs, ys, marker="o", markersize=3, color=colours[label], linestyle=styles[label], label=label
            )
            if panel == "val" and best[label] in xs:  # the round whose model was tested
                y = ys[xs.index(best[label])]
                ax.plot([best[label]], [y], marker="*", markersize=12, color=colours[label], label="_best")
        ax.set_title(_TITLES[panel].format(metric=metric.replace("_", " ")), fontsize=10)
        ax.set_xlabel("round of its stage" if panel != PRETRAIN else "pre-training round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
        if panel == "val" and metric != "loss":
            ax.set_ylim(-0.02, 1.02)
    handles = {
        label: h for ax in axes for h, label in zip(*ax.get_legend_handles_labels()) if label != "_best"
    }
    if handles:
        fig.legend(
            handles.values(), handles.keys(), loc="lower center", ncol=min(2, len(handles)), fontsize=8
        )
    fig.suptitle(f"fedderm-compare: {len(runs)} run{'s' if len(runs) != 1 else ''}", fontsize=11)
    fig.tight_layout(rect=(0, 0.06 + 0.045 * math.ceil(len(handles) / 2), 1, 1))
    fig.savefig(path, format="png", dpi=100)
    return series


# -- the command ----------------------------------------------------------------------------------
def compare(
    folders: Sequence[str | Path], out: str | Path, metric: str = SELECTION_METRIC
) -> tuple[list[Run], dict[str, Path], dict]:
    """Read ``folders``, write ``compare.md``, ``compare.csv`` and ``compare.png`` into ``out``; return
    the runs, the files and the plotted series."""
    runs = load_runs(folders)
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    files = {"md": out / "compare.md", "csv": out / "compare.csv", "png": out / "compare.png"}
    text = [
        "Final test metrics, mean over clients (the selection metric first):",
        "",
        *mean_table(runs),
        "",
        f"Each client's {SELECTION_METRIC} on its own test split:",
        "",
        *client_table(runs),
    ]
    files["md"].write_text("\n".join(text) + "\n", encoding="utf-8")
    write_csv(csv_rows(runs), files["csv"])
    series = plot(runs, files["png"], metric)
    return runs, files, series


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fedderm-compare",
        description=__doc__.split("\n\n")[0],
        epilog="Writes compare.md, compare.csv and compare.png into --out. Exit 0: every run complete; "
        "1: some run incomplete (shown as far as it got); 2: a folder is not a run folder.",
    )
    parser.add_argument(
        "folders", nargs="+", metavar="RUN_DIR", help="run folders, or folders holding run folders"
    )
    parser.add_argument("--out", default=".", help="where to write compare.md/.csv/.png (default: here)")
    parser.add_argument(
        "--metric",
        default=SELECTION_METRIC,
        choices=[*METRIC_NAMES, "loss"],
        help="the validation curve's metric",
    )
    args = parser.parse_args(argv)
    try:
        runs, files, _ = compare(args.folders, args.out, args.metric)
    except CompareError as err:
        print(f"fedderm-compare: {err}", file=sys.stderr)
        return 2
    print(files["md"].read_text(encoding="utf-8"))
    for r in runs:
        if r.problem:
            print(f"fedderm-compare: {r.folder}: {r.problem}; shown as far as it got", file=sys.stderr)
    print("written: " + ", ".join(str(p) for p in files.values()))
    return 1 if any(r.problem for r in runs) else 0


def entry() -> None:
    """The ``fedderm-compare`` console script."""
    sys.exit(main())


if __name__ == "__main__":
    sys.exit(main())
