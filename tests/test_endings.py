"""A first day's commands end cleanly and quietly: ``sim.py`` leaves no process behind and keeps
Ray's and Flower's notes off its console; ``fedderm-run`` names a run-config mistake before Flower
starts anything; ``fedderm-run --stop-local`` stops only its own Flower home's local SuperLink;
under ``flwr run`` a run-config mistake is logged as one line, without a traceback."""

import logging
import os
import subprocess
import sys
import time
import uuid

import pytest
from flwr.common import log

from fedderm import console, procs
from fedderm.config import ConfigError
from fedderm.run import is_local, stop_local

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
#: an environment variable every process a test starts inherits (Ray's workers too)
TAG = "FEDDERM_TEST_TAG"


def _env(tag: str, **extra) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), TAG: tag, **extra}
    env.pop("FORCE_COLOR", None)
    return env


def _left(tag: str) -> list[str]:
    """The live processes that carry ``tag`` (children of this process among them)."""
    mine = set(procs.tagged(TAG, tag)) | {
        pid for pid in procs.descendants(os.getpid()) if procs.environ_value(pid, TAG) == tag
    }
    return [
        f"{pid}: {procs.cmdline(pid, 160)}"
        for pid in sorted(mine)
        if (st := procs.stat(pid)) and st.state != "Z"
    ]


@pytest.mark.federation
def test_sim_py_on_ray_ends_with_no_process_left_and_a_quiet_console(tmp_path):
    tag = uuid.uuid4().hex
    config = (
        'model="tiny-cnn" image-size=16 synthetic-per-class=8 num-server-rounds=1 local-epochs=1 '
        f'output-dir="{tmp_path}" cache-dir="{tmp_path / "cache"}" run-name="r"'
    )
    res = subprocess.run(
        [sys.executable, str(ROOT / "sim.py"), "--run-config", config],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(tag),
        timeout=600,
    )
    left = _left(tag)  # at once: Ray's workers used to outlive sim.py by 10-30 s
    assert res.returncode == 0, res.stderr[-3000:]
    assert not left, left
    console_text = res.stdout + res.stderr
    for noise in (
        "FutureWarning",
        "Manually terminating",
        "Received 2 results",
        "Sampled 2 nodes",
        "Traceback",
    ):
        assert noise not in console_text, console_text
    assert "round 1/1 · val balanced accuracy " in console_text and " s this round" in console_text
    assert res.stdout.strip().splitlines()[-1] == f"results: {tmp_path / 'r'}"


@pytest.mark.parametrize(
    "args, named",
    [
        (["--run-config", 'num-server-rounds="three"'], "run-config key 'num-server-rounds' must be int"),
        (["--run-config", "num-server-round=3"], "Did you mean 'num-server-rounds'"),
        (["--run-config", 'dataset="npz" data-path="/no/such/derma.npz"'], "'data-path': /no/such/derma.npz does not exist"),
        (["--federation-config", "num-supernodes=1"], "federation has 1 clients (--federation-config num-supernodes)"),
    ],
    ids=["wrong-type", "misspelled-key", "missing-data", "too-few-supernodes"],
)  # fmt: skip
def test_fedderm_run_names_a_run_config_mistake_before_flower_starts(tmp_path, args, named):
    tag, home = uuid.uuid4().hex, tmp_path / "flwr-home"
    home.mkdir()  # a fresh Flower home: flwr run would start its local SuperLink
    started = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "fedderm.run", str(ROOT), *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=_env(tag, FLWR_HOME=str(home)),
        timeout=30,
    )
    took = time.monotonic() - started
    assert res.returncode == 2, res.stdout + res.stderr
    assert named in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert took < 5, f"{took:.1f} s"
    # Flower never started: no SuperLink (its folder, its process), no message of Flower's
    assert "Invalid run configuration" not in res.stdout + res.stderr and "SuperLink" not in res.stdout
    assert not (home / "local-superlink").exists()
    assert not _left(tag)


def _sleeper(home, tag, name="flower-superlink"):
    """A process whose command line reads like the local SuperLink of ``home``, with a child (as its
    SuperExec): ``python -c ... flower-superlink ... --log-file <home>/local-superlink/superlink.log``."""
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); time.sleep(120)"
    log_file = home / "local-superlink" / "superlink.log"
    return subprocess.Popen(
        [sys.executable, "-c", code, name, "--insecure", "--simulation", "--log-file", str(log_file)],
        env=_env(tag),
    )


def test_stop_local_stops_only_this_flower_homes_superlink_and_what_runs_under_it(tmp_path, capsys):
    tag = uuid.uuid4().hex
    mine, other = tmp_path / "mine", tmp_path / "other"
    ours, theirs = _sleeper(mine, tag), _sleeper(other, tag)
    try:
        deadline = time.monotonic() + 30
        while len(_left(tag)) < 4:  # both and their children
            assert time.monotonic() < deadline
            time.sleep(0.1)
        child = procs.descendants(ours.pid)
        assert stop_local(mine, grace=5) == 0
        assert (
            f"stopped the local SuperLink of {mine.resolve()} (process {ours.pid}) and 1 process(es) under it"
            in capsys.readouterr().out
        )
        assert ours.wait(timeout=10) is not None
        assert all(not (st := procs.stat(pid)) or st.state == "Z" for pid in child)
        assert theirs.poll() is None and procs.descendants(theirs.pid)  # another home's: untouched
        assert stop_local(tmp_path / "nobody") == 0
        assert "no local SuperLink of" in capsys.readouterr().out
    finally:
        procs.stop_tree([theirs.pid], 2)
        for p in (ours, theirs):
            p.wait(timeout=10)


def test_the_local_superlink_is_the_default_connection_of_flowers_config(tmp_path, monkeypatch):
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    assert is_local(None)  # no config yet: Flower writes one whose default is the local SuperLink
    (tmp_path / "config.toml").write_text(
        '[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = ":local:"\n\n'
        '[superlink.prod]\naddress = "link.hospital.org:9093"\n'
    )
    assert is_local(None) and is_local("local") and not is_local("prod")
    (tmp_path / "config.toml").write_text(
        '[superlink]\ndefault = "prod"\n\n[superlink.prod]\naddress = "h:9093"\n'
    )
    assert not is_local(None)


def test_a_run_config_mistake_that_ends_the_serverapp_is_one_line_in_flowers_log(caplog):
    console.one_line_config_errors()
    console.one_line_config_errors()  # once per process
    flower = logging.getLogger("flwr")
    assert sum(isinstance(f, console._OneLineConfigErrors) for f in flower.filters) == 1
    try:
        try:
            raise ConfigError("run-config key 'num-server-rounds' must be int (like 8), got str 'three'")
        except ConfigError as err:
            wrapped = RuntimeError("ServerApp failed")
            wrapped.__cause__ = err
        with caplog.at_level(logging.ERROR, logger="flwr"):
            log(logging.ERROR, "%s raised an exception", "Simulation", exc_info=wrapped)  # as Flower logs it
            log(logging.ERROR, "%s raised an exception", "Simulation", exc_info=ValueError("a bug"))
        mistake, bug = caplog.records[-2:]
        text = logging.Formatter().format(mistake)
        assert text == (
            "Simulation raised an exception: run-config key 'num-server-rounds' must be int (like 8), got str 'three'"
        )
        assert bug.exc_info is not None  # anything else keeps its traceback
    finally:
        for f in [f for f in flower.filters if isinstance(f, console._OneLineConfigErrors)]:
            flower.removeFilter(f)


#: lines of a real `flwr run --stream` of the default run (Flower 1.42, Ray 2.x), colour codes included
STREAM = """\
Successfully started run 4196573003981582883
\x1b[92mINFO \x1b[0m:      Starting Flower Simulation
\x1b[93mWARNING \x1b[0m:   Since flwr 1.32, default simulated SuperNodes changed from 10 to 2.
\x1b[92mINFO \x1b[0m:      Federation `@none/default` (2 simulated SuperNodes)
\x1b[92mINFO \x1b[0m:      To change federation size, use the following command:
\x1b[92mINFO \x1b[0m:      \tflwr federation simulation-config @none/default <superlink> --num-supernodes <N>
/venv/lib/python3.11/site-packages/ray/_private/worker.py:2051: FutureWarning: Tip: In future versions of Ray, Ray will no longer override accelerator visible devices env var if num_gpus=0 or num_gpus=None (default). To enable this behavior and turn off this error message, set RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0
  warnings.warn(
\x1b[92mINFO \x1b[0m:      client 0 (node 1184956832378929777): train 120 (labelled 120) · val 40 · test 40
\x1b[92mINFO \x1b[0m:      configure_train: Sampled 2 nodes (out of 2)
\x1b[92mINFO \x1b[0m:      aggregate_train: Received 2 results and 0 failures
\x1b[92mINFO \x1b[0m:      round 1/8 · val balanced accuracy 0.550 · 56.8 s this round · ~3 min left
\x1b[92mINFO \x1b[0m:      configure_evaluate: Sampled 2 nodes (out of 2)
\x1b[92mINFO \x1b[0m:      aggregate_evaluate: Received 2 results and 0 failures
\x1b[33m(ClientAppActor pid=10274)\x1b[0m WARNING :   Manually terminating ClientAppActor
Loading weights: 100%|██████████| 103/103 [00:00<00:00, 6009.45it/s]
\x1b[92mINFO \x1b[0m:      results: /root/fedderm-results/fedavg-synthetic-20261128-170239-2883
"""


def test_fedderm_runs_console_leaves_out_what_is_not_the_users_business():
    import io

    from fedderm.run import quiet

    lines = STREAM.splitlines(keepends=True)
    out = io.StringIO()
    assert list(quiet(lines, out)) == lines  # every line still reaches fedderm-run's own reading
    kept = out.getvalue()
    assert [line.split(":      ")[-1] for line in kept.splitlines()] == [
        "Successfully started run 4196573003981582883",
        "Starting Flower Simulation",
        "Federation `@none/default` (2 simulated SuperNodes)",
        "client 0 (node 1184956832378929777): train 120 (labelled 120) · val 40 · test 40",
        "round 1/8 · val balanced accuracy 0.550 · 56.8 s this round · ~3 min left",
        "results: /root/fedderm-results/fedavg-synthetic-20261128-170239-2883",
    ]
    verbose = io.StringIO()
    list(quiet(lines, verbose, verbose=True))
    assert verbose.getvalue() == STREAM
