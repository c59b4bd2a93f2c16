"""The client side of :mod:`fedderm.state_store`: where a client's state lives, and the mod that
opens it for each message and commits what the handler changed.

Every message the server sends (but the handshake) carries a ``fedderm-state`` ConfigRecord:
``run`` (the run folder's name), ``run-dir`` (simulation only: the run folder itself), ``step``
(the server-checkpoint interval the message belongs to), ``resume`` (the step of the checkpoint
the server started from, 0 for a fresh run), ``token`` (new for every server process) and
``keep`` (``keep-checkpoints``).  The state of client ``<partition-id>`` lives in

- ``<state-dir>/client-state/<run>/client-<partition-id>`` with node config ``state-dir``;
- ``<run-dir>/client-state/client-<partition-id>`` in simulation;
- ``$XDG_CACHE_HOME/fedderm/client-state/<run>/client-<partition-id>`` (default ``~/.cache``) else.

Flower's run id and node id play no part: a resumed run (a new Flower run) finds the state.
Handlers reach the state with :func:`client_state`; ``context.state`` holds none of it.
"""

from __future__ import annotations

import os
from logging import WARNING
from pathlib import Path

from flwr.app import Context, Message
from flwr.common import log

from fedderm.node import parse_node_config
from fedderm.state_store import Snapshot, StateStore
from wire import STAMP  # the ConfigRecord every server message carries

_OPEN: dict[tuple[int, int], Snapshot] = {}  # the snapshot of the message being handled
_MEMORY: dict[tuple[int, int], Snapshot] = {}  # handlers called without the mod (unit tests)


def default_root() -> Path:
    return (
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
        / "fedderm"
        / "client-state"
    )


def state_folder(context: Context, stamp) -> tuple[Path, str]:
    """This client's state folder for the run named in ``stamp``, and its label for messages."""
    node = parse_node_config(context.node_config, context.node_id)
    client = f"client-{node.partition_id}"
    run = str(stamp["run"])
    if node.state_dir is not None:
        folder = node.state_dir / "client-state" / run / client
    elif stamp.get("run-dir"):
        folder = Path(str(stamp["run-dir"])) / "client-state" / client
    else:
        folder = default_root() / run / client
    return folder, node.label


def _key(context: Context) -> tuple[int, int]:
    return context.run_id, context.node_id


def client_state(context: Context) -> Snapshot:
    """This client's state for the message being handled (see :class:`fedderm.state_store.Snapshot`).

    Outside :func:`state_mod` (a handler called directly), an in-memory state per run and node."""
    if _key(context) in _OPEN:
        return _OPEN[_key(context)]
    return _MEMORY.setdefault(_key(context), Snapshot(None, 0, None, {}))


def state_mod(msg: Message, context: Context, call_next) -> Message:
    """Flower client mod: open the client's state at the message's step (rolling back first when
    a resumed server starts from an earlier checkpoint), handle the message, commit the changes."""
    stamp = msg.content.config_records.get(STAMP) if msg.has_content() else None
    if stamp is None:
        return call_next(msg, context)
    del msg.content[STAMP]
    folder, label = state_folder(context, stamp)
    store = StateStore(folder, keep=int(stamp["keep"]), label=label)
    note = store.start_session(str(stamp["token"]), int(stamp["resume"]))
    if note:
        log(WARNING, "%s", note)
    snap = store.open(int(stamp["step"]))
    _OPEN[_key(context)] = snap
    try:
        out = call_next(msg, context)
    finally:
        _OPEN.pop(_key(context), None)
    if not out.has_error():
        snap.commit()
    return out
