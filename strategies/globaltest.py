"""Server side of ``test-set="global"`` (docs/test-sets.md): after the per-client test, the final
model goes to the clients with ``split="global-test"``; each evaluates it on the whole global test
set (held out before partitioning, or ``test-data-path``) with its method's own evaluation, and
:meth:`RunRecorder.set_global_test` makes those metrics ``final``'s."""

from __future__ import annotations

from logging import INFO

from flwr.app import ArrayRecord, ConfigRecord
from flwr.common import log
from flwr.serverapp import Grid

from fedderm.data.testset import GLOBAL_SPLIT

from .nodes import send_and_receive


def global_test(strategy, grid: Grid, arrays: ArrayRecord, server_round: int) -> dict[str, float] | None:
    """Evaluate ``arrays`` (per-client models: each client's own best) on the global test set."""
    cfg = strategy.cfg
    if getattr(cfg, "test_set", "per-client") != "global":
        return None
    msgs = strategy.configure_evaluate(server_round, arrays, ConfigRecord({"split": GLOBAL_SPLIT}), grid)
    replies = strategy.screen(
        server_round,
        strategy._eval_sent_to,
        strategy.in_order(send_and_receive(grid, msgs, cfg.round_timeout)),
        validate=False,
    )
    per_client = strategy._per_client(replies)
    if not per_client:
        raise RuntimeError("no client returned metrics on the global test set (test-set='global')")
    source = cfg.test_data_path or ("npz test_* arrays" if cfg.dataset == "npz" else "held out of the data")
    mean = strategy.recorder.set_global_test(per_client, source)
    final = strategy.recorder.final
    log(
        INFO,
        "global test set (%s, %s images): balanced_accuracy %.3f · accuracy %.3f",
        source,
        final.get("num-examples"),
        mean.get("balanced_accuracy", float("nan")),
        mean.get("accuracy", float("nan")),
    )
    return mean
