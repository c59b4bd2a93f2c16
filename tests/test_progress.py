"""The progress a person reads: the round line's labelled fields, the estimate of the time left for
the whole run (a fake clock), and the "n of m clients replied" line of a long wave of messages."""

import logging

import pytest
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity

from strategies import progress
from strategies.fastpoll import send_and_receive_fast, wave_label
from strategies.progress import Progress, duration, round_line


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


@pytest.mark.parametrize(
    "seconds, text",
    [(0.4, "0 s"), (8.2, "8 s"), (59.4, "59 s"), (70, "1 min 10 s"), (121, "2 min"), (598, "10 min"),
     (754, "13 min"), (3600, "1 h 00 min"), (7530, "2 h 06 min")],
)  # fmt: skip
def test_durations_read_as_a_person_says_them(seconds, text):
    assert duration(seconds) == text


def test_the_round_line_labels_every_field():
    fields = [("val balanced accuracy", "0.712"), ("train loss", "0.820")]
    assert round_line("", 3, 8, fields, 12.61, 70.0) == (
        "round 3/8 · val balanced accuracy 0.712 · train loss 0.820 · 12.6 s this round · ~1 min 10 s left"
    )
    # a stage's name leads; no estimate yet, none on the last round, no time for round 0
    assert round_line("pretrain", 1, 4, [("SSL loss", "1.2345")], 9.0, None) == (
        "pretrain round 1/4 · SSL loss 1.2345 · 9.0 s this round"
    )
    assert round_line("", 8, 8, [], 5.0, 0.0) == "round 8/8 · 5.0 s this round"
    assert round_line("", 0, 8, [("val accuracy", "0.200")], None, None) == "round 0/8 · val accuracy 0.200"
    assert progress.reached({"0.5": 2, "0.8": None}) == "0.5 in round 2 · 0.8 not reached"


def test_time_left_covers_every_stage_and_leaves_the_first_rounds_start_up_out():
    clock = Clock()
    p = Progress(clock)
    p.plan([("pretrain", 4), ("finetune", 2)])
    p.start("pretrain", 4)
    assert p.left() is None  # nothing timed yet
    clock.t = 30.0  # round 1 starts the clients: slow
    assert p.finish_round("pretrain", 1) == pytest.approx(3 * 30 + 2 * 30)
    clock.t = 40.0
    assert p.finish_round("pretrain", 2) == pytest.approx(2 * 10 + 2 * 10)  # 10 s a round from round 2 on
    clock.t = 50.0
    assert p.finish_round("pretrain", 3) == pytest.approx(1 * 10 + 2 * 10)
    clock.t = 60.0
    assert p.finish_round("pretrain", 4) == pytest.approx(2 * 10)  # fine-tuning at pre-training's pace
    p.start("finetune", 2)
    clock.t = 64.0
    assert p.finish_round("finetune", 1) == pytest.approx(4.0)  # now at its own pace
    clock.t = 68.0
    assert p.finish_round("finetune", 2) == pytest.approx(0.0)


def test_a_resumed_stage_counts_only_the_rounds_left_and_round_0_is_no_round():
    clock = Clock()
    p = Progress(clock)
    p.start("train", 8, done=5)  # resumed after round 5
    clock.t = 12.0
    assert p.finish_round("train", 6) == pytest.approx(2 * 12)
    q = Progress(clock)
    q.start("train", 3)
    assert q.finish_round("train", 0) is None  # the evaluation before training times no round
    # a stage that was never started is added when its first round ends, and timed from then
    clock.t = 20.0
    assert q.finish_round("other", 1) is None and [s.name for s in q.stages] == ["train", "other"]
    q.plan([("other", 3)])
    clock.t = 25.0
    assert q.finish_round("other", 2) == pytest.approx(5.0)


def test_the_run_progress_lives_as_long_as_its_run():
    class Run:  # stands in for the run's RunRecorder
        pass

    run = Run()
    assert progress.of(run) is progress.of(run) and progress.of(Run()) is not progress.of(run)


class _Grid:  # replies arrive when the fake clock says so
    def __init__(self, clock, arrive_at):
        self.clock, self.arrive_at, self.ids = clock, arrive_at, []

    def push_messages(self, messages):
        self.ids = [f"id{i}" for i in range(len(messages))]
        return list(self.ids)

    def pull_messages(self, ids):
        self.clock.t += 1.0  # every pull moves the fake clock on by a second
        return [_Reply(i) for i in ids if self.clock.t >= self.arrive_at[i]]


class _Meta:
    def __init__(self, reply_to):
        self.reply_to_message_id = reply_to


class _Reply:
    def __init__(self, reply_to):
        self.metadata = _Meta(reply_to)


def _train_messages(server_round, n=2, kind="train"):
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, SUPERLINK_NODE_ID
    content = RecordDict({"config": ConfigRecord({"server-round": server_round})})
    return [Message(content, dst_node_id=10 + i, message_type=kind) for i in range(n)]


def test_a_long_wave_says_after_30_s_and_then_less_often_how_many_clients_replied(caplog):
    clock = Clock()
    grid = _Grid(clock, {"id0": 20.0, "id1": 1000.0})
    with caplog.at_level(logging.INFO, logger="flwr"):
        replies = send_and_receive_fast(grid, _train_messages(3), poll_interval=0.0, clock=clock)
    assert len(replies) == 2
    lines = [r.getMessage() for r in caplog.records if "clients replied" in r.getMessage()]
    # 30 s, then 60 s, 120 s, 240 s later, then every 300 s
    assert lines == [
        f"round 3 training: 1 of 2 clients replied · {said} so far"
        for said in ("30 s", "1 min 30 s", "3 min 30 s", "7 min 30 s", "12 min")
    ]
    # a short wave says nothing; None turns the lines off
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="flwr"):
        send_and_receive_fast(
            _Grid(clock, {"id0": 0.0}), _train_messages(1, 1), poll_interval=0.0, clock=clock
        )
        send_and_receive_fast(
            _Grid(clock, {"id0": clock.t + 100}), _train_messages(1, 1), 0.0, progress_every=None, clock=clock
        )
    assert not [r for r in caplog.records if "clients replied" in r.getMessage()]


def test_a_wave_is_named_as_a_person_says_it():
    assert wave_label(_train_messages(2, 1, "train.pretrain")) == "round 2 pre-training"
    assert wave_label(_train_messages(5, 1, "evaluate")) == "round 5 evaluation"
    assert wave_label(["not a message"]) == "messages"
