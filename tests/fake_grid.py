"""An in-process Grid for strategy tests: messages go straight to the ClientApp's handlers.

Each node has its own ``Context`` (``partition-id`` i, its own ``state``), so client state
persists across rounds exactly as in a SuperNode; no Ray, no threads, deterministic.
"""

from __future__ import annotations

import copy
import itertools

from flwr.app import Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

import client_app

_RUN_IDS = itertools.count(1_000_000)


class FakeGrid:
    def __init__(self, run_config: dict, num_nodes: int, first_node_id: int = 7001):
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
        run_id = next(_RUN_IDS)  # a fresh client session (config, data) per grid
        self.contexts = {
            first_node_id + i: Context(run_id=run_id, node_id=first_node_id + i,
                                       node_config={"partition-id": i, "num-partitions": num_nodes},
                                       state=RecordDict(), run_config=dict(run_config))
            for i in range(num_nodes)}
        self.sent: list[Message] = []  # every instruction, in order
        self.replies: list[Message] = []

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def send_and_receive(self, messages, *, timeout=None) -> list[Message]:
        """Deliver a copy of each message (as serialisation would) and keep copies of what was
        sent and received, untouched by later mutation (FedCLF strips ``features`` from replies)."""
        replies = []
        for msg in messages:
            self.sent.append(copy.deepcopy(msg))
            reply = client_app.dispatch(copy.deepcopy(msg), self.contexts[msg.metadata.dst_node_id])
            self.replies.append(copy.deepcopy(reply))
            replies.append(reply)
        return replies
