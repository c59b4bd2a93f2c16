"""fedderm's ClientApp with injected faults, for the reliability tests.

``FEDDERM_TEST_FAULTS`` holds JSON ``[[partition, round, fault], ...]`` with fault ``raise``
(the handler raises), ``hang`` (the client never answers within the round timeout: it sleeps
``FEDDERM_TEST_HANG`` seconds), ``nan`` (weights full of NaN) or ``shape`` (one array of the
wrong shape). Faults apply to train messages only.
"""

import json
import os
import time

import numpy as np
from flwr.app import Array, ArrayRecord
from flwr.clientapp import ClientApp

import client_app as real


def fault_mod(msg, context, call_next):
    faults = json.loads(os.environ.get("FEDDERM_TEST_FAULTS", "[]"))
    pid = context.node_config.get("partition-id")
    rnd = msg.content["config"].get("server-round") if "config" in msg.content else None
    todo = (
        {f for p, r, f in faults if p == pid and r == rnd}
        if msg.metadata.message_type.startswith("train")
        else set()
    )
    if "raise" in todo:
        raise RuntimeError(f"injected failure on client {pid} in round {rnd}")
    if "hang" in todo:
        time.sleep(float(os.environ.get("FEDDERM_TEST_HANG", "60")))
    out = call_next(msg, context)
    if {"nan", "shape"} & todo:
        arrays = out.content["arrays"]
        key = next(iter(arrays))
        values = arrays[key].numpy()
        bad = np.full_like(values, np.nan) if "nan" in todo else np.zeros(values.shape + (2,), values.dtype)
        out.content["arrays"] = ArrayRecord({**{k: v for k, v in arrays.items()}, key: Array(bad)})
    return out


app = real.register(ClientApp(mods=[*real.MODS, fault_mod]))  # faults act on what the handler returned
