"""Deployment: round time of a real federation on loopback against the same run in simulation.

    python -m bench.deployment                        # fedavg, 3 hospitals, 5 rounds, tiny-cnn + resnet18
    python -m bench.deployment --model tiny-cnn --launcher warm   # the quick one
    python -m bench.deployment --method sift --rounds 3 --nodes 3

The deployment is deploy/loopback.py's: one SuperLink and one SuperNode per hospital as separate
processes on 127.0.0.1, TLS, SuperNode authentication, each hospital reading its own image
folder.  The simulation is ``sim.simulate`` with the same run config, the same number of clients
and the same amount of data (the embedded synthetic generator, one site per client, as the
loopback's folders).  Both write ``round_seconds`` (wall time of each round: train + val) to
``summary.json``; this prints the median round time of each, their ratio (the cost of real
processes and messaging: ClientApp processes, polling, HTTP + TLS per object through the
SuperLink; see docs/deploy.md), and the whole run's wall time including start-up.  The
simulation row comes from the same invocation: on a shared machine only the ratio compares.
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
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--method", default="fedavg")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--per-class", type=int, default=12, help="images per class per hospital")
    parser.add_argument(
        "--model",
        action="append",
        default=None,
        help="model to measure; repeat for several (default: tiny-cnn and resnet18)",
    )
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument(
        "--launcher",
        choices=("warm", "flower", "both"),
        default="both",
        help="which SuperNode launcher to measure (default both, one federation each)",
    )
    parser.add_argument(
        "--superlink-database",
        default="superlink.db",
        help="the SuperLink's --database: a file in the work folder (default, as docs/deploy.md "
        "recommends: fedderm-superlink keeps the registered SuperNodes in it) or :flwr-in-memory: "
        "(Flower's default: nothing kept across a restart)",
    )
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    root = Path(args.workdir or tempfile.mkdtemp(prefix="fedderm-deploy-bench-"))
    print(machine(), flush=True)
    tables = [measure(model, args, root / model) for model in args.model or ["tiny-cnn", "resnet18"]]
    if any(table is None for table in tables):
        return 1
    for table in tables:
        print("\n" + table)
    print(f"(work folder {root})")
    return 0


def measure(model: str, args, root: Path) -> str | None:
    """Loopback and simulation rounds of one model; the printed table (None: a run failed)."""
    config = {
        "num-server-rounds": args.rounds,
        "round-timeout": 600.0,
        "model": model,
        "image-size": args.image_size,
    }
    rows = []
    for launcher in ("warm", "flower") if args.launcher == "both" else (args.launcher,):
        with Loopback(
            root / f"loopback-{launcher}",
            args.nodes,
            per_class=args.per_class,
            image_size=args.image_size,
            launcher=launcher,
        ) as fed:
            fed.database = args.superlink_database
            start = time.monotonic()
            fed.start()
            setup = time.monotonic() - start
            outcome = fed.run(args.method, config)
        if not outcome.ok:
            print(f"deployment run ({launcher} launcher) failed:\n  " + "\n  ".join(outcome.problems))
            return None
        deployed = json.loads((outcome.run_dir / "summary.json").read_text())
        label = {"warm": "loopback, fedderm warm launcher", "flower": "loopback, Flower's own processes"}[
            launcher
        ]
        rows.append((label, round_times(deployed), outcome.wall_s, setup))

    import sim

    start = time.monotonic()
    run_dir = sim.simulate(
        {
            **BASE_RUN_CONFIG,
            **config,
            "method": args.method,
            "min-clients": args.nodes,
            "dataset": "synthetic",
            "synthetic-per-class": args.per_class,
            "output-dir": str(root / "sim"),
            "cache-dir": str(root / "sim-cache"),
        },
        num_supernodes=args.nodes,
    )
    sim_wall = time.monotonic() - start
    simulated = round_times(json.loads((run_dir / "summary.json").read_text()))

    lines = [
        f"{args.method}, {args.nodes} clients, {args.rounds} rounds, {model} {args.image_size} px, "
        f"{args.per_class} images per class per client; TLS + SuperNode authentication on loopback; "
        f"SuperLink --database {args.superlink_database}",
        f"{'':<36} {'median round':>13} {'mean round':>11} {'x simulation':>13} {'run wall':>9}",
    ]
    sim_median = statistics.median(simulated)
    for label, times, wall, setup in rows:
        lines.append(
            f"{label:<36} {statistics.median(times):>12.2f}s {statistics.fmean(times):>10.2f}s "
            f"{statistics.median(times) / sim_median:>12.1f}x {wall:>8.1f}s   (set-up {setup:.1f} s)"
        )
    lines.append(
        f"{'simulation (sim.py)':<36} {sim_median:>12.2f}s {statistics.fmean(simulated):>10.2f}s "
        f"{1.0:>12.1f}x {sim_wall:>8.1f}s"
    )
    print("\n" + "\n".join(lines), flush=True)  # as soon as it is measured; all again at the end
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
