"""Scale: 10, 50 and 100 simulated clients with a small model.

    python -m bench.scale                  # tiny-cnn, 32 px, iid, 25 images per client, 3 rounds
    python -m bench.scale --clients 10,50  # other client counts
    python -m bench.scale --quick          # 10 and 50 clients, 2 rounds

Every client count runs ``sim.simulate`` (fedavg, every client in every round, ``--num-supernodes N``
on Flower's Ray backend with 1 CPU per client) in a fresh process, and prints the time per round
(median over rounds; train + val evaluation of every client), the time per round per 1000 training
samples (flat when time grows linearly with the total number of samples), start-up, and the peak
memory: the sum of RSS over the process tree (driver, Ray's processes and workers), sampled every
0.2 s.  The goal: 100 clients on 2 cores within 6 GB.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from bench import benchlib  # noqa: E402
from bench.overhead import Settings  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default=None, help="comma-separated client counts (default 10,50,100)")
    ap.add_argument(
        "--per-client", type=int, default=25, help="images per client (60 %% train, 20 %% val, 20 %% test)"
    )
    ap.add_argument("--rounds", type=int, default=None, help="default 3, quick 2")
    ap.add_argument("--model", default="tiny-cnn")
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="10 and 50 clients, 2 rounds")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args(argv)
    counts = [int(c) for c in (args.clients or ("10,50" if args.quick else "10,50,100")).split(",")]
    rounds = args.rounds or (2 if args.quick else 3)
    workdir = args.workdir or tempfile.mkdtemp(prefix="fedderm-scale-")
    info = benchlib.print_machine()
    print(
        f"settings: fedavg · {args.model} · {args.image_size} px · iid · {args.per_client} images per client · "
        f"{rounds} rounds · batch 16 · 1 local epoch"
    )
    rows = []
    for n in counts:
        per_class = max(1, n * args.per_client // 5)
        s = Settings(
            model=args.model,
            image_size=args.image_size,
            clients=n,
            per_class=per_class,
            rounds=rounds,
            batch_size=16,
            workdir=workdir,
            extra={"partition": "iid", "synthetic-sites": 1, "keep-checkpoints": 1},
        )
        # the pool is generated (and cached) by a one-round run first, outside the figures
        warm = {**dataclasses.asdict(s), "rounds": 1}
        benchlib.run_child(["-m", "bench.overhead", "--child", "B", "--settings", json.dumps(warm)])
        result, peak, wall = benchlib.run_child(
            ["-m", "bench.overhead", "--child", "B", "--settings", json.dumps(dataclasses.asdict(s))]
        )
        train = round(0.6 * args.per_client) * n
        per_round = result["per_round"]
        rows.append(
            [
                n,
                train,
                f"{result['startup']:.1f}",
                f"{per_round:.2f}",
                f"{1000 * per_round / train:.2f}",
                f"{result['work']:.2f}",
                f"{benchlib.mib(peak):.0f}",
                f"{os.getloadavg()[0]:.1f}",
            ]
        )
        print(
            f"  {n} clients: per round {per_round:.2f} s (local work {result['work']:.2f} s in "
            f"{result['workers']} workers) · start-up {result['startup']:.1f} s · peak {benchlib.mib(peak):.0f} MiB",
            flush=True,
        )
    print()
    print(
        benchlib.table(
            rows,
            [
                "clients",
                "train samples",
                "start-up s",
                "per round s",
                "s per round per 1k samples",
                "work s",
                "peak MiB",
                "load",
            ],
        )
    )
    print(f"load average at start {' '.join(map(str, info['loadavg']))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
