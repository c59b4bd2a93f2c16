"""Where a deployed message exchange goes, read off a loopback federation's DEBUG logs.

    FLWR_LOG_LEVEL=DEBUG python -m deploy.loopback --method fedavg --rounds 3 --keep --workdir /tmp/lb
    python -m bench.deploy_phases /tmp/lb

Every exchange of the ServerApp's log (``logs/run-<name>.log``: ``configure_<kind>`` to
``aggregate_<kind>``) is matched with the messages the SuperNodes received during it
(``logs/supernode-*.log``, Flower's DEBUG timestamps), and each message split into phases:
the ServerApp's push until the SuperNode has the header, the SuperNode's pull of the message's
objects from the SuperLink, the ClientApp (forked or started) getting the message and loading the
app, the handler's work, the reply back to the SuperNode, the SuperNode's push to the SuperLink,
and, per exchange, the last reply's arrival until the ServerApp has pulled all.  Printed: the
median of each phase per exchange kind (train, evaluate).
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
    """One dict of timestamps per message a SuperNode received and answered: ``recv`` (header
    pulled from the SuperLink), ``pulled`` (all its objects pulled: "Received successfully"),
    ``load`` (the ClientApp has the message and loads the app), ``push`` (the reply handed to the
    SuperNode), ``send``/``sent`` (the SuperNode's push of the reply to the SuperLink)."""
    out, cur = [], None
    for t, line in _lines(log):
        if "Receiving:" in line:
            cur = {"kind": line.split("Receiving:")[1].split()[0], "recv": t}
        elif cur is None:
            continue
        elif "Received successfully" in line and "pulled" not in cur:
            cur["pulled"] = t
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


def exchange_spans(run_log: Path) -> list[tuple[str, float, float]]:
    """(kind, start, end) of every exchange in the ServerApp's log: ``configure_<kind>`` (the
    messages are built and pushed next) to ``aggregate_<kind>`` (every reply pulled)."""
    out, start = [], None
    for t, line in _lines(run_log):
        if "configure_" in line and "Sampled" in line:
            start = (line.split("configure_")[1].split(":")[0].split()[0], t)
        elif "aggregate_" in line and "Received" in line and start is not None:
            out.append((start[0], start[1], t))
            start = None
    return out


def exchanges(run_log: Path) -> list[float]:
    return [end - start for _, start, end in exchange_spans(run_log)]


#: (label, seconds of one message or exchange); ``m``: a message, ``x``: its exchange's span and messages
PHASES = (
    ("server push -> header at the SuperNode", lambda m, x: m["recv"] - x[1]),
    ("SuperNode pulls the objects (SuperLink)", lambda m, x: m["pulled"] - m["recv"]),
    ("ClientApp forked, gets message, loads", lambda m, x: m["load"] - m["pulled"]),
    ("handler (train, evaluate; val ride)", lambda m, x: m["push"] - m["load"]),
    ("reply pushed to the SuperNode", lambda m, x: m["send"] - m["push"]),
    ("SuperNode pushes reply to the SuperLink", lambda m, x: m["sent"] - m["send"]),
    ("last reply at SuperLink -> ServerApp has all", lambda m, x: x[2] - x[3]),
)


def phases(work: Path) -> dict[str, dict]:
    """Per exchange kind (``train``, ``evaluate``): its count, the median of every phase over its
    messages and the median exchange."""
    msgs = [m for f in sorted((work / "logs").glob("supernode-hospital-*.log")) for m in node_messages(f)]
    msgs = [m for m in msgs if {"pulled", "load", "push", "send"} <= set(m)]
    spans = [x for run in sorted((work / "logs").glob("run-*.log")) for x in exchange_spans(run)]
    out: dict[str, dict] = {}
    for kind in sorted({k for k, _, _ in spans}, key=lambda k: (k != "train", k)):
        rows, totals = {label: [] for label, _ in PHASES}, []
        for span in (x for x in spans if x[0] == kind):
            mine = [m for m in msgs if span[1] <= m["recv"] <= span[2] and m["kind"] == kind]
            if not mine:
                continue
            x = (*span, max(m["sent"] for m in mine))
            totals.append(span[2] - span[1])
            for label, f in PHASES:
                rows[label] += [f(m, x) for m in mine]
        if totals:
            out[kind] = {
                "exchanges": len(totals),
                "messages": len(rows[PHASES[0][0]]),
                "phases": {label: statistics.median(v) for label, v in rows.items()},
                "exchange": statistics.median(totals),
            }
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not (Path(argv[0]) / "logs").is_dir():
        raise SystemExit("usage: python -m bench.deploy_phases WORKDIR (a loopback --keep folder with logs/)")
    work = Path(argv[0])
    table = phases(work)
    if not table:
        raise SystemExit(f"{work}/logs: no DEBUG timestamps (run the loopback with FLWR_LOG_LEVEL=DEBUG)")
    kinds = list(table)
    n_msgs = sum(t["messages"] for t in table.values())
    n_ex = sum(t["exchanges"] for t in table.values())
    print(f"{work}: {n_msgs} train/evaluate messages, {n_ex} exchanges (medians, seconds)")
    print(f"  {'':<46}" + "".join(f"{k:>10}" for k in kinds))
    for label, _ in PHASES:
        print(f"  {label:<46}" + "".join(f"{table[k]['phases'][label]:>10.2f}" for k in kinds))
    print(
        f"  {'exchange (configure_* -> aggregate_*)':<46}"
        + "".join(f"{table[k]['exchange']:>10.2f}" for k in kinds)
    )
    print(f"  {'exchanges':<46}" + "".join(f"{table[k]['exchanges']:>10d}" for k in kinds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
