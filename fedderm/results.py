"""Run folder writer: config, per-round CSV, JSON summary, model, curves, table.

Why one file of ~630 lines: :class:`RunRecorder` is the single owner of the run folder's layout
(every file below is written here, atomically, from one in-memory record), and its figures share
the recorder's private helpers (NaN handling, client order, atomic writes).  The next split is a
``results_plots.py`` mixin for the ``_plot_*`` methods once those helpers have a module of their own.

A run folder written by :class:`RunRecorder` looks like::

    <run_dir>/
        config.json      resolved run config (sorted keys), written at start
        rounds.csv       one row per client per evaluation round + a 'mean' row,
                         appended as soon as the round is evaluated
        rounds.jsonl     the same evaluations as summary.json's ``rounds`` entries (test ones
                         too), one JSON line each, appended as soon as they are recorded
        summary.json     machine-readable summary, written when the run opens, when its status
                         changes (failed, stopped, done) and at the end: not every round, so
                         the bytes it costs grow with the run's length, not with its square
        model.pt         final global model state_dict (torch.save)
        curves.png       mean validation metrics per round + per-client balanced accuracy
        train_loss.png   mean training loss per round (only if train losses were logged)
        final_table.txt  the text table of the final test metrics (see ``table()``)
        events.out.tfevents.*  TensorBoard events with the same numbers (``tensorboard`` in the
                         config; fedderm.tracking)

All means are *unweighted* means over clients (each hospital counts the same).
JSON files are strict JSON: NaN / infinity are written as ``null``.
"""

from __future__ import annotations

import copy
import csv
import json
import logging
import math
import numbers
import os
import re
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fedderm.atomic import atomic_path, atomic_write_bytes
from fedderm.health import HealthCheck
from fedderm.metrics import CONFUSION_KEY, METRIC_NAMES, mean_over_clients, per_class_metrics
from fedderm.noise import INSECURE, REPRODUCIBLE, insecure_entry

__all__ = ["RunRecorder", "format_table", "to_json_safe", "CSV_COLUMNS"]

#: Columns of rounds.csv, in order.  ``train_loss`` is filled on the 'mean' row of
#: rounds where training metrics were given, empty otherwise.
CSV_COLUMNS: tuple[str, ...] = (
    "round",
    "split",
    "client",
    "num-examples",
    "loss",
    *METRIC_NAMES,
    "train_loss",
)

_RESERVED_SUMMARY_KEYS = frozenset(
    {"method", "config", "rounds", "best_round", "final", "classes", "warnings"}
)
#: the health check's warnings go to the console in Flower's format, next to the round lines
_log = logging.getLogger("flwr")
#: model files that carry the class list in their metadata (``state_dict._metadata["fedderm"]``)
MODEL_FILES = ("model.pt", "model-best.pt")
_CURVE_METRICS = (
    ("balanced_accuracy", "Balanced accuracy"),
    ("accuracy", "Accuracy"),
    ("f1", "Macro F1"),
    ("auc", "Macro ROC-AUC (OvR)"),
)


# --------------------------------------------------------------------------- helpers
def to_json_safe(obj: Any) -> Any:
    """Recursively convert ``obj`` to strict-JSON-safe Python values.

    NaN/inf -> None, numpy scalars/arrays -> Python numbers/lists, tuples/sets ->
    lists, dict keys -> str, Paths and other unknown objects -> str.
    """
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {str(k): to_json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_json_safe(v) for v in obj]
    if hasattr(obj, "tolist") and callable(obj.tolist):  # numpy scalars / arrays, torch tensors
        return to_json_safe(obj.tolist())
    if hasattr(obj, "item") and callable(obj.item):
        return to_json_safe(obj.item())
    return str(obj)


def _file_mode() -> int:
    """Mode for new files honouring the umask (mkstemp would create them 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


_FILE_MODE = _file_mode()


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write_bytes(path, data, mode=_FILE_MODE, fsync=True)


def _write_json(path: Path, obj: Any, sort_keys: bool = False) -> None:
    text = json.dumps(to_json_safe(obj), indent=2, sort_keys=sort_keys, allow_nan=False)
    _atomic_write_bytes(path, (text + "\n").encode("utf-8"))


def client_sort_key(client_id: str):
    """Natural order: '2' before '10'; non-numeric ids after numeric ones."""
    parts = re.split(r"(\d+)", str(client_id))
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in parts if p != ""]


def _sorted_clients(per_client: Mapping[str, Any]) -> list[str]:
    return sorted((str(k) for k in per_client), key=client_sort_key)


def _num(value: Any) -> float:
    """float(value), NaN for missing / non-numeric."""
    if value is None or isinstance(value, bool):
        return float("nan")
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def _csv_cell(value: Any) -> str:
    """CSV text of a value: '' for missing/NaN, exact repr for floats."""
    if value is None or isinstance(value, (bool, str)):
        return "" if value is None else str(value)
    if isinstance(value, numbers.Integral):
        return str(int(value))
    number = _num(value)
    return "" if math.isnan(number) else repr(number)


def _train_loss(train: Mapping[str, Any] | None) -> float | None:
    if not train:
        return None
    for key in ("train_loss", "train-loss", "loss"):
        if key in train:
            return _num(train[key])
    return None


def _total_examples(per_client: Mapping[str, Mapping[str, Any]]) -> int | None:
    counts = [m.get("num-examples") for m in per_client.values() if m.get("num-examples") is not None]
    return int(sum(int(c) for c in counts)) if counts else None


def _square(flat: Any) -> list[list[int]]:
    """A flattened row-major confusion matrix (``CONFUSION_KEY``) as a list of rows."""
    values = [int(round(float(v))) for v in flat]
    c = int(round(math.sqrt(len(values))))
    return [values[i * c : (i + 1) * c] for i in range(c)]


def _confusions_of(per_client: Mapping[str, Mapping[str, Any]]) -> dict[str, list[list[int]]]:
    return {cid: m["confusion_matrix"] for cid, m in per_client.items() if "confusion_matrix" in m}


def _row_only(metrics: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in metrics.items() if k not in ("confusion_matrix", "per_class")}


def _plain(metrics: Mapping[str, Any]) -> dict[str, Any]:
    return {str(k): (int(v) if k == "num-examples" and v is not None else v) for k, v in metrics.items()}


def _style_axis(ax, ylabel: str, unit_interval: bool = True) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("round")
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if unit_interval:
        ax.set_ylim(-0.02, 1.02)
    ax.grid(True, alpha=0.3)


# --------------------------------------------------------------------------- table
def format_table(per_client: Mapping[str, Mapping[str, float]], title: str) -> str:
    """Fixed-width text table: one row per client + a 'mean' row.

    Columns are :data:`METRIC_NAMES` (3 decimals, ``n/a`` for undefined values)
    and ``n`` (``num-examples``).  The 'mean' row is the unweighted, NaN-ignoring
    mean over clients; its ``n`` is the total number of examples.
    """
    mean = mean_over_clients(per_client)
    clients = _sorted_clients(per_client)
    by_id = {str(k): v for k, v in per_client.items()}

    def fmt(value: Any) -> str:
        number = _num(value)
        return "n/a" if math.isnan(number) else f"{number:.3f}"

    def fmt_n(value: Any) -> str:
        return "" if value is None else str(int(value))

    header = ["client", *METRIC_NAMES, "n"]
    rows = [
        [cid, *(fmt(by_id[cid].get(m)) for m in METRIC_NAMES), fmt_n(by_id[cid].get("num-examples"))]
        for cid in clients
    ]
    rows.append(["mean", *(fmt(mean.get(m)) for m in METRIC_NAMES), fmt_n(_total_examples(per_client))])

    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = [c.rjust(w) for c, w in zip(cells[1:], widths[1:])]
        return "  ".join([first, *rest])

    rule = "-" * len(line(header))
    out = [
        title,
        rule,
        line(header),
        rule,
        *(line(r) for r in rows[:-1]),
        rule,
        line(rows[-1]),
        rule,
        "The mean row is the unweighted mean over clients (n/a values ignored); its n is the total number of examples.",
    ]
    return "\n".join(out)


# --------------------------------------------------------------------------- recorder
class RunRecorder:
    """Writes everything about one run into ``run_dir`` as the run progresses.

    Args:
        run_dir: folder to create (parents included); existing files are overwritten.
        method: name of the federated method (e.g. ``"fedavg"``).
        config: the resolved run config; written to ``config.json`` right away.
    """

    def __init__(self, run_dir: Path, method: str, config: dict, state: dict | None = None):
        self.run_dir = Path(run_dir).expanduser()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.method = str(method)
        self.config = dict(config)
        self.rounds: list[dict[str, Any]] = []
        self.best_round: int | None = None
        self.final: dict[str, Any] | None = None
        self.extra: dict[str, Any] = {}
        self.node_partitions: dict[int, int] = {}  # node id -> partition id, from the handshake
        #: node id -> the split sizes it declared at the handshake (train, labelled, val, test): what
        #: its replies' ``num-examples`` are checked against (strategies/screening.py)
        self.node_sizes: dict[int, dict[str, int]] = {}
        #: the class list (names in label order) and images per class per client and split
        self.classes: dict[str, Any] | None = None
        #: what model.pt is (fedderm.inference): classes, method, model, image size, network
        self.model_meta: dict[str, Any] = {}
        #: the health check of every evaluation (fedderm.health): summary.json ``warnings``
        self.health = HealthCheck(self.config)
        #: TensorBoard event files (fedderm.tracking) when the config says ``tensorboard = true``
        self.tracker = None
        #: the in-memory summary differs from summary.json (written by :meth:`flush`)
        self._dirty = True
        _write_json(self.config_path, self.config, sort_keys=True)
        with open(self.rounds_csv_path, "w", newline="", encoding="utf-8") as fh:
            csv.writer(fh).writerow(CSV_COLUMNS)
        self.rounds_jsonl_path.write_bytes(b"")
        if self.config.get("tensorboard") is True:
            from fedderm.tracking import Tracker

            self.tracker = Tracker(self.run_dir)
        if state:
            self.restore(state)
        insecure = insecure_entry(self.config)  # insecure-reproducible-noise: what it weakened
        if insecure is not None:
            self.extra[INSECURE] = insecure
            _log.warning(
                "%s = true: the privacy noise is a function of the run config; summary.json %r: %s",
                REPRODUCIBLE,
                INSECURE,
                "; ".join(insecure["weakened"]),
            )
        self.flush()

    def state(self) -> dict[str, Any]:
        """What a checkpoint needs to restore this recorder (JSON-safe copies)."""
        return copy.deepcopy(
            {
                "rounds": self.rounds,
                "best_round": self.best_round,
                "final": self.final,
                "extra": self.extra,
                "classes": self.classes,
                "health": self.health.state(),
            }
        )

    def restore(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state` (on resume): rounds.csv is rewritten from the rounds."""
        self.rounds, self.best_round = [], state.get("best_round")
        self.final, self.extra = state.get("final"), dict(state.get("extra") or {})
        self.classes = state.get("classes") or self.classes
        self.health.restore(state.get("health"))
        for entry in state.get("rounds", []):  # already in the event files of the first process
            self._append(entry, track=False)

    # paths ------------------------------------------------------------------
    @property
    def config_path(self) -> Path:
        return self.run_dir / "config.json"

    @property
    def rounds_csv_path(self) -> Path:
        return self.run_dir / "rounds.csv"

    @property
    def rounds_jsonl_path(self) -> Path:
        return self.run_dir / "rounds.jsonl"

    @property
    def summary_path(self) -> Path:
        return self.run_dir / "summary.json"

    @property
    def model_path(self) -> Path:
        return self.run_dir / "model.pt"

    # recording ----------------------------------------------------------------
    def set_classes(
        self,
        names: list[str],
        counts: Mapping[str, Mapping[str, list[int]]] | None = None,
        model_meta: Mapping[str, Any] | None = None,
    ) -> None:
        """Record the class list (label order) and, per client, images per class per split
        (``counts[client][split]`` in ``names`` order): ``summary.json`` ``classes``; the names
        also go into the metadata of ``model.pt`` / ``model-best.pt`` with ``model_meta``."""
        names = [str(n) for n in names]
        self.classes = {
            "names": names,
            "counts": {
                str(cid): {split: dict(zip(names, (int(v) for v in row))) for split, row in per_split.items()}
                for cid, per_split in (counts or {}).items()
            },
        }
        self.model_meta = {**dict(model_meta or {}), "classes": names}
        self._dirty = True

    def class_names(self, num_classes: int) -> list[str]:
        """The recorded class names, or ``"0" … "C-1"`` when none were recorded."""
        names = (self.classes or {}).get("names")
        return list(names) if names and len(names) == num_classes else [str(i) for i in range(num_classes)]

    def _with_confusion(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """``metrics`` with a client's flat confusion matrix turned into ``confusion_matrix``
        (rows true, columns predicted) and ``per_class`` metrics."""
        flat = metrics.pop(CONFUSION_KEY, None)
        if flat is None:
            return metrics
        c = int(round(math.sqrt(len(flat))))
        cm = [[int(round(float(v))) for v in flat[i * c : (i + 1) * c]] for i in range(c)]
        metrics["confusion_matrix"] = cm
        metrics["per_class"] = per_class_metrics(cm, self.class_names(c))
        return metrics

    def log_round(
        self,
        round: int,  # noqa: A002 - name fixed by the interface
        split: str,
        per_client: dict[str, dict[str, float]],
        train: dict[str, float] | None = None,
    ) -> dict[str, float]:
        """Record one evaluation round: per_client maps partition-id (str) -> {metric: value, 'num-examples': n, maybe 'loss'}; returns the unweighted mean (mean_over_clients).

        Appends rows to rounds.csv immediately (one row per client + one row
        client='mean'; columns :data:`CSV_COLUMNS`) and the entry to rounds.jsonl, so
        nothing is lost if the run dies; summary.json follows at :meth:`flush`.  The
        ``train_loss`` column is filled on the 'mean' row from ``train['train_loss']``
        (or ``train['loss']``) when ``train`` is given.
        """
        per_client = {str(k): _plain(v) for k, v in per_client.items()}
        confusions = {cid: _square(m[CONFUSION_KEY]) for cid, m in per_client.items() if CONFUSION_KEY in m}
        for metrics in per_client.values():  # confusion matrices: test splits only (summary size)
            if str(split).endswith("test"):
                self._with_confusion(metrics)
            else:
                metrics.pop(CONFUSION_KEY, None)
        mean = mean_over_clients(per_client)
        self._check_health(round, split, confusions, mean, _train_loss(train), _total_examples(per_client))
        self._append(
            {
                "round": int(round),
                "split": str(split),
                "metrics": dict(mean),
                "per_client": per_client,
                "train": dict(train) if train else {},
            }
        )
        return mean

    def _append(self, entry: dict[str, Any], keep: bool = True, track: bool = True) -> None:
        """Add one round entry to ``rounds`` (unless not ``keep``: test rows, which live in
        ``final``) and its rows to rounds.csv (and, with ``track``, to the TensorBoard events)."""
        per_client, mean = entry["per_client"], entry["metrics"]
        rows = []
        for cid in _sorted_clients(per_client):
            m = per_client[cid]
            rows.append(
                [
                    entry["round"],
                    entry["split"],
                    cid,
                    m.get("num-examples"),
                    m.get("loss"),
                    *(m.get(name) for name in METRIC_NAMES),
                    None,
                ]
            )
        rows.append(
            [
                entry["round"],
                entry["split"],
                "mean",
                _total_examples(per_client),
                mean.get("loss"),
                *(mean.get(name) for name in METRIC_NAMES),
                _train_loss(entry["train"]),
            ]
        )
        with open(self.rounds_csv_path, "a", newline="", encoding="utf-8") as fh:
            writer = csv.writer(fh)
            for row in rows:
                writer.writerow([_csv_cell(v) for v in row])
            fh.flush()
        line = json.dumps(to_json_safe(entry), allow_nan=False) + "\n"
        with open(self.rounds_jsonl_path, "a", encoding="utf-8") as fh:
            fh.write(line)
        self._dirty = True
        if self.tracker is not None and track:  # the same values as rounds.csv (fedderm.tracking)
            self.tracker.rows(
                str(entry["split"]),
                int(entry["round"]),
                {str(row[2]): dict(zip(CSV_COLUMNS[4:], row[4:])) for row in rows},
            )
        if keep:
            self.rounds.append(entry)

    def track(self, prefix: str, step: int, values: Mapping[str, Any]) -> None:
        """Extra TensorBoard curves (``<prefix>/<name>`` at ``step``; encoder probes, privacy);
        nothing without ``tensorboard``."""
        if self.tracker is not None:
            self.tracker.scalars(prefix, step, values)

    def set_final(
        self,
        per_client: dict[str, dict[str, float]],
        best_round: int | None,
        extra: dict | None = None,
    ) -> dict[str, float]:
        """Record the final (test) metrics per client; returns their unweighted mean.

        ``extra`` entries are merged at the top level of summary.json (they may not
        override ``method``, ``config``, ``rounds``, ``best_round`` or ``final``).
        """
        per_client = {str(k): self._with_confusion(_plain(v)) for k, v in per_client.items()}
        mean = mean_over_clients(per_client)
        self._check_health(-1, "test", _confusions_of(per_client), mean)
        self.best_round = None if best_round is None else int(best_round)
        self.final = {
            **mean,
            "num-examples": _total_examples(per_client),
            "test_set": "per-client",
            **self._pooled(per_client),
            "per_client": per_client,
        }
        self._append(
            {
                "round": self.best_round if self.best_round is not None else -1,
                "split": "test",
                "metrics": dict(mean),
                "per_client": {k: _row_only(v) for k, v in per_client.items()},
                "train": {},
            },
            keep=False,
        )
        if extra:
            self.update_extra(extra)
        return mean

    def _pooled(
        self, per_client: Mapping[str, Mapping[str, Any]], same_model: bool = False
    ) -> dict[str, Any]:
        """The clients' confusion matrices summed (each client's test images counted once) with
        their per-class metrics; with ``same_model`` (every client evaluated one model on one test
        set) the first client's matrix instead."""
        cms = [np.asarray(m["confusion_matrix"]) for m in per_client.values() if "confusion_matrix" in m]
        if not cms:
            return {}
        cm = cms[0] if same_model else np.sum(cms, axis=0)
        return {
            "confusion_matrix": cm.tolist(),
            "per_class": per_class_metrics(cm, self.class_names(len(cm))),
        }

    def set_global_test(self, per_client: dict[str, dict[str, float]], source: str = "") -> dict[str, float]:
        """Record the final model's metrics on the global test set (``test-set="global"``): they
        become ``final``'s metrics, with the test size, ``test_set="global"``, the confusion matrix
        and per-class metrics; the per-client test means move to ``final["per_client_mean"]``.

        ``per_client`` are the clients' evaluations of the global test set: with one global model
        they are identical; with per-client models (local fine-tuning, FedBN) the metrics are their
        mean and the confusion matrix their sum.
        """
        per_client = {str(k): self._with_confusion(_plain(v)) for k, v in per_client.items()}
        mean = mean_over_clients(per_client)
        self._check_health(-1, "global-test", _confusions_of(per_client), mean)
        sizes = {int(m["num-examples"]) for m in per_client.values() if m.get("num-examples") is not None}
        if len(sizes) > 1:
            raise ValueError(f"clients evaluated global test sets of different sizes {sorted(sizes)}")
        cms = {json.dumps(m.get("confusion_matrix")) for m in per_client.values()}
        prior = self.final or {}
        per_client_mean = {
            k: v
            for k, v in prior.items()
            if k not in ("per_client", "confusion_matrix", "per_class", "test_set")
        }
        self.final = {
            **mean,
            "num-examples": sizes.pop() if sizes else None,
            "test_set": "global",
            "test_source": source,
            "per_client_mean": per_client_mean,
            **self._pooled(per_client, same_model=len(cms) == 1),
            "global_test": {"per_client": per_client},
            "per_client": prior.get("per_client", {}),
        }
        self._append(
            {
                "round": self.best_round if self.best_round is not None else -1,
                "split": "global-test",
                "metrics": dict(mean),
                "per_client": {k: _row_only(v) for k, v in per_client.items()},
                "train": {},
            },
            keep=False,
        )
        return mean

    def _check_health(
        self,
        round: int,  # noqa: A002
        split: str,
        confusions: dict[str, list[list[int]]],
        mean: Mapping[str, Any],
        train_loss: float | None = None,
        num_images: int | None = None,
    ) -> None:
        """One evaluation through the health check (:mod:`fedderm.health`): each new finding is
        logged as one warning line and lands in summary.json ``warnings``."""
        if not confusions:
            return
        names = self.class_names(len(next(iter(confusions.values()))))
        bacc = mean.get("balanced_accuracy")
        for line in self.health.see(
            round, split, confusions, names, None if bacc is None else _num(bacc), train_loss, num_images
        ):
            _log.warning(line)

    @property
    def warnings(self) -> list[str]:
        """The health check's warnings so far (one line each)."""
        return list(self.health.warnings)

    def update_extra(self, extra: dict) -> None:
        """Merge more top-level entries into summary.json (e.g. ``rounds_to_target``); a new
        ``status`` (running, failed, stopped, done) is written at once, the rest by :meth:`flush`."""
        clash = _RESERVED_SUMMARY_KEYS.intersection(extra)
        if clash:
            raise ValueError(f"extra keys {sorted(clash)} are reserved in summary.json")
        self.extra.update({str(k): v for k, v in extra.items()})
        self._dirty = True
        if "status" in extra:
            self.flush()

    def save_model(self, state_dict, name: str = "model.pt") -> Path:
        """torch.save the state_dict to ``run_dir/name`` (atomic); returns the path.

        ``model.pt`` and ``model-best.pt`` carry :attr:`model_meta` (the class list, …) in the
        state dict's ``_metadata["fedderm"]``: ``torch.load`` still returns a plain state dict
        that ``load_state_dict`` takes, and :mod:`fedderm.inference` reads the names from it."""
        import torch  # local import: the rest of this module does not need torch

        if name in MODEL_FILES and self.model_meta:
            meta = OrderedDict(getattr(state_dict, "_metadata", None) or {})
            state_dict = OrderedDict(state_dict)
            meta["fedderm"] = to_json_safe(self.model_meta)
            state_dict._metadata = meta
        path = self.run_dir / name
        with atomic_path(path, mode=_FILE_MODE, fsync=True) as tmp:
            torch.save(state_dict, tmp)
        return path

    def summary(self) -> dict[str, Any]:
        """The summary.json content (JSON-safe: NaN -> None)."""
        data: dict[str, Any] = {
            "method": self.method,
            "config": self.config,
            "rounds": self.rounds,
            "best_round": self.best_round,
            "final": self.final,
            "classes": self.classes,
        }
        data.update(self.extra)
        data["warnings"] = self.warnings
        return to_json_safe(data)

    def flush(self) -> None:
        """Write summary.json if anything changed since it was last written."""
        if self._dirty:
            _write_json(self.summary_path, self.summary())
            self._dirty = False

    def close(self) -> None:
        """Write summary.json and close the TensorBoard writer (and its thread); for a run that
        ends in any way (call it in a ``finally``).  Safe to call more than once."""
        try:
            self.flush()
        finally:
            if self.tracker is not None:
                tracker, self.tracker = self.tracker, None
                tracker.close()

    def finish(self) -> Path:
        """Write summary.json, the PNG curves and final_table.txt; return run_dir."""
        self.flush()
        self._plot_curves()
        self._plot_train_loss()
        self._write_per_class()
        if self.final is not None:
            _atomic_write_bytes(self.run_dir / "final_table.txt", (self.table() + "\n").encode("utf-8"))
        if self.tracker is not None and self.final is not None:
            self.tracker.text("final_table", self.table())
        self.close()
        return self.run_dir

    def table(self) -> str:
        """Readable text table of the final test metrics (see :func:`format_table`)."""
        title = f"Final test metrics - {self.method}"
        if self.final is None:
            return f"{title}\n(no final metrics recorded)"
        if self.best_round is not None:
            title += f" (model from round {self.best_round})"
        if self.warnings:
            title += f"  [!] {len(self.warnings)} health warning(s): not a result to report as is"
        table = format_table(self.final["per_client"], title)
        return "\n".join([table, *(f"[!] {w}" for w in self.warnings), *self._screening_lines()])

    def _screening_lines(self) -> list[str]:
        """A line for the replies screening rejected and one for the rounds whose aggregation
        failed (strategies/screening.py), when there were any: a malicious or broken client."""
        rejected = [
            m
            for m in self.extra.get("missing_clients", [])
            if isinstance(m, dict) and str(m.get("reason", "")).startswith("rejected")
        ]
        errors = self.extra.get("aggregation_errors") or []
        lines = []
        if rejected:
            who = sorted({str(m.get("partition-id")) for m in rejected}, key=client_sort_key)
            lines.append(
                f"[!] {len(rejected)} replies rejected by screening, of client(s) {', '.join(who)} "
                "(summary.json missing_clients)"
            )
        if errors:
            lines.append(
                f"[!] {len(errors)} aggregation(s) failed; those rounds kept their global model "
                "(summary.json aggregation_errors)"
            )
        return lines

    def _confusions(self) -> list[tuple[str, str, dict]]:
        """(set, client, entry with confusion_matrix/per_class) of the final test: the final
        (global or pooled) one first, then every client's own test split."""
        final = self.final or {}
        out = []
        if "confusion_matrix" in final:
            out.append(
                (
                    final.get("test_set", "per-client") == "global" and "global-test" or "pooled-test",
                    "all",
                    final,
                )
            )
        for cid in _sorted_clients(final.get("per_client") or {}):
            entry = final["per_client"][cid]
            if "confusion_matrix" in entry:
                out.append(("test", cid, entry))
        return out

    def _write_per_class(self) -> None:
        """per_class.csv (recall, precision, specificity, support per class) and
        confusion_matrix.csv (one row per true class) and confusion.png of the final test."""
        sets = self._confusions()
        if not sets:
            return
        names = self.class_names(len(sets[0][2]["confusion_matrix"]))
        with open(self.run_dir / "per_class.csv", "w", newline="", encoding="utf-8") as fh:
            w = csv.writer(fh)
            w.writerow(["set", "client", "class", "recall", "precision", "specificity", "support"])
            for which, cid, entry in sets:
                for name, m in entry["per_class"].items():
                    w.writerow(
                        [
                            which,
                            cid,
                            name,
                            *(_csv_cell(m[k]) for k in ("recall", "precision", "specificity", "support")),
                        ]
                    )
        with open(self.run_dir / "confusion_matrix.csv", "w", newline="", encoding="utf-8") as fh:
            w = csv.writer(fh)
            w.writerow(["set", "client", "true \\ predicted", *names])
            for which, cid, entry in sets:
                for name, row in zip(names, entry["confusion_matrix"]):
                    w.writerow([which, cid, name, *row])
        self._plot_confusion(sets[:9], names)

    def _plot_confusion(self, sets, names: list[str]) -> Path:
        from matplotlib.figure import Figure

        cols = min(3, len(sets))
        rows = -(-len(sets) // cols)
        side = 1.2 + 0.45 * len(names)
        fig = Figure(figsize=(side * cols + 1, side * rows + 0.6))
        axes = np.atleast_1d(fig.subplots(rows, cols)).ravel()
        for ax, (which, cid, entry) in zip(axes, sets):
            cm = np.asarray(entry["confusion_matrix"])
            ax.imshow(cm, cmap="Blues")
            for (i, j), v in np.ndenumerate(cm):
                ax.text(
                    j,
                    i,
                    str(v),
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="white" if v > cm.max() / 2 else "black",
                )
            ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=8)
            ax.set_yticks(range(len(names)), names, fontsize=8)
            ax.set_xlabel("predicted")
            ax.set_ylabel("true")
            ax.set_title(
                {"global-test": "global test set", "pooled-test": "all clients' test splits (summed)"}.get(
                    which, f"client {cid}, test split"
                )
                + f" (n={int(cm.sum())})",
                fontsize=9,
            )
        for ax in axes[len(sets) :]:
            ax.axis("off")
        fig.suptitle(f"{self.method}: confusion matrices of the final test")
        return self._save_figure(fig, "confusion.png")

    # plotting -----------------------------------------------------------------
    def _curve_split(self) -> str | None:
        splits = [r["split"] for r in self.rounds]
        if not splits:
            return None
        return "val" if "val" in splits else splits[0]

    def _save_figure(self, fig, name: str) -> Path:
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        FigureCanvasAgg(fig)
        fig.tight_layout()
        path = self.run_dir / name
        with atomic_path(path, mode=_FILE_MODE) as tmp:
            fig.savefig(tmp, format="png", dpi=100, bbox_inches="tight")  # no label cut off
        return path

    def _plot_curves(self) -> Path | None:
        split = self._curve_split()
        if split is None:
            return None
        from matplotlib.figure import Figure

        records = [r for r in self.rounds if r["split"] == split]
        xs = [r["round"] for r in records]
        fig = Figure(figsize=(13, 7.5))
        axes = fig.subplots(2, 3).ravel()
        for ax, (key, label) in zip(axes, _CURVE_METRICS):
            ys = [_num(r["metrics"].get(key)) for r in records]
            ax.plot(xs, ys, marker="o", color="tab:blue")
            ax.set_title(f"{label}\nmean over clients, {split}")
            _style_axis(ax, label)

        ax = axes[4]
        clients = _sorted_clients({cid: None for r in records for cid in r["per_client"]})
        for cid in clients:
            ys = [_num(r["per_client"].get(cid, {}).get("balanced_accuracy")) for r in records]
            ax.plot(xs, ys, marker=".", label=f"client {cid}")
        ax.plot(
            xs,
            [_num(r["metrics"].get("balanced_accuracy")) for r in records],
            color="black",
            linewidth=2,
            linestyle="--",
            label="mean",
        )
        ax.set_title(f"Balanced accuracy\nper client, {split}")
        _style_axis(ax, "Balanced accuracy")
        ax.legend(fontsize="small", ncol=2 if len(clients) > 8 else 1)
        axes[5].axis("off")
        stage = (
            " (stage 2: fine-tuning; pre-training in train_loss.png)"
            if any(r["split"] == "pretrain" for r in self.rounds)
            else ""
        )
        fig.suptitle(f"{self.method}: {'validation' if split == 'val' else split} metrics per round{stage}")
        return self._save_figure(fig, "curves.png")

    def _plot_train_loss(self) -> Path | None:
        """train_loss.png; a two-stage method (pre-training rounds, split ``pretrain``) gets two
        labelled panels: stage 1's self-supervised loss and stage 2's fine-tuning loss."""
        points = [(r["round"], _train_loss(r["train"])) for r in self.rounds if r["split"] != "pretrain"]
        points = sorted({x: y for x, y in points if y is not None}.items())
        pre = sorted(
            {
                r["round"]: _num(r["metrics"].get("loss")) for r in self.rounds if r["split"] == "pretrain"
            }.items()
        )
        if not points and not pre:
            return None
        from matplotlib.figure import Figure

        panels = (
            [("stage 1: self-supervised pre-training\nmean SSL loss per round", pre, "tab:purple")]
            if pre
            else []
        ) + (
            [(("stage 2: fine-tuning\n" if pre else "") + "mean training loss per round", points, "tab:red")]
            if points
            else []
        )
        fig = Figure(figsize=(6 * len(panels), 4))
        axes = np.atleast_1d(fig.subplots(1, len(panels)))
        for ax, (title, pts, colour) in zip(axes, panels):
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=colour)
            ax.set_title(f"{self.method}: {title}")
            _style_axis(ax, "loss", unit_interval=False)
        return self._save_figure(fig, "train_loss.png")
