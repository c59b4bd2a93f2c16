"""Deployment: round time of a real federation on loopback against the same run in simulation.

    python -m bench.deployment                        # fedavg, 3 hospitals, 5 rounds
    python -m bench.deployment --method sift --rounds 3 --nodes 3

The deployment is deploy/loopback.py's: one SuperLink and one SuperNode per hospital as separate
processes on 127.0.0.1, TLS, SuperNode authentication, each hospital reading its own image
folder.  The simulation is ``sim.simulate`` with the same run config, the same number of clients
and the same amount of data (the embedded synthetic generator, one site per client, as the
loopback's folders).  Both write ``round_seconds`` (wall time of each round: train + val) to
``summary.json``; this prints the median round time of each, their difference (the cost of real
processes and messaging: a new ClientApp process per message, the SuperNode's 3 s idle poll,
TLS), and the whole run's wall time including start-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from bench.communication import machine  # noqa: E402
from deploy.loopback import BASE_RUN_CONFIG, Loopback  # noqa: E402


def round_times(summary: dict) -> list[float]:
    """Wall seconds of the training rounds (round 0, the initial evaluation, left out)."""
    return [r["seconds"] for r in summary.get("round_seconds", []) if r["round"] > 0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default="fedavg")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--per-class", type=int, default=12, help="images per class per hospital")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    root = Path(args.workdir or tempfile.mkdtemp(prefix="fedderm-deploy-bench-"))
    print(machine(), flush=True)
    config = {"num-server-rounds": args.rounds, "round-timeout": 600.0}

    with Loopback(root / "loopback", args.nodes, per_class=args.per_class) as fed:
        start = time.monotonic()
        fed.start()
        setup = time.monotonic() - start
        outcome = fed.run(args.method, config)
    if not outcome.ok:
        print("deployment run failed:\n  " + "\n  ".join(outcome.problems))
        return 1
    deployed = json.loads((outcome.run_dir / "summary.json").read_text())

    import sim

    start = time.monotonic()
    run_dir = sim.simulate({**BASE_RUN_CONFIG, **config, "method": args.method, "min-clients": args.nodes,
                            "dataset": "synthetic", "synthetic-per-class": args.per_class,
                            "output-dir": str(root / "sim"), "cache-dir": str(root / "sim-cache")},
                           num_supernodes=args.nodes)
    sim_wall = time.monotonic() - start
    simulated = json.loads((run_dir / "summary.json").read_text())

    d, s = round_times(deployed), round_times(simulated)
    print(f"\n{args.method}, {args.nodes} clients, {args.rounds} rounds, tiny-cnn 32 px, "
          f"{args.per_class} images per class per client")
    print(f"{'':<34} {'median round':>13} {'mean round':>11} {'run wall':>9}")
    print(f"{'loopback deployment (TLS, auth)':<34} {statistics.median(d):>12.2f}s {statistics.fmean(d):>10.2f}s "
          f"{outcome.wall_s:>8.1f}s")
    print(f"{'simulation (sim.py)':<34} {statistics.median(s):>12.2f}s {statistics.fmean(s):>10.2f}s "
          f"{sim_wall:>8.1f}s")
    print(f"deployment - simulation per round: {statistics.median(d) - statistics.median(s):+.2f} s (median); "
          f"federation set-up (SuperLink, certificates, SuperNodes online): {setup:.1f} s, not in the run wall")
    print(f"(work folder {root})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
