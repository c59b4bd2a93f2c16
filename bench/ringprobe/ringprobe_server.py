"""Pass one array around the ring of SuperNodes, one node at a time, and time every hop.

A hop = push one message to the next node -> that node's SuperNode picks it up, its SuperExec
starts a ClientApp process, the ClientApp replies -> the ServerApp has the reply.  The ClientApp
returns the wall-clock times at which its process started, its handler ran and it replied, so a
hop splits into ``pickup`` (push -> ClientApp process started: SuperNode + SuperExec polling),
``startup`` (process start -> handler: Python/Flower/torch imports), ``work`` (the handler) and
``return`` (reply -> ServerApp has it: SuperNode reply push + ServerApp polling).  Each mode in
``modes`` does ``hops`` hops: ``flower`` with Flower's ``Grid.send_and_receive`` (HttpGrid pulls
every 3 s), ``fast`` with fedderm's ``strategies.fastpoll.send_and_receive_fast`` (0.1 s), and
``fedderm`` through fedderm's own :class:`strategies.fastpoll.FastPollGrid`, as fedderm's
ServerApp sends every deployed message: ``send_and_receive_fast`` with each message packed into
one ConfigRecord (3 objects per message instead of 6 here; the ClientApp unpacks it with
fedderm's ``pack_mod`` and packs its reply the same way).
"""

import json
import statistics
import time
from logging import INFO
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common import log
from flwr.serverapp import Grid, ServerApp

app = ServerApp()


def _exchange(mode: str):
    if mode == "flower":
        return lambda grid, msgs, timeout: list(grid.send_and_receive(msgs, timeout=timeout))
    if mode == "fast":
        from fedderm.accel.waits import fast_object_pulls
        from strategies.fastpoll import send_and_receive_fast  # fedderm's helper (PYTHONPATH = repo root)

        fast_object_pulls()  # as fedderm's ServerApp does in a deployment

        return send_and_receive_fast
    if mode == "fedderm":
        from fedderm.accel.waits import fast_object_pulls
        from strategies.fastpoll import FastPollGrid

        fast_object_pulls()
        return lambda grid, msgs, timeout: FastPollGrid(grid).send_and_receive(msgs, timeout=timeout)
    raise ValueError(f"unknown mode {mode!r}: use flower, fast or fedderm")


@app.main()
def main(grid: Grid, context: Context) -> None:
    rc = context.run_config
    hops, need = int(rc["hops"]), int(rc["min-nodes"])
    while len(nodes := sorted(grid.get_node_ids())) < need:
        time.sleep(0.5)
    payload = np.arange(int(rc["payload-kb"]) * 256, dtype=np.float32)
    results = {"nodes": len(nodes), "hops": hops, "payload_kb": int(rc["payload-kb"]), "modes": {}}
    for mode in [m.strip() for m in str(rc["modes"]).split(",") if m.strip()]:
        exchange = _exchange(mode)
        arrays, times = ArrayRecord({"x": Array(payload)}), []
        parts: dict[str, list[float]] = {"pickup": [], "startup": [], "work": [], "return": []}
        for hop in range(hops):
            dst = nodes[hop % len(nodes)]
            msg = Message(
                RecordDict(
                    {
                        "arrays": arrays,
                        "config": ConfigRecord({"hop": hop, "import-fedderm": bool(rc["import-fedderm"])}),
                    }
                ),
                dst_node_id=dst,
                message_type="query.hop",
            )
            t0, w0 = time.monotonic(), time.time()
            replies = exchange(grid, [msg], 300)
            times.append(time.monotonic() - t0)
            w1 = time.time()
            if len(replies) != 1 or replies[0].has_error():
                raise RuntimeError(f"hop {hop} to node {dst} failed: {replies}")
            arrays = replies[0].content["arrays"]
            t = replies[0].content["times"]
            if t["process-start"] > 0:
                parts["pickup"].append(t["process-start"] - w0)
                parts["startup"].append(t["handler"] - t["process-start"])
            parts["work"].append(t["reply"] - t["handler"])
            parts["return"].append(w1 - t["reply"])
        if not np.array_equal(arrays["x"].numpy(), payload + hops):
            raise RuntimeError("the array did not make it around the ring intact")
        summary = {
            "hop_s": times,
            "median_s": statistics.median(times),
            "mean_s": statistics.fmean(times),
            "min_s": min(times),
            "max_s": max(times),
            "parts_mean_s": {k: statistics.fmean(v) for k, v in parts.items() if v},
            "parts": parts,
        }
        results["modes"][mode] = summary
        log(
            INFO,
            "ringprobe %s: %d hops · median %.2f s · mean %.2f s · min %.2f · max %.2f · mean parts %s",
            mode,
            hops,
            summary["median_s"],
            summary["mean_s"],
            summary["min_s"],
            summary["max_s"],
            {k: round(v, 2) for k, v in summary["parts_mean_s"].items()},
        )
    if rc.get("out"):
        Path(str(rc["out"])).write_text(json.dumps(results, indent=2))
