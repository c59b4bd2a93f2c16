"""SSL-FL-BT (paper 004 §III, Fig. 1): a two-stage plan.

1. SSL stage: every centre trains an MSG-GAN on its own images and sends ``ssl.pseudo-per-centre``
   generated images (``train.gan``).  The server pre-trains the backbone on all pseudo images with
   centre classification (Eq. 1) + patch-swap restoration (Eq. 2), L = L_CE + L_MSE (Eq. 3).
2. FL stage: FL-BT (``strategies.flbt``) from the pre-trained backbone (projector and output
   layer start random).

Ablations (004 Tables V-X): ``ssl.tasks`` = ``both`` | ``centre`` (SSL-C-FL-BT) |
``restoration`` (SSL-R-FL-BT); ``ssl.finetune`` = ``flbt`` | ``fedavg`` (SSL-FL: μ = 0).
"""

from __future__ import annotations

import time
from logging import INFO

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from clients.ssl_flbt import PSEUDO
from fedderm.ssl_pseudo import SSL_TASKS, pretrain_multitask
from fedderm.train import resolve_device

from .flbt import build_strategy, check_choice, check_positive, projected_net, run_strategy

FINETUNE = ("flbt", "fedavg")


def collect_pseudo_images(grid: Grid, node_ids: list[int], timeout: float = 7200):
    """Stage 1: ask every centre for pseudo images.  Returns (images uint8 (M,3,S,S), centre index
    (M,) by partition-id order, per-centre metrics)."""
    msgs = [Message(RecordDict({"config": ConfigRecord({"server-round": 0})}), dst_node_id=n,
                    message_type="train.gan") for n in node_ids]
    replies = list(grid.send_and_receive(msgs, timeout=timeout))
    errors = [f"node {r.metadata.src_node_id}: {r.error.reason}" for r in replies if r.has_error()]
    if errors or len(replies) < len(node_ids):
        raise RuntimeError("ssl-flbt: the GAN stage failed:\n  " + "\n  ".join(errors or ["(missing replies)"]))
    by_centre = {}
    for r in replies:
        metrics = dict(r.content["metrics"])
        pid = int(metrics.pop("partition-id"))
        by_centre[pid] = (r.content[PSEUDO][PSEUDO].numpy(), metrics)
    images, centres, info = [], [], {}
    for index, pid in enumerate(sorted(by_centre)):
        pseudo, metrics = by_centre[pid]
        images.append(torch.from_numpy(np.ascontiguousarray(pseudo)))
        centres.append(torch.full((len(pseudo),), index, dtype=torch.long))
        info[str(pid)] = metrics
    return torch.cat(images), torch.cat(centres), info


def save_pseudo_grid(path, images: torch.Tensor, centres: torch.Tensor, per_row: int = 12) -> None:
    """A PNG with a row of pseudo images per centre (a look at what left each centre)."""
    import torchvision.utils as vutils

    rows = [images[centres == c][:per_row] for c in centres.unique()]
    vutils.save_image(torch.cat(rows).float() / 255, str(path), nrow=per_row, padding=1)


def run(grid: Grid, cfg, recorder, classes: list[str]) -> None:
    tasks = check_choice(cfg, "ssl.tasks", SSL_TASKS)
    finetune = check_choice(cfg, "ssl.finetune", FINETUNE)
    for key in ("ssl.pseudo-per-centre", "ssl.gan-steps", "ssl.gan-batch", "ssl.gan-width", "ssl.gan-latent",
                "ssl.epochs", "ssl.swaps", "ssl.gan-lr", "ssl.lr"):
        check_positive(cfg, key)
    strategy = build_strategy(cfg, recorder, mu=0.0 if finetune == "fedavg" else None)

    start = time.monotonic()
    nodes = sorted(grid.get_node_ids())
    log(INFO, "ssl-flbt stage 1: %d centres train an MSG-GAN (%d steps) and send %d pseudo images each",
        len(nodes), cfg.option("ssl.gan-steps"), cfg.option("ssl.pseudo-per-centre"))
    images, centres, gan_info = collect_pseudo_images(grid, nodes)
    gan_seconds = time.monotonic() - start
    save_pseudo_grid(recorder.run_dir / "pseudo_images.png", images, centres)
    log(INFO, "pseudo images: %s from %d centres in %.1f s; pre-training the backbone (%s)",
        tuple(images.shape), len(gan_info), gan_seconds, tasks)
    encoder, ssl_metrics = pretrain_multitask(
        images, centres, model=cfg.model, num_centres=len(gan_info), tasks=tasks,
        epochs=int(cfg.option("ssl.epochs")), batch_size=cfg.batch_size, lr=float(cfg.option("ssl.lr")),
        optimizer="adam", patch=int(cfg.option("ssl.swap-patch")), swaps=int(cfg.option("ssl.swaps")),
        seed=cfg.seed, device=resolve_device(cfg.device))
    log(INFO, "pre-training done: %s", {k: round(v, 4) for k, v in ssl_metrics.items()})
    recorder.update_extra({"ssl": {"tasks": tasks, "finetune": finetune, "gan_stage_seconds": gan_seconds,
                                   "pseudo_images": int(len(images)), "gan": gan_info, "pretrain": ssl_metrics}})
    recorder.save_model(encoder, name="ssl-encoder.pt")

    net = projected_net(cfg, classes)
    net.encoder.load_state_dict(encoder, strict=True)
    log(INFO, "ssl-flbt stage 2: %s from the pre-trained backbone", "FL-BT" if finetune == "flbt" else "FedAvg")
    run_strategy(strategy, grid, cfg, classes, net)
