"""The fedderm ServerApp and ClientApp (all its mods) in one process, over an in-memory Grid.

What ``sim.py`` runs, without Ray: :func:`run_app` calls the ServerApp's ``main`` with a
:class:`LoopGrid` that hands every pushed message (a deep copy, as serialisation would) to
``client_app.app`` with that node's Context and keeps the reply for the next pull.  Each call
is a new Flower run (new run id and node ids, fresh client contexts), as a restart is.
:func:`simulate` is ``sim.simulate`` over this grid: the same checks, ServerApp context and
node configs, in a second instead of a Ray start (the tests' ``in_process`` fixture swaps it in).
The benchmarks (``bench.gpu``, ``bench.cold_start``) and the tests share it.  In a process with one
PyTorch thread it computes the numbers of a Ray simulation at ``--cpus-per-client 1`` bit for bit
(``tests/test_cli.py``'s Ctrl-C test), and those of a deployment given the same node configs
(``tests/test_loopback.py``'s FedCLF resume).
"""

from __future__ import annotations

import copy
import itertools
import uuid
from pathlib import Path

from flwr.app import Context, Error, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.supercore.task_identity import TaskIdentity

#: the smallest run config the tests drive through :func:`run_app` (tiny CNN, 16 px, 3 rounds)
TINY_RUN = {
    "model": "tiny-cnn",
    "image-size": 16,
    "synthetic-per-class": 6,
    "local-epochs": 1,
    "batch-size": 8,
    "optimizer": "sgd",
    "lr": 0.03,
    "num-server-rounds": 3,
}

_RUN_IDS = itertools.count(5_000_000)
_NODE_IDS = itertools.count(80_001, 1000)


class LoopGrid:
    """``node_configs``: each client's node config (a SuperNode's ``--node-config``); default
    ``partition-id`` and ``num-partitions``, as Flower's simulation gives them."""

    def __init__(
        self, run_config: dict, num_clients: int, client_app, node_configs: list[dict] | None = None
    ):
        self.run_id = next(_RUN_IDS)
        first = next(_NODE_IDS)
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, self.run_id, SUPERLINK_NODE_ID
        self.app = client_app
        self.contexts = {
            first + 7 * i: Context(
                run_id=self.run_id,
                node_id=first + 7 * i,
                node_config=dict(node_configs[i])
                if node_configs
                else {"partition-id": i, "num-partitions": num_clients},
                state=RecordDict(),
                run_config=dict(run_config),
            )
            for i in range(num_clients)
        }
        self.replies: dict[str, Message] = {}

    def get_node_ids(self):
        return list(self.contexts)

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = str(uuid.uuid4())
            delivered = copy.deepcopy(msg)
            try:
                reply = self.app(delivered, self.contexts[msg.metadata.dst_node_id])
            except Exception as err:  # noqa: BLE001 - as Flower's runtime: an error reply
                reply = Message(
                    Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=repr(err)), reply_to=delivered
                )
            self.replies[msg.metadata.message_id] = copy.deepcopy(reply)
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, message_ids):
        return [self.replies.pop(m) for m in list(message_ids) if m in self.replies]

    def send_and_receive(self, messages, *, timeout=None):
        ids = self.push_messages(messages)
        return self.pull_messages(ids)


class InMemoryGrid(LoopGrid):
    """A :class:`LoopGrid` the ServerApp takes for Flower's simulation grid
    (``fedderm.flower_private.grid_kind``): clients keep their state in the run folder and polls
    are short, as in a simulation."""

    fedderm_grid_kind = "simulation"


def run_app(overrides: dict, num_clients: int = 2, client_app=None, node_configs: list[dict] | None = None):
    """One run of fedderm's ServerApp + ClientApp in this process; returns the run folder."""
    import server_app
    import sim

    if client_app is None:
        from client_app import app as client_app
    run_config = sim.resolved_run_config(overrides)
    grid = LoopGrid(run_config, num_clients, client_app, node_configs)
    context = Context(
        run_id=grid.run_id, node_id=0, node_config={}, state=RecordDict(), run_config=run_config
    )
    server_app.main(grid, context)
    return sim.run_folder(context.state)


def simulate(
    overrides: dict,
    num_supernodes: int | None = None,
    cpus_per_client: int = 1,
    gpus_per_client: float = 0.0,
    verbose: bool = False,
    client_app=None,
    preset: str = "",
    user_overrides: dict | None = None,
    ray_address: str = "",
) -> Path:
    """``sim.simulate`` in this process: its checks (:func:`sim.checked_run`), default number of
    clients and command-line record, then the ServerApp over a :class:`LoopGrid`.  Same signature;
    Ray's options (``cpus_per_client`` ...) are unused."""
    import server_app
    import sim

    run_config, num_supernodes = sim.checked_run(overrides, num_supernodes, gpus_per_client, ray_address)[:2]
    if client_app is None:
        from client_app import app as client_app
    grid = InMemoryGrid(run_config, num_supernodes, client_app)
    context = sim.server_context(grid.run_id, run_config, overrides, preset, user_overrides)
    server_app.main(grid, context)
    return sim.run_folder(context.state)


def tiny_text_model(path):
    """A tiny random BERT with its own 10-word vocabulary saved as a local model folder: a
    ``sift.text-model`` for tests and benchmarks where the default MiniLM package is absent."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizerFast

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "melanoma", "nevus", "benign", "skin", "lesion"]
    (path / "vocab").mkdir(parents=True, exist_ok=True)
    (path / "vocab" / "vocab.txt").write_text("\n".join(words) + "\n")
    BertTokenizerFast(vocab_file=str(path / "vocab" / "vocab.txt")).save_pretrained(path)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(words),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
    )
    BertModel(config).save_pretrained(path)
    return path
