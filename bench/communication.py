"""Communication: bytes per client per round of every method, against the model's own bytes.

    python -m bench.communication                       # every method, float32 and float16 transport
    python -m bench.communication --methods fedavg,sift,fedclf --model resnet18 --image-size 64

Each method runs one short simulation per ``transport-dtype`` with the outgoing-message audit on
(``FEDDERM_AUDIT_DIR``), which logs every message's size on the wire as Flower serialises it
(protobuf ``ByteSize`` of the content: arrays, metrics and config, not the gRPC/TLS framing).
For each training stage it prints, per client and round: the bytes received (down) and sent
(up), their ratio to the model's own bytes (the float32 bytes of the ``arrays`` record the
stage exchanges, or its largest record: SiFT's models are ``short`` and ``long``), and the
bytes of every other array record (FedCLF's relayed and uploaded features, SiFT's pair,
SCAFFOLD's control variates) in their own column.
Evaluation messages (the same for every method) are left out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import registry  # noqa: E402  (each method's smallest run: registry.smallest_run, as the audit test)

ARRAYS = "arrays"


def machine() -> str:
    import flwr
    import torch

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"{platform.node()} · {os.cpu_count()} CPUs · {platform.processor() or platform.machine()} · "
        f"torch {torch.__version__} · flwr {flwr.__version__} · load average {load:.2f}"
    )


def run_logged(overrides: dict, num_supernodes: int, workdir: Path) -> list[dict]:
    """One simulation with the audit on; returns its audit entries."""
    import sim

    audit = workdir / "audit"
    os.environ["FEDDERM_AUDIT_DIR"] = str(audit)
    try:
        sim.simulate(
            {**overrides, "output-dir": str(workdir / "runs"), "cache-dir": str(workdir / "cache")},
            num_supernodes=num_supernodes,
        )
    finally:
        os.environ.pop("FEDDERM_AUDIT_DIR", None)
    return [
        json.loads(line) for f in sorted(audit.glob("audit-*.jsonl")) for line in f.read_text().splitlines()
    ]


def per_stage(entries: list[dict]) -> dict[str, dict]:
    """Mean bytes per client per round of each training stage (message type)."""
    stages: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for e in entries:
        kind = e["message_type"]
        if not kind.startswith("train"):
            continue
        s = stages[kind]
        s["down"].append(e["received_bytes"])
        s["up"].append(e["sent_bytes"])
        down = e.get("received_records", {})
        up = {name: r["bytes"] for name, r in e["records"].items() if r["type"] == "arrays"}
        model = max([*down.values(), *up.values(), 0])  # the largest record is the model
        s["model"].append(model)
        main = {ARRAYS} if ARRAYS in down or ARRAYS in up else set()
        for direction, records in (("down", down), ("up", up)):
            for name, nbytes in records.items():
                if name not in main:
                    s[f"{name} ({direction})"].append(nbytes)
    return {kind: {k: statistics.fmean(v) for k, v in s.items()} for kind, s in stages.items()}


def _kb(n: float) -> str:
    return f"{n / 1024:,.1f}"


def table(results: dict[str, dict[str, dict[str, dict]]], transports: list[str]) -> str:
    head = ["method", "stage", "model KB (float32)"]
    for t in transports:
        head += [f"down KB {t}", f"up KB {t}", f"down/model {t}", f"up/model {t}"]
    head.append("other records KB per client per round (float32)")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method, by_transport in results.items():
        base = by_transport[transports[0]]
        for stage in sorted(base):
            model = max(base[stage]["model"], 1.0)
            row = [method, stage, _kb(model)]
            for t in transports:
                s = by_transport.get(t, {}).get(stage)
                row += (
                    [_kb(s["down"]), _kb(s["up"]), f"{s['down'] / model:.3f}", f"{s['up'] / model:.3f}"]
                    if s
                    else ["n/a"] * 4
                )
            other = {k: v for k, v in base[stage].items() if k not in ("down", "up", "model")}
            row.append(", ".join(f"{k} {_kb(v)}" for k, v in sorted(other.items())) or "-")
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--methods", default=",".join(sorted(registry.METHODS)))
    parser.add_argument("--transports", default="float32,float16")
    parser.add_argument("--num-supernodes", type=int, default=2)
    parser.add_argument(
        "--model", default=None, help="replace the tiny model of non-ViT methods, e.g. resnet18"
    )
    parser.add_argument("--image-size", type=int, default=None)
    parser.add_argument("--out", default=None, help="write the table here as Markdown too")
    args = parser.parse_args(argv)

    methods = [m for m in args.methods.split(",") if m]
    transports = [t for t in args.transports.split(",") if t]
    print(machine(), flush=True)
    results: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory(prefix="fedderm-comm-") as tmp:
        for method in methods:
            own = registry.get_method(method).smallest
            settings = registry.smallest_run(method, **{"num-server-rounds": 2, "finetune-rounds": 2})
            if args.model and "model" not in own:  # not the ViT methods
                settings["model"] = args.model
            if args.image_size and "image-size" not in own:
                settings["image-size"] = args.image_size
            results[method] = {}
            for t in transports:
                start = time.monotonic()
                entries = run_logged(
                    {**settings, "transport-dtype": t}, args.num_supernodes, Path(tmp) / f"{method}-{t}"
                )
                results[method][t] = per_stage(entries)
                print(
                    f"{method} ({t}): {len(entries)} messages audited, {time.monotonic() - start:.0f} s",
                    flush=True,
                )
            # the table so far, after every method: a crash later loses nothing
            print("\n".join(table({method: results[method]}, transports).split("\n")[2:]), flush=True)
            if args.out:
                Path(args.out).write_text(table(results, transports) + "\n")
    print(table(results, transports))
    return 0


if __name__ == "__main__":
    sys.exit(main())
