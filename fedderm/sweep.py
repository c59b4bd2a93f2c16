"""Experiment sweeps: one TOML file -> the runs of a paper table -> one Markdown table.

The pure parts of ``python sim.py --sweep sweeps/<name>.toml`` (README, "Experiment sweeps"):
parse and validate a sweep file, expand it into runs (the product of ``[sweep.axes]`` × seeds ×
cross-validation folds); :mod:`fedderm.sweep_tables` reads each run's ``summary.json`` and
aggregates the replicates of a row into mean ± SD.  No Flower import: ``sim.py`` runs the simulations.

A sweep file::

    [sweep]
    title = "..."                  # heading of the table (cite the paper table)
    num-supernodes = 4             # simulated clients
    seeds = [0, 1, 2]              # replicates of every row (mean ± SD over them)
    cv-folds = 0                   # k >= 3: every seed also runs folds 0..k-1 (cv-folds=k cv-fold=f)
    table = "final"                # "final": one table; "per-client": a table per client + the mean (GTA)
    metrics = ["balanced_accuracy", "auc"]    # columns; see Metric
    reference = { method = "fedavg" }  # optional: per row, the paired difference (same seed and fold)
                                   #   from the row with these axis labels (the others as the row's), 95 % CI
    [sweep.axes]                    # rows = product of the axes, in file order
    method = ["fedavg", "fedprox"] #   a run-config key with its values
    row = [{ name = "W/o FE", method = "fedclf", "fedclf.feature-sharing" = false }]
                                   #   or any name with labelled sets of run-config keys
    [run-config]                   # base flat run-config keys (as in a preset)
    [quick]                        # --quick: run-config keys, and sweep.<key> / sweep.axes.<axis>
    [gpu]                          # --gpu: the same, for the larger scale a CUDA machine affords

A run's config is ``[run-config]``, then its row's axis values, then ``[quick]`` (with --quick),
then ``[gpu]`` (with --gpu), then ``--set``, then ``seed`` (and ``cv-folds``/``cv-fold``).  So ``[quick]`` shrinks every row
(``num-server-rounds`` wins over a row's own); setting a key that *every* entry of an axis sets
is an error (that axis would vanish): replace the axis with ``sweep.axes.<axis>`` instead.
"""

from __future__ import annotations

import difflib
import itertools
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from fedderm.config import ConfigError
from fedderm.metrics import METRIC_NAMES

SECTIONS = ("sweep", "run-config", "quick", "gpu")
SWEEP_KEYS = ("title", "num-supernodes", "seeds", "cv-folds", "table", "metrics", "axes", "reference")
TABLE_MODES = ("final", "per-client")
#: summary.json "final" entries a plain metric name may take (rates, shown in %)
FINAL_METRICS = (*METRIC_NAMES, "loss")
#: keys a sweep sets per run itself; they cannot be axes or --set
REPLICATE_KEYS = ("seed", "cv-folds", "cv-fold", "run-name", "output-dir", "resume")
METRIC_FIELDS = ("key", "label", "scale", "digits")


class SweepError(ConfigError):
    """A sweep file is malformed; the message names the file and the key at fault."""


@dataclass(frozen=True)
class Metric:
    """A column: ``key`` is a final metric (``auc``) or a path into summary.json.

    Paths are dotted and tried greedily, so keys holding dots work: ``rounds_to_target.0.55``,
    ``config.num-server-rounds``, ``best_round``.  A path that meets a list of records
    (``bytes_per_round.bytes``) takes the mean of that field over the records.  Final metrics
    are shown in % (``scale`` 100), anything else as is (``scale`` 1) unless the entry is a
    table ``{ key = "...", label = "...", scale = ..., digits = ... }``.
    """

    key: str
    label: str
    scale: float
    digits: int = 2

    @property
    def is_final(self) -> bool:
        return "." not in self.key and self.key in FINAL_METRICS


@dataclass(frozen=True)
class Row:
    """One axes combination: its labels (axis -> shown value) and its run-config overrides."""

    index: int
    labels: dict[str, str]
    overrides: dict[str, Any]

    def describe(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.labels.items())


@dataclass(frozen=True)
class Run:
    """One simulation: a row at one seed (and fold)."""

    index: int
    row: Row
    seed: int
    fold: int | None
    name: str
    overrides: dict[str, Any]

    def describe(self) -> str:
        fold = f" cv-fold={self.fold}" if self.fold is not None else ""
        return f"{self.row.describe()} seed={self.seed}{fold}".strip()


@dataclass
class Sweep:
    name: str
    source: str
    title: str
    num_supernodes: int
    seeds: list[int]
    cv_folds: int
    table: str
    metrics: list[Metric]
    axes: dict[str, list[tuple[str, dict[str, Any]]]]  # axis -> [(label, overrides)]
    base: dict[str, Any]  # [run-config]
    late: dict[str, Any]  # [quick] (with --quick), [gpu] (with --gpu), --set: applied over the axes' keys
    quick: bool = False
    gpu: bool = False
    reference: dict[str, str] = field(default_factory=dict)  # axis -> label of the reference row

    def reference_of(self, row: Row) -> Row | None:
        """The row ``row`` is compared with: its labels with the ``reference`` axes' labels put in;
        None without a ``reference`` or for a reference row itself."""
        if not self.reference:
            return None
        labels = {**row.labels, **self.reference}
        if labels == row.labels:
            return None
        return next(r for r in self.rows() if r.labels == labels)

    def rows(self) -> list[Row]:
        names = list(self.axes)
        rows = []
        for i, combo in enumerate(itertools.product(*(self.axes[a] for a in names))):
            overrides: dict[str, Any] = {}
            for _label, values in combo:
                overrides.update(values)
            rows.append(Row(i, {a: label for a, (label, _) in zip(names, combo)}, overrides))
        return rows

    def runs(self) -> list[Run]:
        folds: list[int | None] = list(range(self.cv_folds)) if self.cv_folds else [None]
        runs = []
        for row in self.rows():
            for seed in self.seeds:
                for fold in folds:
                    overrides = {**self.base, **row.overrides, **self.late, "seed": seed}
                    if fold is not None:
                        overrides.update({"cv-folds": self.cv_folds, "cv-fold": fold})
                    runs.append(Run(len(runs), row, seed, fold, run_name(row, seed, fold), overrides))
        return runs


def slug(text: Any) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", str(text)).strip("-").lower() or "x"


def run_name(row: Row, seed: int, fold: int | None) -> str:
    """Folder name of a run: ``r03-fedprox-0.1-s1`` (row index first, so folders sort by row)."""
    parts = [f"r{row.index:02d}", *(slug(v) for v in row.labels.values()), f"s{seed}"]
    if fold is not None:
        parts.append(f"f{fold}")
    return "-".join(parts)


def _label(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _flatten(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested TOML tables -> dotted keys (``fedclf.queue-size = 1`` unquoted is a table)."""
    flat: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _unknown(what: str, key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"unknown {what} {key!r}.{hint} Valid: {', '.join(valid)}"


def _metric(entry: Any, where: str) -> Metric:
    if isinstance(entry, str):
        entry = {"key": entry}
    if not isinstance(entry, dict) or not isinstance(entry.get("key"), str):
        raise SweepError(f"{where}: a metric is a string or a table with a string 'key', got {entry!r}")
    for k in entry:
        if k not in METRIC_FIELDS:
            raise SweepError(f"{where}: " + _unknown("metric field", k, list(METRIC_FIELDS)))
    key = entry["key"]
    if "." not in key and key not in FINAL_METRICS and key != "best_round":
        raise SweepError(
            f"{where}: "
            + _unknown(
                "metric",
                key,
                [*FINAL_METRICS, "best_round", "<path into summary.json, e.g. rounds_to_target.0.55>"],
            )
        )
    final = "." not in key and key in FINAL_METRICS and key != "loss"
    scale, digits = entry.get("scale", 100.0 if final else 1.0), entry.get("digits", 2)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise SweepError(f"{where}: metric {key!r} scale must be a number, got {scale!r}")
    if isinstance(digits, bool) or not isinstance(digits, int) or digits < 0:
        raise SweepError(f"{where}: metric {key!r} digits must be an int >= 0, got {digits!r}")
    return Metric(key, str(entry.get("label", key)), float(scale), digits)


def _axis(name: str, values: Any, where: str, valid_keys: list[str] | None) -> list[tuple[str, dict]]:
    if not isinstance(values, list) or not values:
        raise SweepError(f"{where}: axis {name!r} must be a non-empty list, got {values!r}")
    if name in REPLICATE_KEYS:
        raise SweepError(
            f"{where}: {name!r} cannot be an axis; the sweep sets it per run "
            f"(use sweep.seeds / sweep.cv-folds)"
        )
    if all(isinstance(v, dict) for v in values):  # labelled variants: {name = "...", key = value, ...}
        out = []
        for v in values:
            label = v.get("name")
            if not isinstance(label, str):
                raise SweepError(f"{where}: every entry of axis {name!r} needs a string 'name', got {v!r}")
            keys = _flatten({k: x for k, x in v.items() if k != "name"})
            bad = [k for k in keys if k in REPLICATE_KEYS]
            if bad:
                raise SweepError(
                    f"{where}: axis {name!r} entry {label!r} sets {bad[0]!r}, which the sweep sets per run"
                )
            out.append((label, keys))
        labels = [label for label, _ in out]
        if len(set(labels)) != len(labels):
            raise SweepError(f"{where}: axis {name!r} has repeated names {labels}")
        return out
    if any(isinstance(v, (dict, list)) for v in values):
        raise SweepError(f"{where}: axis {name!r} mixes tables and values; use one kind")
    if valid_keys is not None and name not in valid_keys:
        close = difflib.get_close_matches(name, valid_keys, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise SweepError(
            f"{where}: axis {name!r} is not a run-config key.{hint} An axis of values names a "
            f'run-config key (or give labelled tables: [{{ name = "...", key = value }}]). '
            f"Valid keys: {', '.join(valid_keys)}"
        )
    return [(_label(v), {name: v}) for v in values]


def _renamed(table: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``table`` with the names of the previous release (``[grid]``, ``grid.<key>``, also inside
    ``[quick]``) read as ``[sweep]`` / ``sweep.<key>``, each with a deprecation warning."""
    out = {}
    for key, value in table.items():
        new = "sweep" + key[4:] if key == "grid" or key.startswith("grid.") else key
        if new != key:
            warnings.warn(
                f"{source}: {key!r} is the old name of {new!r}; the old name will be removed",
                FutureWarning,
                stacklevel=3,
            )
        out[new] = (
            _renamed(value, source) if key in ("quick", "gpu") and isinstance(value, Mapping) else value
        )
    return out


def parse_sweep(
    data: Mapping[str, Any],
    name: str,
    source: str = "<sweep>",
    quick: bool = False,
    overrides: Mapping[str, Any] | None = None,
    seeds: list[int] | None = None,
    load_config: Callable[[dict], Any] | None = None,
    valid_keys: list[str] | None = None,
    gpu: bool = False,
) -> Sweep:
    """Validate a parsed sweep file and build the :class:`Sweep`.

    ``overrides`` (``--set``) are run-config keys or ``sweep.<key>``; they apply after ``[quick]``
    and ``[gpu]`` (``gpu``: a file without that section is an error).
    ``load_config`` (``registry.load_config``) validates every row's run config (and ``valid_keys``
    the axis names), so a bad key fails before the first run, naming the file and the row.
    """
    data, overrides = _renamed(data, source), _renamed(overrides or {}, "--set")
    for key in data:
        if key not in SECTIONS:
            raise SweepError(f"{source}: " + _unknown("section", key, list(SECTIONS)))
    if "sweep" not in data:
        raise SweepError(f"{source}: missing [sweep] section")
    base = _flatten(data.get("run-config", {}))
    bad = [k for k in base if k in REPLICATE_KEYS and k != "output-dir"]
    if bad:
        raise SweepError(
            f"{source} [run-config]: {bad[0]!r} is set per run by the sweep (sweep.seeds, sweep.cv-folds)"
        )
    layers = [("[quick]", _flatten(data.get("quick", {})))] if quick else []
    if gpu:
        if "gpu" not in data:
            raise SweepError(f"{source}: --gpu needs a [gpu] section (the settings for a CUDA machine)")
        layers.append(("[gpu]", _flatten(data["gpu"])))
    layers.append(("--set", dict(overrides)))
    spec, late = _layered(dict(data["sweep"]), layers, source)
    if seeds is not None:
        spec["seeds"] = list(seeds)
    sweep = _settings(spec, f"{source} [sweep]", name, source, base, late, quick, gpu, valid_keys)
    _check_unused_overrides(sweep, layers)
    if load_config is not None:
        _check_rows(sweep, load_config)
    return sweep


def _layered(spec: dict, layers: list[tuple[str, dict]], source: str) -> tuple[dict, dict]:
    """``[sweep]`` with the ``sweep.*`` keys of each layer (``[quick]``, ``[gpu]``, ``--set``) applied, and
    the layers' run-config keys (applied to every row after its axes)."""
    late: dict[str, Any] = {}
    for where, layer in layers:
        for key, value in layer.items():
            if key.startswith("sweep.axes."):
                spec["axes"] = {**spec.get("axes", {}), key[len("sweep.axes.") :]: value}
            elif key.startswith("sweep."):
                sub = key[len("sweep.") :]
                if sub not in SWEEP_KEYS:
                    raise SweepError(
                        f"{source} {where}: " + _unknown("sweep key", key, [f"sweep.{k}" for k in SWEEP_KEYS])
                    )
                spec[sub] = value
            elif key in REPLICATE_KEYS and key != "output-dir":
                raise SweepError(
                    f"{source} {where}: {key!r} is set per run by the sweep (sweep.seeds, sweep.cv-folds)"
                )
            else:
                late[key] = value
    for key in spec:
        if key not in SWEEP_KEYS:
            raise SweepError(f"{source} [sweep]: " + _unknown("sweep key", key, list(SWEEP_KEYS)))
    return spec, late


def _settings(
    spec: dict, where: str, name: str, source: str, base: dict, late: dict, quick: bool, gpu: bool, valid_keys
) -> Sweep:
    """The :class:`Sweep` of the checked ``[sweep]`` settings."""

    def get(key: str, kind: type, default: Any) -> Any:
        value = spec.get(key, default)
        if isinstance(value, bool) or not isinstance(value, kind):
            raise SweepError(f"{where}: {key!r} must be {kind.__name__}, got {value!r}")
        return value

    num_supernodes = get("num-supernodes", int, 2)
    cv_folds = get("cv-folds", int, 0)
    table = get("table", str, "final")
    seed_list = get("seeds", list, [0])
    if num_supernodes < 1:
        raise SweepError(f"{where}: 'num-supernodes' must be >= 1, got {num_supernodes}")
    if cv_folds and cv_folds < 3:
        raise SweepError(f"{where}: 'cv-folds' must be 0 (off) or >= 3, got {cv_folds}")
    if table not in TABLE_MODES:
        raise SweepError(f"{where}: 'table' must be one of {list(TABLE_MODES)}, got {table!r}")
    if not seed_list or not all(isinstance(s, int) and not isinstance(s, bool) for s in seed_list):
        raise SweepError(f"{where}: 'seeds' must be a non-empty list of ints, got {seed_list!r}")
    if len(set(seed_list)) != len(seed_list):
        raise SweepError(f"{where}: 'seeds' repeats a seed: {seed_list}")
    metrics = [_metric(m, where) for m in get("metrics", list, ["balanced_accuracy"])]
    if not metrics:
        raise SweepError(f"{where}: 'metrics' is empty")
    bad = [m.key for m in metrics if not m.is_final]
    if table == "per-client" and bad:
        raise SweepError(
            f'{where}: table = "per-client" takes final metrics only ({", ".join(FINAL_METRICS)}), got {bad}'
        )
    axes = {a: _axis(a, v, f"{source} [sweep.axes]", valid_keys) for a, v in get("axes", dict, {}).items()}
    reference = get("reference", dict, {})
    for axis, label in reference.items():
        if axis not in axes:
            raise SweepError(f"{where}: 'reference' names axis {axis!r}, not one of {list(axes)}")
        labels = [lab for lab, _ in axes[axis]]
        if label not in labels:
            raise SweepError(
                f"{where}: 'reference' {axis} = {label!r} is not a row label of that axis: {labels}"
            )
    return Sweep(
        name=name,
        source=source,
        title=get("title", str, name),
        num_supernodes=num_supernodes,
        seeds=[int(s) for s in seed_list],
        cv_folds=cv_folds,
        table=table,
        metrics=metrics,
        axes=axes,
        base=base,
        late=late,
        quick=quick,
        gpu=gpu,
        reference=dict(reference),
    )


def _check_unused_overrides(sweep: Sweep, layers: list[tuple[str, dict]]) -> None:
    """A ``[quick]`` or ``--set`` key that every entry of an axis sets would never be used."""
    for where, layer in layers:
        for key in layer:
            for a, entries in sweep.axes.items():
                if not key.startswith("sweep.") and all(key in values for _, values in entries):
                    raise SweepError(
                        f"{sweep.source} {where}: {key!r} is set by every entry of axis {a!r}, so this "
                        f"value would never be used; set 'sweep.axes.{a}' instead"
                    )


def _check_rows(sweep: Sweep, load_config: Callable[[dict], Any]) -> None:
    """Every row's run config passes ``load_config`` and asks for no more clients than the sweep has."""
    for row in sweep.rows():
        config = {**sweep.base, **row.overrides, **sweep.late, "seed": sweep.seeds[0]}
        if sweep.cv_folds:
            config.update({"cv-folds": sweep.cv_folds, "cv-fold": 0})
        try:
            cfg = load_config(config)
        except ConfigError as err:
            flags = (" (--quick)" if sweep.quick else "") + (" (--gpu)" if sweep.gpu else "")
            raise SweepError(f"{sweep.source}{flags}, row {row.describe() or '(base)'}: {err}") from None
        if getattr(cfg, "min_clients", 1) > sweep.num_supernodes:
            raise SweepError(
                f"{sweep.source}, row {row.describe()}: min-clients={cfg.min_clients} > "
                f"num-supernodes={sweep.num_supernodes}; the run would wait for clients that never come"
            )


def load_sweep(
    path: str | Path,
    quick: bool = False,
    overrides: Mapping[str, Any] | None = None,
    seeds: list[int] | None = None,
    load_config: Callable[[dict], Any] | None = None,
    valid_keys: list[str] | None = None,
    gpu: bool = False,
) -> Sweep:
    """Read and validate a sweep file (see :func:`parse_sweep`)."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SweepError(f"sweep file {str(path)!r} not found") from None
    except tomllib.TOMLDecodeError as err:
        raise SweepError(f"{path}: not valid TOML: {err}") from None
    return parse_sweep(data, path.stem, str(path), quick, overrides, seeds, load_config, valid_keys, gpu)


# --------------------------------------------------------------------------- results
