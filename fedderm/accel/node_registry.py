"""The link state of ``fedderm-superlink --database FILE``: Flower's in-memory link state, with
the registered SuperNodes kept in FILE.

Flower's ``SqlLinkState`` puts every link-state query (each object a SuperNode pulls or pushes,
each poll, each heartbeat) through SQLAlchemy into the SQLite file (docs/deploy.md, "ResNet-18:
where a round goes").  What a restarted SuperLink must not forget is which SuperNodes
were registered (their public keys and node ids): that is written to FILE at each registration
and unregistration (SQLite's default rollback journal, ``synchronous=FULL``: a registration is on
disk when ``flwr supernode register`` returns) and read back at start.  Runs and messages live
in memory, as with ``--database :flwr-in-memory:``: a restarted SuperLink has no run history
(fedderm's results and checkpoints are in the run folder, and a run resumes from them).

A FILE written by Flower's ``SqlLinkState`` (``flower-superlink --database FILE`` or an earlier
fedderm) has its registrations imported once, through Flower's own ``get_node_info``.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from pathlib import Path

from flwr.proto.node_pb2 import NodeInfo  # pylint: disable=no-name-in-module
from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState
from flwr.server.superlink.linkstate.linkstate_factory import LinkStateFactory
from flwr.supercore.constant import NodeStatus

#: the table of registered SuperNodes in FILE: node id (decimal text) -> Flower's ``NodeInfo``, serialised
TABLE = "fedderm_registered_nodes"
#: the table Flower's ``SqlLinkState`` keeps its nodes in (only looked for, never read directly)
FLOWER_NODE_TABLE = "node"


class RegisteredNodesLinkState(InMemoryLinkState):
    """``InMemoryLinkState`` whose node registrations survive a restart (kept in ``database``)."""

    def __init__(self, database: str | Path, federation_manager, object_store) -> None:
        super().__init__(federation_manager, object_store)
        self.database = str(database)
        self._file_lock = threading.Lock()
        with self._connect() as conn:
            tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            conn.execute(f"CREATE TABLE IF NOT EXISTS {TABLE} (node_id TEXT PRIMARY KEY, info BLOB NOT NULL)")
        if TABLE not in tables and FLOWER_NODE_TABLE in tables:
            self._import_flower_registrations(object_store)
        self._load()

    @contextlib.contextmanager
    def _connect(self):
        conn = sqlite3.connect(self.database, timeout=30)
        try:
            with conn:  # one transaction: committed on success, rolled back on error
                yield conn
        finally:
            conn.close()

    def _load(self) -> None:
        """Registrations from the file into memory; a restarted SuperLink has no node online."""
        with self._connect() as conn:
            rows = conn.execute(f"SELECT info FROM {TABLE}").fetchall()
        with self.lock:
            for (blob,) in rows:
                info = NodeInfo.FromString(blob)
                node_id = info.node_id
                if info.status != NodeStatus.UNREGISTERED:
                    info.status = NodeStatus.REGISTERED
                self.nodes[node_id] = info
                self.node_public_key_to_node_id[info.public_key] = node_id
                self.owner_to_node_ids.setdefault(info.owner_aid, set()).add(node_id)

    def _save(self, info: NodeInfo) -> None:
        with self._file_lock, self._connect() as conn:
            conn.execute(
                f"INSERT OR REPLACE INTO {TABLE} (node_id, info) VALUES (?, ?)",
                (str(info.node_id), info.SerializeToString()),  # a uint64: beyond SQLite's INTEGER
            )

    def _import_flower_registrations(self, object_store) -> None:
        """Nodes registered in a file of Flower's ``SqlLinkState``, read with its own API."""
        from flwr.server.superlink.linkstate.sql_linkstate import SqlLinkState
        from flwr.superlink.federation.noop_federation_manager import NoOpFederationManager

        flower = SqlLinkState(self.database, NoOpFederationManager(), object_store)
        flower.initialize()
        try:
            for info in flower.get_node_info():
                self._save(info)
        finally:
            flower._engine.dispose()  # pylint: disable=protected-access

    def create_node(self, *args, **kwargs) -> int:
        """Flower's ``create_node``, then the registration written to the file (undone in
        memory if it cannot be written, so that memory and file agree)."""
        node_id = super().create_node(*args, **kwargs)
        if node_id:
            try:
                self._save(self.nodes[node_id])
            except BaseException:
                with self.lock:
                    info = self.nodes.pop(node_id)
                    self.node_public_key_to_node_id.pop(info.public_key, None)
                    self.owner_to_node_ids.get(info.owner_aid, set()).discard(node_id)
                raise
        return node_id

    def delete_node(self, owner_aid: str, node_id: int) -> None:
        """Flower's ``delete_node``, then the unregistration written to the file (the node's
        previous record restored in memory if it cannot be written)."""
        before = NodeInfo()
        with self.lock:
            if node_id in self.nodes:
                before.CopyFrom(self.nodes[node_id])
        super().delete_node(owner_aid, node_id)
        try:
            self._save(self.nodes[node_id])
        except BaseException:
            with self.lock:
                self.nodes[node_id].CopyFrom(before)
            raise


def link_state_factory(database: str | Path, federation_manager, objectstore_factory) -> LinkStateFactory:
    """Flower's ``LinkStateFactory`` holding a :class:`RegisteredNodesLinkState` on ``database``
    (made now: Flower's SuperLink asks for its state as soon as it has the factory)."""
    factory = LinkStateFactory(str(database), federation_manager, objectstore_factory)
    factory.state_instance = RegisteredNodesLinkState(
        database, federation_manager, objectstore_factory.store()
    )
    return factory
