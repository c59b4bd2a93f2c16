"""``fedderm-compare``: run folders of different methods and numbers of clients side by side."""

import csv
import json
import shutil
from pathlib import Path

import pytest
import tomllib

import registry
from bench.loop_grid import TINY_RUN, run_app
from fedderm import compare as fc
from fedderm.metrics import SELECTION_METRIC

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """A FedAvg run on 3 clients and a FedMAE run (pre-training, then fine-tuning) on 2, in process."""
    out = tmp_path_factory.mktemp("runs")
    common = {"output-dir": str(out), "cache-dir": str(out / "cache"), "tensorboard": False}
    fedavg = run_app({**TINY_RUN, **common, "num-server-rounds": 2, "run-name": "fedavg-3"}, num_clients=3)
    fedmae = run_app(
        registry.smallest_run(
            "fedmae", **common, **{"num-server-rounds": 2, "finetune-rounds": 2, "run-name": "mae-2"}
        )
    )
    return fedavg, fedmae


def summary(folder: Path) -> dict:
    return json.loads((folder / "summary.json").read_text())


def test_the_tables_hold_the_runs_summary_numbers_and_the_figure_their_validation_curves(
    two_runs, tmp_path, capsys
):
    assert fc.main([str(f) for f in two_runs] + ["--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    rows = list(csv.DictReader(open(tmp_path / "compare.csv", encoding="utf-8")))
    for folder, clients in zip(two_runs, (["0", "1", "2"], ["0", "1"])):
        s = summary(folder)
        mine = [r for r in rows if r["folder"] == str(folder)]
        assert [r["client"] for r in mine] == ["mean", *clients]  # the mean first, then each client
        for r in mine:
            source = s["final"] if r["client"] == "mean" else s["final"]["per_client"][r["client"]]
            for metric in fc.METRICS:
                assert float(r[metric]) == source[metric], (folder.name, r["client"], metric)  # unrounded
            assert r["method"] == s["method"] and r["best_round"] == str(s["best_round"])
        label = f"{s['method']} · {folder.name}"
        line = next(x for x in printed.splitlines() if x.startswith(f"| {label} | {len(clients)} |"))
        cells = line.strip("|").split(" | ")
        assert cells[5] == f"{s['final'][SELECTION_METRIC]:.4f}"  # the selection metric is the first metric
        assert [c.strip() for c in cells[5:]] == [f"{s['final'][m]:.4f}" for m in fc.METRICS]
    assert fc.METRICS[0] == SELECTION_METRIC == "balanced_accuracy"
    # the per-client table: FedMAE has no client 2
    line = next(x for x in printed.splitlines() if x.startswith("| fedmae · mae-2 |") and x.count("|") == 5)
    assert line.rstrip(" |").endswith("–")

    png = tmp_path / "compare.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = fc.load_runs(two_runs)
    series = fc.plot(runs, tmp_path / "again.png")
    fedavg, fedmae = (f"{summary(f)['method']} · {f.name}" for f in two_runs)
    for folder, label in zip(two_runs, (fedavg, fedmae)):
        val = [r for r in summary(folder)["rounds"] if r["split"] == "val"]
        assert series["val"][label] == (
            [r["round"] for r in val],
            [r["metrics"][SELECTION_METRIC] for r in val],
        )
        assert series["val-loss"][label][1] == [r["metrics"]["loss"] for r in val]
    pre = [r for r in summary(two_runs[1])["rounds"] if r["split"] == "pretrain"]
    assert series["pretrain"] == {fedmae: ([1, 2], [r["metrics"]["loss"] for r in pre])}  # FedAvg has none
    assert series["val"][fedmae][0] == [0, 1, 2]  # the fine-tuning rounds, round 0 the pre-trained model


def test_rounds_come_from_rounds_csv_where_summary_json_holds_none(two_runs, tmp_path):
    """The per-round records may leave summary.json: the curves are the same from rounds.csv."""
    copy = tmp_path / "mae-2"
    shutil.copytree(two_runs[1], copy)
    s = summary(copy)
    rounds = s.pop("rounds")
    (copy / "summary.json").write_text(json.dumps(s))
    assert fc.curves(fc.load_runs([copy])) == fc.curves(fc.load_runs([two_runs[1]]))
    assert len(fc.read_rounds(copy, s)) == len(rounds)


def test_a_folder_that_is_no_run_folder_stops_with_one_line_naming_it(two_runs, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert fc.main([str(two_runs[0]), str(tmp_path / "empty"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"fedderm-compare: {tmp_path / 'empty'}: not a run folder (no summary.json or config.json) "
        "and no run folders inside it"
    )
    assert not (tmp_path / "o").exists()
    assert fc.main([str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.strip() == f"fedderm-compare: {tmp_path / 'nowhere'}: no such folder"
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "summary.json").write_text("{not json")
    assert fc.main([str(tmp_path / "bad")]) == 2
    assert f"{tmp_path / 'bad' / 'summary.json'}: not readable as JSON" in capsys.readouterr().err


@pytest.mark.parametrize(
    "status, error, says",
    [
        (
            "running",
            "",
            "still running (or ended without recording it): 2 pretrain rounds, 2 val rounds recorded",
        ),
        (
            "failed",
            "ValueError: client 1 sent NaN\nTraceback ...",
            "failed: 2 pretrain rounds, 2 val rounds recorded",
        ),
    ],
)
def test_an_incomplete_run_is_shown_as_far_as_it_got_and_named(
    two_runs, tmp_path, capsys, status, error, says
):
    """A run still going or failed: its curves and whatever final metrics it has, a line on stderr
    naming the folder and what it lacks, exit 1."""
    copy = tmp_path / "cut"
    shutil.copytree(two_runs[1], copy)
    s = summary(copy)
    s.update(status=status, error=error, final=None, best_round=None)
    s["rounds"] = [r for r in s["rounds"] if not (r["split"] == "val" and r["round"] == 2)]
    (copy / "summary.json").write_text(json.dumps(s))
    assert fc.main([str(two_runs[0]), str(copy), "--out", str(tmp_path / "o")]) == 1
    out, err = capsys.readouterr()
    assert err.strip().splitlines() == [
        f"fedderm-compare: {copy}: {says}, no final test metrics"
        + ("; error: ValueError: client 1 sent NaN" if error else "")
        + "; shown as far as it got"
    ]
    assert f"| fedmae · cut | 2 | {status} | – | – | –" in out
    runs, _, series = fc.compare([copy], tmp_path / "o2")
    assert series["val"]["fedmae · cut"][0] == [0, 1] and runs[0].problem


def test_a_sweeps_folder_stands_for_its_run_folders_and_equal_names_are_told_apart(two_runs, tmp_path):
    sweep = tmp_path / "sweep"
    for i, folder in enumerate(two_runs):
        shutil.copytree(folder, sweep / f"r0{i}-{folder.name}")
    (sweep / "table.md").write_text("# a table\n")
    assert [r.folder.name for r in fc.load_runs([sweep])] == [
        f"r00-{two_runs[0].name}",
        f"r01-{two_runs[1].name}",
    ]
    other = tmp_path / "again" / two_runs[0].name
    shutil.copytree(two_runs[0], other)
    labels = [r.label for r in fc.load_runs([two_runs[0], other])]
    assert labels == [f"fedavg · {two_runs[0].parent.name}/fedavg-3", "fedavg · again/fedavg-3"]


def test_fedderm_compare_is_a_console_script():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["fedderm-compare"] == "fedderm.compare:entry"
