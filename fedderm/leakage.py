"""Leakage audit of FedCLF's feature relay (run-config ``fedclf.leakage-audit``): a
membership-inference attack by an honest-but-curious hospital.

The attacker holds the relayed features it received (Q_r, Eq. 2), the current global model and
candidate images of another hospital; it scores every candidate by the L2 distance from the
candidate's feature under the global model's key encoder to its nearest relayed feature (a small
distance says "this image's feature was relayed"): the distance-to-closest-record attack of GAN-Leaks
(Chen et al., CCS 2020, full black-box).  A relayed row is the key of a random *augmented view*, so
with ``views`` > 0 the attacker also encodes that many views of the candidate, drawn with the
client's own augmentation policy (public code), and keeps the smallest distance over them: the
views of EncoderMI (Liu et al., CCS 2021), matched against the relay.  The audit's ROC-AUC (scikit-learn
``roc_auc_score``) separates members (images whose features were relayed) from non-members
(held-out images of the same hospital): 0.5 = the relay leaks nothing this attack can see,
1 = membership is plain.  Which image each relayed row came from is the victim client's own
bookkeeping (:class:`fedderm.moco.FeatureQueue` ids); it is never sent.
"""

from __future__ import annotations

import numpy as np
import torch
from sklearn.metrics import roc_auc_score

from .augment import ContrastiveAugment
from .moco import MoCo, normalise_input

__all__ = ["encode_candidates", "nearest_distance", "membership_auc", "distance_auc", "audit"]


@torch.no_grad()
def encode_candidates(
    model: MoCo,
    images: torch.Tensor,
    batch_size: int = 256,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The attacker's feature of every candidate image (uint8 N×3×S×S): the key encoder of
    ``model`` on the un-augmented image, or with ``generator`` on a random augmented view
    (:class:`ContrastiveAugment`, as the relayed keys were made); BatchNorm in training mode (batch
    statistics, as the relayed keys were computed; the model's own running statistics are left
    untouched)."""
    model = model.to(device)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    out = []
    for i in range(0, len(images), batch_size):
        x = images[i : i + batch_size].to(device).float() / 255.0
        if generator is not None:
            x = ContrastiveAugment(images.shape[-1])(x, generator)
        out.append(model.keys(normalise_input(x)).float().cpu())
    model.load_state_dict(saved)
    return torch.cat(out) if out else torch.empty(0, model.head[-1].out_features)


def nearest_distance(candidates: torch.Tensor, relayed: torch.Tensor) -> np.ndarray:
    """L2 distance from every candidate feature to its nearest relayed feature (the attack score,
    smaller = more likely a member)."""
    if len(relayed) == 0:
        raise ValueError("the leakage audit needs at least one relayed feature")
    d = torch.cdist(candidates.float(), relayed.float())
    return d.min(dim=1).values.numpy()


def membership_auc(members: torch.Tensor, non_members: torch.Tensor, relayed: torch.Tensor) -> float:
    """ROC-AUC of the nearest-relayed-feature attack: members (label 1) against non-members
    (label 0), score = −distance (scikit-learn ``roc_auc_score``)."""
    _need_both(len(members), len(non_members))
    return distance_auc(nearest_distance(members, relayed), nearest_distance(non_members, relayed))


def _need_both(members: int, non_members: int) -> None:
    if members == 0 or non_members == 0:
        raise ValueError(f"the leakage audit needs members and non-members, got {members} and {non_members}")


def distance_auc(member_distance: np.ndarray, non_member_distance: np.ndarray) -> float:
    """ROC-AUC of score = −distance, members label 1 (scikit-learn ``roc_auc_score``)."""
    scores = -np.concatenate([member_distance, non_member_distance])
    labels = np.r_[np.ones(len(member_distance)), np.zeros(len(non_member_distance))]
    return float(roc_auc_score(labels, scores))


def audit(
    model: MoCo,
    members: torch.Tensor,
    non_members: torch.Tensor,
    relayed: torch.Tensor,
    *,
    views: int = 0,
    batch_size: int = 256,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> float:
    """The attack's ROC-AUC for ``members`` and ``non_members`` (uint8 images) against the
    ``relayed`` features, score = −(smallest distance to a relayed feature over the plain image and
    ``views`` augmented views, seeded by ``seed``): both kinds are encoded together in one seeded
    random order, so that BatchNorm's batch statistics cannot tell them apart."""
    _need_both(len(members), len(non_members))
    if len(relayed) == 0:
        raise ValueError("the leakage audit needs at least one relayed feature")
    images = torch.cat([members, non_members])
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(images), generator=gen)
    distance = torch.full((len(images),), float("inf"))
    for v in range(views + 1):
        features = encode_candidates(model, images[order], batch_size, device, gen if v else None)
        distance[order] = torch.minimum(distance[order], torch.cdist(features, relayed.float()).min(1).values)
    d = distance.numpy()
    return distance_auc(d[: len(members)], d[len(members) :])
