"""Experiment sweeps (fedderm/sweep.py, sim.py --sweep): parsing, expansion, errors, aggregation,
resume, every sweeps/*.toml, and one real end-to-end sweep."""

import json
import re
from pathlib import Path

import pytest
import tomllib

import registry
import sim
from fedderm import sweep as fs
from fedderm import sweep_tables as ft
from fedderm.config import default_config

ROOT = Path(__file__).resolve().parents[1]
VALID = sorted([*default_config(), *registry.method_options()])
TINY = {"model": "tiny-cnn", "image-size": 32, "synthetic-per-class": 20, "num-server-rounds": 1}


def parse(data, **kw):
    return fs.parse_sweep(data, "g", "g.toml", load_config=registry.load_config, valid_keys=VALID, **kw)


def spec(**sweep):
    return {
        "sweep": {
            "seeds": [0, 1],
            "metrics": ["balanced_accuracy"],
            **sweep,
            "axes": sweep.get("axes", {"method": ["fedavg", "fedprox"]}),
        },
        "run-config": dict(TINY),
    }


# --------------------------------------------------------------------------- parsing and expansion
def test_rows_are_the_product_of_the_axes_in_file_order_and_runs_add_seeds():
    g = parse(
        spec(
            axes={
                "method": ["fedavg", "fedprox"],
                "variant": [{"name": "A", "lr": 0.1}, {"name": "B", "lr": 0.2, "local-epochs": 3}],
            }
        )
    )
    rows = g.rows()
    assert [r.labels for r in rows] == [
        {"method": "fedavg", "variant": "A"},
        {"method": "fedavg", "variant": "B"},
        {"method": "fedprox", "variant": "A"},
        {"method": "fedprox", "variant": "B"},
    ]
    assert rows[3].overrides == {"method": "fedprox", "lr": 0.2, "local-epochs": 3}
    runs = g.runs()
    assert len(runs) == 8 and len({r.name for r in runs}) == 8
    assert [r.seed for r in runs[:2]] == [0, 1]
    assert runs[7].overrides == {**TINY, "method": "fedprox", "lr": 0.2, "local-epochs": 3, "seed": 1}
    assert runs[7].name == "r03-fedprox-b-s1"
    assert runs[7].describe() == "method=fedprox variant=B seed=1"


def test_quick_and_set_override_rows_and_sweep_keys():
    data = spec(
        axes={"row": [{"name": "a", "num-server-rounds": 50}, {"name": "b"}]}, **{"num-supernodes": 4}
    )
    data["quick"] = {
        "num-server-rounds": 2,
        "sweep.seeds": [5],
        "sweep.num-supernodes": 3,
        "sweep.axes.label-fraction": [0.1, 0.5],
        "sweep": {"title": "nested form"},
    }
    full, quick = parse(data), parse(data, quick=True)
    assert full.num_supernodes == 4 and [r.overrides["num-server-rounds"] for r in full.runs()][0] == 50
    assert quick.num_supernodes == 3 and quick.seeds == [5] and quick.title == "nested form"
    assert all(r.overrides["num-server-rounds"] == 2 for r in quick.runs())  # [quick] wins over a row's own
    assert quick.axes["label-fraction"] and len(quick.rows()) == 4
    with_set = parse(data, quick=True, overrides={"lr": 0.5, "sweep.seeds": [1, 2]}, seeds=[7])
    assert with_set.seeds == [7] and all(r.overrides["lr"] == 0.5 for r in with_set.runs())


def test_gpu_section_layers_after_quick_and_before_set():
    data = spec(axes={"method": ["fedavg", "fedprox"]})
    data["quick"] = {"num-server-rounds": 2, "lr": 0.3}
    data["gpu"] = {"model": "resnet18", "num-server-rounds": 30, "sweep.seeds": [0, 1, 2, 3, 4]}
    plain, gpu = parse(data), parse(data, gpu=True)
    assert plain.seeds == [0, 1] and all(r.overrides["model"] == "tiny-cnn" for r in plain.runs())
    assert gpu.gpu and gpu.seeds == [0, 1, 2, 3, 4] and len(gpu.runs()) == 10
    assert all(
        r.overrides["model"] == "resnet18" and r.overrides["num-server-rounds"] == 30 for r in gpu.runs()
    )
    both = parse(data, quick=True, gpu=True, overrides={"num-server-rounds": 4})
    assert {(r.overrides["lr"], r.overrides["num-server-rounds"]) for r in both.runs()} == {(0.3, 4)}
    del data["gpu"]
    with pytest.raises(fs.SweepError, match=r"g.toml: --gpu needs a \[gpu\] section"):
        parse(data, gpu=True)


def test_cv_folds_are_replicates():
    g = parse(spec(**{"cv-folds": 3}))
    runs = g.runs()
    assert len(runs) == 2 * 2 * 3
    assert (
        runs[1].overrides["cv-folds"] == 3
        and runs[1].overrides["cv-fold"] == 1
        and runs[1].name.endswith("-s0-f1")
    )


@pytest.mark.parametrize(
    "data, match",
    [
        ({"sweep": {}, "runconfig": {}}, r"unknown section 'runconfig'.*Did you mean 'run-config'"),
        ({"sweep": {"seed": [0]}}, r"unknown sweep key 'seed'.*Did you mean 'seeds'"),
        (
            {"sweep": {"axes": {"label-fractoin": [0.1]}}},
            r"axis 'label-fractoin' is not a run-config key. Did you mean 'label-fraction'",
        ),
        ({"sweep": {"axes": {"seed": [0, 1]}}}, r"'seed' cannot be an axis"),
        (
            {"sweep": {"axes": {"method": ["fedavg", "fedavgg"]}}},
            r"row method=fedavgg: unknown method 'fedavgg'",
        ),
        ({"sweep": {"axes": {"m": [{"name": "x", "lrr": 1.0}]}}}, r"row m=x: unknown run-config key 'lrr'"),
        ({"sweep": {"axes": {"m": [{"lr": 1.0}]}}}, r"needs a string 'name'"),
        ({"sweep": {"metrics": ["balanced_acc"]}}, r"unknown metric 'balanced_acc'.*'balanced_accuracy'"),
        ({"sweep": {"metrics": [{"key": "auc", "lable": "AUC"}]}}, r"unknown metric field 'lable'"),
        (
            {"sweep": {"table": "per-client", "metrics": ["rounds_to_target.0.55"]}},
            r"per-client.*final metrics only",
        ),
        ({"sweep": {"seeds": []}}, r"'seeds' must be a non-empty list"),
        (
            {"sweep": {"num-supernodes": 2}, "run-config": {"min-clients": 3}},
            r"min-clients=3 > num-supernodes=2",
        ),
        (
            {"sweep": {"axes": {"method": ["fedavg"]}}, "quick": {"method": "fedprox"}},
            r"\[quick\]: 'method' is set by every entry",
        ),
        ({"sweep": {}, "quick": {"sweep.axis": 1}}, r"unknown sweep key 'sweep.axis'"),
        ({"sweep": {}, "run-config": {"seed": 3}}, r"'seed' is set per run"),
    ],
)
def test_sweep_errors_name_the_key(data, match):
    with pytest.raises(fs.SweepError, match=match):
        parse(data, quick="quick" in data)


def test_load_sweep_names_the_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[sweep]\nnum-supernode = 3\n")
    with pytest.raises(fs.SweepError, match=r"bad.toml \[sweep\]: unknown sweep key 'num-supernode'"):
        fs.load_sweep(bad)
    with pytest.raises(fs.SweepError, match="not found"):
        fs.load_sweep(tmp_path / "missing.toml")


# --------------------------------------------------------------------------- aggregation
def fake_summary(bacc, auc=None, per_client=None, rtt=None, mb=()):
    final = {"balanced_accuracy": bacc, "auc": auc, "per_client": per_client or {}}
    return {
        "final": final,
        "best_round": 2,
        "rounds_to_target": rtt or {},
        "bytes_per_round": [{"round": i + 1, "bytes": b} for i, b in enumerate(mb)],
    }


def test_aggregate_mean_sd_over_seeds_missing_and_failed_runs():
    g = fs.parse_sweep(
        spec(
            metrics=[
                "balanced_accuracy",
                "auc",
                "rounds_to_target.0.55",
                {"key": "bytes_per_round.bytes", "label": "MB", "scale": 2**-20},
            ]
        ),
        "g",
    )
    s = [
        fake_summary(0.5, 0.9, rtt={"0.55": 3}, mb=[2**20, 3 * 2**20]),
        fake_summary(0.7, None, rtt={"0.55": None}, mb=[2**20]),
    ]
    results = [
        {"run": 0, "status": "done", "summary": s[0], "dir": "a"},
        {"run": 1, "status": "done", "summary": s[1], "dir": "b"},
        {"run": 2, "status": "failed", "reason": "RuntimeError: boom | pipe", "summary": None},
        {"run": 3, "status": "done", "summary": fake_summary(0.25)},
    ]
    table = ft.aggregate(g, results)
    r0, r1 = table["rows"]
    cell = r0["metrics"]["balanced_accuracy"]
    assert cell["mean"] == pytest.approx(0.6) and cell["sd"] == pytest.approx(0.1414213562)  # sample SD
    assert r0["metrics"]["auc"]["n"] == 1 and r0["metrics"]["rounds_to_target.0.55"]["values"] == [3.0]
    assert r0["metrics"]["MB"]["values"] == [
        2 * 2**20,
        2**20,
    ]  # mean over each run's rounds (bytes; scaled when shown)
    assert r1["done"] == 1 and r1["runs"][0]["status"] == "failed"
    md = ft.render_markdown(table)
    assert "| fedavg | 60.00 ± 14.14 | 90.00 (1/2) | 3.00 (1/2) | 1.50 ± 0.71 | 2/2 |" in md
    assert (
        "| fedprox | 25.00 | n/a | n/a | n/a | 1/2; failed: r01-fedprox-s0: RuntimeError: boom \\| pipe |"
        in md
    )
    json.dumps(table, allow_nan=False)


def test_rows_within_noise_of_chance_are_marked_and_the_rule_is_stated():
    """5 classes, 100 test images: chance 20 %, margin 2·sqrt(0.2·0.8/100) = 8 points;
    over 2 seeds the margin is at least 2 SD.  AUC has no 1/K chance level and is never marked."""
    g = fs.parse_sweep(spec(metrics=["balanced_accuracy", "auc"], axes={"method": ["a", "b", "c", "d"]}), "g")

    def s(bacc, n=100):
        out = fake_summary(bacc, 0.5)
        out["classes"] = {"names": ["c0", "c1", "c2", "c3", "c4"], "counts": {}}  # as summary.json
        out["final"]["num-examples"] = n
        return out

    pairs = [(0.20, 0.27), (0.29, 0.29), (0.40, 0.50), (0.28, 0.29)]  # a, b (27.99 + 1), c, d (n = 400)
    results = []
    for row, (x, y) in enumerate(pairs):
        n = 400 if row == 3 else 100
        results += [
            {"run": 2 * row, "status": "done", "summary": s(x, n)},
            {"run": 2 * row + 1, "status": "done", "summary": s(y, n)},
        ]
    table = ft.aggregate(g, results)
    a, b, c, d = (r["metrics"]["balanced_accuracy"] for r in table["rows"])
    assert a["chance"] == pytest.approx(0.2) and b["chance_margin"] == pytest.approx(0.08)
    assert d["chance_margin"] == pytest.approx(0.04)  # more test images: a narrower band
    assert a["at_chance"] and not b["at_chance"] and not c["at_chance"] and not d["at_chance"]
    assert c["chance_margin"] == pytest.approx(2 * 0.0707106781)  # 2 SD of (0.40, 0.50) > 0.08
    assert all("at_chance" not in r["metrics"]["auc"] for r in table["rows"])
    md = ft.render_markdown(table)
    assert "| a | 23.50 ± 4.95 ≈chance | 50.00 ± 0.00 | 2/2 |" in md
    assert "| b | 29.00 ± 0.00 | 50.00 ± 0.00 | 2/2 |" in md
    assert "within noise of chance (1 of 4 balanced-accuracy/recall cells)" in md and "20 %" in md
    json.dumps(table, allow_nan=False)


def test_per_client_chance_uses_each_clients_test_size():
    g = fs.parse_sweep(
        {"sweep": {"seeds": [0], "table": "per-client", "metrics": ["recall"], "axes": {"method": ["flbt"]}}},
        "g",
    )
    summary = {
        "classes": ["a", "b"],
        "final": {
            "recall": 0.6,
            "num-examples": 300,
            "per_client": {
                "0": {"recall": 0.6, "num-examples": 100},
                "1": {"recall": 0.6, "num-examples": 200},
            },
        },
    }
    table = ft.aggregate(g, [{"run": 0, "status": "done", "summary": summary}])
    row = table["rows"][0]
    # chance 50 %: margin 2·sqrt(0.25/100) = 0.10 (client 0: marked), 0.0707 (client 1), 0.0577 (all)
    assert row["per_client"]["0"]["recall"]["at_chance"]
    assert not row["per_client"]["1"]["recall"]["at_chance"] and not row["metrics"]["recall"]["at_chance"]


def test_paired_differences_from_the_reference_row_with_a_t_interval():
    """Hand-computed: fedprox − fedavg at L = 0.1 over seeds 0, 1, 2: d = 0.05, 0.10, 0.02, mean
    0.056667, SD 0.040415, t(0.975, 2) = 4.302653, half-width 4.302653 · 0.040415 / √3 = 0.100395.
    At L = 0.2 seed 1 of fedprox failed: one pair fewer (d = 0.10, 0.30: mean 0.2, SD 0.141421,
    t(0.975, 1) = 12.706205, half-width 1.270621); the reference of each row has the row's L."""
    g = fs.parse_sweep(
        spec(
            seeds=[0, 1, 2],
            reference={"method": "fedavg"},
            axes={"method": ["fedavg", "fedprox"], "label-fraction": [0.1, 0.2]},
        ),
        "g",
    )
    assert [g.reference_of(r) and g.reference_of(r).index for r in g.rows()] == [None, None, 0, 1]
    values = {0: [0.50, 0.60, 0.70], 1: [0.40, 0.40, 0.40], 2: [0.55, 0.70, 0.72], 3: [0.50, None, 0.70]}
    results = []
    for row, accs in values.items():
        for i, acc in enumerate(accs):
            run = 3 * row + i
            if acc is None:
                results.append({"run": run, "status": "failed", "reason": "x", "summary": None})
            else:
                results.append({"run": run, "status": "done", "summary": fake_summary(acc)})
    table = ft.aggregate(g, results)
    rows = table["rows"]
    assert rows[0]["vs_reference"] is None and rows[1]["vs_reference"] is None
    d = rows[2]["vs_reference"]["metrics"]["balanced_accuracy"]
    assert rows[2]["vs_reference"]["axes"] == {"method": "fedavg", "label-fraction": "0.1"}
    assert d["n"] == 3 and d["values"] == pytest.approx([0.05, 0.10, 0.02])
    assert d["mean"] == pytest.approx(0.0566667, abs=1e-6) and d["sd"] == pytest.approx(0.0404145, abs=1e-6)
    assert d["ci"] == pytest.approx([0.0566667 - 0.100395, 0.0566667 + 0.100395], abs=1e-5)
    d = rows[3]["vs_reference"]["metrics"]["balanced_accuracy"]
    assert d["n"] == 2 and d["values"] == pytest.approx([0.10, 0.30])
    assert d["ci"] == pytest.approx([0.2 - 1.270621, 0.2 + 1.270621], abs=1e-5)
    md = ft.render_markdown(table)
    assert "| fedprox | 0.1 | +5.67 [-4.37, +15.71] | 3 |" in md
    assert "| fedprox | 0.2 | +20.00 [-107.06, +147.06] | 2 |" in md
    assert "| fedavg | 0.1 | reference |  |" in md and "95 % t-interval" in md
    json.dumps(table, allow_nan=False)
    one = ft.paired_difference([(0.7, 0.5)])
    assert one["mean"] == pytest.approx(0.2) and one["ci"] is None
    assert ft.format_difference(one, g.metrics[0]) == "+20.00 (n = 1)"


@pytest.mark.parametrize(
    "reference, match",
    [({"metod": "fedavg"}, r"'reference' names axis 'metod'"), ({"method": "fedavgg"}, r"not a row label")],
)
def test_reference_errors_name_the_axis_and_label(reference, match):
    with pytest.raises(fs.SweepError, match=match):
        parse(spec(reference=reference))


def test_all_runs_failed_row_says_failed():
    g = fs.parse_sweep(spec(seeds=[0]), "g")
    table = ft.aggregate(
        g,
        [
            {"run": 0, "status": "failed", "reason": "x"},
            {"run": 1, "status": "done", "summary": fake_summary(1.0)},
        ],
    )
    md = ft.render_markdown(table)
    assert "| fedavg | failed | 0/1; failed: r00-fedavg-s0: x |" in md and "| fedprox | 100.00 | 1/1 |" in md


def test_per_client_tables_and_gta():
    g = fs.parse_sweep(
        {
            "sweep": {
                "seeds": [0, 1],
                "table": "per-client",
                "metrics": ["accuracy"],
                "axes": {"method": ["flbt"]},
            }
        },
        "g",
    )

    def s(a0, a1):
        return {
            "final": {"accuracy": (a0 + a1) / 2, "per_client": {"0": {"accuracy": a0}, "1": {"accuracy": a1}}}
        }

    table = ft.aggregate(
        g,
        [
            {"run": 0, "status": "done", "summary": s(0.8, 0.6)},
            {"run": 1, "status": "done", "summary": s(1.0, 0.6)},
        ],
    )
    assert table["clients"] == ["0", "1"]
    md = ft.render_markdown(table)
    c1, c2, gta = md.split("**C1**")[1], md.split("**C2**")[1], md.split("**GTA**")[1]
    assert "| flbt | 90.00 ± 14.14 | 2/2 |" in c1.split("**C2**")[0]
    assert "| flbt | 60.00 ± 0.00 | 2/2 |" in c2.split("**GTA**")[0]
    assert "| flbt | 75.00 ± 7.07 | 2/2 |" in gta


def test_lookup_is_greedy_on_keys_with_dots():
    summary = {"rounds_to_target": {"0.55": 4}, "config": {"num-server-rounds": 9}, "a": {"b.c": {"d": 1}}}
    assert ft.lookup(summary, "rounds_to_target.0.55") == 4
    assert ft.lookup(summary, "config.num-server-rounds") == 9
    assert ft.lookup(summary, "a.b.c.d") == 1 and ft.lookup(summary, "a.x") is None


# --------------------------------------------------------------------------- runner: resume, failures
def write_sweep(path, rows=("fedavg", "fedprox"), seeds=(0,)):
    path.write_text(
        f"[sweep]\ntitle = 'T'\nseeds = {list(seeds)}\nmetrics = ['balanced_accuracy']\n"
        f"[sweep.axes]\nmethod = {json.dumps(list(rows))}\n[run-config]\n"
        + "".join(f"{json.dumps(k)} = {json.dumps(v)}\n" for k, v in TINY.items())
    )
    return path


def test_run_sweep_records_failures_and_resume_skips_finished_runs(tmp_path, monkeypatch):
    calls = []

    def fake_simulate(overrides, *args, **kwargs):
        calls.append(overrides["run-name"])
        if overrides["method"] == "fedprox" and len(calls) <= 2:
            raise RuntimeError("client 1 ran out of memory")
        run_dir = Path(overrides["output-dir"]) / overrides["run-name"]
        run_dir.mkdir(parents=True)
        config = sim.resolved_run_config({k: v for k, v in overrides.items() if k != "resume"})
        bacc = {"fedavg": 0.5, "fedprox": 0.75}[overrides["method"]]
        (run_dir / "summary.json").write_text(
            json.dumps({"config": config, "final": {"balanced_accuracy": bacc}})
        )
        return run_dir

    monkeypatch.setattr(sim, "simulate", fake_simulate)
    sweep_file, out, lines = write_sweep(tmp_path / "g.toml"), tmp_path / "out", []
    table_md = sim.run_sweep(str(sweep_file), out=str(out), echo=lines.append)
    assert calls == ["r00-fedavg-s0", "r01-fedprox-s0"]
    assert re.match(
        r"run 2/2: method=fedprox seed=0 \.\.\. \d+ s FAILED: RuntimeError: client 1 ran out of memory",
        lines[2],
    )
    md = table_md.read_text()
    assert (
        "| fedavg | 50.00 | 1/1 |" in md
        and "| fedprox | failed | 0/1; failed: r01-fedprox-s0: RuntimeError" in md
    )
    # the failed run's log ends with why, which bench.sweep_pool tables for a run its worker failed
    log = (out / "logs" / "r01-fedprox-s0.log").read_text().splitlines()
    assert log[-1] == "sweep: run failed: RuntimeError: client 1 ran out of memory"
    from bench.sweep_pool import _not_finished

    with pytest.raises(RuntimeError, match=r"^RuntimeError: client 1 ran out of memory$"):
        _not_finished({"output-dir": str(out), "run-name": "r01-fedprox-s0"})
    with pytest.raises(RuntimeError, match=r"^not started: bench.sweep_pool's deadline"):
        _not_finished({"output-dir": str(out), "run-name": "r09-never-s0"})
    # an incomplete folder left by a dead run (no checkpoint) is moved aside, not lost
    (out / "r01-fedprox-s0").mkdir()
    (out / "r01-fedprox-s0" / "summary.json").write_text(json.dumps({"final": None}))
    lines.clear()
    sim.run_sweep(str(sweep_file), out=str(out), echo=lines.append)
    assert calls[2:] == ["r01-fedprox-s0"]  # fedavg was not run again
    assert lines[1] == "run 1/2: method=fedavg seed=0 ... done before, skipped"
    assert (out / "r01-fedprox-s0.incomplete-1" / "summary.json").exists()
    table = json.loads((out / "table.json").read_text())
    assert [r["metrics"]["balanced_accuracy"]["mean"] for r in table["rows"]] == [0.5, 0.75]
    # a finished run with other settings is not reused silently
    with pytest.raises(
        fs.SweepError,
        match=r"r00-fedavg-s0 holds a finished run with other settings "
        r"\(num-server-rounds: 1 there, 2 now\)",
    ):
        sim.run_sweep(str(sweep_file), out=str(out), sets={"num-server-rounds": 2}, echo=lines.append)


def test_incomplete_run_with_a_checkpoint_is_resumed(tmp_path, monkeypatch):
    seen = []

    def fake_simulate(overrides, *args, **kwargs):
        seen.append(overrides.get("resume"))
        run_dir = Path(overrides["output-dir"]) / overrides["run-name"]
        (run_dir / "summary.json").write_text(json.dumps({"config": {}, "final": {"balanced_accuracy": 1.0}}))
        return run_dir

    monkeypatch.setattr(sim, "simulate", fake_simulate)
    out = tmp_path / "out"
    (out / "r00-fedavg-s0").mkdir(parents=True)
    (out / "r00-fedavg-s0" / "checkpoint-round-1.pt").write_bytes(b"")
    lines = []
    sim.run_sweep(str(write_sweep(tmp_path / "g.toml", rows=["fedavg"])), out=str(out), echo=lines.append)
    assert seen == [str(out / "r00-fedavg-s0")] and "(resumed)" in lines[1]


def test_cli_set_takes_toml_values_with_spaces_and_bad_sweeps_exit_2(tmp_path, monkeypatch, capsys):
    assert sim.parse_sets(['sweep.axes.data=[{name="Organ C", dirichlet-alpha=0.5}]', "lr=0.5 seed=1"]) == {
        "sweep.axes.data": [{"name": "Organ C", "dirichlet-alpha": 0.5}],
        "lr": 0.5,
        "seed": 1,
    }
    seen = []

    def fake_simulate(overrides, num_supernodes, *args, **kwargs):
        seen.append((overrides["run-name"], overrides["finetune-rounds"], num_supernodes))
        raise RuntimeError("stop")

    monkeypatch.setattr(sim, "simulate", fake_simulate)
    sweep_file = write_sweep(tmp_path / "g.toml", rows=["fedavg"])
    assert (
        sim.main(
            [
                "--sweep",
                str(sweep_file),
                "--out",
                str(tmp_path / "o"),
                "--seeds",
                "3",
                "--set",
                "finetune-rounds=4",
                "sweep.num-supernodes=3",
            ]
        )
        == 0
    )
    assert seen == [("r00-fedavg-s3", 4, 3)]
    assert "table: " + str(tmp_path / "o" / "table.md") in capsys.readouterr().out
    assert sim.main(["--sweep", str(sweep_file), "--set", "sweep.seed=[1]"]) == 2
    assert "unknown sweep key 'sweep.seed'" in capsys.readouterr().err


# --------------------------------------------------------------------------- sweeps/ cannot rot
CONFIGS = sorted((ROOT / "sweeps").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_config_parses_and_its_rows_load(path):
    full = fs.load_sweep(path, load_config=registry.load_config, valid_keys=VALID)
    quick = fs.load_sweep(path, quick=True, load_config=registry.load_config, valid_keys=VALID)
    assert full.title.startswith(path.stem[:3])  # the title cites the paper
    for run in quick.runs():  # --quick must stay small enough for 2 CPU cores
        cfg = registry.load_config(run.overrides)
        assert (
            cfg.model in ("tiny-cnn", "vit-micro")
            and cfg.image_size <= 32
            and cfg.dataset in ("synthetic", "digits")
        )
        assert cfg.num_server_rounds <= 20  # each quick table must stay within ~10 min on 2 cores
        assert cfg.dataset == "digits" or cfg.synthetic_per_class <= 40
    assert quick.num_supernodes <= 4 and len(quick.seeds) == 1


CLAIMS = sorted((ROOT / "sweeps" / "claims").glob("*.toml"))


@pytest.mark.parametrize("path", CLAIMS, ids=[p.stem for p in CLAIMS])
def test_every_claims_experiment_parses_with_replicates_and_a_reference(path):
    """The pre-registered experiments of docs/claims.md: every row loads, >= 3 seeds, a reference row
    for the paired differences, no [quick] section (the file's settings are the experiment), and the
    title cites the paper."""
    sweep = fs.load_sweep(path, load_config=registry.load_config, valid_keys=VALID)
    assert sweep.title.startswith(f"{path.stem[:3]} claims")
    assert len(sweep.seeds) >= 3 and sweep.reference
    refs = [sweep.reference_of(r) for r in sweep.rows()]
    assert any(refs) and all(ref is None or ref.labels.items() >= sweep.reference.items() for ref in refs)
    assert "quick" not in tomllib.loads(path.read_text())
    assert "Pre-registered" in path.read_text().splitlines()[0]


DIAGNOSTICS = sorted((ROOT / "sweeps" / "diagnostics").glob("*.toml"))


@pytest.mark.parametrize("path", DIAGNOSTICS, ids=[p.stem for p in DIAGNOSTICS])
def test_every_diagnostic_sweep_loads_and_the_ledger_reports_it(path):
    """Diagnostic sweeps trace one observation (a seed may be all it needs); the ledger reports each."""
    sweep = fs.load_sweep(path, load_config=registry.load_config, valid_keys=VALID)
    assert sweep.runs() and sweep.reference
    assert f"sweeps/diagnostics/{path.name}" in (ROOT / "docs" / "claims.md").read_text()


def test_the_claims_ledger_names_every_claims_experiment():
    ledger = (ROOT / "docs" / "claims.md").read_text()
    assert len(CLAIMS) >= 8
    for path in CLAIMS:
        assert f"sweeps/claims/{path.name}" in ledger, path.name


def test_configs_exist_for_the_paper_tables():
    names = {p.stem for p in CONFIGS}
    assert {
        "000-fedclf-table1",
        "000-fedclf-table2",
        "000-fedclf-fig6",
        "000-fedmae-table3",
        "000-fedmae-table4",
        "000-fedmae-table5",
        "003-table3",
        "003-table6",
        "003-table7",
        "003-table9",
        "002-sift-tables-1-2",
        "002-sift-fig4",
        "004-tables-2-4",
        "004-tables-5-7",
        "004-tables-8-10",
    } <= names


@pytest.mark.parametrize("name", ["003-table3", "003-table9"])
@pytest.mark.parametrize("quick", [False, True], ids=["full", "quick"])
def test_003_sweeps_pretrain_with_the_papers_adamw_beta2(name, quick):
    """003 §IV-B3: "AdamW with beta1 = 0.9, beta2 = 0.999" for Fed-MAE and Fed-BEiT alike, in every
    pre-training run of both 003 sweeps (FedMAE's own default is 000's 0.95)."""
    g = fs.load_sweep(
        ROOT / "sweeps" / f"{name}.toml", quick=quick, load_config=registry.load_config, valid_keys=VALID
    )
    cfgs = [registry.load_config(r.overrides) for r in g.runs()]
    pretrained = [c for c in cfgs if c.method == "fedbeit" or c.option("fedmae.pretrain")]
    assert {c.method for c in pretrained} == {"fedmae", "fedbeit"}
    assert [c.option("mim.adam-beta2") for c in pretrained] == [0.999] * len(pretrained)


# --------------------------------------------------------------------------- end to end
def test_sweep_end_to_end_table_equals_the_runs_summaries(in_process, tmp_path):
    """2 rows × 1 seed, tiny CNN, 1 round, through the real simulation."""
    out = tmp_path / "sweep"
    table_md = sim.run_sweep(str(write_sweep(tmp_path / "e2e.toml")), out=str(out), echo=lambda *_: None)
    table = json.loads((out / "table.json").read_text())
    md = table_md.read_text()
    for row in table["rows"]:
        (run,) = row["runs"]
        assert run["status"] == "done" and Path(run["dir"]) == out / run["name"]
        summary = json.loads((Path(run["dir"]) / "summary.json").read_text())
        assert summary["config"]["method"] == row["axes"]["method"]
        value = summary["final"]["balanced_accuracy"]
        assert row["metrics"]["balanced_accuracy"]["values"] == [value]
        assert f"| {row['axes']['method']} | {100 * value:.2f}" in md  # " ≈chance" may follow
    assert (out / "logs" / "r00-fedavg-s0.log").exists()  # (under pytest's capture Flower writes elsewhere)


def test_old_grid_names_still_work_for_one_release_and_say_so(tmp_path, monkeypatch, capsys):
    """``[grid]`` / ``grid.<key>`` / ``--grid`` are read as ``[sweep]`` / ``sweep.<key>`` / ``--sweep``
    (the previous release's names), with a deprecation warning or line."""
    new = parse(spec(axes={"method": ["fedavg", "fedprox"]}))
    old_data = spec(axes={"method": ["fedavg", "fedprox"]})
    old_data["grid"] = old_data.pop("sweep")
    old_data["quick"] = {"grid": {"seeds": [5]}}
    with pytest.warns(FutureWarning, match="'grid' is the old name of 'sweep'"):
        old = parse(old_data, quick=True, overrides={"grid.num-supernodes": 3})
    assert [r.overrides for r in old.rows()] == [r.overrides for r in new.rows()]
    assert old.seeds == [5] and old.num_supernodes == 3
    seen = []
    monkeypatch.setattr(
        sim, "simulate", lambda overrides, *a, **k: seen.append(overrides["run-name"]) or 1 / 0
    )
    sweep_file = write_sweep(tmp_path / "g.toml", rows=["fedavg"])
    assert sim.main(["--grid", str(sweep_file), "--out", str(tmp_path / "o"), "--seeds", "3"]) == 0
    assert seen == ["r00-fedavg-s3"]
    assert "--grid is deprecated" in capsys.readouterr().err
