"""The claims registry (``ledger/claims.toml``) and what the ledger concludes from it.

Each ``[[claim]]`` is one pre-registered comparison: a paper's claim as a paired difference
(``row`` − ``vs`` of a sweep, a ``metric``), the paper's own effect in the same direction and where
it is from, and the ``group`` of comparisons that together make the paper's claim (e.g. "FL-BT
above every baseline": all must hold, :func:`fedderm.ledger.stats.combine`, by the group's ``rule``
when its sweep file registered another order than the default).  :func:`evaluate`
computes each comparison's interval, detectable effect and four-way verdict from its source
(records, else the printed unrecorded table), and the page blocks and the forest plot are made from
that.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from fedderm.ledger import LedgerError, stats
from fedderm.ledger.sources import Diff

REGISTRY = Path("ledger") / "claims.toml"
FOREST_PNG = Path("docs") / "img" / "ledger-forest.png"
FOREST_DATA = Path("docs") / "img" / "ledger-forest.json"
CLAIM_KEYS = {
    "id", "paper", "claim", "group", "paper_effect", "direction", "paper_source", "source", "row", "vs",
    "row2", "vs2", "metric", "unit", "setting", "printed", "n", "commit", "needs_records",
}  # fmt: skip
GROUP_KEYS = {"id", "title", "paper", "registered", "rule"}


@dataclass
class Result:
    claim: dict[str, Any]
    diff: Diff
    verdict: str
    recorded: bool
    commit: str
    digits: int
    complete: bool = True  # False: from records of a sweep not every run of which is in

    @property
    def id(self) -> str:
        return self.claim["id"]


@dataclass
class Group:
    group: dict[str, Any]
    members: list[Result]

    @property
    def verdict(self) -> str:
        return stats.combine([m.verdict for m in self.members], self.group.get("rule", "underpowered-first"))


@dataclass
class Index:
    results: dict[str, Result]
    groups: dict[str, Group]
    pending: list[dict] = field(default_factory=list)  # registered comparisons waiting for records

    def __contains__(self, key: str) -> bool:
        return key in self.results or key in self.groups

    def __getitem__(self, key: str) -> Result | Group:
        return self.results[key] if key in self.results else self.groups[key]


def load_registry(root: Path) -> tuple[list[dict], list[dict]]:
    path = Path(root) / REGISTRY
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return [], []
    except tomllib.TOMLDecodeError as err:
        raise LedgerError(f"{path}: {err}") from None
    claims, groups = data.get("claim", []), data.get("group", [])
    seen: set[str] = set()
    for g in groups:
        bad = set(g) - GROUP_KEYS
        if bad or "id" not in g or "title" not in g:
            raise LedgerError(f"{path}: group {g.get('id')!r}: needs id and title; unknown {sorted(bad)}")
        if g.get("rule", "underpowered-first") not in stats.COMBINE_RULES:
            raise LedgerError(
                f"{path}: group {g['id']!r}: rule {g['rule']!r} is not one of {', '.join(stats.COMBINE_RULES)}"
            )
        seen.add(g["id"])
    ids: set[str] = set()
    for c in claims:
        where = f"{path}: claim {c.get('id')!r}"
        bad = set(c) - CLAIM_KEYS
        if bad:
            raise LedgerError(f"{where}: unknown key {sorted(bad)[0]!r}")
        for key in (
            "id",
            "paper",
            "claim",
            "paper_source",
            "source",
            "group",
            *(() if "printed" in c else ("row",)),
        ):
            if key not in c:
                raise LedgerError(f"{where}: missing {key!r}")
        if c["id"] in ids or c["id"] in seen:
            raise LedgerError(f"{where}: id used twice")
        ids.add(c["id"])
        if c["group"] not in seen:
            raise LedgerError(f"{where}: group {c['group']!r} is not a [[group]]")
        if c.get("paper_effect") is None and c.get("direction") not in (1, -1):
            raise LedgerError(f"{where}: give paper_effect (points, signed) or direction (+1/-1)")
    return claims, groups


def evaluate(root: Path, catalogue, errors: list[str] | None = None) -> Index:
    """Every claim's result; a claim that cannot be computed is left out, its reason in ``errors``
    (raised when ``errors`` is None)."""
    claims, groups = load_registry(root)
    results: dict[str, Result] = {}
    pending = []
    for c in claims:
        if c.get("needs_records") and c["source"] not in getattr(catalogue, "sources", {}):
            pending.append(c)  # its endpoint was never printed: it waits for the sweep's records
            continue
        try:
            _evaluate_one(c, catalogue, results)
        except LedgerError as err:
            if errors is None:
                raise
            errors.append(str(err))
    out = {g["id"]: Group(g, [r for r in results.values() if r.claim["group"] == g["id"]]) for g in groups}
    return Index(results, {k: g for k, g in out.items() if g.members}, pending)


def _evaluate_one(c: dict, catalogue, results: dict[str, Result]) -> None:
    if True:  # noqa: SIM108
        where = f"{REGISTRY}: claim {c['id']!r}"
        if "printed" in c:  # a difference printed with no table to recompute it from
            d, digits = _printed_diff(c, where)
            v = stats.verdict(d.ci, c.get("paper_effect"), c.get("direction"))
            results[c["id"]] = Result(c, d, v, False, c["commit"], digits)
            return
        src = catalogue.get(c["source"], where)
        metric = src.metric(c.get("metric"))
        row = src.find(c["row"])
        vs = src.find(c["vs"]) if c.get("vs") else src.reference_of(row)
        if vs is None:
            raise LedgerError(f"{where}: {c['row']!r} is a reference row: give vs")
        row2 = src.find(c["row2"]) if c.get("row2") else None
        vs2 = src.find(c["vs2"]) if c.get("vs2") else None
        try:
            d = src.diff(row, vs, metric, row2, vs2)
        except LedgerError as err:
            raise LedgerError(f"{where}: {err}") from None
        v = stats.verdict(d.ci, c.get("paper_effect"), c.get("direction"))
        complete = not src.recorded or src.records.complete
        results[c["id"]] = Result(c, d, v, src.recorded, src.commit, src.digits[metric], complete)


def _printed_diff(c: Mapping[str, Any], where: str) -> tuple[Diff, int]:
    from fedderm.ledger.fmt import _DIFF, _digits

    m = _DIFF.match(c["printed"].replace("\u2212", "-"))
    if not m or "n" not in c or "commit" not in c:
        raise LedgerError(f"{where}: printed = 'Δ [low, high]' needs n and commit")
    ci = (float(m["lo"]), float(m["hi"])) if m["lo"] else None
    return Diff(float(m["m"]), None, int(c["n"]), ci, {}, True), _digits(m["m"])


# --------------------------------------------------------------------------- text
def _num(x: float | None, digits: int, sign: bool = False) -> str:
    from fedderm.ledger.fmt import num

    return num(x, digits, sign)


def _evidence(r: Result) -> str:
    if r.recorded:
        return f"records, `{r.commit[:7]}`" + ("" if r.complete else ", **incomplete**")
    return f"**unrecorded**, printed at `{r.commit}`"


def verdict_text(item: Result | Group) -> str:
    """The verdict as the page states it, saying when it rests on unrecorded numbers."""
    if isinstance(item, Group):
        members = item.members
        word = item.verdict
    else:
        members = [item]
        word = item.verdict
    unrec = sum(not m.recorded for m in members)
    text = f"**{word}**"
    if unrec and unrec == len(members):
        text += " (on unrecorded numbers)"
    elif unrec:
        text += f" ({unrec} of {len(members)} comparisons on unrecorded numbers)"
    if any(not m.complete for m in members):
        text += " (records incomplete: the sweep is still running)"
    return text


def paper_effect_text(c: Mapping[str, Any], digits: int) -> str:
    unit = c.get("unit", "points")
    if c.get("paper_effect") is None:
        side = "above" if c["direction"] > 0 else "below"
        return f"{side} 0, no number ({c['paper_source']})"
    return f"{_num(c['paper_effect'], digits, True)} {unit} ({c['paper_source']})"


def claims_table(index: Index, paper: str | None = None) -> str:
    """One row per comparison: the paper's effect, the interval here, what it could detect, the
    verdict; then one row per claim with the combined verdict."""
    from fedderm.ledger.fmt import fmt_diff

    head = [
        "paper", "comparison (setting here)", "paper's effect (source)", "here: Δ [95 % CI] (n)",
        "detectable Δ (80 % power)", "verdict", "evidence",
    ]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in index.results.values():
        c = r.claim
        if paper and c["paper"] != paper:
            continue
        here = fmt_diff(r.diff, r.digits) + (f" (n = {r.diff.n})" if r.diff.ci else "")
        cells = [
            c["paper"],
            f"{c['claim']} ({c.get('setting', c['source'])})",
            paper_effect_text(c, r.digits),
            here,
            _num(r.diff.detectable, r.digits),
            f"**{r.verdict}**",  # the evidence column says when it rests on unrecorded numbers
            _evidence(r),
        ]
        lines.append("| " + " | ".join(str(x).replace("|", "\\|") for x in cells) + " |")
    for c in index.pending:
        if paper and c["paper"] != paper:
            continue
        cells = [
            c["paper"], f"{c['claim']} ({c.get('setting', c['source'])})", paper_effect_text(c, 1),
            "–", "–", "**pending**", f"registered, never printed: waits for the records of `{c['source']}`",
        ]  # fmt: skip
        lines.append("| " + " | ".join(str(x).replace("|", "\\|") for x in cells) + " |")
    lines += ["", "| claim | comparisons | verdict |", "|---|---|---|"]
    for g in index.groups.values():
        if paper and g.group.get("paper") != paper:
            continue
        names = "; ".join(dict.fromkeys(m.claim["claim"] for m in g.members))
        lines.append(f"| {g.group['title']} | {names} | {verdict_text(g)} |")
    return "\n" + "\n".join(lines) + "\n"


def summary_text(index: Index) -> str:
    """How many claims and comparisons end in each verdict, and which claims are not underpowered."""

    def counts(verdicts: list[str]) -> str:
        return ", ".join(f"{verdicts.count(v)} {v}" for v in stats.VERDICTS if verdicts.count(v))

    groups = list(index.groups.values())
    comps = list(index.results.values())
    lines = [
        f"- **{len(groups)} claims** tested here: {counts([g.verdict for g in groups])}.",
        f"- **{len(comps)} comparisons** behind them: {counts([r.verdict for r in comps])}; "
        f"{sum(not r.recorded for r in comps)} rest on unrecorded numbers, "
        f"{sum(r.recorded and not r.complete for r in comps)} on records of a sweep still running.",
    ]
    for word in (stats.REPRODUCED, stats.CONTRADICTED, stats.SMALLER):
        named = [g.group["title"] for g in groups if g.verdict == word]
        if named:
            lines.append(f"- *{word.capitalize()}*: " + "; ".join(named) + ".")
    return "\n" + "\n".join(lines) + "\n"


def multiplicity_text(index: Index, page_intervals: tuple[int, int] | None = None) -> str:
    n = len(index.results)
    k = sum(r.diff.excludes_zero for r in index.results.values())
    exp = stats.expected_false_exclusions(n)
    text = (
        f"The verdicts rest on {n} intervals; {k} of them exclude 0. At 95 % each interval excludes 0 by "
        f"chance one time in 20 when there is no effect, so about {exp:.1f} of {n} would do so with no "
        "effect anywhere: one interval that excludes 0 is weak evidence on its own, and the page reads "
        "a claim as reproduced only by its pre-registered rule."
    )
    if page_intervals:
        pn, pk = page_intervals
        text += (
            f" The tables of this page hold {pn} paired intervals in all, {pk} excluding 0 "
            f"(about {stats.expected_false_exclusions(pn):.1f} expected by chance alone)."
        )
    return "\n" + text + "\n"


def sources_text(catalogue) -> str:
    lines = ["| source | numbers | where they ran |", "|---|---|---|"]
    ids = sorted(set(catalogue.sources) | set(catalogue.printed))
    for id in ids:
        if id in catalogue.sources:
            src = catalogue.sources[id]
            meta = src.records.meta
            state = "complete" if meta.get("complete") else "**incomplete**"
            lines.append(
                f"| `{id}` | records: {len(meta['recorded'])} of {len(meta['planned'])} runs ({state}) | "
                f"{src.describe()} |"
            )
        else:
            src = catalogue.printed[id]
            partial = getattr(catalogue, "partial", {}).get(id)
            note = (
                f"; its re-run is being recorded ({len(partial.records.meta['recorded'])} of "
                f"{len(partial.records.meta['planned'])} runs in `ledger/records/{id}/`)"
                if partial
                else ""
            )
            lines.append(
                f"| `{id}` | **unrecorded** ({len(src.rows)} rows printed){note} | printed at `{src.commit}` |"
            )
    return "\n" + "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- the forest plot
def forest_data(index: Index) -> list[dict[str, Any]]:
    """What the forest plot draws, one entry per comparison in points (rounds are left out)."""
    out = []
    for r in index.results.values():
        c = r.claim
        if c.get("unit", "points") != "points" or r.diff.mean is None:
            continue
        out.append(
            {
                "id": r.id,
                "label": f"{c['paper']} {c['claim']} ({c.get('setting', c['source'])})",
                "mean": round(r.diff.mean, 4),
                "ci": [round(x, 4) for x in r.diff.ci] if r.diff.ci else None,
                "paper_effect": c.get("paper_effect"),
                "verdict": r.verdict,
                "recorded": r.recorded,
            }
        )
    return out


def forest_text(index: Index) -> str:
    data = forest_data(index)
    return (
        f"\n![Forest plot of the ledger: {len(data)} paired differences with their 95 % intervals, "
        "0 and each paper's effect marked](img/ledger-forest.png)\n"
    )


def plot_forest(data: list[dict[str, Any]], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    n = max(len(data), 1)
    height = 0.24 * n + 1.4
    fig = Figure(figsize=(12, height))
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0.47, 0.7 / height, 0.5, 1 - 1.25 / height))
    colours = {
        stats.REPRODUCED: "#1a7f37", stats.CONTRADICTED: "#cf222e", stats.SMALLER: "#9a6700",
        stats.UNDERPOWERED: "#57606a", stats.NOT_TESTED: "#afb8c1",
    }  # fmt: skip
    lim = 40.0
    for y, d in enumerate(reversed(data)):
        colour = colours[d["verdict"]]
        if d["ci"]:
            lo, hi = max(d["ci"][0], -lim), min(d["ci"][1], lim)
            ax.plot([lo, hi], [y, y], color=colour, lw=2)
            for end, edge in ((d["ci"][0], -lim), (d["ci"][1], lim)):
                if (end < -lim and edge < 0) or (end > lim and edge > 0):
                    ax.annotate(
                        "",
                        xy=(edge, y),
                        xytext=(edge * 0.92, y),
                        arrowprops={"arrowstyle": "->", "color": colour},
                    )
        face = colour if d["recorded"] else "white"
        ax.plot([max(min(d["mean"], lim), -lim)], [y], "o", color=colour, mfc=face, ms=5)
        if d["paper_effect"] is not None:
            ax.plot([d["paper_effect"]], [y], "D", color="#0969da", ms=4, mfc="none")
    ax.axvline(0, color="black", lw=0.8)
    ax.set_yticks(range(len(data)))
    ax.set_yticklabels([d["label"] for d in reversed(data)], fontsize=6.5)
    ax.set_ylim(-0.7, len(data) - 0.3)
    ax.set_xlim(-lim, lim)
    ax.grid(axis="x", alpha=0.3)
    ax.set_xlabel(
        "paired difference here (points) with its 95 % interval; clipped at ±40 (arrow)", fontsize=8
    )
    handles = [Line2D([], [], color=c, lw=2, label=v) for v, c in colours.items()]
    handles += [
        Line2D([], [], marker="o", color="#57606a", mfc="#57606a", ls="", label="recorded"),
        Line2D([], [], marker="o", color="#57606a", mfc="white", ls="", label="unrecorded"),
        Line2D([], [], marker="D", color="#0969da", mfc="none", ls="", label="paper's effect"),
    ]
    fig.legend(handles=handles, fontsize=7, loc="upper center", ncol=8, frameon=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, metadata={"Software": None})


def write_forest(root: Path, index: Index) -> None:
    data = forest_data(index)
    if not data:
        return
    (Path(root) / FOREST_DATA).parent.mkdir(parents=True, exist_ok=True)
    (Path(root) / FOREST_DATA).write_text(
        json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    plot_forest(data, Path(root) / FOREST_PNG)


def check_forest(root: Path, index: Index) -> list[str]:
    data = forest_data(index)
    if not data:
        return []
    path = Path(root) / FOREST_DATA
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return [f"{path}: missing or unreadable: run python -m fedderm.ledger render"]
    if saved != json.loads(json.dumps(data)):
        return [f"{FOREST_DATA}: the forest plot is stale: run python -m fedderm.ledger render"]
    if not (Path(root) / FOREST_PNG).is_file():
        return [f"{FOREST_PNG}: missing: run python -m fedderm.ledger render"]
    return []


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)
