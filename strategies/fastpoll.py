"""Fast polling of Flower's Grid: ``send_and_receive`` that checks for replies every 0.1 s (0.02 s
on the simulation's in-memory grid) instead of Flower's 3 s, and :class:`FastPollGrid`, the Grid
the ServerApp hands every strategy (it also applies the ``transport-dtype`` codec of :mod:`wire`)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from logging import INFO, WARNING

from flwr.app import Message
from flwr.common import log
from flwr.serverapp import Grid

import wire
from fedderm.flower_private import grid_kind

from .progress import duration

POLL_INTERVAL = 0.1  # seconds between pulls in send_and_receive_fast
#: seconds until the first line that says, during a long wave of messages, how many clients have
#: replied; each later line waits twice as long as the one before, at most :data:`PROGRESS_MAX`
PROGRESS_EVERY = 30.0
PROGRESS_MAX = 300.0
#: between pulls on the simulation's in-memory grid, where a pull is cheap: every wave of
#: messages (train, evaluate, ring hop) ends within 20 ms of its last reply instead of 100 ms
IN_MEMORY_POLL_INTERVAL = 0.02


#: message types as a person says them
_WAVES = {
    "train": "training",
    "train.pretrain": "pre-training",
    "train.finetune": "fine-tuning",
    "evaluate": "evaluation",
    "query.info": "the handshake (the clients load their data)",
}


def wave_label(messages: list[Message]) -> str:
    """What a wave of ``messages`` is, for a person: ``round 3 training``, ``round 3 evaluation``,
    ``the handshake (the clients load their data)``."""
    if not messages or not isinstance(messages[0], Message):
        return "messages"
    kind = messages[0].metadata.message_type
    what = _WAVES.get(kind) or _WAVES.get(kind.split(".")[0], kind)
    if kind.startswith("train.") and kind not in _WAVES:
        what = f"training ({kind.split('.', 1)[1]})"
    config = messages[0].content.config_records.get("config")
    server_round = config.get("server-round") if config is not None else None
    return f"round {server_round} {what}" if isinstance(server_round, int) else what


def send_and_receive_fast(
    grid: Grid,
    messages: Iterable[Message],
    timeout: float | None = None,
    poll_interval: float = POLL_INTERVAL,
    progress_every: float | None = PROGRESS_EVERY,
    clock=time.monotonic,
) -> list[Message]:
    """``grid.send_and_receive`` that checks for replies every ``poll_interval`` seconds.

    Flower's deployment grid (``HttpGrid``) sleeps 3 s between pulls, so every message
    exchange (a round's train or evaluate wave, every hop of a ring) ends up to 3 s after the
    last reply arrived.  This pushes ``messages``, then pulls every ``poll_interval`` s until each
    has a reply or ``timeout`` (s; None waits forever) has passed, and returns the replies
    received (like Flower: missing replies are simply absent).  Works on any Grid (simulation's
    ``InMemoryGrid`` too).  After ``progress_every`` seconds without every reply it logs how
    many clients have replied (None: never), then after twice as long each time, up to every
    :data:`PROGRESS_MAX` seconds (a deployment's rounds may take many minutes).
    """
    messages = list(messages)
    label = wave_label(messages)
    pushed = list(grid.push_messages(messages))
    pending = {mid for mid in pushed if mid}
    if len(pending) < len(pushed):
        log(
            WARNING,
            "send_and_receive_fast: %d of %d messages could not be pushed",
            len(pushed) - len(pending),
            len(pushed),
        )
    start = clock()
    end = None if timeout is None else start + timeout
    gap = progress_every
    next_line = None if gap is None else start + gap
    expected = len(pending)
    replies: list[Message] = []
    while pending:
        got = list(grid.pull_messages(pending))
        replies.extend(got)
        pending.difference_update(m.metadata.reply_to_message_id for m in got)
        if not pending:
            break
        now = clock()
        if end is not None and now >= end:
            break
        if next_line is not None and now >= next_line:
            log(
                INFO,
                "%s: %d of %d clients replied · %s so far",
                label,
                expected - len(pending),
                expected,
                duration(now - start),
            )
            gap = min(2 * gap, max(PROGRESS_MAX, progress_every))
            next_line = now + gap
        time.sleep(poll_interval if end is None else max(0.0, min(poll_interval, end - clock())))
    return replies


class WrappedGrid(Grid):
    """A Grid that hands everything to the grid it wraps (``inner``); subclasses change a part."""

    def __init__(self, grid: Grid):
        self.inner = grid

    def set_run(self, run):
        return self.inner.set_run(run)

    @property
    def run(self):
        return self.inner.run

    def create_message(self, *args, **kwargs):
        return self.inner.create_message(*args, **kwargs)

    def get_node_ids(self):
        return self.inner.get_node_ids()

    def get_nodes(self):
        return self.inner.get_nodes()

    def push_messages(self, messages):
        return self.inner.push_messages(messages)

    def pull_messages(self, message_ids):
        return self.inner.pull_messages(message_ids)

    def send_and_receive(self, messages, *, timeout=None):
        return self.inner.send_and_receive(messages, timeout=timeout)

    def __getattr__(self, name):  # anything else a concrete grid offers
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


class FastPollGrid(WrappedGrid):
    """A Grid whose ``send_and_receive`` is :func:`send_and_receive_fast`, and whose messages
    carry their arrays in ``transport-dtype``; all else delegated.

    The ServerApp wraps Flower's grid in it once, so every strategy (and Flower's own
    ``Strategy.start``) gets replies within ``poll_interval`` of their arrival.
    """

    def __init__(
        self,
        grid: Grid,
        poll_interval: float | None = None,
        transport: str = "float32",
        pack: bool | None = None,
    ):
        super().__init__(grid)
        #: ``"simulation"``, ``"deployment"`` or ``"other"`` (a test's fake grid)
        self.kind = grid_kind(grid)
        if poll_interval is None:  # in memory (simulation): pulls are cheap, poll more often
            poll_interval = IN_MEMORY_POLL_INTERVAL if self.kind == "simulation" else POLL_INTERVAL
        #: deployment: every message's arrays travel as one Array (:func:`wire.pack_content`):
        #: Flower moves each Array as 2 objects, one HTTP request each per hop
        self.pack = self.kind == "deployment" if pack is None else pack
        self.poll_interval = poll_interval
        #: ``transport-dtype``: outgoing arrays are encoded in it, replies decoded back to float32
        self.transport = transport
        #: stamps every message but the handshake with the client-state step (a
        #: :class:`strategies.common.StateClock`, set by the ServerApp)
        self.state_clock = None
        #: why the run must stop (:meth:`stop`): every later call on the grid raises it
        self.stopped = ""
        #: seconds between the "n of m clients replied" lines of a long wave (None: none)
        self.progress_every = PROGRESS_EVERY

    def stop(self, reason: str) -> None:
        """End the ServerApp's wait: its next (or current) push, pull or node query raises
        ``RuntimeError(reason)`` (``sim.py`` calls it when the simulation runtime failed, so that
        a ServerApp waiting for clients that will never answer ends at once)."""
        self.stopped = reason or "the run was stopped"

    def _check_stopped(self) -> None:
        if self.stopped:
            raise RuntimeError(self.stopped)

    def get_node_ids(self):
        self._check_stopped()
        return self.inner.get_node_ids()

    def push_messages(self, messages):
        self._check_stopped()
        messages = list(messages)
        if self.state_clock is not None:
            for m in messages:
                if m.metadata.message_type != "query.info":
                    m.content[wire.STAMP] = self.state_clock.stamp()
        messages = [wire.encode_message(m, self.transport) for m in messages]
        if self.pack:
            messages = [wire.pack_message(m) for m in messages]
        return self.inner.push_messages(messages)

    def pull_messages(self, message_ids):
        self._check_stopped()
        return [
            wire.decode_message(wire.unpack_message(m), self.transport)
            for m in self.inner.pull_messages(message_ids)
        ]

    def send_and_receive(self, messages, *, timeout=None):
        return send_and_receive_fast(self, messages, timeout, self.poll_interval, self.progress_every)
