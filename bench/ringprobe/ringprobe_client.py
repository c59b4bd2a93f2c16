"""The ring probe's ClientApp: add 1 to the array, pass it back with timestamps of this hop."""

import os
import time

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp


def fedderm_packing(msg: Message, context: Context, call_next) -> Message:
    """fedderm's ``clients.transport.pack_mod`` for a message the ServerApp packed (mode
    ``fedderm``: :class:`strategies.fastpoll.FastPollGrid`, one ConfigRecord per message);
    anything else passes as it is, without importing fedderm."""
    if msg.has_content() and "fedderm-packed" in msg.content.config_records:
        from clients.transport import pack_mod

        return pack_mod(msg, context, call_next)
    return call_next(msg, context)


app = ClientApp(mods=[fedderm_packing])


def process_start_time() -> float:
    """Wall-clock time this process started (or was forked), to a clock tick (Linux /proc), or
    -1 where unknown.  Measured back from now with /proc/uptime (10 ms), not from /proc/stat's
    btime, which is whole seconds and put the split between pickup and startup off by up to 1 s."""
    try:
        ticks = int(open(f"/proc/{os.getpid()}/stat").read().rsplit(")", 1)[1].split()[19])
        now, uptime = time.time(), float(open("/proc/uptime").read().split()[0])
        return now - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return -1.0


@app.query("hop")
def hop(msg: Message, context: Context) -> Message:
    t_handler = time.time()
    if msg.content["config"]["import-fedderm"]:
        import client_app  # noqa: F401  fedderm's ClientApp module: the real per-process start-up cost

    x = msg.content["arrays"]["x"].numpy()
    times = ConfigRecord({"process-start": process_start_time(), "handler": t_handler, "reply": time.time()})
    return Message(RecordDict({"arrays": ArrayRecord({"x": Array(x + 1)}), "times": times}), reply_to=msg)
