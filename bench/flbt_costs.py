"""Paper 004 Table XII: communication and computation counts of every 004 method (no training).

    python -m bench.flbt_costs                                   # the model of sweeps/004-tables-2-4.toml
    python -m bench.flbt_costs --model resnet18 --image-size 32  # any model and size

Prints, per method, the communication rounds, the parameters the centres upload per round
(summed over the centres), the parameters and the multiply-accumulates per image
(``fedderm/costs.py``).  The accuracy tables of 004 are sweeps: ``python sim.py --sweep
sweeps/004-tables-2-4.toml``; Table XII needs no runs, so it stays a script.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    run_config = tomllib.loads((ROOT / "sweeps" / "004-tables-2-4.toml").read_text())["run-config"]
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=run_config["model"])
    parser.add_argument("--image-size", type=int, default=run_config["image-size"])
    parser.add_argument("--classes", type=int, default=4, help="classes of the task (004: 4)")
    parser.add_argument("--centres", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=run_config["num-server-rounds"])
    parser.add_argument("--proj-dim", type=int, default=128)
    parser.add_argument("--pseudo-per-centre", type=int, default=run_config["ssl.pseudo-per-centre"])
    args = parser.parse_args(argv)

    from fedderm.costs import cost_table

    rows = cost_table(
        args.model,
        args.classes,
        args.image_size,
        args.centres,
        args.rounds,
        args.proj_dim,
        args.pseudo_per_centre,
    )
    print(
        f"004 Table XII for {args.model} at {args.image_size} px, {args.classes} classes, {args.centres} centres"
    )
    print("| Algorithm | # comm rounds | # comm params / round | Params | MACs / image |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['method']} | {r['comm_rounds']} | {r['comm_params_per_round'] / 1e6:.2f}M"
            f" | {r['params'] / 1e6:.2f}M | {r['macs'] / 1e9:.3f}G |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
