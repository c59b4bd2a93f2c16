"""wire.py: fast ArrayRecord <-> tensor conversions and the weighted mean, against Flower's own."""

import logging

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords
from flwr.supercore.task_identity import TaskIdentity

import registry
import wire
from fedderm.results import RunRecorder
from strategies.common import cast_like, consistent_replies
from strategies.fedavg import build_strategy


def _state(seed: int) -> dict[str, np.ndarray]:
    """A state dict with every kind of entry a model has (and a few it might)."""
    rng = np.random.default_rng(seed)
    return {
        "conv.weight": rng.normal(size=(8, 3, 3, 3)).astype(np.float32),
        "bn.running_mean": rng.normal(size=8).astype(np.float32),
        "bn.num_batches_tracked": np.array(int(rng.integers(1, 100)), np.int64),
        "half": rng.normal(size=(5, 7)).astype(np.float16),
        "double": rng.normal(size=3),
        "mask": rng.random(6) > 0.5,
        "count": rng.integers(0, 9, size=(2, 2)).astype(np.int32),
    }


def test_values_is_a_zero_copy_view_equal_to_flower_numpy():
    for key, value in _state(0).items():
        array = Array(value)
        view = wire.values(array)
        assert view.dtype == value.dtype and view.shape == value.shape, key
        assert np.array_equal(view, array.numpy()) and np.array_equal(view, value), key
        assert not view.flags.writeable and not view.flags.owndata  # a view of the bytes, not a copy
    fortran = np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4))
    assert np.array_equal(wire.values(Array(fortran)), fortran)  # falls back to Flower's decoder


def test_to_array_writes_flowers_bytes_and_round_trips():
    state = _state(1)
    for key, value in state.items():
        assert wire.to_array(value).data == Array(value).data, key
        assert wire.to_array(torch.from_numpy(value)).data == Array(value).data, key
    strided = np.arange(20, dtype=np.float32).reshape(4, 5)[:, ::2]
    assert np.array_equal(wire.to_array(strided).numpy(), strided)
    tensors = wire.to_state_dict(wire.to_record(state))
    assert list(tensors) == list(state)
    assert all(torch.equal(tensors[k], torch.from_numpy(v)) for k, v in state.items())
    model = torch.nn.BatchNorm1d(4)
    model.load_state_dict(wire.to_state_dict(wire.to_record(model.state_dict())))  # loads (copies)


def test_weighted_mean_is_flowers_aggregation_bit_for_bit():
    states, weights = [_state(s) for s in range(3)], [255, 260, 17]
    recs = [ArrayRecord({k: Array(v) for k, v in st.items()}) for st in states]
    contents = [
        RecordDict({"arrays": r, "metrics": MetricRecord({"num-examples": n})}) for r, n in zip(recs, weights)
    ]
    ours, flowers = wire.weighted_mean(recs, weights), aggregate_arrayrecords(contents, "num-examples")
    assert list(ours) == list(flowers)
    for key in flowers:
        assert ours[key].dtype == flowers[key].dtype and ours[key].data == flowers[key].data, key
    # ... which is the weighted mean (float tolerance, float64 reference)
    total = sum(weights)
    for key in ("conv.weight", "double", "bn.num_batches_tracked"):
        expected = sum(st[key].astype(np.float64) * n / total for st, n in zip(states, weights))
        assert np.allclose(ours[key].numpy(), expected, rtol=1e-6, atol=1e-7), key


def test_cast_like_restores_integer_and_half_dtypes():
    template = ArrayRecord({k: Array(v) for k, v in _state(0).items()})
    mean = wire.weighted_mean([template, ArrayRecord({k: Array(v) for k, v in _state(1).items()})], [1, 3])
    assert mean["bn.num_batches_tracked"].dtype == "float64" and mean["mask"].dtype == "float64"
    cast = cast_like(mean, template)
    for key, array in template.items():
        assert cast[key].dtype == array.dtype and tuple(cast[key].shape) == tuple(array.shape), key
    expected = np.rint(
        0.25 * _state(0)["bn.num_batches_tracked"] + 0.75 * _state(1)["bn.num_batches_tracked"]
    )
    assert int(cast["bn.num_batches_tracked"].numpy()) == int(expected)


def test_fedderm_fedavg_aggregates_like_flowers_fedavg(tmp_path):
    """Tracked's aggregation path gives Flower FedAvg's global model (then integer buffers cast back)
    and Flower's weighted train metrics."""
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 1
    cfg = registry.load_config({"min-clients": 1})
    strategy = build_strategy(cfg, RunRecorder(tmp_path, "fedavg", cfg.to_flat()))
    strategy.sent = ArrayRecord({k: Array(v) for k, v in _state(9).items()})
    strategy._sent_to = [11, 12, 13]

    def reply(node, seed, n):
        instr = Message(RecordDict({"config": ConfigRecord()}), dst_node_id=node, message_type="train")
        return Message(
            RecordDict(
                {
                    "arrays": ArrayRecord({k: Array(v) for k, v in _state(seed).items()}),
                    "metrics": MetricRecord(
                        {"num-examples": n, "train_loss": float(seed), "partition-id": node - 11}
                    ),
                }
            ),
            reply_to=instr,
        )

    arrays, metrics = strategy.aggregate_train(1, [reply(11, 1, 30), reply(12, 2, 50), reply(13, 3, 20)])
    plain = FedAvg(min_available_nodes=1)
    ref_arrays, ref_metrics = plain.aggregate_train(1, [reply(11, 1, 30), reply(12, 2, 50), reply(13, 3, 20)])
    ref_arrays = cast_like(ref_arrays, strategy.sent)
    for key in ref_arrays:
        assert arrays[key].dtype == strategy.sent[key].dtype
        assert np.array_equal(arrays[key].numpy(), ref_arrays[key].numpy()), key
    assert metrics["train_loss"] == pytest.approx((30 * 1 + 50 * 2 + 20 * 3) / 100)
    assert dict(metrics) == {
        k: v for k, v in ref_metrics.items() if k != "partition-id"
    }  # taken out per client


def test_inconsistent_replies_stop_fedderms_fedavg_as_they_stop_flowers(tmp_path, caplog):
    """Tracked runs Flower's own FedAvg checks (on the replies without their numbers): replies whose
    keys differ, or without the weighting metric, raise what Flower's FedAvg raises."""
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 1
    cfg = registry.load_config({"min-clients": 1})

    def reply(node, arrays, metrics):
        instr = Message(RecordDict({"config": ConfigRecord()}), dst_node_id=node, message_type="train")
        content = RecordDict({"arrays": ArrayRecord(arrays), "metrics": MetricRecord(metrics)})
        return Message(content, reply_to=instr)

    w = {"w": Array(np.ones(3, np.float32))}
    cases = [
        [
            reply(11, w, {"num-examples": 1}),
            reply(12, {"v": Array(np.ones(3, np.float32))}, {"num-examples": 1}),
        ],
        [reply(11, w, {"loss": 1.0}), reply(12, w, {"loss": 2.0})],
    ]
    for replies in cases:
        strategy = build_strategy(cfg, RunRecorder(tmp_path, "fedavg", cfg.to_flat()))
        assert not consistent_replies([m.content for m in replies], "num-examples")
        with pytest.raises(Exception) as theirs:
            FedAvg(min_available_nodes=1).aggregate_train(1, replies)
        with pytest.raises(type(theirs.value)) as ours:
            strategy._aggregate(1, replies)
        assert str(ours.value) == str(theirs.value)
    # consistent replies: the same log lines as Flower's FedAvg, and the same metrics
    good = [reply(11, w, {"num-examples": 1, "loss": 1.0}), reply(12, w, {"num-examples": 3, "loss": 2.0})]
    assert consistent_replies([m.content for m in good], "num-examples")
    strategy = build_strategy(cfg, RunRecorder(tmp_path, "fedavg", cfg.to_flat()))
    lines = []
    for aggregate in (FedAvg(min_available_nodes=1).aggregate_train, strategy._aggregate):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="flwr"):
            _, metrics = aggregate(1, good)
        lines.append(([r.getMessage() for r in caplog.records], dict(metrics)))
    assert lines[0] == lines[1] and lines[0][0] == ["aggregate_train: Received 2 results and 0 failures"]


def test_replies_are_summed_in_partition_order_whatever_their_arrival(tmp_path):
    """Node ids are drawn at random per run and replies arrive in any order; float addition is not
    associative, so with 3+ clients the sum must follow the partition ids for same seed, same numbers."""
    import itertools

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 1
    cfg = registry.load_config({"min-clients": 1})
    recorder = RunRecorder(tmp_path, "fedavg", cfg.to_flat())
    recorder.node_partitions = {907: 0, 15: 1, 442: 2}
    strategy = build_strategy(cfg, recorder)
    values = {907: 1e16, 15: 1.0, 442: -1e16}  # (a + b) + c = 0 but (a + c) + b = 1

    def reply(node):
        instr = Message(RecordDict({"config": ConfigRecord()}), dst_node_id=node, message_type="train")
        return Message(
            RecordDict(
                {
                    "arrays": ArrayRecord({"w": Array(np.array([values[node]], np.float32))}),
                    "metrics": MetricRecord(
                        {"num-examples": 10, "partition-id": recorder.node_partitions[node]}
                    ),
                }
            ),
            reply_to=instr,
        )

    def aggregate(replies):
        strategy.sent = ArrayRecord({"w": Array(np.zeros(1, np.float32))})
        strategy._sent_to = [907, 15, 442]
        return float(strategy.aggregate_train(1, replies)[0]["w"].numpy()[0])

    arrivals = list(itertools.permutations([907, 15, 442]))
    assert [m.metadata.src_node_id for m in strategy.in_order([reply(n) for n in (442, 907, 15)])] == [
        907,
        15,
        442,
    ]
    assert len({aggregate([reply(n) for n in order]) for order in arrivals}) > 1  # arrival order matters ...
    assert {aggregate(strategy.in_order([reply(n) for n in order])) for order in arrivals} == {
        0.0
    }  # ... not here


def _pack_sample() -> RecordDict:
    state = {f"l{i}.weight": torch.randn(8, 4) for i in range(10)}
    state["bn.num_batches_tracked"] = torch.tensor(3)
    return RecordDict(
        {
            "arrays": wire.to_record(state),
            "config": ConfigRecord({"lr": 0.1, "name": "x", "flags": [True, False], "raw": b"\x00\x01"}),
            "extra": wire.to_record({"x": np.arange(5, dtype=np.int64)}),
            "empty": ArrayRecord(),
            "metrics": MetricRecord({"loss": 0.5, "n": 3}),
        }
    )


def _assert_same_content(back: RecordDict, content: RecordDict) -> None:
    assert list(back) == list(content)
    assert list(back.array_records) == list(content.array_records)
    assert list(back.config_records) == list(content.config_records)
    assert list(back.metric_records) == list(content.metric_records)
    for name in content.array_records:
        assert list(back[name]) == list(content[name])
        for key, array in content[name].items():
            got = back[name][key]
            assert (got.dtype, tuple(got.shape), got.stype) == (array.dtype, tuple(array.shape), array.stype)
            assert bytes(got.data) == bytes(array.data)
    for name in [*content.config_records, *content.metric_records]:
        assert dict(back[name]) == dict(content[name])
        assert [type(v) for v in back[name].values()] == [type(v) for v in content[name].values()]


def test_pack_content_is_lossless_and_moves_three_objects_per_message():
    """A deployed message travels as one ConfigRecord: unpacked, every record, key, dtype, shape,
    byte and config/metric value is what was packed, in the same order; Flower moves the Message,
    its RecordDict and that record (3 objects) instead of one per record, Array and chunk."""
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    content = _pack_sample()
    packed = wire.pack_content(content)
    assert list(packed) == [wire.PACKED] and wire.is_packed(packed)
    assert len(get_all_nested_objects(packed)) == 2  # + the Message: 3 per message
    assert len(get_all_nested_objects(content)) == 30
    assert wire.pack_content(packed) is packed  # packing twice changes nothing
    _assert_same_content(wire.unpack_content(packed), content)
    assert wire.unpack_content(content) is content  # not packed: left alone
    metrics_only = RecordDict({"metrics": MetricRecord({"loss": 0.5})})
    assert wire.pack_content(metrics_only) is metrics_only  # one record, no arrays: already minimal


def test_pack_content_over_one_chunk_moves_the_arrays_as_one_chunked_array(monkeypatch):
    """Above Flower's chunk size the joined bytes travel as one Array, which Flower chunks."""
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    content = _pack_sample()
    size = sum(len(a.data) for name in content.array_records for a in content[name].values())
    monkeypatch.setattr(wire, "_chunk_size", lambda: size - 1)
    packed = wire.pack_content(content)
    assert list(packed) == [wire.PACKED_ARRAY, wire.PACKED] and "blob" not in packed[wire.PACKED]
    assert len(get_all_nested_objects(packed)) == 5  # RecordDict, 2 records, the Array, one chunk
    _assert_same_content(wire.unpack_content(packed), content)


def test_client_pack_mod_unpacks_for_the_handler_and_packs_the_reply():
    from clients.transport import pack_mod

    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
    record = wire.to_record({"w": torch.arange(6, dtype=torch.float32)})
    incoming = Message(wire.pack_content(RecordDict({"arrays": record})), dst_node_id=2, message_type="train")
    incoming.metadata.__dict__["_message_id"] = incoming.object_id
    seen = {}

    def handler(msg, context):
        seen["keys"] = list(msg.content)
        return Message(RecordDict({"arrays": msg.content["arrays"]}), reply_to=msg)

    reply = pack_mod(incoming, None, handler)
    assert seen["keys"] == ["arrays"] and list(reply.content) == [wire.PACKED]
    assert bytes(wire.unpack_content(reply.content)["arrays"]["w"].data) == bytes(record["w"].data)


def test_ray_moves_arrays_out_of_band_with_the_same_fields_and_bytes():
    """wire.ray_out_of_band: through Ray's pickler an Array's bytes leave the pickle stream (a
    pickle-5 out-of-band buffer Ray writes to its store in one copy) and come back identical."""
    pytest.importorskip("ray")
    import pickle

    from ray import cloudpickle

    state = _state(3)
    big = np.arange(250_000, dtype=np.float32)  # 1 MB
    content = RecordDict(
        {"arrays": wire.to_record({**state, "big": big}), "config": ConfigRecord({"server-round": 2})}
    )

    def through_ray():
        buffers = []
        stream = cloudpickle.dumps(content, protocol=5, buffer_callback=buffers.append)
        return stream, buffers, pickle.loads(stream, buffers=buffers)

    saved = cloudpickle.CloudPickler.dispatch.pop(Array, None)  # a simulation earlier in this process
    try:
        in_band, no_buffers, _ = through_ray()
        assert len(in_band) > big.nbytes and not no_buffers  # Ray's default: the bytes in the stream
        assert wire.ray_out_of_band(only_in_ray=True) is False  # no Ray worker here: nothing registered
        assert Array not in cloudpickle.CloudPickler.dispatch
        assert wire.ray_out_of_band() is True
        stream, buffers, back = through_ray()
    finally:  # leave Ray's pickler as this test found it
        if saved is None:
            cloudpickle.CloudPickler.dispatch.pop(Array, None)
        else:
            cloudpickle.CloudPickler.dispatch[Array] = saved
    total = sum(a.data.__len__() for a in content["arrays"].values())
    assert len(stream) < 10_000 and sum(memoryview(b).nbytes for b in buffers) == total
    assert list(back["arrays"].keys()) == list(content["arrays"].keys())
    for key, array in content["arrays"].items():
        got = back["arrays"][key]
        assert (got.dtype, got.shape, got.stype) == (array.dtype, array.shape, array.stype), key
        assert isinstance(got.data, bytes) and got.data == array.data, key
        assert np.array_equal(wire.values(got), wire.values(array)), key
    assert back["config"]["server-round"] == 2


def test_the_server_app_registers_the_out_of_band_serializer_where_ray_runs(monkeypatch, tmp_path):
    """A `flwr run` simulation's ServerApp runs in Ray's driver process (it sends the messages to the
    ClientApp actors): after the handshake it registers wire.ray_out_of_band, as sim.py does; in a
    process without Ray (a deployment's ServerApp) nothing is registered."""
    ray = pytest.importorskip("ray")
    from ray import cloudpickle

    from bench.loop_grid import TINY_RUN, run_app

    saved = cloudpickle.CloudPickler.dispatch.pop(Array, None)  # a simulation earlier in this process
    try:
        overrides = {**TINY_RUN, "num-server-rounds": 1, "output-dir": str(tmp_path / "a")}
        run_app(overrides)
        assert Array not in cloudpickle.CloudPickler.dispatch  # Ray not initialised here
        monkeypatch.setattr(ray, "is_initialized", lambda: True)
        run_app({**overrides, "output-dir": str(tmp_path / "b")})
        assert cloudpickle.CloudPickler.dispatch.get(Array) is not None
    finally:
        if saved is None:
            cloudpickle.CloudPickler.dispatch.pop(Array, None)
        else:
            cloudpickle.CloudPickler.dispatch[Array] = saved
