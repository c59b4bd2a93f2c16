"""Semi-FL (Yang et al., MedIA 2021) as paper 003 §IV-C4 (Fig. 10b) adapts it to classification:
labelled cross-entropy plus a consistency loss on unlabelled images.

003: "It trains the clients with labeled data in a fully supervised manner for 400 epochs and then
jointly trains with an extra client holding all the unlabeled data for another 400 epochs ... For
the unlabeled client, we use a consistency loss function based on data augmentation, calculating
the cross-entropy loss between the outputs of the augmented data and the pseudo labels based on
the predictions of the original data."

Per local step, with a labelled batch (x, y) and an unlabelled batch u of B images:

  L = CE(f(aug(x)), y) + w · (1/B) Σ_b 1[max p_b ≥ t] · CE(f(A(u_b)), ŷ_b),
  p_b = softmax(f(u_b)) (the original image, no gradient), ŷ_b = argmax p_b,

A the strong augmentation (:class:`fedderm.augment.ContrastiveAugment`: crop, colour jitter, grey,
blur), w = ``semifl.weight``, t = ``semifl.threshold`` (003 states no threshold: 0 keeps every
pseudo label; t > 0 is FixMatch's confidence mask), the mean over all B images (FixMatch's
normalisation).  fedderm keeps the unlabelled images on their own clients (each client's
unlabelled remainder of ``label-fraction``) instead of 003's one extra client holding them all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .augment import Augment, ContrastiveAugment, random_flips
from .moco import normalise_input
from .train import to_input, train_epochs


def consistency_loss(
    model: nn.Module,
    unlabelled: torch.Tensor,
    strong: Augment,
    generator: torch.Generator,
    device: torch.device,
    threshold: float = 0.0,
) -> torch.Tensor:
    """(1/B) Σ_b 1[max p_b ≥ t] · CE(f(A(u_b)), argmax p_b), p_b = softmax(f(u_b)) without gradient
    (the pseudo label from the original image), ``unlabelled`` uint8 (B, 3, S, S)."""
    with torch.no_grad():
        probs = F.softmax(model(to_input(unlabelled, device)).float(), dim=1)
        confidence, pseudo = probs.max(dim=1)
        mask = (confidence >= threshold).float()
    x = unlabelled.to(device).float() / 255.0
    logits = model(normalise_input(strong(x, generator)))
    return (F.cross_entropy(logits, pseudo, reduction="none") * mask).mean()


def semifl_round(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    unlabelled: torch.Tensor,
    *,
    weight: float,
    threshold: float,
    use_unlabelled: bool,
    augment: Augment = random_flips,
    epochs: int,
    batch_size: int,
    lr: float,
    optimizer: str = "sgd",
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> dict[str, float]:
    """One round of local Semi-FL: epochs over the labelled images (``augment``-ed, as supervised
    training); with ``use_unlabelled`` (the joint phase) and unlabelled images, every step adds
    ``weight`` × :func:`consistency_loss` on a batch of ``batch_size`` unlabelled images drawn at
    random (seeded).  ``use_unlabelled=False`` is the supervised phase."""
    device = torch.device(device)
    strong = ContrastiveAugment(images.shape[-1])
    draw = torch.Generator().manual_seed(seed + 3)
    joint = use_unlabelled and len(unlabelled) > 0 and weight > 0

    def loss_fn(model, xb, yb, generator):
        loss = F.cross_entropy(model(to_input(augment(xb, generator), device)), yb.to(device))
        if joint:
            pick = torch.randint(len(unlabelled), (min(batch_size, len(unlabelled)),), generator=draw)
            loss = loss + weight * consistency_loss(
                model, unlabelled[pick], strong, generator, device, threshold
            )
        return loss

    return train_epochs(
        model,
        images,
        labels,
        loss_fn,
        epochs=epochs,
        batch_size=batch_size,
        lr=lr,
        optimizer=optimizer,
        momentum=momentum,
        weight_decay=weight_decay,
        seed=seed,
        device=device,
    )
