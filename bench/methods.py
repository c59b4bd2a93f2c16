"""Per-method overhead: the time per round that every fedderm method spends outside its local loops
(benchmark 1 for every method; ``bench/overhead.py`` compares FedAvg with a plain loop).

    python -m bench.methods                                  # every method, its smallest run (tiny models, 16 px)
    python -m bench.methods --methods fedavg,sift --model resnet18 --image-size 64
    python -m bench.methods --out /tmp/methods.md            # the table as Markdown too

Each method runs ``sim.simulate`` in a fresh process (its smallest run, ``registry.smallest_run``,
with ``--rounds`` rounds in every stage and ``--clients`` simulated clients on 2 workers) with the
timing ClientApp of ``bench/timed_app.py``: every client logs the intervals it spends inside the
local loops (training, GAN, evaluation passes).  The server logs the end of every round (when it
records the round's results, ``RunRecorder.log_round``) and the intervals it waits for replies.
Per stage, medians over the rounds after the first (round 1 pays imports and allocations):

- *per round*: end of round to end of round (train wave, aggregation, val wave, checkpoint);
- *in local loops*: the time during which at least one client is inside a local loop;
- *outside local loops* = per round − in local loops: the time the federation costs on top of the
  clients' training and evaluation (messages, (de)serialisation, aggregation, checkpoints, the
  simulation engine's pick-up of messages).  Goal: no more than Flower's own FedAvg,
  +0.25–0.3 s per round;
- *server busy*: per round − the time the ServerApp waits for replies (aggregation, screening,
  checkpoints, logging).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import registry  # noqa: E402
from bench import benchlib  # noqa: E402


def union(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of [lo, hi) covered by at least one of ``spans``."""
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in spans if b > lo and a < hi)
    total, end = 0.0, lo
    for a, b in clipped:
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def per_stage(ends: dict[tuple[str, int], float], work: list, waits: list) -> dict[str, dict]:
    """Per stage: the medians over rounds >= 2 of round time, time in local loops, outside them,
    and server busy time (see the module docstring)."""
    out: dict[str, dict] = {}
    for stage in sorted({s for s, _ in ends}, key=lambda s: min(t for (st, _), t in ends.items() if st == s)):
        rounds = sorted(r for s, r in ends if s == stage)
        rows = []
        for r in rounds:
            if r < 2 or (stage, r - 1) not in ends:
                continue
            lo, hi = ends[(stage, r - 1)], ends[(stage, r)]
            loops = union(work, lo, hi)
            rows.append(
                {
                    "round": hi - lo,
                    "loops": loops,
                    "outside": hi - lo - loops,
                    "server": hi - lo - union(waits, lo, hi),
                }
            )
        if rows:
            out[stage] = {k: benchlib.median(row[k] for row in rows) for k in rows[0]} | {"rounds": len(rows)}
    return out


# ----------------------------------------------------------------------------- child: one method
def child(settings: dict, clients: int) -> None:
    t0 = benchlib.launch_time()
    workdir = Path(settings["output-dir"])
    workdir.mkdir(parents=True, exist_ok=True)
    trace = tempfile.mkdtemp(prefix="trace-", dir=workdir)
    os.environ["FEDDERM_BENCH_TRACE"] = trace
    import sim
    import strategies.fastpoll as fastpoll
    from bench.timed_app import app, read_trace
    from fedderm.results import RunRecorder

    ends: dict[tuple[str, int], float] = {}
    waits: list[tuple[float, float]] = []
    log_round, wait = RunRecorder.log_round, fastpoll.send_and_receive_fast

    def timed_log_round(self, server_round, split, *args, **kwargs):
        out = log_round(self, server_round, split, *args, **kwargs)
        ends[({"val": "train"}.get(split, split), server_round)] = time.time()
        return out

    def timed_wait(*args, **kwargs):
        start = time.time()
        try:
            return wait(*args, **kwargs)
        finally:
            waits.append((start, time.time()))

    RunRecorder.log_round, fastpoll.send_and_receive_fast = timed_log_round, timed_wait
    sim.simulate(settings, num_supernodes=clients, client_app=app)
    entries = read_trace(trace)
    work = [tuple(span) for e in entries for span in e["spans"]]
    if any(stage == "pretrain" for stage, _ in ends):  # the val rounds after pre-training fine-tune
        ends = {("finetune" if stage == "train" else stage, r): t for (stage, r), t in ends.items()}
    benchlib.emit(
        {
            "stages": per_stage(ends, work, waits),
            "wall": time.time() - t0,
            "workers": len({e["pid"] for e in entries}),
        }
    )


def settings_for(method: str, args, workdir: Path) -> dict:
    own = registry.get_method(method).smallest
    s = registry.smallest_run(
        method,
        **{
            "num-server-rounds": args.rounds,
            "finetune-rounds": args.rounds,
            "ssl.rounds": args.rounds,
            "min-clients": args.clients,
            "output-dir": str(workdir / method),
            "cache-dir": str(workdir / "cache"),
            "keep-checkpoints": 1,
        },
    )
    if "ssl.rounds" not in registry.get_method(method).options:
        del s["ssl.rounds"]
    for key, value in (
        ("model", args.model),
        ("image-size", args.image_size),
        ("synthetic-per-class", args.per_class),
    ):
        if value is not None and key not in own:  # the ViT methods keep their ViT
            s[key] = value
    return s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default=",".join(sorted(registry.METHODS)))
    ap.add_argument("--rounds", type=int, default=4, help="rounds of every stage (medians over rounds 2..R)")
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--model", default=None, help="replace the tiny CNN of non-ViT methods, e.g. resnet18")
    ap.add_argument("--image-size", type=int, default=None)
    ap.add_argument("--per-class", type=int, default=None, help="synthetic images per class and client")
    ap.add_argument("--out", default=None, help="write the table here as Markdown too (after every method)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--settings", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rounds < 2:
        ap.error("--rounds must be >= 2 (round 1 is left out of the medians)")
    if args.child:
        child(json.loads(args.settings), args.clients)
        return 0
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in registry.METHODS]
    if unknown:
        ap.error(f"unknown methods {unknown}; valid: {', '.join(sorted(registry.METHODS))}")
    info = benchlib.print_machine()
    print(
        f"settings: each method's smallest run, {args.rounds} rounds per stage, {args.clients} clients"
        + (f", model {args.model}" if args.model else "")
        + (f", {args.image_size} px" if args.image_size else ""),
        flush=True,
    )
    header = [
        "method",
        "stage",
        "model",
        "per round s",
        "in local loops s",
        "outside local loops s",
        "server busy s",
        "run wall s",
    ]
    rows: list[list] = []
    with tempfile.TemporaryDirectory(prefix="fedderm-methods-") as tmp:
        for method in methods:
            s = settings_for(method, args, Path(tmp))
            result, _, wall = benchlib.run_child(
                [
                    "-m",
                    "bench.methods",
                    "--child",
                    "--clients",
                    str(args.clients),
                    "--settings",
                    json.dumps(s),
                ]
            )
            for stage, m in result["stages"].items():
                rows.append(
                    [
                        method,
                        stage,
                        s["model"],
                        f"{m['round']:.3f}",
                        f"{m['loops']:.3f}",
                        f"{m['outside']:.3f}",
                        f"{m['server']:.3f}",
                        f"{wall:.0f}",
                    ]
                )
                print(
                    f"  {method} {stage}: per round {m['round']:.3f} s · in local loops {m['loops']:.3f} s · "
                    f"outside {m['outside']:.3f} s · server busy {m['server']:.3f} s ({m['rounds']} rounds) · "
                    f"load {os.getloadavg()[0]:.2f}",
                    flush=True,
                )
            if args.out:
                Path(args.out).write_text(benchlib.table(rows, header) + "\n")
    print()
    print(benchlib.table(rows, header))
    print(
        f"load average at start {' '.join(map(str, info['loadavg']))}, now "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
