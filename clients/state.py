"""The client side of :mod:`fedderm.state_store`: where a client's state lives, and the mod that
opens it for each message and commits what the handler changed.

Every message the server sends (but the handshake) carries a ``fedderm-state`` ConfigRecord:
``run`` (the run folder's name), ``step`` (the server-checkpoint interval the message belongs to),
``resume`` (the step of the checkpoint the server started from, 0 for a fresh run), ``token``
(secret, new for every server process) and ``keep`` (``keep-checkpoints``).  The state of client
``<partition-id>`` lives in

- ``<state-dir>/client-state/<run>/client-<partition-id>`` with node config ``state-dir``;
- ``<run folder>/client-state/client-<partition-id>`` in a simulation on this machine: the run
  folder its server registered under its token (:func:`fedderm.state_store.register_simulation`);
- ``$XDG_CACHE_HOME/fedderm/client-state/<run>/client-<partition-id>`` (default ``~/.cache``) else.

The server decides none of these paths: ``<run>`` is reduced to one safe folder name
(:func:`fedderm.paths.safe_component`), the partition id is the client's own, and a path the
server might send (older fedderm servers sent ``run-dir``) is never read.  Flower's run id and node
id play no part: a resumed run (a new Flower run) finds the state.  Handlers reach the state with
:func:`client_state`; ``context.state`` holds none of it.
"""

from __future__ import annotations

from logging import WARNING
from pathlib import Path

from flwr.app import Context, Message
from flwr.common import log

from fedderm.node import parse_node_config
from fedderm.paths import inside, safe_component
from fedderm.state_store import Snapshot, StateStore, default_root, simulation_run_dir, stamp_int
from wire import STAMP  # the ConfigRecord every server message carries

__all__ = ["client_state", "default_root", "state_folder", "state_mod"]

_OPEN: dict[tuple[int, int], Snapshot] = {}  # the snapshot of the message being handled
_MEMORY: dict[tuple[int, int], Snapshot] = {}  # handlers called without the mod (unit tests)


def state_folder(context: Context, stamp) -> tuple[Path, str]:
    """This client's state folder for the run named in ``stamp``, and its label for messages.

    Only the client's node config and this machine's own simulation registration decide where it
    is; the run's name becomes one safe folder name inside it."""
    node = parse_node_config(context.node_config, context.node_id)
    client = safe_component(f"client-{node.partition_id}")
    run = safe_component(stamp.get("run", ""))
    if node.state_dir is not None:
        folder = inside(node.state_dir / "client-state", run, client)
    elif (run_dir := simulation_run_dir(stamp.get("token"))) is not None:
        folder = inside(run_dir / "client-state", client)
    else:
        folder = inside(default_root(), run, client)
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
    step, resume, keep = (stamp_int(stamp, key) for key in ("step", "resume", "keep"))
    folder, label = state_folder(context, stamp)
    store = StateStore(folder, keep=keep, label=label)
    note = store.start_session(str(stamp.get("token", "")), resume)
    if note:
        log(WARNING, "%s", note)
    snap = store.open(step)
    _OPEN[_key(context)] = snap
    try:
        out = call_next(msg, context)
    finally:
        _OPEN.pop(_key(context), None)
    if not out.has_error():
        snap.commit()
    return out
