"""Connected nodes: waiting for ``min-clients``, a round's fixed view of the connected nodes, and
send-and-receive with a round timeout."""

from __future__ import annotations

import time
from collections.abc import Iterable
from logging import INFO

from flwr.app import Message
from flwr.common import log
from flwr.serverapp import Grid


def send_and_receive(grid: Grid, messages: Iterable[Message], timeout: float) -> list[Message]:
    """Send ``messages`` and return the replies that arrived within ``timeout`` seconds."""
    messages = list(messages)
    return list(grid.send_and_receive(messages, timeout=timeout)) if messages else []


def wait_for_nodes(grid: Grid, n: int, timeout: float | None = None, poll: float = 1.0) -> list[int]:
    """Connected node ids once at least ``n`` are connected; raises after ``timeout`` seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    last = -1
    while len(ids := sorted(grid.get_node_ids())) < n:
        if deadline is not None and time.monotonic() > deadline:
            have = ", ".join(f"node {i}" for i in ids) or "none"
            raise RuntimeError(
                f"only {len(ids)} of min-clients={n} clients connected within round-timeout="
                f"{timeout:.0f} s (connected: {have}); {n - len(ids)} missing: start the "
                "missing SuperNode(s) or lower min-clients; the results so far are in the run "
                'folder: resume with resume="<run folder>" once the hospitals are back'
            )
        if len(ids) != last:
            log(INFO, "waiting for clients: %d connected, %d needed (min-clients)", len(ids), n)
            last = len(ids)
        time.sleep(poll)
    return ids


class SentTo(list):
    """The node ids a wave of messages went to (a list, in sending order) and, once they are
    pushed, which node each reply answers for (:meth:`node_of`).

    A reply's ``src_node_id`` is not always its node: when a SuperNode dies mid-round, Flower
    answers its message with an error reply from the SuperLink (node 1).  Every reply names the
    message it answers (``reply_to_message_id``); Flower's grids set ``message_id`` on the sent
    ``Message`` when they push it, so this keeps the messages' metadata and looks it up.
    """

    def __init__(self, messages: Iterable[Message]):
        messages = list(messages)
        super().__init__(m.metadata.dst_node_id for m in messages)
        self._metadata = [m.metadata for m in messages]  # the same objects the grid stamps on push

    def get(self, reply: Message) -> int | None:
        """The node the message ``reply`` answers was sent to, or None if not one of these."""
        wanted = reply.metadata.reply_to_message_id
        if not wanted:
            return None
        return next((m.dst_node_id for m in self._metadata if m.message_id == wanted), None)

    def node_of(self, reply: Message) -> int:
        """The node ``reply`` answers for; its ``src_node_id`` only for a reply to none of these."""
        node = self.get(reply)
        return reply.metadata.src_node_id if node is None else node


class NodeView:
    """The grid as a strategy sees it during one round: the nodes connected at its start.

    Flower's node sampling waits forever while fewer than ``min_available_nodes`` are
    connected; sampling from this fixed list never blocks on a node that vanished mid-round.
    """

    def __init__(self, grid: Grid, node_ids: list[int]):
        self._grid, self._ids = grid, list(node_ids)

    def get_node_ids(self) -> list[int]:
        return list(self._ids)

    def __getattr__(self, name: str):
        return getattr(self._grid, name)
