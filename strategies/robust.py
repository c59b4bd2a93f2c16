"""Robust aggregation (run-config ``aggregation``): Flower's own rules in place of the mean.

A strategy's screened replies are handed to the ``aggregate_train`` of Flower's
:class:`~flwr.serverapp.strategy.FedMedian` (coordinate-wise median, Yin et al. 2018),
:class:`~flwr.serverapp.strategy.FedTrimmedAvg` (coordinate-wise trimmed mean, β =
``trimmed-mean-beta``), :class:`~flwr.serverapp.strategy.Krum` / :class:`~flwr.serverapp.strategy.MultiKrum`
(Blanchard et al. 2017: the update(s) nearest the others, f = ``byzantine-clients``) or
:class:`~flwr.serverapp.strategy.Bulyan` (El Mhamdi et al. 2018): the same computation, not a
re-written one.  Flower's rules take the arrays out of the messages they get, so they get copies
(:func:`wire.copy_record`: the same immutable Arrays, no data copy).  The number of clients each
rule needs is checked before the run (:func:`fedderm.config.robust_needs`).
"""

from __future__ import annotations

from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import Bulyan, FedAvg, FedMedian, FedTrimmedAvg, Krum, MultiKrum

import wire


def flower_rule(cfg, replies: int) -> FedAvg:
    """Flower's strategy that computes ``cfg.aggregation`` over ``replies`` replies."""
    f, rule = cfg.byzantine_clients, cfg.aggregation
    if rule == "median":
        return FedMedian()
    if rule == "trimmed-mean":
        return FedTrimmedAvg(beta=cfg.trimmed_mean_beta)
    if rule == "krum":
        return Krum(num_malicious_nodes=f)
    if rule == "multi-krum":
        return MultiKrum(
            num_malicious_nodes=f, num_nodes_to_select=cfg.multi_krum_select or max(replies - f, 1)
        )
    if rule == "bulyan":
        return Bulyan(num_malicious_nodes=f)
    raise ValueError(f"aggregation {rule!r} is not one of Flower's robust rules")


def robust_aggregate(
    cfg, server_round: int, replies: list[Message], records: list[ArrayRecord], metrics: list[MetricRecord]
) -> tuple[ArrayRecord | None, MetricRecord | None]:
    """``cfg.aggregation`` of ``records`` (one per reply in ``replies``, each weighing its
    ``metrics``' ``num-examples`` where the rule weighs) by Flower's class for it."""
    messages = [
        Message(RecordDict({"arrays": wire.copy_record(r), "metrics": m}), reply_to=reply)
        for reply, r, m in zip(replies, records, metrics, strict=True)
    ]
    return flower_rule(cfg, len(messages)).aggregate_train(server_round, messages)
