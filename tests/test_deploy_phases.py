"""bench/deploy_phases.py: the per-phase medians of a deployed exchange, read off DEBUG logs."""

from __future__ import annotations

from bench import deploy_phases

NODE_LOG = """\
\x1b[92mINFO 2026-11-24 01:30:07,700\x1b[0m:      Receiving: train message (ID: aa)
DEBUG 2026-11-24 01:30:08,000:     Runtime.PushMessages
INFO 2026-11-24 01:30:08,100:      Received successfully
DEBUG 2026-11-24 01:30:08,200:     Loading ClientApp `client_app:app`
DEBUG 2026-11-24 01:30:09,000:     Runtime.PushMessages
DEBUG 2026-11-24 01:30:09,100:     Runtime.PushMessages
INFO 2026-11-24 01:30:09,200:      Sending: train message (ID: bb)
INFO 2026-11-24 01:30:10,400:      Sent successfully
INFO 2026-11-24 01:30:11,000:      Receiving: query.info message (ID: cc)
DEBUG 2026-11-24 01:30:11,100:     Loading ClientApp `client_app:app`
DEBUG 2026-11-24 01:30:11,200:     Runtime.PushMessages
INFO 2026-11-24 01:30:11,300:      Sending: query.info message (ID: dd)
INFO 2026-11-24 01:30:11,400:      Sent successfully
"""
RUN_LOG = """\
INFO 2026-11-24 01:30:07,200:      configure_train: Sampled 3 nodes (out of 3)
INFO 2026-11-24 01:30:11,700:      aggregate_train: Received 3 results and 0 failures
INFO 2026-11-24 01:30:11,800:      configure_evaluate: Sampled 3 nodes (out of 3)
INFO 2026-11-24 01:30:14,300:      aggregate_evaluate: Received 3 results and 0 failures
"""


def test_phases_are_read_off_the_timestamps(tmp_path, capsys):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "supernode-hospital-a.log").write_text(NODE_LOG)
    (logs / "run-fedavg.log").write_text(RUN_LOG)
    msgs = deploy_phases.node_messages(logs / "supernode-hospital-a.log")
    assert [m["kind"] for m in msgs] == ["train", "query.info"]
    train = msgs[0]
    assert round(train["load"] - train["recv"], 3) == 0.5
    assert round(train["pulled"] - train["recv"], 3) == 0.4
    assert round(train["push"] - train["load"], 3) == 0.8  # the first push after loading
    assert round(train["sent"] - train["send"], 3) == 1.2
    assert [round(e, 3) for e in deploy_phases.exchanges(logs / "run-fedavg.log")] == [4.5, 2.5]
    assert deploy_phases.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "1 train/evaluate messages, 1 exchanges" in out  # no evaluate message in the node's log
    table = deploy_phases.phases(tmp_path)
    assert list(table) == ["train"] and table["train"]["exchange"] == 4.5
    p = {k: round(v, 3) for k, v in table["train"]["phases"].items()}
    assert list(p.values()) == [0.5, 0.4, 0.1, 0.8, 0.2, 1.2, 1.3]  # 07.2 -> 07.7 ... 10.4 -> 11.7
    assert sum(p.values()) == 4.5
