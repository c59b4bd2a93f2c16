"""The ledger's markers in the docs: every table and every figure a page states is generated from
a source (records, or a printed unrecorded table) and checked against it.

A marker is an HTML comment pair around the text it owns (invisible on the rendered page)::

    <!--L table 004-flbt metrics="Accuracy (GTA):seeds,diff"-->...generated table...<!--/L-->
    <!--L table 000-fedclf-relay unrecorded=1349072 metrics="Recall:seeds,diff"-->...printed...<!--/L-->
    <!--L 004-flbt diff row="digits Dir 0.3;FL-BT"-->**−13.10 [−24.82, −1.37]**<!--/L-->
    <!--L verdict claim=004-flbt-digits-fedavg-->**reproduced**<!--/L-->
    <!--L claims-->...the verdicts table...<!--/L-->   <!--L multiplicity-->...<!--/L-->
    <!--L sources-->...<!--/L-->   <!--L forest-->...<!--/L-->
    <!--L paper 004 Table II-->93.42<!--/L-->   (a paper's number, quoted)

``render`` rewrites every marker's text from its source; ``verify`` fails where the text differs,
where a page states a result-like number or a verdict word outside any marker (the *lint*), and
where an unrecorded table disagrees with its own per-seed values beyond rounding.

Figure statistics (``<id> <stat>``): ``mean`` (m ± SD), ``value``, ``sd``, ``seeds`` (a / b / c),
``diff`` (Δ [low, high], bold when the interval excludes 0; ``plain`` drops the bold), ``dmean``,
``dabs``, ``ci``, ``dseeds``, ``drange``, ``dabsrange``, ``mde`` (detectable effect), ``n``,
``rank`` (ordinal among the rows ``among`` selects).  Options: ``row``, ``vs`` (default: the row's
reference), ``row2``/``vs2`` ((row − vs) − (row2 − vs2)), ``metric``, ``client``.  Rows are selected by
their labels, ``;``-separated (``row="digits Dir 0.3;FL-BT"``).  A figure whose source is unrecorded is
followed by a dagger that links to the page's list of sources.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from fedderm import sweep as fs
from fedderm.ledger import LedgerError, records, stats
from fedderm.ledger.fmt import _DIFF, _MEAN, MINUS, _digits, _parse_number, fmt_diff, fmt_mean, num
from fedderm.ledger.sources import Cell, Diff, PrintedSource, RecordSource, Source, rounding_bound

MARKER = re.compile(r"<!--L\s+(?P<head>.*?)-->(?P<body>.*?)<!--/L-->", re.S)
BLOCK_KINDS = (
    "table",
    "claims",
    "summary",
    "multiplicity",
    "sources",
    "forest",
    "curves",
    "paper",
    "words",
    "printed",
)
#: pages the lint reads in full; other pages only between <!-- ledger:lint --> and <!-- /ledger:lint -->
FULL_LINT = ("claims.md", "quick-tables.md")
LINT_REGION = re.compile(r"<!-- ledger:lint -->(.*?)<!-- /ledger:lint -->", re.S)
UNRECORDED_ANCHOR = "unrecorded-numbers"
ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth")
NUMBERS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


# --------------------------------------------------------------------------- markers
@dataclass
class Marker:
    page: Path
    start: int
    end: int
    head: str
    body: str
    kind: str
    args: list[str]
    opts: dict[str, str]

    @property
    def where(self) -> str:
        line = self.text_before.count("\n") + 1
        return f"{self.page.name}:{line}: <!--L {self.head}-->"

    text_before: str = ""


def _split_head(head: str) -> tuple[list[str], dict[str, str]]:
    try:
        tokens = shlex.split(head)
    except ValueError as err:
        raise LedgerError(f"marker <!--L {head}-->: {err}") from None
    args, opts = [], {}
    for t in tokens:
        if "=" in t and not t.startswith("="):
            k, v = t.split("=", 1)
            opts[k] = v
        else:
            args.append(t)
    return args, opts


def _blank_code(text: str) -> str:
    """``text`` with code blocks and code spans blanked (same length): markers there are examples."""
    return _CODE.sub(lambda m: " " * len(m.group(0)), text)


def markers(page: Path, text: str) -> list[Marker]:
    out = []
    for m in MARKER.finditer(_blank_code(text)):
        m = MARKER.match(text, m.start())
        args, opts = _split_head(m.group("head"))
        if not args:
            raise LedgerError(f"{page.name}: empty marker <!--L {m.group('head')}-->")
        kind = args[0] if args[0] in BLOCK_KINDS or args[0] == "verdict" else "figure"
        out.append(
            Marker(
                page,
                m.start(),
                m.end(),
                m.group("head"),
                m.group("body"),
                kind,
                args,
                opts,
                text[: m.start()],
            )
        )
    stray = re.findall(r"<!--/?L\b", MARKER.sub("", _blank_code(text)))
    if stray:
        raise LedgerError(f"{page.name}: an unpaired or nested ledger marker ({stray[0]!r})")
    return out


# --------------------------------------------------------------------------- tables: the ledger layout
@dataclass
class MetricSpec:
    label: str
    seeds: bool = False
    diff: bool = False


def metric_specs(text: str | None, source: Source) -> list[MetricSpec]:
    """``metrics="Recall:seeds,diff|Accuracy:diff"`` (default: the first metric, seeds and diff)."""
    if not text:
        return [MetricSpec(source.metric(None), True, True)]
    out = []
    for part in text.split("|"):
        label, _, flags = part.partition(":")
        names = {f.strip() for f in flags.split(",") if f.strip()}
        bad = names - {"seeds", "diff"}
        if bad:
            raise LedgerError(f"metrics={text!r}: unknown flag {sorted(bad)[0]!r} (seeds, diff)")
        out.append(MetricSpec(source.metric(label.strip()), "seeds" in names, "diff" in names))
    return out


def _ref_name(source: Source) -> str:
    return ", ".join(source.reference.values())


def _header(source: Source, specs: list[MetricSpec]) -> list[str]:
    head = list(source.axes)
    seeds = " / ".join(str(s) for s in source.seeds)
    for s in specs:
        head.append(s.label)
        if s.seeds:
            head.append(f"{s.label}, seeds {seeds}" if len(specs) > 1 else f"seeds {seeds}")
        if s.diff:
            head.append(
                f"Δ {s.label} vs {_ref_name(source)}" if len(specs) > 1 else f"Δ vs {_ref_name(source)}"
            )
            head.append("detectable Δ (80 % power)" if len(specs) == 1 else f"detectable Δ {s.label}")
    return head


def _cell_text(text: str) -> str:
    return str(text).replace("|", "\\|")


def ledger_rows(source: Source, specs: list[MetricSpec], rows: list[int]) -> list[str]:
    head = _header(source, specs)
    lines = ["| " + " | ".join(_cell_text(h) for h in head) + " |", "|" + "---|" * len(head)]
    for i in rows:
        cells = [source.rows[i][a] for a in source.axes]
        ref = source.reference_of(i)
        for s in specs:
            digits = source.digits[s.label]
            c = source.cell(i, s.label)
            cells.append(fmt_mean(c, digits))
            if s.seeds:
                cells.append(" / ".join(num(c.seeds.get(seed), digits) for seed in source.seeds))
            if s.diff:
                if ref is None:
                    cells += ["reference", ""]
                else:
                    d = source.diff(i, ref, s.label)
                    cells += [fmt_diff(d, digits), num(d.detectable, digits)]
        lines.append("| " + " | ".join(_cell_text(c) for c in cells) + " |")
    return lines


def _table_lines(body: str) -> list[list[str]]:
    """The pipe-table rows of ``body`` (separator rows dropped), cells stripped, ``\\|`` kept as |."""
    rows = []
    for line in body.splitlines():
        line = line.strip()
        if not line.startswith("|"):
            continue
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip("|"))]
        if all(re.fullmatch(r":?-{3,}:?", c) for c in cells):
            continue
        rows.append(cells)
    return rows


def parse_ledger_table(source: PrintedSource, body: str, specs: list[MetricSpec], where: str) -> list[int]:
    """Read a printed table in the ledger layout into ``source``; returns its rows' indices."""
    table = _table_lines(body)
    if not table:
        raise LedgerError(f"{where}: no table")
    head, rows = table[0], table[1:]
    want = _header(source, specs)
    if head != want:
        raise LedgerError(f"{where}: header {head} is not the ledger layout {want}")
    indices = []
    for cells in rows:
        labels = dict(zip(source.axes, cells[: len(source.axes)]))
        i = source.add_row(labels)
        indices.append(i)
        k = len(source.axes)
        for s in specs:
            text = cells[k]
            k += 1
            m = _MEAN.match(text)
            if text == "n/a":
                mean = sd = None
            elif not m:
                raise LedgerError(f"{where}: {labels} {s.label}: {text!r} is not 'mean ± SD'")
            else:
                mean, sd = float(m["m"].replace(MINUS, "-")), (float(m["sd"]) if m["sd"] else None)
            digits = _digits(text)
            source.add_metric(s.label, digits)
            seeds: dict[int, float | None] = {}
            if s.seeds:
                parts = [p.strip() for p in cells[k].split("/")]
                k += 1
                if len(parts) != len(source.seeds):
                    raise LedgerError(
                        f"{where}: {labels}: {len(parts)} seed values for {len(source.seeds)} seeds"
                    )
                seeds = dict(zip(source.seeds, (_parse_number(p) for p in parts)))
            n = sum(v is not None for v in seeds.values()) if seeds else (len(source.seeds) if sd else 1)
            source.cells[(i, s.label, None)] = Cell(mean, sd, n, seeds)
            if s.diff:
                text = cells[k]
                k += 2  # the detectable column is computed, not read
                if text in ("reference", "n/a"):
                    continue
                d = _DIFF.match(text)
                if not d:
                    raise LedgerError(f"{where}: {labels}: {text!r} is not 'Δ [low, high]'")
                ci = (
                    (float(d["lo"].replace(MINUS, "-")), float(d["hi"].replace(MINUS, "-")))
                    if d["lo"]
                    else None
                )
                pairs = int(d["n"]) if d["n"] else len(source.seeds)
                source.diffs[(i, s.label)] = Diff(
                    float(d["m"].replace(MINUS, "-")), None, pairs, ci, {}, True
                )
    return indices


def check_printed(source: PrintedSource, where: str) -> list[str]:
    """An unrecorded table against its own per-seed values: each printed mean, SD and paired
    interval within what rounding the per-seed values allows (:func:`rounding_bound`)."""
    errors = []
    for (i, metric, _client), c in source.cells.items():
        vals = [v for v in c.seeds.values() if v is not None]
        if not vals or c.mean is None:
            continue
        digits = source.digits[metric]
        b = rounding_bound(digits, len(vals), 1)
        mean, sd = fs_mean_sd(vals)
        if abs(mean - c.mean) > b["mean"]:
            errors.append(
                f"{where}: {source.rows[i]} {metric}: mean {c.mean} printed, {mean:.4f} from its seeds"
            )
        if sd is not None and c.sd is not None and abs(sd - c.sd) > b["sd"]:
            errors.append(f"{where}: {source.rows[i]} {metric}: SD {c.sd} printed, {sd:.4f} from its seeds")
    for (i, metric), d in source.diffs.items():
        ref = source.reference_of(i)
        if ref is None or not source.seed_values(i, metric) or not source.seed_values(ref, metric):
            continue
        x = source.computed_diff(i, ref, metric)
        b = rounding_bound(source.digits[metric], x.n, 2)
        far = abs(x.mean - d.mean) > b["mean"] or (
            d.ci is not None
            and x.ci is not None
            and max(abs(x.ci[0] - d.ci[0]), abs(x.ci[1] - d.ci[1])) > b["ci"]
        )
        if far:
            got = f"{x.mean:.4f}" + (f" [{x.ci[0]:.4f}, {x.ci[1]:.4f}]" if x.ci else "")
            errors.append(
                f"{where}: {source.rows[i]} {metric}: Δ {d.mean} {d.ci} printed, {got} from its seeds"
            )
    return errors


def fs_mean_sd(values: list[float]) -> tuple[float, float | None]:
    from fedderm.sweep_tables import mean_sd

    return mean_sd(values)


# --------------------------------------------------------------------------- tables: the sweep layout
_CLIENT_HEAD = re.compile(r"^\*\*(?P<name>C\d+|GTA)\*\* \((?:client (?P<id>[^,]+),|mean over clients)")


def parse_sweep_table(source: PrintedSource, body: str, axes: int, where: str) -> list[int]:
    """A printed ``table.md`` (sim.py's layout: per-client tables, the GTA table, the paired
    differences) into ``source``; cells as printed (mean, SD, ``≈chance``)."""
    client = None
    indices: list[int] = []
    lines = body.splitlines()
    chunks: list[tuple[str | None, list[str]]] = []
    current: list[str] = []
    for line in lines:
        m = _CLIENT_HEAD.match(line.strip())
        if m:
            if current:
                chunks.append((client, current))
            client, current = (None if m["name"] == "GTA" else m["name"]), []
            source.clients[m["name"]] = m["id"]
        elif line.strip().startswith("|"):
            current.append(line)
        elif current and line.strip() == "":
            chunks.append((client, current))
            current = []
    if current:
        chunks.append((client, current))
    for client, chunk in chunks:
        table = _table_lines("\n".join(chunk))
        head, rows = table[0], table[1:]
        names = head[:axes]
        if source.axes and names != source.axes:
            raise LedgerError(f"{where}: axes {names}, the sweep's are {source.axes}")
        source.axes = names
        differences = any(h.startswith("Δ ") for h in head)
        for cells in rows:
            labels = dict(zip(names, cells[:axes]))
            i = source.add_row(labels)
            if i not in indices:
                indices.append(i)
            for h, text in zip(head[axes:], cells[axes:]):
                if h in ("runs", "pairs"):
                    continue
                if differences:
                    if not h.startswith("Δ ") or text in ("reference", "n/a", ""):
                        continue
                    d = _DIFF.match(text)
                    if not d:
                        raise LedgerError(f"{where}: {labels} {h}: {text!r}")
                    label = h[2:]
                    ci = (
                        (float(d["lo"].replace(MINUS, "-")), float(d["hi"].replace(MINUS, "-")))
                        if d["lo"]
                        else None
                    )
                    source.diffs[(i, label)] = Diff(
                        float(d["m"].replace(MINUS, "-")), None, len(source.seeds), ci, {}, True
                    )
                    continue
                if text in ("n/a", "failed"):
                    continue
                m = _MEAN.match(text)
                if not m:
                    raise LedgerError(f"{where}: {labels} {h}: {text!r} is not a table.md cell")
                source.add_metric(h, _digits(m["m"]))
                mean, sd = float(m["m"].replace(MINUS, "-")), (float(m["sd"]) if m["sd"] else None)
                seeds = {source.seeds[0]: mean} if sd is None and len(source.seeds) == 1 else {}
                source.cells[(i, h, client)] = Cell(
                    mean, sd, 1 if sd is None else len(source.seeds), seeds, at_chance=bool(m["c"])
                )
    return indices


def check_gta(source: PrintedSource, where: str) -> list[str]:
    """A per-client table's GTA row is the mean of its clients' values (within rounding)."""
    errors = []
    names = [c for c in source.clients if c != "GTA"]
    if not names:
        return errors
    for (i, metric, client), c in source.cells.items():
        if client is not None or c.mean is None or c.sd is not None:
            continue
        parts = [source.cells.get((i, metric, n)) for n in names]
        if any(p is None or p.mean is None for p in parts):
            continue
        mean = sum(p.mean for p in parts) / len(parts)
        if abs(mean - c.mean) > 0.5 * 10 ** -source.digits[metric] * 2 + 1e-9:
            errors.append(f"{where}: {source.rows[i]} {metric}: GTA {c.mean}, the clients' mean {mean:.3f}")
    return errors


# --------------------------------------------------------------------------- the catalogue of sources
def sweep_file_for(root: Path, id: str) -> tuple[Path, bool, bool]:
    """``sweeps/**/<stem>.toml`` of a source id ``<stem>[-quick][-gpu][:variant]``."""
    base = id.split(":", 1)[0]
    quick = gpu = False
    if base.endswith("-gpu"):
        base, gpu = base[: -len("-gpu")], True
    if base.endswith("-quick"):
        base, quick = base[: -len("-quick")], True
    hits = sorted((root / "sweeps").rglob(f"{base}.toml"))
    if len(hits) != 1:
        raise LedgerError(f"source {id!r}: {len(hits)} sweep files named {base}.toml under sweeps/")
    return hits[0], quick, gpu


@dataclass
class Catalogue:
    """Every source the docs use: records under ledger/records, else the pages' unrecorded tables."""

    root: Path
    sources: dict[str, Source] = field(default_factory=dict)
    printed: dict[str, PrintedSource] = field(default_factory=dict)
    superseded: dict[str, list[Marker]] = field(default_factory=dict)
    #: records of a sweep still running whose printed table the pages keep until every run is in
    partial: dict[str, RecordSource] = field(default_factory=dict)

    def get(self, id: str, where: str) -> Source:
        if id in self.sources:
            return self.sources[id]
        if id in self.printed:
            return self.printed[id]
        raise LedgerError(f"{where}: no records for {id!r} and no unrecorded table of it on any page")


def _new_printed(root: Path, id: str, commit: str) -> PrintedSource:
    path, quick, gpu = sweep_file_for(root, id)
    spec = fs.load_sweep(path, quick=quick, gpu=gpu)
    return PrintedSource(id, commit, list(spec.axes), dict(spec.reference), list(spec.seeds))


def build_catalogue(root: Path, pages: dict[Path, str]) -> tuple[Catalogue, list[str]]:
    cat = Catalogue(root)
    errors: list[str] = []
    for name in records.available(root):
        cat.sources[name] = RecordSource(records.load(root, name))
    for page, text in pages.items():
        for mk in markers(page, text):
            if mk.kind != "table" or "unrecorded" not in mk.opts:
                continue
            id = mk.args[1]
            if id in cat.sources and cat.sources[id].records.complete:  # render replaces the printed table
                cat.superseded.setdefault(id, []).append(mk)
            src = cat.printed.get(id)
            if src is None:
                src = cat.printed[id] = _new_printed(root, id, mk.opts["unrecorded"])
            elif src.commit != mk.opts["unrecorded"]:
                errors.append(
                    f"{mk.where}: {id} printed at {mk.opts['unrecorded']} here, {src.commit} elsewhere"
                )
            if mk.opts.get("seeds"):
                src.seeds = [int(s) for s in mk.opts["seeds"].split(",")]
            if mk.opts.get("reference"):  # the reference a printed table was rendered with (--set)
                src.reference = dict(p.split("=", 1) for p in mk.opts["reference"].split(";"))
            try:
                if mk.opts.get("layout") == "sweep":
                    parse_sweep_table(src, mk.body, int(mk.opts.get("axes", len(src.axes))), mk.where)
                else:
                    parse_ledger_table(src, mk.body, metric_specs_printed(mk, src), mk.where)
            except LedgerError as err:
                errors.append(str(err))
    for id in [i for i in cat.sources if i in cat.printed and not cat.sources[i].records.complete]:
        cat.partial[id] = cat.sources.pop(id)  # the printed numbers stay until the re-run is complete
    return cat, errors


def metric_specs_printed(mk: Marker, src: PrintedSource) -> list[MetricSpec]:
    """A printed table's metric columns, as its marker names them (labels kept as written)."""
    text = mk.opts.get("metrics")
    if not text:
        raise LedgerError(
            f'{mk.where}: an unrecorded table names its columns: metrics="Label:seeds,diff|..."'
        )
    out = []
    for part in text.split("|"):
        label, _, flags = part.partition(":")
        names = {f.strip() for f in flags.split(",") if f.strip()}
        out.append(MetricSpec(label.strip(), "seeds" in names, "diff" in names))
    return out


# --------------------------------------------------------------------------- figures
def _select_rows(source: Source, selector: str | None) -> list[int]:
    if not selector:
        return list(range(len(source.rows)))
    parts = [p.strip() for p in selector.split(";") if p.strip()]
    return [i for i, r in enumerate(source.rows) if all(p in r.values() for p in parts)]


def _client(source: Source, name: str | None) -> str | None:
    if name is None:
        return None
    clients = getattr(source, "clients", None)
    if clients is not None:  # printed per-client tables are keyed by their C-name
        if name not in clients:
            raise LedgerError(f"{source.id}: no client table {name!r} ({', '.join(clients)})")
        return name
    if isinstance(source, RecordSource) and name.startswith("C") and name[1:].isdigit():
        ids = source.table.get("clients") or []
        return ids[int(name[1:]) - 1]
    return name


def figure_text(cat: Catalogue, mk: Marker, claims_index: dict) -> str:
    from fedderm.ledger import claims as cl

    if mk.kind == "verdict":
        cid = mk.opts.get("claim")
        if any(c["id"] == cid for c in claims_index.pending):
            return "**pending** (its runs are not recorded)"
        if cid not in claims_index:
            raise LedgerError(f"{mk.where}: no claim {cid!r} in ledger/claims.toml")
        return cl.verdict_text(claims_index[cid])
    if len(mk.args) < 2:
        raise LedgerError(f"{mk.where}: a figure is <!--L <source> <stat> ...-->")
    src = cat.get(mk.args[0], mk.where)
    stat = mk.args[1]
    o = mk.opts
    metric = src.metric(o.get("metric"))
    digits = src.digits[metric]
    client = _client(src, o.get("client"))
    row = src.find(o["row"]) if "row" in o else None
    text: str
    if stat in ("mean", "value", "sd", "seeds", "seed", "n", "rank"):
        if row is None:
            raise LedgerError(f"{mk.where}: {stat} needs row=")
        if isinstance(src, PrintedSource):
            c = src.cells.get((row, metric, client))
            if c is None:
                raise LedgerError(
                    f"{mk.where}: {src.id} (unrecorded) printed no {metric} for {src.rows[row]}"
                )
        else:
            c = src.cell(row, metric, client)
        if stat == "mean":
            text = fmt_mean(c, digits)
        elif stat == "value":
            text = num(c.mean, digits)
        elif stat == "sd":
            text = num(c.sd, digits)
        elif stat == "seeds":
            text = " / ".join(num(c.seeds.get(s), digits) for s in src.seeds)
        elif stat == "seed":
            if "seed" not in o or int(o["seed"]) not in c.seeds:
                raise LedgerError(f"{mk.where}: seed= one of {sorted(c.seeds)}")
            text = num(c.seeds[int(o["seed"])], digits)
        elif stat == "n":
            text = str(c.n)
        else:
            among = _select_rows(src, o.get("among"))
            if row not in among:
                raise LedgerError(f"{mk.where}: the row is not among {o.get('among')!r}")
            means = []
            for i in among:
                ci = (
                    src.cells.get((i, metric, client))
                    if isinstance(src, PrintedSource)
                    else src.cell(i, metric, client)
                )
                if ci is None or ci.mean is None:
                    raise LedgerError(f"{mk.where}: rank: {src.rows[i]} has no {metric}")
                means.append(ci.mean)
            rank = 1 + sum(m > c.mean for m in means)
            text = f"{ORDINALS[rank - 1]} of {NUMBERS[len(means) - 1]}"
    else:
        if row is None:
            raise LedgerError(f"{mk.where}: {stat} needs row=")
        vs = src.find(o["vs"]) if "vs" in o else src.reference_of(row)
        if vs is None:
            raise LedgerError(f"{mk.where}: {src.rows[row]} is a reference row: give vs=")
        row2 = src.find(o["row2"]) if "row2" in o else None
        vs2 = src.find(o["vs2"]) if "vs2" in o else None
        if (row2 is None) != (vs2 is None):
            raise LedgerError(f"{mk.where}: row2= and vs2= go together")
        if client is not None:
            raise LedgerError(f"{mk.where}: paired differences are of the clients' mean (no client=)")
        d = src.diff(row, vs, metric, row2, vs2)
        if stat in ("dseeds", "drange", "dabsrange"):
            if not d.values and isinstance(src, PrintedSource):  # a printed interval: seeds from the table
                d = src.computed_diff(row, vs, metric, row2, vs2)
            if not d.values:
                raise LedgerError(f"{mk.where}: no per-seed values for {stat}")
        values = [d.values[k] for k in sorted(d.values)]
        if d.mean is None and stat != "diff":
            text = "n/a"  # no pair recorded yet
        elif stat == "diff":
            text = fmt_diff(d, digits, bold="plain" not in mk.args)
        elif stat == "dmean":
            text = num(d.mean, digits, True)
        elif stat == "dabs":
            text = num(abs(d.mean), digits)
        elif stat == "ci":
            text = f"[{num(d.ci[0], digits, True)}, {num(d.ci[1], digits, True)}]" if d.ci else "–"
        elif stat == "mde":
            text = num(d.detectable, digits)
        elif stat == "dseeds":
            text = " / ".join(num(v, digits, True) for v in values)
        elif stat == "drange":
            text = f"{num(min(values), digits, True)} to {num(max(values), digits, True)}"
        elif stat == "dabsrange":
            a = sorted(abs(v) for v in values)
            text = f"{num(a[0], digits)} to {num(a[-1], digits)}"
        else:
            raise LedgerError(f"{mk.where}: unknown statistic {stat!r}")
    if not src.recorded:
        text += f"[†]({_sources_link(mk.page)})"
    return text


def _sources_link(page: Path) -> str:
    """The link from ``page`` to the list of sources on docs/claims.md."""
    import os

    docs = next((p for p in page.parents if p.name == "docs"), page.parent)
    target = os.path.relpath(docs / "claims.md", page.parent).replace(os.sep, "/")
    return (
        f"#{UNRECORDED_ANCHOR}"
        if target == "claims.md" and page.name == "claims.md"
        else f"{target}#{UNRECORDED_ANCHOR}"
    )


# --------------------------------------------------------------------------- the lint
#: numbers that state a result: a signed decimal, a decimal ± decimal, a bracketed interval, or any
#: decimal from 1.0 up with one or two places (settings below 1 and 3+ places are not matched)
_RESULT = re.compile(
    r"(?<![\w.])(?:[+\u2212]\d+\.\d+|\d+\.\d+ ± \d+\.\d+|\[[+\-\u2212]?\d+\.\d+, [+\-\u2212]?\d+\.\d+\]"
    r"|[1-9]\d{0,2}\.\d{1,2})(?![\d.]*\d)(?!e[-+]?\d)"
)
_VERSION = re.compile(r"(?:torch|flwr|timm|Python|numpy|Flower|CUDA|cu)\s*$", re.I)
_VERDICT_WORDS = re.compile(
    r"\b(?:reproduced|contradicted|underpowered|within noise|smaller than the paper)", re.I
)
_CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)


def lint(page: Path, text: str) -> list[str]:
    """Result-like numbers and verdict words outside any marker (and outside code)."""
    if page.name in FULL_LINT:
        regions = [(0, text)]
    else:
        regions = [(m.start(1), m.group(1)) for m in LINT_REGION.finditer(text)]
    errors = []
    for offset, region in regions:
        blanked = MARKER.sub(lambda m: " " * len(m.group(0)), region)
        blanked = _CODE.sub(lambda m: " " * len(m.group(0)), blanked)
        blanked = re.sub(r"<!--.*?-->", lambda m: " " * len(m.group(0)), blanked, flags=re.S)
        for m in _RESULT.finditer(blanked):
            before = blanked[max(0, m.start() - 12) : m.start()]
            if _VERSION.search(before) or before.endswith("§"):  # a version, a paper's section
                continue
            line = text[: offset + m.start()].count("\n") + 1
            errors.append(f"{page.name}:{line}: {m.group(0)!r} states a number outside a ledger marker")
        for m in _VERDICT_WORDS.finditer(blanked):
            line = text[: offset + m.start()].count("\n") + 1
            errors.append(f"{page.name}:{line}: verdict word {m.group(0)!r} outside a verdict marker")
    return errors


# --------------------------------------------------------------------------- render / verify
def table_text(cat: Catalogue, mk: Marker) -> str:
    id = mk.args[1] if len(mk.args) > 1 else None
    if not id:
        raise LedgerError(f"{mk.where}: <!--L table <source id> ...-->")
    src = cat.sources.get(id)
    if src is None:
        return _printed_table_text(cat, mk)
    rows = _select_rows(src, mk.opts.get("rows"))
    if mk.opts.get("layout") == "sweep":
        from fedderm import sweep_tables as ft

        lines = ft.markdown_tables(src.table)
    else:
        lines = ledger_rows(src, metric_specs(mk.opts.get("metrics"), src), rows)
    return "\n" + f"*Records: {src.describe()}.*" + "\n\n" + "\n".join(lines) + "\n"


def printed_text(mk: Marker) -> str:
    """A number printed from runs with no record and no table to recompute it from: kept as
    written, with its commit, and the dagger that marks it unrecorded."""
    if not mk.opts.get("commit"):
        raise LedgerError(f"{mk.where}: a printed figure names the commit it was printed at (commit=)")
    link = f"[†]({_sources_link(mk.page)})"
    body = mk.body[: -len(link)] if mk.body.endswith(link) else mk.body
    if not body.strip() or "<!--" in body:
        raise LedgerError(f"{mk.where}: empty printed figure")
    return body + link


def unrecorded_line(commit: str) -> str:
    return (
        f"*Unrecorded: printed at `{commit}`; its run folders are gone and no record exists, so these "
        "numbers are checked for internal consistency only.*"
    )


def _printed_table_text(cat: Catalogue, mk: Marker) -> str:
    id = mk.args[1]
    src = cat.printed.get(id)
    if src is None or "unrecorded" not in mk.opts:
        raise LedgerError(
            f"{mk.where}: no records for {id}: mark the table unrecorded=<commit> it was printed at"
        )
    first = unrecorded_line(mk.opts["unrecorded"])
    if mk.opts.get("layout") == "sweep":  # table.md as printed, under its unrecorded line
        rest = mk.body.replace(first, "", 1) if first in mk.body else mk.body
        return "\n" + first + "\n\n" + rest.lstrip("\n")
    rows = parse_rows_order(src, mk)
    lines = ledger_rows(src, metric_specs_printed(mk, src), rows)
    return "\n" + first + "\n\n" + "\n".join(lines) + "\n"


def parse_rows_order(src: PrintedSource, mk: Marker) -> list[int]:
    rows = []
    for cells in _table_lines(mk.body)[1:]:
        labels = dict(zip(src.axes, cells[: len(src.axes)]))
        rows.append(src.rows.index(labels))
    return rows


def block_text(cat: Catalogue, mk: Marker, claims_index: dict, root: Path) -> str | None:
    """The text a marker must hold; None for markers whose text is free (paper, words)."""
    from fedderm.ledger import claims as cl

    if mk.kind == "table":
        return table_text(cat, mk)
    if mk.kind in ("figure", "verdict"):
        return figure_text(cat, mk, claims_index)
    if mk.kind == "claims":
        return cl.claims_table(claims_index, mk.opts.get("paper"))
    if mk.kind == "summary":
        return cl.summary_text(claims_index)
    if mk.kind == "printed":
        return printed_text(mk)
    if mk.kind == "multiplicity":
        return cl.multiplicity_text(claims_index)
    if mk.kind == "sources":
        return cl.sources_text(cat)
    if mk.kind == "forest":
        return cl.forest_text(claims_index)
    if mk.kind == "curves":
        return curves_text(cat, mk, root)
    return None


def curves_data(src: RecordSource) -> dict:
    from fedderm import sweep_plots

    return sweep_plots.curve_data(src.table, src.records.runs)


def curves_text(cat: Catalogue, mk: Marker, root: Path) -> str:
    """The validation curves of a recorded sweep (docs/img/curves-<id>.png, drawn by render)."""
    id = mk.args[1] if len(mk.args) > 1 else ""
    src = cat.sources.get(id)
    if src is None:
        raise LedgerError(f"{mk.where}: curves need records of {id!r}")
    import os

    image = os.path.relpath(root / "docs" / "img" / f"curves-{id}.png", mk.page.parent).replace(os.sep, "/")
    return (
        f"\n![Validation curves of {id}: each arm's mean over its seeds per round, the band from the "
        f"lowest to the highest seed]({image})\n"
    )


def write_curves(root: Path, cat: Catalogue, wanted: set[str]) -> list[str]:
    """Draw (``wanted`` ids) into docs/img/curves-<id>.png, with the plotted data beside as JSON."""
    import json

    from fedderm import sweep_plots

    for id in sorted(wanted):
        src = cat.sources[id]
        data = curves_data(src)
        (root / "docs" / "img").mkdir(parents=True, exist_ok=True)
        (root / "docs" / "img" / f"curves-{id}.json").write_text(json.dumps(data, indent=1) + "\n")
        sweep_plots.plot_curves(data, root / "docs" / "img" / f"curves-{id}.png", src.sweep.title)
    return []


def check_curves(root: Path, cat: Catalogue, wanted: set[str]) -> list[str]:
    import json

    errors = []
    for id in sorted(wanted):
        path = root / "docs" / "img" / f"curves-{id}.json"
        try:
            saved = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            saved = None
        if saved != json.loads(json.dumps(curves_data(cat.sources[id]))):
            errors.append(f"docs/img/curves-{id}.json: stale or missing: run python -m fedderm.ledger render")
    return errors


def pages(root: Path, names: Iterable[str] | None = None) -> dict[Path, str]:
    docs = root / "docs"
    paths = sorted(docs.rglob("*.md")) if names is None else [docs / n for n in names]
    return {p: p.read_text(encoding="utf-8") for p in paths}


def process(root: Path, write: bool) -> tuple[list[str], list[str]]:
    """Render (``write``) or verify every page: (errors, changes)."""
    from fedderm.ledger import claims as cl

    texts = pages(root)
    cat, errors = build_catalogue(root, texts)
    for src in cat.printed.values():
        errors += check_printed(src, f"unrecorded {src.id}")
        errors += check_gta(src, f"unrecorded {src.id}")
    try:
        index = cl.evaluate(root, cat, errors)
    except LedgerError as err:
        return errors + [str(err)], []
    changes = []
    for page, text in texts.items():
        try:
            found = markers(page, text)
        except LedgerError as err:
            errors.append(str(err))
            continue
        if not found and page.name not in FULL_LINT:
            errors += lint(page, text)
            continue
        wants: dict[int, str | None] = {}
        for k, mk in enumerate(found):
            if mk.kind == "multiplicity":
                continue
            try:
                wants[k] = block_text(cat, mk, index, root)
            except LedgerError as err:
                errors.append(str(err))
                wants[k] = None
        tables = [
            wants[k] if wants[k] is not None else mk.body for k, mk in enumerate(found) if mk.kind == "table"
        ]
        for k, mk in enumerate(found):
            if mk.kind == "multiplicity":
                wants[k] = cl.multiplicity_text(index, page_intervals(tables))
        out, last = [], 0
        for k, mk in enumerate(found):
            want = wants[k]
            out.append(text[last : mk.start])
            head = mk.head
            if mk.kind == "table" and mk.args[1] in cat.sources and "unrecorded" in mk.opts:
                head = re.sub(r"\s*unrecorded=\S+", "", head)
                changes.append(f"{mk.where}: records replace the table printed at {mk.opts['unrecorded']}")
            if want is None or want == mk.body:
                out.append(
                    f"<!--L {head}-->{mk.body}<!--/L-->" if head != mk.head else text[mk.start : mk.end]
                )
            else:
                if not write:
                    errors.append(
                        f"{mk.where}: the page says {_short(mk.body)!r}, the ledger {_short(want)!r}"
                    )
                changes.append(f"{mk.where}: {_short(mk.body)!r} -> {_short(want)!r}")
                out.append(f"<!--L {head}-->{want}<!--/L-->")
            last = mk.end
        out.append(text[last:])
        new = "".join(out)
        errors += lint(page, new)
        if write and new != text:
            page.write_text(new, encoding="utf-8")
    curves = {
        mk.args[1]
        for page, text in texts.items()
        for mk in _safe_markers(page, text)
        if mk.kind == "curves" and len(mk.args) > 1 and mk.args[1] in cat.sources
    }
    if write:
        cl.write_forest(root, index)
        write_curves(root, cat, curves)
    else:
        errors += cl.check_forest(root, index)
        errors += check_curves(root, cat, curves)
    return errors, changes


_INTERVAL = re.compile(r"(\**)[+\-−]?\d+(?:\.\d+)? \[[+\-−]?\d+(?:\.\d+)?, [+\-−]?\d+(?:\.\d+)?\]")


def page_intervals(tables: list[str]) -> tuple[int, int]:
    """How many paired intervals the tables hold, and how many exclude 0 (bold: the ledger bolds
    those, and only those)."""
    found = [m.group(1) for t in tables for m in _INTERVAL.finditer(t)]
    return len(found), sum(bool(b) for b in found)


def _safe_markers(page: Path, text: str) -> list[Marker]:
    try:
        return markers(page, page.read_text(encoding="utf-8") if page.exists() else text)
    except LedgerError:
        return []


def _short(text: str, width: int = 120) -> str:
    line = " ".join(text.split())
    return line if len(line) <= width else line[: width - 1] + "…"


def verify(root: Path) -> list[str]:
    errors, _ = process(root, write=False)
    return errors


def render(root: Path) -> tuple[list[str], list[str]]:
    return process(root, write=True)


__all__ = ["render", "verify", "lint", "markers", "stats"]
