"""Run records: what the ledger keeps of each run of a sweep, small enough to commit.

``ledger/records/<sweep id>/`` holds ``sweep.json`` (the sweep as it ran: its file's text, rows,
reference, metrics, planned runs; where and on what it ran; whether every planned run is in) and
``<run name>.json`` per finished run: its seed, the run config it differs from the sweep's common one
by, the PyTorch version and device, the validation metrics of every round and the final test metrics
(means and per client).  No predictions, no per-class tables, no models.

:func:`import_folder` builds them from a ``sim.py --sweep --out DIR`` or ``bench.sweep_pool`` folder
(run folders with ``summary.json``, and ``table.json`` once the sweep wrote it).  It can run while the
sweep still runs: the record set is then marked incomplete, and importing the same folder again later
replaces it.  :func:`load` gives back the sweep and per-run summaries that
:func:`fedderm.sweep_tables.aggregate` turns into the same table ``sim.py`` writes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from fedderm import sweep as fs
from fedderm import sweep_tables as ft
from fedderm.ledger import LedgerError
from fedderm.results import client_sort_key

SCHEMA = 1
RECORDS_DIR = Path("ledger") / "records"
#: the file a sweep folder's writer leaves beside table.json: commit, machine, versions
PROVENANCE = "provenance.json"
#: config keys that are per run by construction, or say where, not what
_NOT_CONFIG = ("client-data", "overrides", "output-dir", "run-name", "resume", "seed", "cv-fold")
#: summary.json entries a record keeps whole (besides the trimmed ``final``)
_KEPT = ("best_round", "rounds_to_target", "status", "warnings")


# --------------------------------------------------------------------------- provenance
def _git(args: list[str], cwd: Path) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def machine_description() -> dict[str, Any]:
    """CPU model and cores, memory, GPU (when CUDA is up): what a number may depend on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    out: dict[str, Any] = {"cpu": cpu, "cores": os.cpu_count(), "system": platform.system()}
    try:
        import psutil

        out["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:  # pragma: no cover - psutil is a dependency
        pass
    try:
        import torch

        if torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:  # pragma: no cover
        pass
    return out


def versions() -> dict[str, str]:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for name in ("torch", "flwr", "timm", "numpy"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def provenance_here(repo: Path | None = None) -> dict[str, Any]:
    """Where this process runs: the git commit of ``repo`` (outside a checkout, e.g. a ``git archive``
    export, ``$FEDDERM_COMMIT`` or None; ``dirty`` when tracked files differ from it), machine and
    versions."""
    repo = Path(repo or Path(__file__).resolve().parents[2])
    commit = _git(["rev-parse", "HEAD"], repo)
    dirty = bool(_git(["status", "--porcelain", "--untracked-files=no"], repo)) if commit else None
    if not commit and os.environ.get("FEDDERM_COMMIT"):  # an export without .git (a device machine)
        commit = os.environ["FEDDERM_COMMIT"]
    return {
        "commit": commit,
        "dirty": dirty,
        "machine": machine_description(),
        "versions": versions(),
        "written": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


# --------------------------------------------------------------------------- one run
def _round6(value: Any) -> Any:
    if isinstance(value, float):
        return float(f"{value:.6g}") if math.isfinite(value) else None
    return value


_PREDICTION_LIKE = ("per_class", "confusion_matrix")


def _final(final: Mapping[str, Any]) -> dict[str, Any]:
    """Final metrics without per-class tables and confusion matrices, at any depth (``per_client``,
    ``global_test``, ...); every number kept exactly."""
    return {
        k: _final(v) if isinstance(v, Mapping) else v for k, v in final.items() if k not in _PREDICTION_LIKE
    }


def curves(summary: Mapping[str, Any]) -> dict[str, Any]:
    """Per-round validation metrics, column-wise (6 significant digits): the mean over clients of
    every metric, each client's balanced accuracy and accuracy, and the mean training loss."""
    val = [r for r in summary.get("rounds") or [] if r.get("split") == "val"]
    out: dict[str, Any] = {"round": [r["round"] for r in val]}
    names = sorted({k for r in val for k in (r.get("metrics") or {})})
    out["mean"] = {k: [_round6((r.get("metrics") or {}).get(k)) for r in val] for k in names}
    clients = sorted({c for r in val for c in (r.get("per_client") or {})}, key=client_sort_key)
    out["per_client"] = {
        c: {
            k: [_round6(((r.get("per_client") or {}).get(c) or {}).get(k)) for r in val]
            for k in ("balanced_accuracy", "accuracy")
        }
        for c in clients
    }
    out["train_loss"] = [_round6((r.get("train") or {}).get("train_loss")) for r in val]
    return out


def compact_summary(summary: Mapping[str, Any], metrics: list[fs.Metric]) -> dict[str, Any]:
    """The part of summary.json the tables read (:func:`fedderm.sweep_tables.metric_value` and the
    chance rule), exact; any other top-level entry a metric of the sweep reads is kept whole."""
    out: dict[str, Any] = {k: summary[k] for k in _KEPT if k in summary}
    if summary.get("final") is not None:
        out["final"] = _final(summary["final"])
    classes = summary.get("classes") or []
    names = classes.get("names") if isinstance(classes, Mapping) else classes
    out["classes"] = {"names": list(names or [])}
    if summary.get("bytes_per_round"):
        out["bytes_per_round"] = [
            {k: e.get(k) for k in ("stage", "round", "bytes")} for e in summary["bytes_per_round"]
        ]
    if isinstance(summary.get("holdout"), Mapping):
        hold = summary["holdout"]
        out["holdout"] = {k: v for k, v in hold.items() if k != "final"}
        if hold.get("final") is not None:
            out["holdout"]["final"] = _final(hold["final"])
    for m in metrics:  # whatever else a column reads
        if ft.metric_value(out, m) != ft.metric_value(summary, m):
            head = next((k for k in summary if m.key == k or m.key.startswith(k + ".")), None)
            if head is None:
                raise LedgerError(f"metric {m.key!r}: no top-level entry of summary.json holds it")
            out[head] = summary[head]
    return out


def _client_env(config: Mapping[str, Any]) -> dict[str, Any]:
    data = config.get("client-data") or {}
    seen = {
        k: sorted({str(d.get(k)) for d in data.values() if d.get(k) is not None}) for k in ("torch", "device")
    }
    threads = sorted({d.get("torch-threads") for d in data.values() if d.get("torch-threads") is not None})
    return {
        "torch": ", ".join(seen["torch"]) or None,
        "device": ", ".join(seen["device"]) or None,
        "threads": threads[0] if len(threads) == 1 else threads or None,
        "clients": {
            c: {k: d.get(k) for k in ("dataset", "train", "labelled", "val", "test") if k in d}
            for c, d in sorted(data.items(), key=lambda kv: client_sort_key(kv[0]))
        },
    }


# --------------------------------------------------------------------------- a sweep
def sweep_id(name: str, quick: bool = False, gpu: bool = False) -> str:
    return f"{name}{'-quick' if quick else ''}{'-gpu' if gpu else ''}"


def _sweep_meta(spec: fs.Sweep) -> dict[str, Any]:
    rows = spec.rows()
    return {
        "name": spec.name,
        "title": spec.title,
        "num-supernodes": spec.num_supernodes,
        "seeds": list(spec.seeds),
        "cv-folds": spec.cv_folds,
        "table": spec.table,
        "quick": spec.quick,
        "gpu": spec.gpu,
        "metrics": [
            {"key": m.key, "label": m.label, "scale": m.scale, "digits": m.digits} for m in spec.metrics
        ],
        "axes": {a: [[label, values] for label, values in entries] for a, entries in spec.axes.items()},
        "reference": dict(spec.reference),
        "rows": [
            {
                "row": r.index,
                "axes": r.labels,
                "reference": (ref.index if (ref := spec.reference_of(r)) else None),
            }
            for r in rows
        ],
    }


def sweep_from_meta(meta: Mapping[str, Any], source: str = "") -> fs.Sweep:
    """The :class:`fedderm.sweep.Sweep` a ``sweep.json`` describes (rows, runs, reference and
    metrics as when it ran; no run config: records hold it)."""
    return fs.Sweep(
        name=meta["name"],
        source=source or meta.get("sweep_file", {}).get("path", meta["name"]),
        title=meta["title"],
        num_supernodes=meta["num-supernodes"],
        seeds=list(meta["seeds"]),
        cv_folds=meta["cv-folds"],
        table=meta["table"],
        metrics=[fs.Metric(m["key"], m["label"], m["scale"], m["digits"]) for m in meta["metrics"]],
        axes={a: [(label, dict(values)) for label, values in entries] for a, entries in meta["axes"].items()},
        base={},
        late={},
        quick=meta["quick"],
        gpu=meta["gpu"],
        reference=dict(meta["reference"]),
    )


def _mismatch(saved: Mapping[str, Any], wanted: Mapping[str, Any]) -> list[str]:
    return [
        f"{k}: {saved.get(k)!r} there, {v!r} in the sweep file"
        for k, v in sorted(wanted.items())
        if k not in ("output-dir", "run-name", "resume") and saved.get(k) != v
    ]


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise LedgerError(f"{path}: {err}") from None


def _dump(obj: Mapping[str, Any]) -> str:
    """One line per top-level key: small, and a re-import's diff shows which entries changed."""

    def one(v: Any) -> str:
        return json.dumps(v, separators=(",", ":"), allow_nan=False, ensure_ascii=False)

    return "{\n" + ",\n".join(f" {one(k)}: {one(v)}" for k, v in obj.items()) + "\n}\n"


@dataclass
class ImportReport:
    sweep_id: str
    folder: Path
    done: int
    planned: int
    failed: list[str]
    bytes: int

    @property
    def complete(self) -> bool:
        return self.done == self.planned

    def __str__(self) -> str:
        state = "complete" if self.complete else "INCOMPLETE"
        failed = f", {len(self.failed)} failed" if self.failed else ""
        return (
            f"{self.sweep_id}: {self.done}/{self.planned} runs recorded ({state}{failed}), "
            f"{self.bytes:,} bytes in {self.folder}"
        )


def import_folder(
    folder: str | Path,
    sweep_file: str | Path,
    root: str | Path,
    *,
    quick: bool = False,
    gpu: bool = False,
    sets: Mapping[str, Any] | None = None,
    seeds: list[int] | None = None,
    name: str | None = None,
    commit: str | None = None,
    machine: str | None = None,
) -> ImportReport:
    """Records of the sweep folder ``folder`` (the runs of ``sweep_file`` with ``quick``/``gpu``/``sets``/
    ``seeds`` as it ran) into ``<root>/ledger/records/<name>/``, replacing what was there.

    ``commit`` and ``machine`` say where it ran; they default to the folder's ``provenance.json``
    (written by today's sweep writers) and are required when it has none.  Every run folder must hold
    the settings the sweep file gives it (else the folder is another sweep's: error); ``table.json``,
    when present, must agree with the records to the last digit."""
    folder = Path(folder).expanduser().resolve()
    if not folder.is_dir():
        raise LedgerError(f"{folder}: no such sweep folder")
    spec = fs.load_sweep(sweep_file, quick, sets, seeds, gpu=gpu)
    name = name or sweep_id(spec.name, quick, gpu)
    prov_path = folder / PROVENANCE
    prov = _read_json(prov_path) if prov_path.is_file() else {}
    commit = commit or prov.get("commit")
    if not commit:
        raise LedgerError(
            f"{folder}: no {PROVENANCE} with a commit (an older sweep writer, or a run outside a git "
            "checkout): say which commit it ran at with --commit"
        )
    if prov.get("commit") and commit != prov["commit"] and not prov["commit"].startswith(commit):
        raise LedgerError(f"{folder}: --commit {commit} but {PROVENANCE} says {prov['commit']}")
    if not machine and not prov.get("machine"):
        raise LedgerError(f"{folder}: no {PROVENANCE}: describe the machine it ran on with --machine")
    table_path = folder / "table.json"
    table = _read_json(table_path) if table_path.is_file() else None
    by_index = {}
    if table:
        for row in table["rows"]:
            for run in row["runs"]:
                by_index[run["name"]] = run

    runs, summaries, failed = spec.runs(), {}, []
    for run in runs:
        run_dir = folder / run.name
        summary = ft.read_summary(run_dir)
        entry = by_index.get(run.name, {})
        if ft.is_complete(summary):
            saved = (summary.get("config") or {}).get("overrides") or {}
            bad = _mismatch(saved, run.overrides)
            if bad:
                raise LedgerError(
                    f"{run_dir}: not run {run.name} of {sweep_file} as given ({'; '.join(bad)}); "
                    "pass the --set/--seeds/--quick/--gpu it ran with, or another sweep file"
                )
            summaries[run.name] = (summary, entry.get("seconds"))
        elif entry.get("status") == "failed":
            failed.append(f"{run.name}: {entry.get('reason', '')}")

    configs = {n: (s.get("config") or {}) for n, (s, _) in summaries.items()}
    keys = set().union(*(c.keys() for c in configs.values())) if configs else set()
    common = {}
    for k in sorted(keys - set(_NOT_CONFIG)):
        seen = {json.dumps(c.get(k), sort_keys=True) for c in configs.values()}
        if len(seen) == 1 and all(k in c for c in configs.values()):
            common[k] = next(iter(configs.values()))[k]

    target = Path(root) / RECORDS_DIR / name
    tmp = target.with_name(target.name + ".importing")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    envs = []
    for run in runs:
        if run.name not in summaries:
            continue
        summary, seconds = summaries[run.name]
        config = configs[run.name]
        env = _client_env(config)
        envs.append(env)
        record = {
            "schema": SCHEMA,
            "sweep": name,
            "run": run.name,
            "index": run.index,
            "row": run.row.index,
            "axes": run.row.labels,
            "seed": run.seed,
            "fold": run.fold,
            "seconds": seconds,
            "torch": env["torch"],
            "device": env["device"],
            "torch-threads": env["threads"],
            "clients": env["clients"],
            "config": {k: v for k, v in sorted(config.items()) if k not in common and k not in _NOT_CONFIG},
            "summary": compact_summary(summary, spec.metrics),
            "curves": curves(summary),
        }
        (tmp / f"{run.name}.json").write_text(_dump(record), encoding="utf-8")
    sweep_text = Path(sweep_file).read_text(encoding="utf-8")
    meta = {
        "schema": SCHEMA,
        "id": name,
        **_sweep_meta(spec),
        "sweep_file": {
            "path": Path(sweep_file).as_posix(),
            "sha256": hashlib.sha256(sweep_text.encode()).hexdigest(),
            "text": sweep_text,
        },
        "sets": dict(sets or {}),
        "commit": commit,
        "also_commits": prov.get("also", []),  # a resume at another commit
        "dirty": prov.get("dirty"),
        "machine": machine or prov.get("machine"),
        "versions": prov.get("versions") or {"torch": sorted({e["torch"] for e in envs if e["torch"]})},
        "wall_time_s": (table or {}).get("wall_time_s"),
        "planned": [r.name for r in runs],
        "recorded": [r.name for r in runs if r.name in summaries],
        "failed": failed,
        "complete": len(summaries) == len(runs),
        "config_common": common,
        "imported_from": str(folder),
    }
    (tmp / "sweep.json").write_text(_dump(meta), encoding="utf-8")
    if table:  # the sweep's own table must be what the records give
        _check_against_table(load_dir(tmp), table, folder)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    size = sum(p.stat().st_size for p in target.iterdir())
    return ImportReport(name, target, len(summaries), len(runs), failed, size)


# --------------------------------------------------------------------------- reading them back
@dataclass
class SweepRecords:
    """One sweep's records: its meta (``sweep.json``) and each recorded run's record."""

    id: str
    meta: dict[str, Any]
    runs: dict[str, dict[str, Any]]
    folder: Path

    @property
    def sweep(self) -> fs.Sweep:
        return sweep_from_meta(self.meta)

    @property
    def complete(self) -> bool:
        return bool(self.meta.get("complete"))

    def results(self) -> list[dict[str, Any]]:
        """The ``results`` :func:`fedderm.sweep_tables.aggregate` takes: recorded runs as done, the
        runs the sweep reported failed as failed; runs not yet recorded are left out."""
        out = []
        failed = {f.split(":", 1)[0]: f.split(":", 1)[1].strip() for f in self.meta.get("failed", [])}
        for run in self.sweep.runs():
            rec = self.runs.get(run.name)
            if rec is not None:
                out.append(
                    {
                        "run": run.index,
                        "dir": None,
                        "status": "done",
                        "reason": "",
                        "seconds": rec["seconds"],
                        "summary": rec["summary"],
                    }
                )
            elif run.name in failed:
                out.append(
                    {
                        "run": run.index,
                        "dir": None,
                        "status": "failed",
                        "reason": failed[run.name],
                        "seconds": None,
                        "summary": None,
                    }
                )
        return out

    def table(self) -> dict[str, Any]:
        """table.json's content, computed from the records."""
        return ft.aggregate(self.sweep, self.results())


def load_dir(folder: Path) -> SweepRecords:
    folder = Path(folder)
    meta = _read_json(folder / "sweep.json")
    if meta.get("schema") != SCHEMA:
        raise LedgerError(f"{folder}/sweep.json: schema {meta.get('schema')!r}, this code reads {SCHEMA}")
    runs = {}
    for name in meta["recorded"]:
        path = folder / f"{name}.json"
        if not path.is_file():
            raise LedgerError(f"{folder}: sweep.json lists {name} but {path.name} is missing")
        runs[name] = _read_json(path)
    extra = {p.stem for p in folder.glob("*.json")} - {"sweep", *runs}
    if extra:
        raise LedgerError(f"{folder}: records not listed in sweep.json: {sorted(extra)}")
    return SweepRecords(meta.get("id", folder.name), meta, runs, folder)


def load(root: str | Path, name: str) -> SweepRecords:
    folder = Path(root) / RECORDS_DIR / name
    if not (folder / "sweep.json").is_file():
        raise LedgerError(f"no records for sweep {name!r} ({folder}/sweep.json)")
    return load_dir(folder)


def available(root: str | Path) -> list[str]:
    base = Path(root) / RECORDS_DIR
    return sorted(p.name for p in base.iterdir() if (p / "sweep.json").is_file()) if base.is_dir() else []


def _check_against_table(records: SweepRecords, table: Mapping[str, Any], folder: Path) -> None:
    """Every cell and paired difference of the folder's table.json equals the records' (the
    importer's self-check: nothing lost or changed on the way)."""
    metrics = {m.label: m for m in records.sweep.metrics}
    for row in table["rows"]:
        done = [r["name"] for r in row["runs"] if r["status"] == "done"]
        for label, cell in row["metrics"].items():
            if label not in metrics:
                continue
            ours = [
                v
                for name in done
                if name in records.runs
                and (v := ft.metric_value(records.runs[name]["summary"], metrics[label])) is not None
            ]
            if done and all(n in records.runs for n in done) and ours != cell.get("values"):
                raise LedgerError(
                    f"{folder}/table.json row {row['axes']} {label}: {cell.get('values')} there, "
                    f"{ours} from the run folders"
                )
