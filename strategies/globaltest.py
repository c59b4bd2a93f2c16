"""Server side of ``test-set="global"`` (docs/test-sets.md): after the per-client test, the final
model goes to the clients with ``split="global-test"``; each evaluates it on the whole global test
set (held out before partitioning, or ``test-data-path``) with its method's own evaluation, and
:meth:`RunRecorder.set_global_test` makes those metrics ``final``'s."""

from __future__ import annotations

from collections import Counter
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
        validate=strategy.validate_evaluation,
    )
    node_of = {strategy.reply_partition(m, m.content["metrics"]): strategy.reply_node(m) for m in replies}
    per_client = strategy._per_client(replies)
    sizes = Counter(m.get("num-examples") for m in per_client.values())
    if len(sizes) > 1:  # one global test set: a size most clients do not report is rejected
        (size, count), (_, second) = sizes.most_common(2)
        keep = {pid for pid, m in per_client.items() if m.get("num-examples") == size and count > second}
        strategy.note_missing(
            server_round,
            [
                (
                    node_of[pid],
                    f"rejected: global test set of {m.get('num-examples')} images; "
                    + (
                        f"{count} of {len(per_client)} clients evaluated {size}"
                        if keep
                        else "no size has a majority"
                    ),
                )
                for pid, m in per_client.items()
                if pid not in keep
            ],
        )
        per_client = {pid: m for pid, m in per_client.items() if pid in keep}
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
