"""``transport-dtype``: what crosses the wire, and that it is turned back on arrival."""

import json

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity

import registry
import sim
from clients.transport import transport_mod
from fedderm.config import ConfigError
from fedderm.data.synthetic import CLASSES
from fedderm.models import create_model
from fedderm.transport import decode, encode, wire_nbytes
from strategies.fastpoll import FastPollGrid


def test_codec_halves_floats_and_leaves_the_rest_alone():
    w = np.linspace(-3, 3, 10, dtype=np.float32)
    assert encode(w, "float16").dtype == np.float16
    np.testing.assert_allclose(decode(encode(w, "float16"), "float16"), w, atol=2e-3)
    assert decode(encode(w, "float16"), "float16").dtype == np.float32
    assert encode(w, "float32") is w
    steps = np.array([7], dtype=np.int64)  # BatchNorm's num_batches_tracked
    assert encode(steps, "float16") is steps and wire_nbytes(steps, "float16") == 8
    big = np.array([1.0, 7e4], dtype=np.float32)  # beyond float16's 65504: travels as float32
    assert encode(big, "float16") is big and wire_nbytes(big, "float16") == 8
    nan = np.array([np.nan, 1.0], dtype=np.float32)  # screening must still see the NaN
    assert encode(nan, "float16").dtype == np.float32
    assert wire_nbytes(w, "float16") == 20 and wire_nbytes(w, "float32") == 40


def test_bad_transport_value_names_the_key():
    with pytest.raises(ConfigError, match="transport-dtype"):
        registry.load_config({"transport-dtype": "int8"})


def _context(transport: str) -> Context:
    return Context(
        run_id=1, node_id=5, node_config={}, state=RecordDict(), run_config={"transport-dtype": transport}
    )


def test_client_mod_decodes_what_arrives_and_encodes_what_leaves():
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, SUPERLINK_NODE_ID
    weights = {"w": np.full((3, 2), 0.1, np.float32), "n": np.array(4, np.int64)}
    incoming = Message(
        RecordDict(
            {
                "arrays": ArrayRecord({k: Array(encode(v, "float16")) for k, v in weights.items()}),
                "config": ConfigRecord({"server-round": 1}),
            }
        ),
        dst_node_id=5,
        message_type="train",
    )
    seen = {}

    def handler(msg, context):
        seen.update({k: a.numpy() for k, a in msg.content["arrays"].items()})
        return Message(RecordDict({"arrays": msg.content["arrays"]}), reply_to=msg)

    out = transport_mod(incoming, _context("float16"), handler)
    assert seen["w"].dtype == np.float32 and seen["n"].dtype == np.int64  # the handler never sees float16
    np.testing.assert_allclose(seen["w"], 0.1, atol=1e-4)
    sent = {k: a.numpy() for k, a in out.content["arrays"].items()}
    assert sent["w"].dtype == np.float16 and sent["n"].dtype == np.int64


class _Inner:
    """The minimum of a Grid: keeps pushed messages, answers with their content."""

    def __init__(self):
        self.pushed = []

    def push_messages(self, messages):
        self.pushed.extend(messages)
        return [str(i) for i in range(len(messages))]

    def pull_messages(self, ids):
        return [Message(RecordDict({"arrays": m.content["arrays"]}), reply_to=m) for m in self.pushed]


def test_server_grid_encodes_outgoing_and_decodes_replies():
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, SUPERLINK_NODE_ID
    inner = _Inner()
    grid = FastPollGrid(inner, poll_interval=0.0, transport="float16")
    sent = ArrayRecord({"w": Array(np.full(4, 0.3, np.float32))})
    msg = Message(RecordDict({"arrays": sent}), dst_node_id=2, message_type="train")
    replies = grid.send_and_receive([msg], timeout=1)
    assert inner.pushed[0].content["arrays"]["w"].numpy().dtype == np.float16  # on the wire
    assert sent["w"].numpy().dtype == np.float32  # the strategy's own record is not touched
    got = replies[0].content["arrays"]["w"].numpy()
    assert got.dtype == np.float32 and np.allclose(got, 0.3, atol=1e-4)


def test_float16_run_halves_traffic_and_still_learns(in_process, tmp_path, monkeypatch):
    """A short FedAvg run with float16 transport: every float array a client sends is float16
    (audit log), bytes per round are the model's float16 size, and the model still learns."""
    audit = tmp_path / "audit"
    monkeypatch.setenv("FEDDERM_AUDIT_DIR", str(audit))
    overrides = {
        "model": "tiny-cnn",
        "image-size": 32,
        "synthetic-per-class": 40,
        "num-server-rounds": 2,
        "local-epochs": 2,
        "batch-size": 16,
        "lr": 0.05,
        "transport-dtype": "float16",
        "output-dir": str(tmp_path),
        "cache-dir": str(tmp_path / "cache"),
    }
    run_dir = sim.simulate(overrides, num_supernodes=2)
    summary = json.loads((run_dir / "summary.json").read_text())

    state = create_model("tiny-cnn", len(CLASSES), 32).state_dict()
    float_bytes = sum(v.numel() * 4 for v in state.values() if v.is_floating_point())
    flower_count = ArrayRecord(state).count_bytes()  # what float32 transport counts
    for entry in summary["bytes_per_round"]:  # 2 clients; every float array at 2 bytes a number
        assert entry["down"] == entry["up"] == 2 * (flower_count - float_bytes // 2)

    entries = [json.loads(line) for f in audit.glob("audit-*.jsonl") for line in f.read_text().splitlines()]
    trains = [e for e in entries if e["message_type"] == "train"]
    assert len(trains) == 4
    for entry in trains:
        dtypes = {k: d["dtype"] for k, d in entry["records"]["arrays"]["arrays"].items()}
        assert {dtypes[k] for k, v in state.items() if v.is_floating_point()} == {"float16"}
        assert {dtypes[k] for k, v in state.items() if not v.is_floating_point()} == {"int64"}
    val = [r["metrics"]["accuracy"] for r in summary["rounds"] if r["split"] == "val"]
    assert max(val[1:]) > val[0]  # trained from float16-rounded weights, the model beats round 0
