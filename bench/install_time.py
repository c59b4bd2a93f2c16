"""How long README's command 1 takes to install fedderm, and how much of it is bytecode.

    python -m bench.install_time                       # both ways, each in a new venv, one after the other
    python -m bench.install_time --ways fedderm.install

Each way starts from an empty virtual environment under ``--workdir`` (removed after it) and installs
this checkout with the machine's package sources:

* ``pip``: ``pip install -e .``, which compiles every installed ``.py`` file, one after another;
* ``pip --no-compile``: the same without bytecode (what the first import of each module then pays);
* ``fedderm.install``: ``python -m fedderm.install`` (pip ``--no-compile``, then ``compileall -j 0``).

It prints the wall seconds and the environment's size of each, and the load average, in one table.
Measure on an idle machine: the ways run one after the other and the ratio is what to read.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WAYS = {
    "pip": ["-m", "pip", "install", "-q", "-e", str(ROOT)],
    "pip --no-compile": ["-m", "pip", "install", "-q", "--no-compile", "-e", str(ROOT)],
    "fedderm.install": ["-m", "fedderm.install"],
}


def du(folder: Path) -> int:
    out = subprocess.run(["du", "-sb", str(folder)], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[0])


def install(way: str, workdir: Path) -> tuple[float, int]:
    """Wall seconds of one way into a new virtual environment, and that environment's bytes."""
    venv = workdir / "venv"
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    log = workdir / f"{way.replace(' ', '_')}.log"
    start = time.monotonic()
    with log.open("w") as out:
        done = subprocess.run([str(venv / "bin" / "python"), *WAYS[way]], cwd=ROOT, stdout=out, stderr=out)
    wall = time.monotonic() - start
    if done.returncode != 0:
        raise SystemExit(f"{way} failed (exit {done.returncode}): {log}")
    size = du(venv)
    shutil.rmtree(venv)
    return wall, size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated, of: {', '.join(WAYS)}")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/fedderm-install-time"))
    args = parser.parse_args(argv)
    ways = args.ways.split(",")
    unknown = sorted(set(ways) - set(WAYS))
    if unknown:
        parser.error(f"unknown --ways {', '.join(unknown)}; choose from {', '.join(WAYS)}")
    args.workdir.mkdir(parents=True, exist_ok=True)
    print(f"machine: {os.cpu_count()} CPUs · load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("| way | wall s | environment GiB |\n|---|---|---|")
    for way in ways:
        wall, size = install(way, args.workdir)
        print(f"| {way} | {wall:.0f} | {size / 2**30:.2f} |", flush=True)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
