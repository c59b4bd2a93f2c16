"""Transport precision on the wire (``transport-dtype``): the client mod and the shared codec.

With ``transport-dtype="float16"`` every floating-point array leaves a client as float16 and
arrives back as float32, on the server (:class:`strategies.common.FastPollGrid`) and on the
client (:func:`transport_mod`): handlers and strategies never see float16.  The numbers are in
:mod:`fedderm.transport`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, RecordDict

from fedderm import transport as codec

from .common import RUN_CONFIG

KEY = "transport-dtype"


def recode(content: RecordDict, fn: Callable[[np.ndarray], np.ndarray]) -> RecordDict:
    """``content`` with every array passed through ``fn``.  Arrays ``fn`` returns unchanged, and
    records with no change, are kept as they are (the same objects): the default transport
    costs nothing."""
    out = RecordDict()
    for name, record in content.items():
        if name in content.array_records:
            arrays, changed = dict(record.items()), {}
            for key, array in arrays.items():
                values = array.numpy()
                new = fn(values)
                if new is not values:  # np.require keeps 0-d arrays 0-d (ascontiguousarray would not)
                    changed[key] = Array(np.require(new, requirements="C"))
            if changed:
                record = ArrayRecord({key: changed.get(key, array) for key, array in arrays.items()})
        out[name] = record
    return out


def encode_message(msg: Message, transport: str) -> Message:
    """``msg`` with its arrays in the transport dtype (in place; returns ``msg``)."""
    if transport != "float32" and msg.has_content():
        msg.content = recode(msg.content, lambda v: codec.encode(v, transport))
    return msg


def decode_message(msg: Message, transport: str) -> Message:
    """``msg`` with float16 arrays back in float32 (in place; returns ``msg``)."""
    if transport != "float32" and msg.has_content():
        msg.content = recode(msg.content, lambda v: codec.decode(v, transport))
    return msg


def transport_of(context: Context) -> str:
    """The run's ``transport-dtype``: from the config the server handed out, else the run config."""
    source = context.state[RUN_CONFIG] if RUN_CONFIG in context.state else context.run_config
    return str(source.get(KEY, "float32"))


def transport_mod(msg: Message, context: Context, call_next) -> Message:
    """Flower client mod: decode what arrives, encode what leaves (``transport-dtype``)."""
    out = call_next(decode_message(msg, transport_of(context)), context)
    return encode_message(out, transport_of(context))
