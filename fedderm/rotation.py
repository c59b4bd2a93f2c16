"""Rotation prediction (Gidaris et al. 2018): the FedRotation baseline of paper 000 §V.

The model predicts which of four rotations (0°, 90°, 180°, 270°) was applied to an image; the
pretext model is the classifier of ``cfg.model`` with a 4-way head, so its ``backbone`` transfers
to fine-tuning unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .augment import Augment
from .train import random_flips, to_input

NUM_ROTATIONS = 4


def rotate_batch(images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every image in all four rotations: (4N, C, H, W) images and their rotation labels 0..3."""
    rotated = torch.cat([torch.rot90(images, k, dims=(-2, -1)) for k in range(NUM_ROTATIONS)])
    labels = torch.arange(NUM_ROTATIONS).repeat_interleave(len(images))
    return rotated, labels


def rotation_loss(
    model: nn.Module,
    images: torch.Tensor,
    device: torch.device,
    generator: torch.Generator | None = None,
    augment: Augment = random_flips,
) -> torch.Tensor:
    """Cross-entropy of the rotation prediction over the four rotations of each image, each image
    first ``augment``-ed (the run's pre-training policy) when a ``generator`` is given."""
    if generator is not None:
        images = augment(images, generator)
    x, y = rotate_batch(images)
    return F.cross_entropy(model(to_input(x, device)), y.to(device))
