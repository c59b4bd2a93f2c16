"""Where a deployed message exchange goes, read off a loopback federation's DEBUG logs.

    FLWR_LOG_LEVEL=DEBUG python -m deploy.loopback --method fedavg --rounds 3 --keep --workdir /tmp/lb
    python -m bench.deploy_phases /tmp/lb

For every train/evaluate message a SuperNode handled (``logs/supernode-*.log``, Flower's DEBUG
timestamps) it takes the median of: header received -> the ClientApp loads the app (objects pulled
SuperLink -> SuperNode -> ClientApp, the ClientApp process started or forked), app loaded -> reply
handed to the SuperNode (app import + the handler's work), and the SuperNode's reply push to the
SuperLink; and from the ServerApp's log (``logs/run-fedavg.log``) the median exchange, from
``configure_*`` to ``aggregate_*``.  What the exchange has beyond the slowest node's three phases
is the ServerApp's push and its pull of the replies.
"""

from __future__ import annotations

import re
import statistics
import sys
from datetime import datetime
from pathlib import Path

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STAMP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")


def _lines(path: Path) -> list[tuple[float, str]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        line = _ANSI.sub("", line)
        if m := _STAMP.search(line):
            out.append((datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp(), line))
    return out


def node_messages(log: Path) -> list[dict]:
    """One dict of timestamps per message a SuperNode received and answered."""
    out, cur = [], None
    for t, line in _lines(log):
        if "Receiving:" in line:
            cur = {"kind": line.split("Receiving:")[1].split()[0], "recv": t}
        elif cur is None:
            continue
        elif "Loading ClientApp" in line:
            cur["load"] = t
        elif "Runtime.PushMessages" in line and "load" in cur and "push" not in cur:
            cur["push"] = t
        elif "Sending:" in line:
            cur["send"] = t
        elif "Sent successfully" in line:
            cur["sent"] = t
            out.append(cur)
            cur = None
    return out


def exchanges(run_log: Path) -> list[float]:
    out, start = [], None
    for t, line in _lines(run_log):
        if "configure_" in line and "Sampled" in line:
            start = t
        elif "aggregate_" in line and "Received" in line and start is not None:
            out.append(t - start)
            start = None
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not (Path(argv[0]) / "logs").is_dir():
        raise SystemExit("usage: python -m bench.deploy_phases WORKDIR (a loopback --keep folder with logs/)")
    work = Path(argv[0])
    msgs = [m for f in sorted((work / "logs").glob("supernode-hospital-*.log")) for m in node_messages(f)]
    msgs = [m for m in msgs if m["kind"] in ("train", "evaluate") and {"load", "push"} <= set(m)]
    runs = sorted((work / "logs").glob("run-*.log"))
    if not msgs or not runs:
        raise SystemExit(f"{work}/logs: no DEBUG timestamps (run the loopback with FLWR_LOG_LEVEL=DEBUG)")

    def med(f) -> float:
        return statistics.median(f(m) for m in msgs)

    ex = [e for run in runs for e in exchanges(run)]
    print(f"{work}: {len(msgs)} train/evaluate messages, {len(ex)} exchanges (medians)")
    print(f"  header in -> ClientApp loads the app      {med(lambda m: m['load'] - m['recv']):6.2f} s")
    print(f"  app loaded -> reply at the SuperNode      {med(lambda m: m['push'] - m['load']):6.2f} s")
    print(f"  SuperNode reply push to the SuperLink     {med(lambda m: m['sent'] - m['send']):6.2f} s")
    print(f"  exchange (configure_* -> aggregate_*)     {statistics.median(ex):6.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
