"""The claims ledger (fedderm/ledger): records and their importer, the power arithmetic, the
four-way verdict, and the verifier that holds the docs to the records."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

import sim
from fedderm import sweep_plots
from fedderm import sweep_tables as ft
from fedderm.ledger import LedgerError, claims, docs, records, stats
from fedderm.ledger.__main__ import main as ledger_main
from fedderm.ledger.sources import PrintedSource, rounding_bound

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- power and verdicts
def t_df2(p: float) -> float:
    """Student's t quantile with 2 degrees of freedom, in closed form: F(t) = ½ + t / (2·√(2 + t²))."""
    q = 2 * p - 1
    return q * math.sqrt(2 / (1 - q * q))


def test_detectable_effect_and_half_width_by_hand_for_three_seeds():
    sd, n = 2.0, 3
    assert t_df2(0.975) == pytest.approx(4.302653, abs=1e-6) and t_df2(0.80) == pytest.approx(
        1.060660, abs=1e-6
    )
    assert stats.half_width(sd, n) == pytest.approx(t_df2(0.975) * sd / math.sqrt(3), rel=1e-9)
    hand = (t_df2(0.975) + t_df2(0.80)) * sd / math.sqrt(3)  # 6.1930...
    assert stats.detectable_effect(sd, n) == pytest.approx(hand, rel=1e-9)
    assert hand == pytest.approx(6.19302, abs=1e-4)
    assert stats.detectable_effect(None, 1) is None and stats.detectable_effect(1.0, 1) is None


def test_a_printed_intervals_detectable_effect_is_its_half_width_scaled():
    """Without an SD the ledger derives it from the interval: the same number as from the SD."""
    from fedderm.ledger.sources import Diff

    sd, n = 3.0, 3
    half = stats.half_width(sd, n)
    d = Diff(1.0, None, n, (1.0 - half, 1.0 + half))
    assert d.detectable == pytest.approx(stats.detectable_effect(sd, n), rel=1e-9)


@pytest.mark.parametrize(
    ("ci", "effect", "direction", "want"),
    [
        ((0.5, 4.0), 2.0, None, stats.REPRODUCED),
        ((0.5, 4.0), -2.0, None, stats.CONTRADICTED),
        ((-4.0, -0.5), -2.0, None, stats.REPRODUCED),
        ((-4.0, -0.5), 2.0, None, stats.CONTRADICTED),
        ((0.0, 4.0), 2.0, None, stats.UNDERPOWERED),  # an end at 0 contains 0
        ((-4.0, 0.0), 2.0, None, stats.SMALLER),
        ((-1.0, 1.0), 3.0, None, stats.SMALLER),
        ((-1.0, 3.0), 3.0, None, stats.UNDERPOWERED),  # an end at the paper's effect contains it
        ((-10.0, 10.0), -3.0, None, stats.UNDERPOWERED),
        ((-1.0, 1.0), None, 1, stats.NOT_TESTED),  # a figure without numbers: direction only
        ((0.2, 1.0), None, -1, stats.CONTRADICTED),
        (None, 3.0, None, stats.NOT_TESTED),  # one seed: no interval
    ],
)
def test_four_way_verdict_edges(ci, effect, direction, want):
    assert stats.verdict(ci, effect, direction) == want


def test_verdict_rejects_a_directionless_paper_effect_and_a_reversed_interval():
    with pytest.raises(ValueError):
        stats.verdict((-1.0, 1.0), 0.0)
    with pytest.raises(ValueError):
        stats.verdict((1.0, -1.0), 2.0)
    with pytest.raises(ValueError):
        stats.verdict((-1.0, 1.0), None)


def test_combined_verdict_needs_every_comparison():
    r, c, s, u, n = stats.REPRODUCED, stats.CONTRADICTED, stats.SMALLER, stats.UNDERPOWERED, stats.NOT_TESTED
    assert stats.combine([r, r]) == r
    assert stats.combine([r, c, u]) == c
    assert stats.combine([r, s, u]) == u
    assert stats.combine([r, s]) == s
    assert stats.combine([r, n, s]) == n
    assert stats.expected_false_exclusions(40) == pytest.approx(2.0)


def test_a_group_combines_by_the_rule_its_sweep_file_registered(tmp_path):
    """004-flbt-centres registers "contradicted if either is; else smaller than the paper's if either
    is; else underpowered": one comparison ruling out the paper's effect decides before one that
    cannot tell, the reverse of the default order."""
    r, c, s, u, n = stats.REPRODUCED, stats.CONTRADICTED, stats.SMALLER, stats.UNDERPOWERED, stats.NOT_TESTED
    assert stats.combine([s, u], "smaller-first") == s and stats.combine([s, u]) == u
    assert stats.combine([u, c], "smaller-first") == c and stats.combine([r, r], "smaller-first") == r
    assert stats.combine([r, u, n], "smaller-first") == u and stats.combine([r, n], "smaller-first") == n
    with pytest.raises(ValueError):
        stats.combine([s], "most-favourable")
    root = mini_root(tmp_path)
    # two comparisons of the printed 004-ssl-flbt table: SSL-FL-BT − FL-BT, −10.83 [−21.79, +0.12]
    # (smaller than +2.64) and SSL-C-FL-BT − FL-BT, −8.06 [−49.48, +33.36] (underpowered against +0.99)
    two = REGISTRY + (
        '\n[[claim]]\nid = "ssl-c"\npaper = "004"\nclaim = "SSL-C-FL-BT > FL-BT"\ngroup = "g"\n'
        'paper_effect = 0.99\npaper_source = "004 Table V"\nsource = "004-ssl-flbt"\nrow = "SSL-C-FL-BT"\n'
    )
    title = 'title = "004: SSL-FL-BT > FL-BT"\n'
    for rule, want in (("", u), ('rule = "smaller-first"\n', s)):
        (root / "ledger" / "claims.toml").write_text(two.replace(title, title + rule))
        index = claims.evaluate(root, docs.build_catalogue(root, docs.pages(root))[0])
        assert [index.results[k].verdict for k in ("ssl", "ssl-c")] == [s, u]
        assert index.groups["g"].verdict == want, rule
    (root / "ledger" / "claims.toml").write_text(two.replace(title, title + 'rule = "best-of"\n'))
    with pytest.raises(LedgerError, match="rule 'best-of'"):
        claims.load_registry(root)


def test_rounding_bound_covers_the_worst_case_of_rounded_seeds():
    """Per-seed values rounded to 2 digits: the mean, SD and interval from them stay within the bound
    of those from the exact values, on an adversarial case."""
    exact = [10.004999, 20.005001, 35.004999]
    rounded = [round(v, 2) for v in exact]
    b = rounding_bound(2, 3, 1)
    m_exact, sd_exact = ft.mean_sd(exact)
    m_round, sd_round = ft.mean_sd(rounded)
    assert abs(round(m_exact, 2) - m_round) <= b["mean"] and abs(round(sd_exact, 2) - sd_round) <= b["sd"]


# --------------------------------------------------------------------------- a ledger in a tmp root
PRINTED = """# page

<!--L table 004-ssl-flbt unrecorded=1349072 metrics="Accuracy:seeds,diff"-->
| method | Accuracy | seeds 0 / 1 / 2 | Δ vs FL-BT | detectable Δ (80 % power) |
|---|---|---|---|---|
| FL-BT | 69.72 ± 11.38 | 75.00 / 56.67 / 77.50 | reference | |
| SSL-C-FL-BT | 61.67 ± 10.41 | 50.00 / 65.00 / 70.00 | −8.06 [−49.48, +33.36] | |
| SSL-FL-BT | 58.89 ± 7.28 | 60.83 / 50.83 / 65.00 | −10.83 [−21.79, +0.12] | |
<!--/L-->

SSL-FL-BT against SSL-C-FL-BT: <!--L 004-ssl-flbt diff row=SSL-FL-BT vs=SSL-C-FL-BT--><!--/L-->.
The verdict: <!--L verdict claim=ssl--><!--/L-->.

## Sources { #unrecorded-numbers }

<!--L sources--><!--/L-->

<!--L claims--><!--/L-->
"""

REGISTRY = """
[[group]]
id = "g"
title = "004: SSL-FL-BT > FL-BT"

[[claim]]
id = "ssl"
paper = "004"
claim = "SSL-FL-BT > FL-BT"
group = "g"
paper_effect = 2.64
paper_source = "004 Table V"
source = "004-ssl-flbt"
row = "SSL-FL-BT"
"""


def mini_root(tmp_path: Path, page: str = PRINTED) -> Path:
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    (root / "ledger").mkdir()
    (root / "sweeps").symlink_to(ROOT / "sweeps")
    (root / "docs" / "claims.md").write_text(page, encoding="utf-8")
    (root / "ledger" / "claims.toml").write_text(REGISTRY, encoding="utf-8")
    return root


def test_render_fills_every_marker_and_verify_then_passes(tmp_path):
    root = mini_root(tmp_path)
    errors, changes = docs.render(root)
    assert not errors and changes
    text = (root / "docs" / "claims.md").read_text()
    assert "*Unrecorded: printed at `1349072`" in text
    # SSL-FL-BT − SSL-C-FL-BT from the printed seeds: +2.78 [...], marked unrecorded
    diffs = [60.83 - 50.00, 50.83 - 65.00, 65.00 - 70.00]
    mean, sd = ft.mean_sd(diffs)
    half = stats.half_width(sd, 3)
    want = f"{mean:+.2f} [{mean - half:+.2f}, {mean + half:+.2f}]".replace("-", "−")
    assert f"{want}[†](#unrecorded-numbers)" in text
    # the verdict: −10.83 [−21.79, +0.12] contains 0 but not the paper's +2.64, on unrecorded numbers
    assert "**smaller than the paper's** (on unrecorded numbers)" in text
    assert (root / claims.FOREST_PNG).is_file()
    assert docs.verify(root) == []


def test_verify_fails_on_an_altered_number_a_stale_figure_and_a_stronger_verdict(tmp_path):
    root = mini_root(tmp_path)
    docs.render(root)
    page = root / "docs" / "claims.md"
    good = page.read_text()

    page.write_text(good.replace("−8.06 [−49.48, +33.36]", "−8.06 [−29.48, +13.36]"))
    assert any("SSL-C-FL-BT" in e and "from its seeds" in e for e in docs.verify(root))

    page.write_text(good.replace("SSL-FL-BT against", "SSL-FL-BT (58.9 against FL-BT's 69.72) against"))
    errors = docs.verify(root)
    assert any("'58.9'" in e for e in errors) and any("'69.72'" in e for e in errors)

    page.write_text(
        good.replace(
            "The verdict: <!--L verdict claim=ssl-->**smaller",
            "The verdict: <!--L verdict claim=ssl-->**reproduced, not smaller",
        )
    )
    assert any("claim=ssl" in e and "smaller than the paper" in e for e in docs.verify(root))

    page.write_text(good + "\nSo the claim is **contradicted** here.\n")
    assert any("verdict word 'contradicted'" in e for e in docs.verify(root))

    page.write_text(good.replace("−10.83 [−21.79, +0.12]", "**−10.83 [−21.79, +0.12]**"))
    assert any("is not the ledger layout" in e or "the ledger" in e for e in docs.verify(root))

    page.write_text(good.replace("*Unrecorded: printed at `1349072`; its run", "*Its run"))
    assert docs.verify(root)  # the visible mark cannot be dropped

    page.write_text(good.replace(" unrecorded=1349072", ""))
    assert any("unrecorded" in e for e in docs.verify(root))
    page.write_text(good)
    assert docs.verify(root) == []


def test_printed_table_inconsistent_with_its_seeds_fails():
    src = PrintedSource("004-ssl-flbt", "1349072", ["method"], {"method": "FL-BT"}, [0, 1, 2])
    body = PRINTED.split("-->", 1)[1].split("<!--/L-->")[0].replace("58.89 ± 7.28", "59.89 ± 7.28")
    docs.parse_ledger_table(src, body, [docs.MetricSpec("Accuracy", True, True)], "t")
    errors = docs.check_printed(src, "t")
    assert len(errors) == 1 and "mean 59.89 printed" in errors[0]


# --------------------------------------------------------------------------- the importer on a real run
def write_sweep(path: Path) -> Path:
    path.write_text(
        "[sweep]\ntitle = 'T'\nseeds = [0, 1]\nmetrics = ['balanced_accuracy', 'accuracy']\n"
        "reference = { method = 'fedavg' }\n[sweep.axes]\nmethod = ['fedavg', 'fedprox']\n[run-config]\n"
        'model = "tiny-cnn"\nimage-size = 16\nsynthetic-per-class = 4\nnum-server-rounds = 1\n'
        "local-epochs = 1\nbatch-size = 8\n"
    )
    return path


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """One tiny sweep (2 rows × 2 seeds, 1 round) through the real in-process simulation."""
    from bench.loop_grid import simulate

    tmp = tmp_path_factory.mktemp("ledger")
    sweep_file = write_sweep(tmp / "t.toml")
    out = tmp / "out"
    saved = sim.simulate
    sim.simulate = simulate
    try:
        sim.run_sweep(str(sweep_file), out=str(out), echo=lambda *_: None)
    finally:
        sim.simulate = saved
    return sweep_file, out


def test_sweep_writes_provenance_and_the_arms_validation_curves(swept):
    sweep_file, out = swept
    prov = json.loads((out / records.PROVENANCE).read_text())
    assert prov["machine"]["cores"] and prov["versions"]["torch"] and "commit" in prov
    assert (out / sweep_plots.CURVES_PNG).stat().st_size > 1000
    table = json.loads((out / "table.json").read_text())
    runs = {
        r["name"]: json.loads((out / r["name"] / "summary.json").read_text())
        for row in table["rows"]
        for r in row["runs"]
    }
    data = sweep_plots.curve_data(table, runs)
    assert data["metric"] == "balanced_accuracy" and set(data["panels"]["T"]) == {"fedavg", "fedprox"}
    c = data["panels"]["T"]["fedprox"]
    per_seed = [
        {
            e["round"]: e["metrics"]["balanced_accuracy"]
            for e in runs[f"r01-fedprox-s{s}"]["rounds"]
            if e["split"] == "val"
        }
        for s in (0, 1)
    ]
    assert c["n"] == 2 and c["round"] == sorted(per_seed[0])
    for k, r in enumerate(c["round"]):
        vals = [p[r] for p in per_seed]
        assert c["mean"][k] == pytest.approx(sum(vals) / 2) and (c["low"][k], c["high"][k]) == (
            min(vals),
            max(vals),
        )


def test_a_one_axis_sweeps_figure_names_its_title_once():
    """A sweep with one axis has one panel named by its title: the figure heads with the title and
    leaves the panel untitled (a second copy at panel width was cut off); panels of a two-axis sweep
    keep their names."""
    arm = {"round": [0, 1], "mean": [0.1, 0.5], "low": [0.1, 0.4], "high": [0.1, 0.6], "n": 2}
    title = "004 claims, Tables II-IV on stained centres: FL-BT vs FedAvg and FedBN (per centre, GTA)"
    fig = sweep_plots.curves_figure({"metric": "accuracy", "panels": {title: {"FedAvg": arm}}}, title)
    assert [ax.get_title() for ax in fig.axes] == [""]
    assert fig.get_suptitle().replace("\n", " ").startswith(title)
    two = {"metric": "accuracy", "panels": {"digits": {"FedAvg": arm}, "synthetic centres": {"FedAvg": arm}}}
    fig = sweep_plots.curves_figure(two, title)
    assert [ax.get_title() for ax in fig.axes] == ["digits", "synthetic centres"]
    assert sweep_plots.curves_figure({"metric": "accuracy", "panels": {}}) is None


def test_importer_records_the_runs_and_their_table_to_the_digit(swept, tmp_path):
    sweep_file, out = swept
    prov = json.loads((out / records.PROVENANCE).read_text())
    with pytest.raises(LedgerError, match="provenance.json says"):
        records.import_folder(out, sweep_file, tmp_path, commit="abc1234")
    rep = records.import_folder(out, sweep_file, tmp_path)
    assert rep.complete and rep.done == 4 and rep.bytes < 40_000
    sr = records.load(tmp_path, "t")
    assert (
        sr.meta["commit"] == prov["commit"]
        and sr.meta["machine"] == prov["machine"]
        and sr.meta["sweep_file"]["text"] == sweep_file.read_text()
    )
    table = json.loads((out / "table.json").read_text())
    mine = sr.table()
    for theirs, ours in zip(table["rows"], mine["rows"]):
        for label in ("balanced_accuracy", "accuracy"):
            assert ours["metrics"][label]["values"] == theirs["metrics"][label]["values"]
        if theirs["vs_reference"]:
            assert ours["vs_reference"]["metrics"] == theirs["vs_reference"]["metrics"]
    rec = sr.runs["r01-fedprox-s1"]
    summary = json.loads((out / "r01-fedprox-s1" / "summary.json").read_text())
    assert (
        rec["seed"] == 1
        and rec["torch"]
        and rec["summary"]["final"]["accuracy"] == summary["final"]["accuracy"]
    )
    val = [e for e in summary["rounds"] if e["split"] == "val"]
    assert rec["curves"]["round"] == [e["round"] for e in val]
    assert rec["curves"]["mean"]["loss"] == [float(f"{e['metrics']['loss']:.6g}") for e in val]
    assert "confusion_matrix" not in json.dumps(rec) and "per_class" not in json.dumps(rec)
    assert rec["config"]["method"] == "fedprox" and "method" not in sr.meta["config_common"]
    # the curves drawn from the records are those drawn from the run folders (to 6 digits)
    summaries = {n: json.loads((out / n / "summary.json").read_text()) for n in sr.runs}
    ours, theirs = sweep_plots.curve_data(sr.table(), sr.runs), sweep_plots.curve_data(table, summaries)
    for arm, c in theirs["panels"]["T"].items():
        assert ours["panels"]["T"][arm]["round"] == c["round"]
        assert ours["panels"]["T"][arm]["mean"] == pytest.approx(c["mean"], rel=1e-5)
    # the ledger's own figures agree with the sweep's table.md
    md = (out / "table.md").read_text()
    src = docs.RecordSource(sr)
    d = src.diff(src.find("fedprox"), src.find("fedavg"), "balanced_accuracy")
    assert (
        ft.format_difference(
            {"n": d.n, "mean": d.mean / 100, "ci": [x / 100 for x in d.ci]},
            ft.Metric("balanced_accuracy", "b", 100),
        )
        in md
    )


def test_importer_marks_a_partial_sweep_incomplete_and_names_bad_input(swept, tmp_path):
    sweep_file, out = swept
    part = tmp_path / "part"
    shutil.copytree(out, part)
    (part / "table.json").unlink()
    (part / records.PROVENANCE).unlink()
    shutil.rmtree(part / "r01-fedprox-s1")
    with pytest.raises(LedgerError, match="--commit"):
        records.import_folder(part, sweep_file, tmp_path)
    rep = records.import_folder(part, sweep_file, tmp_path, commit="abc1234", machine="m")
    assert not rep.complete and rep.done == 3 and "INCOMPLETE" in str(rep)
    sr = records.load(tmp_path, "t")
    assert not sr.complete and sr.table()["rows"][1]["done"] == 1
    other = tmp_path / "other.toml"
    other.write_text(sweep_file.read_text().replace("num-server-rounds = 1", "num-server-rounds = 3"))
    with pytest.raises(LedgerError, match="num-server-rounds"):
        records.import_folder(part, other, tmp_path, commit="abc1234", machine="m")


def test_cli_import_then_verify_on_a_mini_root(swept, tmp_path, capsys):
    sweep_file, out = swept
    root = mini_root(tmp_path)
    assert ledger_main(["--root", str(root), "import", str(out), "--sweep-file", str(sweep_file)]) == 0
    assert "t: 4/4 runs recorded (complete" in capsys.readouterr().out
    assert ledger_main(["--root", str(root), "render"]) == 0
    assert ledger_main(["--root", str(root), "verify"]) == 0


# --------------------------------------------------------------------------- the committed ledger
def test_the_committed_docs_agree_with_the_records_and_their_own_rules():
    """What CI checks: every table, figure and verdict of docs/ as `python -m fedderm.ledger render`
    makes it from ledger/records, the printed unrecorded tables and ledger/claims.toml."""
    assert docs.verify(ROOT) == []


def test_every_claims_experiment_has_a_registered_comparison():
    from fedderm import sweep as fs

    registered = {c["source"].split(":")[0] for c in claims.load_registry(ROOT)[0]}
    for path in sorted((ROOT / "sweeps" / "claims").glob("*.toml")):
        ids = {records.sweep_id(path.stem), records.sweep_id(path.stem, gpu=True)}
        assert ids & registered, path.name
        assert fs.load_sweep(path).reference


def copy_of_the_ledger(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    root.mkdir(parents=True)
    shutil.copytree(ROOT / "docs", root / "docs")
    shutil.copytree(ROOT / "ledger", root / "ledger")
    (root / "sweeps").symlink_to(ROOT / "sweeps")
    return root


def test_an_altered_record_or_table_cell_fails_the_committed_ledger(tmp_path):
    """A record changed after the docs were rendered (or a page changed after the records) is caught."""
    name = records.available(ROOT)[0]
    root = copy_of_the_ledger(tmp_path)
    folder = root / records.RECORDS_DIR / name
    first = records.load_dir(folder).meta["recorded"][0]
    path = folder / f"{first}.json"
    rec = json.loads(path.read_text())
    metric = records.load_dir(folder).sweep.metrics[0]
    rec["summary"]["final"][metric.key] -= 0.05
    path.write_text(json.dumps(rec))
    errors = docs.verify(root)
    assert any(f"table {name}" in e and "the ledger" in e for e in errors), errors[:3]

    root = copy_of_the_ledger(tmp_path / "b")
    page = root / "docs" / "claims.md"
    text = page.read_text()
    start = text.index(f"<!--L table {name} ")
    row = text.index("| reference |", start)  # the first reference row: alter its mean
    line_start = text.rindex("\n", 0, row) + 1
    cells = text[line_start:row].split(" | ")
    altered = text[:line_start] + text[line_start:row].replace(cells[-1], "12.34 ± 5.67", 1) + text[row:]
    page.write_text(altered)
    assert any(f"table {name}" in e for e in docs.verify(root))


QUICK = """# q

<!--L table 004-table-11-quick layout=sweep unrecorded=24a6d73-->
| method | Accuracy | Precision | Recall | F1-score | best epoch | runs |
|---|---|---|---|---|---|---|
| FedAvg | 100.00 | 100.00 | 100.00 | 100.00 | 2 | 1/1 |
| FL-BT | 75.00 | 61.64 | 75.00 | 67.13 | 2 | 1/1 |
<!--/L-->

FL-BT − FedAvg: <!--L 004-table-11-quick dmean row=FL-BT vs=FedAvg--><!--/L-->, verdict <!--L verdict claim=t11--><!--/L-->.

## S { #unrecorded-numbers }
"""


def test_a_printed_table_md_keeps_its_layout_and_one_seed_tests_nothing(tmp_path):
    root = mini_root(tmp_path, QUICK)
    (root / "ledger" / "claims.toml").write_text(
        '[[group]]\nid = "t11"\ntitle = "T"\n[[claim]]\nid = "c"\npaper = "004"\nclaim = "x"\ngroup = "t11"\n'
        'paper_effect = 2.21\npaper_source = "004 Table XI"\nsource = "004-table-11-quick"\nrow = "FL-BT"\nvs = "FedAvg"\n'
    )
    assert docs.render(root)[0] == []
    text = (root / "docs" / "claims.md").read_text()
    assert "consistency only.*\n\n| method |" in text  # a blank line, or Markdown swallows the table
    assert "−25.00[†](#unrecorded-numbers)" in text and "**not tested** (on unrecorded numbers)" in text
    assert docs.verify(root) == []


def test_a_registered_endpoint_never_printed_waits_for_records(tmp_path):
    root = mini_root(tmp_path)
    (root / "ledger" / "claims.toml").write_text(REGISTRY + "needs_records = true\n")
    assert docs.render(root)[0] == []
    text = (root / "docs" / "claims.md").read_text()
    assert "| **pending** | registered, never printed: waits for the records of `004-ssl-flbt` |" in text
    index = claims.evaluate(root, docs.build_catalogue(root, docs.pages(root))[0])
    assert not index.results and [c["id"] for c in index.pending] == ["ssl"]


def test_provenance_outside_a_checkout_takes_the_commit_it_is_given(tmp_path, monkeypatch):
    monkeypatch.delenv("FEDDERM_COMMIT", raising=False)
    assert records.provenance_here(tmp_path)["commit"] is None  # no .git: the importer will ask
    monkeypatch.setenv("FEDDERM_COMMIT", "abc1234")
    prov = records.provenance_here(tmp_path)
    assert prov["commit"] == "abc1234" and prov["machine"]["cores"] and prov["versions"]["python"]


def test_a_sweep_resumed_at_another_commit_keeps_the_first_and_adds_the_second(tmp_path, monkeypatch):
    from fedderm.ledger import records as rec

    monkeypatch.setattr(rec, "provenance_here", lambda repo=None: {"commit": "aaa1111", "machine": {}})
    assert sweep_plots.write_provenance(tmp_path)["commit"] == "aaa1111"
    monkeypatch.setattr(rec, "provenance_here", lambda repo=None: {"commit": "bbb2222", "machine": {}})
    sweep_plots.write_provenance(tmp_path)
    saved = json.loads((tmp_path / records.PROVENANCE).read_text())
    assert saved["commit"] == "aaa1111" and saved["also"] == ["bbb2222"]


def test_partial_records_leave_the_printed_table_until_the_re_run_is_complete(swept, tmp_path):
    """Records of a sweep still running do not replace a printed table: the page keeps the printed
    numbers (marked unrecorded) and says that a re-run is being recorded; complete records replace it."""
    sweep_file, out = swept
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    (root / "sweeps").mkdir()
    shutil.copy(sweep_file, root / "sweeps" / "t.toml")
    page = """# p

<!--L table t unrecorded=0ld0ld0 metrics="balanced_accuracy:seeds,diff"-->
| method | balanced_accuracy | seeds 0 / 1 | Δ vs fedavg | detectable Δ (80 % power) |
|---|---|---|---|---|
| fedavg | 51.00 ± 1.41 | 50.00 / 52.00 | reference | |
| fedprox | 53.00 ± 1.41 | 52.00 / 54.00 | +2.00 (n = 2) | |
<!--/L-->

## S { #unrecorded-numbers }

<!--L sources--><!--/L-->
"""
    (root / "docs" / "claims.md").write_text(page)
    part = tmp_path / "part"
    shutil.copytree(out, part)
    shutil.rmtree(part / "r01-fedprox-s1")
    (part / "table.json").unlink()
    records.import_folder(part, root / "sweeps" / "t.toml", root)
    assert docs.render(root)[0] == []
    text = (root / "docs" / "claims.md").read_text()
    assert "unrecorded=0ld0ld0" in text and "| fedprox | 53.00 ± 1.41 |" in text
    assert "its re-run is being recorded (3 of 4 runs in `ledger/records/t/`)" in text
    records.import_folder(out, root / "sweeps" / "t.toml", root)
    assert docs.render(root)[0] == []
    text = (root / "docs" / "claims.md").read_text()
    assert "unrecorded=" not in text and "*Records: recorded at" in text and "53.00 ± 1.41" not in text
    assert docs.verify(root) == []
