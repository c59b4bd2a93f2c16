"""The shared self-supervised plan: pre-train -> fine-tune (federated | local) -> test."""

import json

import pytest
import torch

import registry
import sim
from fedderm.models import create_model
from fedderm.rotation import rotate_batch
from strategies.finetune import backbone_prefix_state, classifier_from_pretrained

SMALL = {
    "model": "tiny-cnn",
    "image-size": 32,
    "synthetic-per-class": 30,
    "num-server-rounds": 2,
    "finetune-rounds": 2,
    "finetune-epochs": 1,
    "local-epochs": 1,
    "batch-size": 16,
    "label-fraction": 0.5,
    "finetune-lr": 0.003,
}


def test_rotate_batch():
    x = torch.arange(2 * 3 * 4 * 4, dtype=torch.uint8).reshape(2, 3, 4, 4)
    rotated, labels = rotate_batch(x)
    assert rotated.shape == (8, 3, 4, 4) and labels.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert torch.equal(rotated[2], torch.rot90(x[0], 1, dims=(-2, -1)))
    assert torch.equal(rotated[5, :, 0, 0], x[1, :, -1, -1])  # 180° puts the last pixel first


def test_classifier_takes_the_pretrained_backbone_and_a_new_head():
    cfg = registry.load_config({"model": "tiny-cnn", "image-size": 32})
    pretext = create_model("tiny-cnn", 4)
    model = classifier_from_pretrained(cfg, 7, pretext.state_dict())
    for k, v in pretext.backbone.state_dict().items():
        assert torch.equal(model.backbone.state_dict()[k], v)
    assert model.head.weight.shape == (7, model.num_features)
    assert set(backbone_prefix_state(pretext.state_dict())) == set(pretext.backbone.state_dict())
    with pytest.raises(RuntimeError):  # strict: a backbone of another architecture is refused
        classifier_from_pretrained(cfg, 7, {"backbone.x": torch.zeros(1)})


@pytest.mark.parametrize("finetune", ["federated", "local"])
def test_pretrain_then_finetune_end_to_end(in_process, tmp_path, finetune):
    run_dir = sim.simulate(
        {
            **SMALL,
            "method": "fedrotation",
            "finetune": finetune,
            "output-dir": str(tmp_path),
            "cache-dir": str(tmp_path / "c"),
            "run-name": "r",
        },
        num_supernodes=2,
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    pre = [r for r in summary["rounds"] if r["split"] == "pretrain"]
    val = [r for r in summary["rounds"] if r["split"] == "val"]
    assert [r["round"] for r in pre] == [1, 2] and all(r["metrics"]["loss"] > 0 for r in pre)
    assert pre[1]["metrics"]["loss"] < 1.5 * pre[0]["metrics"]["loss"]
    assert [r["round"] for r in val] == [0, 1, 2]
    assert set(summary["final"]["per_client"]) == {"0", "1"}
    assert (run_dir / "model-pretrained.pt").exists()
    pretrained = torch.load(run_dir / "model-pretrained.pt")
    assert pretrained["head.weight"].shape[0] == 4  # the rotation head
    final = torch.load(run_dir / "model.pt")
    assert final["head.weight"].shape[0] == 5
    # local: nothing is averaged, so the server's model is still the pre-trained backbone;
    # federated: the averaged fine-tuned backbone has moved away from it
    unchanged = torch.equal(final["backbone.0.0.weight"], pretrained["backbone.0.0.weight"])
    assert unchanged == (finetune == "local")
