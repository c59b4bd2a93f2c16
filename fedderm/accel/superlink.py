"""``fedderm-superlink``: Flower's SuperLink with its link state and objects in memory (the
registered SuperNodes kept in ``--database``, :mod:`fedderm.accel.node_registry`) and idle
SuperNode pulls held until a message is stored (:class:`HeldPulls`)."""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
import threading
import time as _time

from fedderm.accel.waits import ACCELERATED_ENV, env_seconds


def link_state_in_memory() -> None:
    """Make ``flower-superlink --database FILE`` keep its link state (runs, message headers, node
    liveness) and the messages' objects (the model arrays) in memory, and only the registered
    SuperNodes in the SQLite FILE (:class:`fedderm.accel.node_registry.RegisteredNodesLinkState`),
    where Flower writes and reads back every message's arrays through SQLAlchemy (docs/deploy.md,
    "ResNet-18: where a round goes").  ``:flwr-in-memory:`` and non-SQLite URLs are left to Flower."""
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.superlink import config_loader
    from flwr.superlink import main as superlink_main

    from fedderm.accel.node_registry import link_state_factory

    flower_factories = config_loader.get_objectstore_linkstate_factories

    def factories(database: str, federation_manager):
        if database.startswith(":flwr-in-memory:") or "://" in database:
            return flower_factories(database, federation_manager)
        objects = ObjectStoreFactory()  # Flower's in-memory store
        return objects, link_state_factory(database, federation_manager, objects)

    superlink_main.get_objectstore_linkstate_factories = factories


#: Flower's default ``--host`` (``flwr.supercore.constant.UVICORN_DEFAULT_HOST``)
FLOWER_DEFAULT_HOST = "127.0.0.1"
#: where the deployment guide explains the proxy
PROXY_DOCS = "docs/deploy.md#the-proxy-only-the-fleet-api-on-the-public-address"


def is_loopback(host: str, resolve: bool = False) -> bool:
    """Whether ``host`` is reachable from this machine only: a loopback address, ``localhost``,
    or (``resolve``) a name whose every address is a loopback address."""
    host = host.strip().strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if not resolve or not host:
        return False
    try:
        found = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError):
        return False
    return bool(found) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in found)


def _option(argv: list[str], name: str) -> str | None:
    """The last value of ``--name VALUE`` / ``--name=VALUE`` in ``argv`` (argparse's rule), else None."""
    value = None
    for i, token in enumerate(argv):
        if token == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif token.startswith(name + "="):
            value = token.split("=", 1)[1]
    return value


def exposure_warning(argv: list[str]) -> str | None:
    """The warning for a SuperLink whose ``--host`` is not a loopback address, else None.

    Flower's SuperLink serves its Control API (register SuperNodes, start, list and stop runs:
    no login without Flower's enterprise account plugin) on the same address as the Fleet API, so
    whoever reaches that address with the CA certificate every hospital holds can administer the
    federation and register a SuperNode of their own.  The hardened deployment keeps the SuperLink
    on 127.0.0.1 and puts the proxy, which forwards only the Fleet API, on the public address."""
    host = _option(argv, "--host") or FLOWER_DEFAULT_HOST
    if is_loopback(host, resolve=True):
        return None
    port = _option(argv, "--port") or "8000"
    return (
        f"--host {host} is not a loopback address: every SuperLink API on {host}:{port} is open to "
        "whoever reaches it, the Control API too (register a SuperNode, start, list and stop runs; "
        "it has no login), so an outsider holding the CA certificate can join the federation. "
        f"Listen on 127.0.0.1 and put the proxy in front (python -m deploy.proxy; {PROXY_DOCS})"
    )


#: how long the SuperLink holds a SuperNode's pull when no message is waiting (``FEDDERM_PULL_HOLD``)
DEFAULT_PULL_HOLD = 1.0
#: at most this many pulls held at once: each holds one of the SuperLink's 40 request threads
MAX_HELD_PULLS = 16


def pull_hold() -> float:
    """``FEDDERM_PULL_HOLD`` in seconds (default 1; 0 answers every pull at once, as Flower)."""
    return env_seconds("FEDDERM_PULL_HOLD", DEFAULT_PULL_HOLD, 0, 10, "fedderm-superlink")


class HeldPulls:
    """Long polling of the Fleet API's PullMessages, inside the SuperLink's link state.

    An idle SuperNode asks for a message every ``FEDDERM_POLL_INTERVAL``, each request
    authenticated and answered by the SuperLink (docs/deploy.md).  Here a pull that
    finds nothing waits up to ``hold`` seconds for a message to be stored (any node's: the pull
    then asks again) before it answers "nothing", so an idle SuperNode asks about once per
    ``hold`` and a new message is delivered as soon as it is stored.  The SuperNode is unchanged
    (Flower's SuperNode, too, gets its messages sooner).  At most ``max_held`` pulls wait at once
    (each holds a request thread); beyond that a pull answers at once, as in Flower.
    """

    def __init__(self, hold: float, max_held: int = MAX_HELD_PULLS):
        self.hold = hold
        self.stored = 0  # messages stored so far (a counter, so that no wake-up is lost)
        self._cond = threading.Condition()
        self._slots = threading.BoundedSemaphore(max_held)

    def wrap(self, state):
        """Hold ``state``'s pulls of a SuperNode's messages; returns ``state``.

        Flower 1.42's Fleet API pulls through ``get_message_ins(node_id, limit)``; 1.43's through
        ``get_messages(dst_node_id=, limit=)`` (messages stay pending until acknowledged). Each
        method the installed link state has is wrapped; :func:`self_test_held_pull` checks the
        one Flower's own Fleet handler calls."""
        from flwr.common.constant import SUPERLINK_NODE_ID

        def stored() -> None:
            with self._cond:
                self.stored += 1
                self._cond.notify_all()

        def held(fetch, node_pull: bool):
            with self._cond:
                seen = self.stored
            messages = fetch()
            # the ServerApp's own pulls (SUPERLINK_NODE_ID, a run_id, replies) are answered at once
            if messages or not node_pull or self.hold <= 0:
                return messages
            if not self._slots.acquire(blocking=False):
                return messages
            try:
                deadline = _time.monotonic() + self.hold
                while not messages:
                    with self._cond:
                        while self.stored == seen:
                            left = deadline - _time.monotonic()
                            if left <= 0:
                                return messages
                            self._cond.wait(left)
                        seen = self.stored
                    messages = fetch()
                return messages
            finally:
                self._slots.release()

        if callable(getattr(state, "get_message_ins", None)):  # Flower 1.42
            get_message_ins = state.get_message_ins

            def get(node_id, limit, *, run_id=None):
                node_pull = node_id != SUPERLINK_NODE_ID and run_id is None
                return held(lambda: get_message_ins(node_id, limit, run_id=run_id), node_pull)

            state.get_message_ins = get
        if callable(getattr(state, "get_messages", None)):  # Flower 1.43
            get_messages = state.get_messages

            def get_pending(*, dst_node_id, run_id=None, reply_to_message_ids=None, limit=None):
                node_pull = (
                    dst_node_id != SUPERLINK_NODE_ID and run_id is None and reply_to_message_ids is None
                )
                args = {"run_id": run_id, "reply_to_message_ids": reply_to_message_ids, "limit": limit}
                return held(lambda: get_messages(dst_node_id=dst_node_id, **args), node_pull)

            state.get_messages = get_pending
        if callable(getattr(state, "store_message_ins", None)):
            store_message_ins = state.store_message_ins

            def store(message):
                message_id = store_message_ins(message)
                if message_id is not None:
                    stored()
                return message_id

            state.store_message_ins = store
        if callable(getattr(state, "store_messages", None)):  # Flower 1.43
            store_messages = state.store_messages

            def store_many(messages):
                accepted = store_messages(messages)
                if any(ok for ok, m in zip(accepted, messages) if not m.metadata.reply_to_message_id):
                    stored()
                return accepted

            state.store_messages = store_many
        store_with_tree = state.store_message_and_object_tree

        def store_and_tree(message, object_tree, session_id):
            # the ServerApp's push: its transaction is committed when this returns (the wake-up
            # from the store inside it may come before the row is visible)
            result = store_with_tree(message, object_tree, session_id)
            if result[0] and not message.metadata.reply_to_message_id:
                stored()
            return result

        state.store_message_and_object_tree = store_and_tree
        return state


def hold_pulls(hold: float | None = None) -> None:
    """Make the SuperLink's link state (file or ``:flwr-in-memory:``) hold idle pulls (:class:`HeldPulls`)."""
    hold = pull_hold() if hold is None else hold
    if hold <= 0:
        return
    from flwr.superlink import main as superlink_main

    held = HeldPulls(hold)
    factories = superlink_main.get_objectstore_linkstate_factories

    def held_factories(database: str, federation_manager):
        objects, links = factories(database, federation_manager)
        make_state = links.state
        wrapped = []

        def state():
            instance = make_state()
            if not wrapped:  # Flower's factory makes one instance and returns it every time
                wrapped.append(held.wrap(instance))
            return instance

        links.state = state
        return objects, links

    superlink_main.get_objectstore_linkstate_factories = held_factories


def superlink_main(argv: list[str]) -> None:
    """``fedderm-superlink``: ``flower-superlink`` (same options) with :func:`link_state_in_memory`
    and :func:`hold_pulls`."""
    from flwr.superlink.cli.flower_superlink import flower_superlink

    link_state_in_memory()
    hold_pulls()
    os.environ[ACCELERATED_ENV] = "1"  # the ServerApp it starts shortens its object pulls too
    sys.argv = ["flower-superlink", *argv]
    flower_superlink()


def self_test_held_pull(hold: float = 0.2) -> str | None:
    """A SuperNode's pull through Flower's own Fleet handler, on Flower's in-memory link state
    wrapped by :class:`HeldPulls`, with nothing waiting: it must be held for ``hold`` seconds.
    Returns what failed, or ``None``."""
    from flwr.proto.fleet_pb2 import PullMessagesRequest  # pylint: disable=no-name-in-module
    from flwr.proto.node_pb2 import Node  # pylint: disable=no-name-in-module
    from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.superlink.federation.noop_federation_manager import NoOpFederationManager
    from flwr.superlink.servicer.fleet import fleet_handlers

    store = ObjectStoreFactory().store()
    state = HeldPulls(hold).wrap(InMemoryLinkState(NoOpFederationManager(), store))
    start = _time.monotonic()
    reply = fleet_handlers.pull_messages(PullMessagesRequest(node=Node(node_id=4242)), state, store)
    waited = _time.monotonic() - start
    if list(reply.messages_list) or waited < 0.8 * hold:
        return f"held pull: an idle pull through Flower's Fleet handler answered after {waited:.3f} s, not {hold} s"
    return None
