"""An in-process Flower Grid for strategy tests: messages go straight to the real client handlers.

Each node has its own ``Context`` (node config ``partition-id``/``num-partitions``, its own
``state``), so per-client state survives rounds as under Flower.  A handler that raises becomes an
error reply, as Flower's ClientApp runtime does; ``fail`` injects failures of train messages by
partition id: ``"raise"`` (the handler raises), ``"timeout"`` (no reply arrives) or ``"dead"`` (the
node died: the SuperLink answers with Flower's own NODE_UNAVAILABLE error reply, whose source is the
SuperLink, node 1); ``"raise-evaluate"`` makes its evaluate messages raise instead.  Every sent
message gets a ``message_id`` as Flower's grids give it on push.  Messages are delivered and
recorded as copies, as serialisation would: later mutation (FedCLF strips ``features`` from replies)
does not change what was sent and received.
"""

from __future__ import annotations

import copy
import itertools
import uuid

from flwr.app import Context, Error, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.server.superlink.linkstate.utils import create_message_error_unavailable_res_message
from flwr.supercore.task_identity import TaskIdentity

from client_app import dispatch
from clients.common import info

_RUN_IDS = itertools.count(9_000_000)


class FakeGrid:
    def __init__(
        self,
        run_config: dict,
        partition_of_node: dict[int, int] | int,
        fail: dict[int, str] | None = None,
        first_node_id: int = 7001,
    ):
        if isinstance(partition_of_node, int):  # N nodes numbered from first_node_id, partitions 0..N-1
            partition_of_node = {first_node_id + i: i for i in range(partition_of_node)}
        # sessions are cached per run id: one per grid, unique even where this module is imported
        # twice (as `fake_grid` and as `tests.fake_grid`, each with its own counter)
        self.run_id = next(_RUN_IDS) + (uuid.uuid4().int & 0xFFFFFFFF) * 1_000_000
        # what the ServerApp runtime sets before messages can be built (as sim.py does)
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, self.run_id, SUPERLINK_NODE_ID
        self.partition_of_node = dict(partition_of_node)
        self.contexts = {
            node: Context(
                run_id=self.run_id,
                node_id=node,
                node_config={"partition-id": pid, "num-partitions": len(partition_of_node)},
                state=RecordDict(),
                run_config=dict(run_config),
            )
            for node, pid in partition_of_node.items()
        }
        self.fail = dict(fail or {})
        self.sent: list[Message] = []
        self.replies: list[Message] = []

    def get_node_ids(self):
        return list(self.partition_of_node)

    def _handle(self, msg: Message) -> Message | None:
        node = msg.metadata.dst_node_id
        context = self.contexts[node]
        kind = msg.metadata.message_type
        failure = self.fail.get(self.partition_of_node[node])
        if failure == "raise-evaluate":
            failure = "raise" if kind.startswith("evaluate") else None
        elif not kind.startswith("train"):
            failure = None
        if failure == "timeout":
            return None
        if failure == "dead":
            return create_message_error_unavailable_res_message(msg.metadata, "node_unavail")
        try:
            if failure == "raise":
                raise RuntimeError("injected failure")
            return info(msg, context) if kind == "query.info" else dispatch(msg, context)
        except Exception as err:  # noqa: BLE001 - mirrors Flower turning exceptions into error replies
            return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=repr(err)), reply_to=msg)

    def send_and_receive(self, messages, *, timeout=None):
        out = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = str(uuid.uuid4())  # as Flower's grids on push
            self.sent.append(copy.deepcopy(msg))
            reply = self._handle(copy.deepcopy(msg))
            if reply is not None:
                self.replies.append(copy.deepcopy(reply))
                out.append(reply)
        return out

    def train_messages(self) -> list[Message]:
        return [m for m in self.sent if m.metadata.message_type.startswith("train")]
