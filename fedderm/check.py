"""``fedderm-check``: the checks of a run, in seconds, before ``flwr run`` (or ``sim.py``) starts it.

    fedderm-check . --run-config 'method="fedprox" num-server-rounds=20'
    fedderm-check . --data --num-supernodes 4 --run-config 'dataset="folder" data-path="/data/derm"'
    fedderm-check . --data --run-config my-run.toml --node-config 'dataset="folder" data-path="/data/derm"'

The first argument is the app folder (the one ``flwr run`` takes; default ``.``).  It checks the
run config as the run will see it (pyproject.toml's defaults with the overrides, every key and
value, the paths) and names the key at fault where Flower's own check says only ``Invalid run
configuration``; ``--data`` also loads and checks the data, as a simulation with
``--num-supernodes`` clients partitions it, or with ``--node-config`` a hospital's own data as its
SuperNode will load it (docs/data-checks.md).  Nothing is trained and Ray does not start.  Exit
codes: 0 all good, 2 a config mistake, 1 a data problem, each with one ``error:`` line.

It runs the app's own ``sim.py --check`` (``--check-data`` with ``--data``), so the checks are
the ones of the app version in that folder.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    app = Path(args.pop(0)) if args and not args[0].startswith("-") else Path(".")
    if args and args[0] in ("-h", "--help"):
        from .cli import plain

        print(plain(__doc__).strip())
        return 0
    sim = app / "sim.py"
    if not sim.is_file():
        print(
            f"error: {app.resolve()} is not a fedderm app folder (no sim.py): give the folder that "
            "flwr run takes, e.g. fedderm-check /path/to/fedderm --run-config '...'",
            file=sys.stderr,
        )
        return 2
    flags = ["--check-data" if a == "--data" else a for a in args]
    if "--check-data" not in flags:
        flags.insert(0, "--check")
    return subprocess.call([sys.executable, str(sim.resolve()), *flags])


def entry() -> None:
    """The ``fedderm-check`` console script."""
    sys.exit(main())


if __name__ == "__main__":
    sys.exit(main())
