"""Leakage audit of the feature relay (issue 20, fedclf.leakage-audit): the membership attack,
the relay bank's image ids, the switch in a FedCLF run, bad input."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import registry
from fedderm.config import ConfigError
from fedderm.leakage import membership_auc, nearest_distance
from fedderm.moco import FeatureQueue


def test_feature_queue_keeps_the_image_id_of_every_row_through_wraparound_and_restore():
    q = FeatureQueue(4, 2)
    q.enqueue(torch.arange(6.0).reshape(3, 2), ids=torch.tensor([10, 11, 12]))
    q.enqueue(torch.full((1, 2), 9.0))  # no ids: unknown (-1), e.g. remote features
    q.enqueue(torch.full((2, 2), 7.0), ids=torch.tensor([20, 21]))  # wraps around
    assert q.ordered_ids().tolist() == [12, -1, 20, 21]
    assert q.ordered()[:, 0].tolist() == [4.0, 9.0, 7.0, 7.0]
    # image_ids() follows features()' row order
    assert q.image_ids().tolist() == [20, 21, 12, -1]
    assert q.features()[:, 0].tolist() == [7.0, 7.0, 4.0, 9.0]
    restored = FeatureQueue(4, 2, q.ordered(), ids=q.ordered_ids())
    assert torch.equal(restored.ordered(), q.ordered())
    assert torch.equal(restored.ordered_ids(), q.ordered_ids())


def test_membership_auc_is_one_for_exact_features_and_chance_for_unrelated_ones():
    gen = torch.Generator().manual_seed(0)
    members = F.normalize(torch.randn(200, 32, generator=gen), dim=1)
    non_members = F.normalize(torch.randn(200, 32, generator=gen), dim=1)
    assert nearest_distance(members, members).max() == pytest.approx(0.0, abs=1e-3)
    assert membership_auc(members, non_members, members) == 1.0
    unrelated = F.normalize(torch.randn(200, 32, generator=gen), dim=1)
    assert abs(membership_auc(members, non_members, unrelated) - 0.5) < 0.1
    with pytest.raises(ValueError, match="non-members"):
        membership_auc(members, non_members[:0], members)


@pytest.mark.parametrize(
    "raw,key",
    [
        ({"fedclf.leakage-audit": True, "fedclf.feature-sharing": False}, "fedclf.leakage-audit"),
        ({"fedclf.leakage-audit": "yes"}, "fedclf.leakage-audit"),
    ],
)
def test_bad_audit_settings_name_the_key(raw, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        registry.load_config({"method": "fedclf", **raw})
