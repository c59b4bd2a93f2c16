"""Transport precision on the wire (``transport-dtype``): the client mod (the codec is in :mod:`wire`).

With ``transport-dtype="float16"`` every floating-point array leaves a client as float16 and
arrives back as float32, on the server (:class:`strategies.fastpoll.FastPollGrid`) and on the
client (:func:`transport_mod`): handlers and strategies never see float16.  The numbers are in
:mod:`fedderm.transport`.
"""

from __future__ import annotations

from flwr.app import Context, Message

from wire import decode_message, encode_message, is_packed, pack_message, unpack_message

from .common import RUN_CONFIG

KEY = "transport-dtype"


def transport_of(context: Context) -> str:
    """The run's ``transport-dtype``: from the config the server handed out, else the run config."""
    source = context.state[RUN_CONFIG] if RUN_CONFIG in context.state else context.run_config
    return str(source.get(KEY, "float32"))


def transport_mod(msg: Message, context: Context, call_next) -> Message:
    """Flower client mod: decode what arrives, encode what leaves (``transport-dtype``)."""
    out = call_next(decode_message(msg, transport_of(context)), context)
    return encode_message(out, transport_of(context))


def pack_mod(msg: Message, context: Context, call_next) -> Message:
    """Flower client mod, outermost: a message the server packed (:func:`wire.pack_content`, in a
    deployment: one ConfigRecord) is unpacked before any other mod sees it, and its reply packed
    the same way."""
    packed = msg.has_content() and is_packed(msg.content)
    out = call_next(unpack_message(msg) if packed else msg, context)
    return pack_message(out) if packed else out
