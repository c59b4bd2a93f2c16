"""Communication and computation counts of paper 004 Table XII.

As in the table: "# of Comm Params" is the number of model *parameters* the centres upload per
round, summed over the centres (ResNet-50 FedAvg: 3 × 23.52 M = 70.55 M; FedBN leaves out the
BatchNorm weights and biases); "Params" is the model's parameter count; "FLOPs" are
multiply-accumulates of one forward pass of one image (the convention of the table: 5.397 G for
ResNet-50 at 256 px), counted with ``torch.utils.flop_counter`` (convolutions and matrix
products; BN and activations are not counted).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from .flbt import batchnorm_keys, build_projected_net
from .models import create_model
from .ssl_pseudo import MultiTaskSSLNet

__all__ = ["count_parameters", "macs_per_image", "cost_table"]


def count_parameters(model: nn.Module, exclude: set[str] = frozenset()) -> int:
    return sum(p.numel() for name, p in model.named_parameters() if name not in exclude)


@torch.no_grad()
def macs_per_image(model: nn.Module, image_size: int) -> int:
    """Multiply-accumulates of one forward pass of one image (FLOP counter / 2)."""
    model.eval()
    with FlopCounterMode(display=False) as counter:
        model(torch.zeros(1, 3, image_size, image_size))
    return counter.get_total_flops() // 2


def cost_table(
    model: str,
    num_classes: int,
    image_size: int,
    centres: int,
    rounds: int,
    proj_dim: int = 128,
    pseudo_per_centre: int = 0,
) -> list[dict]:
    """Rows of Table XII for ``model`` (e.g. ``resnet50``, 4 classes, 256 px, 3 centres, 300 rounds)."""
    plain = create_model(model, num_classes, image_size)
    projected = build_projected_net(model, num_classes, image_size, proj_dim)
    ssl = MultiTaskSSLNet(model, centres, image_size, "both")
    p_plain, p_proj = count_parameters(plain), count_parameters(projected)
    bn_params = {k for k in batchnorm_keys(plain) if k in dict(plain.named_parameters())}
    p_shared = count_parameters(plain, exclude=bn_params)
    m_plain, m_proj = macs_per_image(plain, image_size), macs_per_image(projected, image_size)
    m_ssl = macs_per_image(ssl, image_size)

    def row(name, comm_rounds, comm_params, params, macs, **extra):
        return {
            "method": name,
            "comm_rounds": comm_rounds,
            "comm_params_per_round": comm_params,
            "params": params,
            "macs": macs,
            **extra,
        }

    return [
        row("local", 0, 0, p_plain, m_plain),
        row("fedavg", rounds, centres * p_plain, p_plain, m_plain),
        row("fedprox", rounds, centres * p_plain, p_plain, m_plain),
        row("fedbn", rounds, centres * p_shared, p_plain, m_plain),
        row("moon", rounds, centres * p_proj, p_proj, m_proj),
        row("flbt", rounds, centres * p_proj, p_proj, m_proj),
        row(
            "ssl-flbt stage 1",
            0,
            0,
            count_parameters(ssl),
            m_ssl,
            pseudo_values_uploaded=centres * pseudo_per_centre * 3 * image_size**2,
        ),
        row("ssl-flbt stage 2", rounds, centres * p_proj, p_proj, m_proj),
    ]
