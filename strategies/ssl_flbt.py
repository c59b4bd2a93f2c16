"""SSL-FL-BT (paper 004 §III, Fig. 1) and the SSL variants of its Tables V-X: a two-stage plan.

Stage 1, where the self-supervised pre-training happens (``ssl.pretrain``):

* ``pseudo`` (SSL-FL-BT): every centre trains an MSG-GAN on its own images and sends
  ``ssl.pseudo-per-centre`` generated images (``train.gan``; with ``ssl.fid-select`` the ones of the
  generator snapshots with the smallest FID).  The server pre-trains the backbone on all pseudo
  images with centre classification (Eq. 1) + patch-swap restoration (Eq. 2), L = L_CE + L_MSE (Eq. 3).
* ``local`` (SSL-Fed-R / SSL-Fed-S): every centre pre-trains alone on its original images
  (``ssl.rounds`` rounds of ``ssl.epochs`` epochs, nothing averaged), and starts stage 2 from its
  own pre-trained encoder.
* ``federated`` (FedSSL-R / FedSSL-S): the same pre-training averaged by FedAvg every round.

``ssl.tasks``: ``both`` | ``centre`` (SSL-C-FL-BT) | ``restoration`` (SSL-R-FL-BT) on pseudo images;
``restoration`` (-R) | ``simclr`` (-S) on original images.

Stage 2 (``ssl.finetune``) on the 004 network from the pre-trained encoder (projector and output
layer start random): ``flbt`` (FL-BT), ``fedavg`` (μ = 0: SSL-FL) or ``local`` (every centre trains
alone, no FL: SSL-L-FT).
"""

from __future__ import annotations

import time
from logging import INFO

import numpy as np
import torch
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from fedderm.checkpoint import DEFAULT_STAGE
from fedderm.ssl_pseudo import backbone_arrays, encoder_prefix, original_ssl_network, pretrain_multitask
from fedderm.train import resolve_device, use_bn_stats
from wire import PSEUDO, to_record, to_state_dict

from . import progress
from .common import Tracked
from .finetune import LocalFinetune, pretrain
from .flbt import build_strategy
from .flbt_family import projected_net, run_strategy
from .local import run as run_local
from .nodes import SentTo
from .probe import probe_due, probe_round
from .recording import record_missing
from .screening import metrics_problem, partition_problem, pseudo_problem


def _pretrain_augment(cfg):
    """The run's ``augment`` policy for pre-training on the pseudo images (004 §IV-B under ``paper``)."""
    import registry
    from fedderm.augment import policy

    return policy(cfg.augment, "pretrain", registry.METHODS[cfg.method].augment)


def collect_pseudo_images(grid: Grid, node_ids: list[int], timeout: float = 7200, cfg=None, recorder=None):
    """Stage 1: ask every centre for pseudo images.  Returns (images uint8 (M,3,S,S), centre index
    (M,) by partition-id order, per-centre metrics).  With ``cfg`` and ``recorder`` every reply is
    screened (:func:`pseudo_problem`, finite metrics, the handshake's partition id): a reply that
    fails is left out, logged and recorded (``missing_clients``), and the stage goes on with the
    others (at least ``min-clients``)."""
    msgs = [
        Message(
            RecordDict({"config": ConfigRecord({"server-round": 0})}), dst_node_id=n, message_type="train.gan"
        )
        for n in node_ids
    ]
    sent = SentTo(msgs)  # a dead node's error reply comes from the SuperLink: map by message id
    replies = list(grid.send_and_receive(msgs, timeout=timeout))
    errors = [f"node {sent.node_of(r)}: {r.error.reason}" for r in replies if r.has_error()]
    if errors or len(replies) < len(node_ids):
        raise RuntimeError(
            "ssl-flbt: the GAN stage failed:\n  " + "\n  ".join(errors or ["(missing replies)"])
        )
    known = recorder.node_partitions if recorder is not None else {}
    rejected = []
    if cfg is not None:
        for r in list(replies):
            if problem := pseudo_reply_problem(r, sent.node_of(r), cfg, known):
                rejected.append((sent.node_of(r), f"rejected: {problem}"))
                replies.remove(r)
        if recorder is not None:
            record_missing(recorder, "gan", 0, rejected)
        if len(replies) < cfg.min_clients:
            raise RuntimeError(
                f"ssl-flbt: only {len(replies)} centres sent usable pseudo images (min-clients={cfg.min_clients}): "
                + "; ".join(f"node {n}: {why}" for n, why in rejected)
            )
    by_centre = {}
    for r in replies:
        metrics = dict(r.content["metrics"])
        claim = metrics.pop("partition-id")
        pid = int(known.get(sent.node_of(r), claim))  # the handshake's partition id, not the claim
        by_centre[pid] = (r.content[PSEUDO][PSEUDO].numpy(), metrics)
    images, centres, info = [], [], {}
    for index, pid in enumerate(sorted(by_centre)):
        pseudo, metrics = by_centre[pid]
        images.append(torch.from_numpy(np.ascontiguousarray(pseudo)))
        centres.append(torch.full((len(pseudo),), index, dtype=torch.long))
        info[str(pid)] = metrics
    return torch.cat(images), torch.cat(centres), info


def pseudo_reply_problem(reply: Message, node: int, cfg, known: dict[int, int]) -> str | None:
    """Why a ``train.gan`` reply cannot join the pseudo-image set, or None: only its images and
    metrics, finite metrics, its node's partition id, the images of :func:`pseudo_problem`."""
    extra = sorted(set(reply.content.keys()) - {PSEUDO, "metrics"})
    metrics = reply.content.metric_records.get("metrics")
    if extra:
        return f"records the method does not send: {extra[:3]}"
    if metrics is None:
        return "no 'metrics' MetricRecord"
    return (
        metrics_problem(metrics)
        or partition_problem(node, metrics, known)
        or pseudo_problem(
            reply.content.array_records.get(PSEUDO),
            metrics.get("num-examples"),
            int(cfg.option("ssl.pseudo-per-centre")),
            cfg.image_size,
        )
    )


def save_pseudo_grid(path, images: torch.Tensor, centres: torch.Tensor, per_row: int = 12) -> None:
    """A PNG with a row of pseudo images per centre (a look at what left each centre)."""
    import torchvision.utils as vutils

    rows = [images[centres == c][:per_row] for c in centres.unique()]
    vutils.save_image(torch.cat(rows).float() / 255, str(path), nrow=per_row, padding=1)


def pseudo_stage(grid: Grid, cfg, recorder, tasks: str) -> dict:
    """Stage 1 of SSL-FL-BT: pseudo images from every centre, multi-task SSL on the server;
    returns the pre-trained encoder's state (``ProjectedNet.encoder`` keys)."""
    start = time.monotonic()
    nodes = sorted(grid.get_node_ids())
    log(
        INFO,
        "ssl-flbt stage 1: %d centres train an MSG-GAN (%d steps) and send %d pseudo images each%s",
        len(nodes),
        cfg.option("ssl.gan-steps"),
        cfg.option("ssl.pseudo-per-centre"),
        f" (FID selection over {cfg.option('ssl.fid-checkpoints')} snapshots)"
        if cfg.option("ssl.fid-select")
        else "",
    )
    images, centres, gan_info = collect_pseudo_images(grid, nodes, cfg=cfg, recorder=recorder)
    gan_seconds = time.monotonic() - start
    save_pseudo_grid(recorder.run_dir / "pseudo_images.png", images, centres)
    log(
        INFO,
        "pseudo images: %s from %d centres in %.1f s; pre-training the backbone (%s)",
        tuple(images.shape),
        len(gan_info),
        gan_seconds,
        tasks,
    )
    with use_bn_stats(cfg.bn_stats):  # the clients' loops read it from their ClientApp (client_app.dispatch)
        encoder, ssl_metrics = pretrain_multitask(
            images,
            centres,
            model=cfg.model,
            num_centres=len(gan_info),
            tasks=tasks,
            epochs=int(cfg.option("ssl.epochs")),
            batch_size=cfg.batch_size,
            lr=float(cfg.option("ssl.lr")),
            optimizer="adam",
            patch=int(cfg.option("ssl.swap-patch")),
            swaps=int(cfg.option("ssl.swaps")),
            seed=cfg.seed,
            device=resolve_device(cfg.device),
            augment=_pretrain_augment(cfg),
        )
    log(INFO, "pre-training done: %s", {k: round(v, 4) for k, v in ssl_metrics.items()})
    recorder.update_extra(
        {
            "ssl": {
                **recorder.extra.get("ssl", {}),
                "gan_stage_seconds": gan_seconds,
                "pseudo_images": int(len(images)),
                "gan": gan_info,
                "pretrain": ssl_metrics,
            }
        }
    )
    return encoder


class FederatedSSL(Tracked, FedAvg):
    """FedSSL's pre-training rounds: FedAvg of the centres' SSL models."""


class LocalSSL(LocalFinetune):
    """SSL-Fed's pre-training rounds: every centre keeps training its own SSL model."""


def original_images_stage(grid: Grid, cfg, recorder) -> dict:
    """Stage 1 of SSL-Fed / FedSSL: ``ssl.rounds`` rounds of ``train.pretrain`` on the centres'
    original images; returns the encoder the server holds (FedSSL: the averaged pre-trained one;
    SSL-Fed: the initial one, which every centre replaces by its own)."""
    tasks = str(cfg.option("ssl.tasks"))
    torch.manual_seed(cfg.seed)
    initial = original_ssl_network(cfg.model, cfg.image_size, tasks)
    kind = FederatedSSL if cfg.option("ssl.pretrain") == "federated" else LocalSSL
    n = cfg.min_clients
    strategy = kind(
        cfg=cfg,
        recorder=recorder,
        action="pretrain",
        num_rounds=int(cfg.option("ssl.rounds")),
        fraction_evaluate=0.0,
        min_train_nodes=n,
        min_available_nodes=n,
    )
    log(
        INFO,
        "ssl-flbt stage 1: %s %s pre-training on the centres' own images (%d rounds x %d epochs)",
        "federated" if kind is FederatedSSL else "per-centre (no averaging)",
        tasks,
        strategy.num_rounds,
        cfg.option("ssl.epochs"),
    )
    arrays = pretrain(strategy, grid, to_record(initial.state_dict()))
    return backbone_arrays(to_state_dict(arrays), encoder_prefix(tasks))


def run(grid: Grid, cfg, recorder, classes: list[str]) -> None:
    where, tasks, finetune = (str(cfg.option(k)) for k in ("ssl.pretrain", "ssl.tasks", "ssl.finetune"))
    recorder.update_extra({"ssl": {"pretrain": where, "tasks": tasks, "finetune": finetune}})
    # the time left counts both stages' rounds (the server's pseudo-image stage has no rounds)
    stages = [] if where == "pseudo" else [("pretrain", int(cfg.option("ssl.rounds")))]
    progress.of(recorder).plan([*stages, (DEFAULT_STAGE, cfg.num_server_rounds)])
    encoder = (
        pseudo_stage(grid, cfg, recorder, tasks)
        if where == "pseudo"
        else original_images_stage(grid, cfg, recorder)
    )
    if where == "pseudo" and probe_due(cfg, 1, 1):  # the server's one pre-training, probed as round 1
        probe_round(grid, cfg, recorder, 1, to_record(encoder))
    recorder.save_model(encoder, name="ssl-encoder.pt")

    net = projected_net(cfg, classes)
    net.encoder.load_state_dict(encoder, strict=True)
    log(
        INFO,
        "ssl-flbt stage 2: %s from the pre-trained backbone%s",
        {"flbt": "FL-BT", "fedavg": "FedAvg", "local": "per-centre training (no FL)"}[finetune],
        " (each centre's own)" if where == "local" else "",
    )
    if finetune == "local":
        recorder.save_model(net.state_dict())  # no global model: model.pt is the pre-trained start
        run_local(grid, cfg, recorder, classes, net)
    else:
        run_strategy(
            build_strategy(cfg, recorder, mu=0.0 if finetune == "fedavg" else None), grid, cfg, classes, net
        )
