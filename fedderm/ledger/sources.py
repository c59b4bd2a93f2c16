"""A sweep's numbers, from its records or, for runs recorded nowhere, from the table the docs printed.

:class:`Source` answers the questions the docs ask: a row's mean ± SD and per-seed values, and a
paired difference (row − other row, or a difference of two differences) with its interval and
detectable effect.  :class:`RecordSource` computes them from ``ledger/records/<id>/`` exactly as
``sim.py``'s tables do (unscaled values, then ×100); :class:`PrintedSource` holds what an
*unrecorded* table printed (means, SDs, per-seed values, intervals) and computes what it did not
print from the printed per-seed values (rounded to the printed digits, so within a few hundredths).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from fedderm import sweep_tables as ft
from fedderm.ledger import LedgerError, stats
from fedderm.ledger.records import SweepRecords


@dataclass
class Diff:
    """A paired difference in display units (points): mean, SD, n, interval and per-seed values."""

    mean: float | None
    sd: float | None
    n: int
    ci: tuple[float, float] | None
    values: dict[int, float] = field(default_factory=dict)
    printed: bool = False  # taken from a printed table, not computed

    @property
    def detectable(self) -> float | None:
        """:func:`fedderm.ledger.stats.detectable_effect`; from a printed interval's half-width when
        no SD is known: (t_.975 + t_.80)·SD/√n = half-width·(t_.975 + t_.80)/t_.975."""
        if self.sd is not None:
            return stats.detectable_effect(self.sd, self.n)
        if self.ci is not None and self.n >= 2:
            half = (self.ci[1] - self.ci[0]) / 2
            t975, t80 = (
                stats.t_quantile(0.5 + stats.LEVEL / 2, self.n - 1),
                stats.t_quantile(stats.POWER, self.n - 1),
            )
            return half * (t975 + t80) / t975
        return None

    @property
    def excludes_zero(self) -> bool:
        return self.ci is not None and (self.ci[0] > 0 or self.ci[1] < 0)


@dataclass
class Cell:
    """One row's value of one metric (for one client or their mean), in display units."""

    mean: float | None
    sd: float | None
    n: int
    seeds: dict[int, float | None] = field(default_factory=dict)
    runs: int | None = None  # planned replicates, when known
    at_chance: bool = False


def paired(pairs: Mapping[int, tuple[float, float]]) -> Diff:
    """The paired difference of ``pairs`` (seed -> (x, r)), with :mod:`fedderm.sweep_tables`'s rule."""
    keys = sorted(pairs)
    out = ft.paired_difference([pairs[k] for k in keys])
    return Diff(
        out["mean"],
        out["sd"],
        out["n"],
        tuple(out["ci"]) if out["ci"] else None,
        dict(zip(keys, out["values"])),
    )


def _scaled(d: Diff, scale: float) -> Diff:
    def s(x):
        return None if x is None else scale * x

    return Diff(
        s(d.mean),
        None if d.sd is None else abs(scale) * d.sd,
        d.n,
        (scale * d.ci[0], scale * d.ci[1]) if d.ci else None,
        {k: scale * v for k, v in d.values.items()},
    )


class Source:
    """The common interface; ``rows`` are label dicts (axis -> label) in the sweep's order."""

    id: str
    recorded: bool
    commit: str
    axes: list[str]
    rows: list[dict[str, str]]
    metric_labels: list[str]
    digits: dict[str, int]
    seeds: list[int]
    reference: dict[str, str]

    # ------------------------------------------------------------------ rows
    def find(self, selector: str) -> int:
        """The row whose labels include every ``;``-separated part of ``selector`` (exact labels)."""
        parts = [p.strip() for p in selector.split(";") if p.strip()]
        hits = [i for i, r in enumerate(self.rows) if all(p in r.values() for p in parts)]
        if len(hits) != 1:
            what = "no row" if not hits else f"{len(hits)} rows"
            labels = "; ".join(" / ".join(r.values()) for r in self.rows)
            raise LedgerError(f"{self.id}: {what} match {selector!r} (rows: {labels})")
        return hits[0]

    def reference_of(self, index: int) -> int | None:
        if not self.reference:
            return None
        labels = {**self.rows[index], **self.reference}
        if labels == self.rows[index]:
            return None
        hits = [i for i, r in enumerate(self.rows) if r == labels]
        return hits[0] if hits else None

    def metric(self, label: str | None) -> str:
        if label is None:
            return self.metric_labels[0]
        for m in self.metric_labels:
            if m.lower() == label.lower():
                return m
        raise LedgerError(f"{self.id}: no metric {label!r} (metrics: {', '.join(self.metric_labels)})")

    # ------------------------------------------------------------------ numbers
    def cell(self, index: int, metric: str, client: str | None = None) -> Cell:
        raise NotImplementedError

    def seed_values(self, index: int, metric: str, client: str | None = None) -> dict[int, float]:
        return {k: v for k, v in self.cell(index, metric, client).seeds.items() if v is not None}

    def diff(
        self, index: int, vs: int, metric: str, index2: int | None = None, vs2: int | None = None
    ) -> Diff:
        """(row − vs), or (row − vs) − (row2 − vs2), paired by seed."""
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


class RecordSource(Source):
    recorded = True

    def __init__(self, records: SweepRecords):
        self.records = records
        self.id = records.id
        meta = records.meta
        self.commit = meta["commit"]
        self.sweep = records.sweep
        self.axes = list(self.sweep.axes)
        self.rows = [r.labels for r in self.sweep.rows()]
        self.metrics = {m.label: m for m in self.sweep.metrics}
        self.metric_labels = list(self.metrics)
        self.digits = {m.label: m.digits for m in self.sweep.metrics}
        self.seeds = list(self.sweep.seeds)
        self.reference = dict(self.sweep.reference)
        self._by_row: dict[int, dict[tuple, dict]] = {}
        for run in self.sweep.runs():
            rec = records.runs.get(run.name)
            if rec is not None:
                self._by_row.setdefault(run.row.index, {})[(run.seed, run.fold)] = rec["summary"]
        self.table = records.table()

    def _raw(self, index: int, metric: str, client: str | None = None) -> dict[tuple, float | None]:
        m = self.metrics[metric]
        return {k: ft.metric_value(s, m, client) for k, s in self._by_row.get(index, {}).items()}

    def cell(self, index: int, metric: str, client: str | None = None) -> Cell:
        m = self.metrics[metric]
        row = self.table["rows"][index]
        c = row["metrics"][metric] if client is None else row["per_client"].get(client, {}).get(metric)
        if c is None:
            return Cell(None, None, 0, {}, row["planned"])
        raw = self._raw(index, metric, client)
        seeds = {
            k[0]: (None if v is None else m.scale * v)
            for k, v in sorted(raw.items(), key=lambda kv: str(kv[0]))
        }
        mean = None if c["mean"] is None else m.scale * c["mean"]
        sd = None if c["sd"] is None else m.scale * c["sd"]
        return Cell(mean, sd, c["n"], seeds, row["planned"], bool(c.get("at_chance")))

    def diff(
        self, index: int, vs: int, metric: str, index2: int | None = None, vs2: int | None = None
    ) -> Diff:
        terms = [(index, 1), (vs, -1)] + ([(index2, -1), (vs2, 1)] if index2 is not None else [])
        raws = [(self._raw(i, metric), sign) for i, sign in terms]
        keys = set.intersection(*(set(k for k, v in r.items() if v is not None) for r, _ in raws))
        if index2 is None:
            pairs = {k: (raws[0][0][k], raws[1][0][k]) for k in keys}
        else:  # (x − v) − (x2 − v2) = ((x − v) + v2) − x2: paired as (x − v + v2, x2)
            pairs = {k: (raws[0][0][k] - raws[1][0][k] + raws[3][0][k], raws[2][0][k]) for k in keys}
        by_seed = {k[0] if k[1] is None else k: v for k, v in pairs.items()}
        return _scaled(paired(by_seed), self.metrics[metric].scale)

    def describe(self) -> str:
        meta = self.records.meta
        machine = meta.get("machine")
        if isinstance(machine, Mapping):
            machine = ", ".join(f"{v}" for k, v in machine.items() if k in ("cpu", "gpu"))
        torch = (meta.get("versions") or {}).get("torch")
        torch = ", ".join(torch) if isinstance(torch, list) else torch
        state = (
            ""
            if meta.get("complete")
            else f", INCOMPLETE: {len(meta['recorded'])} of {len(meta['planned'])} runs"
        )
        also = "".join(f", resumed at `{c[:7]}`" for c in meta.get("also_commits") or [])
        dirty = " with local changes" if meta.get("dirty") else ""
        return (
            f"recorded at `{self.commit[:7]}`{dirty}{also} on {machine}, torch {torch}"
            f" (`ledger/records/{self.id}/`{state})"
        )


class PrintedSource(Source):
    """Numbers a page printed for runs with no record; built by :mod:`fedderm.ledger.docs` from the
    page's unrecorded table blocks.  ``cells[(row, metric, client)]`` and ``diffs[(row, metric)]``
    hold the printed values."""

    recorded = False

    def __init__(self, id: str, commit: str, axes: list[str], reference: dict[str, str], seeds: list[int]):
        self.id, self.commit, self.axes, self.reference, self.seeds = id, commit, axes, reference, seeds
        self.rows: list[dict[str, str]] = []
        self.metric_labels: list[str] = []
        self.digits: dict[str, int] = {}
        self.cells: dict[tuple, Cell] = {}
        self.diffs: dict[tuple, Diff] = {}
        self.clients: dict[str, str | None] = {}  # per-client tables: C-name -> client id

    def add_row(self, labels: dict[str, str]) -> int:
        if labels not in self.rows:
            self.rows.append(dict(labels))
        return self.rows.index(labels)

    def add_metric(self, label: str, digits: int) -> None:
        if label not in self.metric_labels:
            self.metric_labels.append(label)
        self.digits.setdefault(label, digits)

    def cell(self, index: int, metric: str, client: str | None = None) -> Cell:
        try:
            return self.cells[(index, metric, client)]
        except KeyError:
            raise LedgerError(
                f"{self.id} (unrecorded): no printed {metric!r} for {self.rows[index]}"
                + (f", client {client}" if client else "")
            ) from None

    def diff(
        self, index: int, vs: int, metric: str, index2: int | None = None, vs2: int | None = None
    ) -> Diff:
        """The printed difference from the reference row, else one computed from the printed seeds."""
        if index2 is None and vs == self.reference_of(index) and (index, metric) in self.diffs:
            return self.diffs[(index, metric)]
        if index2 is None and index == self.reference_of(vs) and (vs, metric) in self.diffs:
            d = self.diffs[(vs, metric)]  # reference − row: the printed row − reference, negated
            ci = (-d.ci[1], -d.ci[0]) if d.ci else None
            return Diff(-d.mean, d.sd, d.n, ci, {k: -v for k, v in d.values.items()}, True)
        return self.computed_diff(index, vs, metric, index2, vs2)

    def computed_diff(
        self, index: int, vs: int, metric: str, index2: int | None = None, vs2: int | None = None
    ) -> Diff:
        terms = [(index, 1), (vs, -1)] + ([(index2, -1), (vs2, 1)] if index2 is not None else [])
        values = [(self.seed_values(i, metric), s) for i, s in terms]
        seeds = set.intersection(*(set(v) for v, _ in values))
        if not seeds:
            raise LedgerError(
                f"{self.id} (unrecorded): {self.rows[index]} − {self.rows[vs]} was not printed and the "
                "table has no per-seed values to compute it from"
            )
        if index2 is None:
            pairs = {s: (values[0][0][s], values[1][0][s]) for s in seeds}
        else:
            pairs = {s: (values[0][0][s] - values[1][0][s] + values[3][0][s], values[2][0][s]) for s in seeds}
        return paired(pairs)

    def describe(self) -> str:
        return f"**unrecorded**: printed at `{self.commit}`; its run folders are gone and no record exists"


def rounding_bound(digits: int, n: int, k: int) -> dict[str, float]:
    """How far a statistic computed from printed values (each rounded to ``digits``) can lie from the
    printed one computed exactly: ``k`` rounded terms per pair (1: a mean, 2: a difference), ``n`` pairs.

    Each printed value is within u = ½·10^−digits of the exact one, so a mean of k-term sums within k·u;
    an SD within k·u·√(n/(n−1)) (the deviations' error norm over √(n−1)); an interval end within the
    mean's bound plus t·(SD bound)/√n; and the printed statistic itself is rounded by u again."""
    u = 0.5 * 10.0**-digits
    mean = k * u + u
    if n < 2:
        return {"mean": mean, "sd": math.inf, "ci": math.inf}
    sd = k * u * math.sqrt(n / (n - 1))
    t = stats.t_quantile(0.5 + stats.LEVEL / 2, n - 1)
    return {"mean": mean + 1e-9, "sd": sd + u + 1e-9, "ci": k * u + t * sd / math.sqrt(n) + u + 1e-9}
