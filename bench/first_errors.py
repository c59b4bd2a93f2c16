"""How long a user waits for the first mistakes of a run (issue "a hospital engineer's first hour").

    python -m bench.first_errors                          # this checkout, 3 repeats
    python -m bench.first_errors --app /path/to/old/checkout --repeats 3   # another checkout (before)

Wall time of ``python sim.py ...`` from launch to exit, as a user runs it, for:

- ``config``: a misspelled key (``num-server-round=2``): exit 2 with a "did you mean" line;
- ``too-few-images``: 6 images in an image folder over 8 clients (``partition="iid"``): exit 1
  with one line naming the client and the folder (before: flwr-datasets' ``IndexError``);
- ``check``: ``sim.py --check`` of a good run config (what ``fedderm-check`` runs);
- ``check-data``: ``sim.py --check-data`` of a 40-image folder with 2 clients (loads and checks it).

Each case runs ``--repeats`` times in a fresh process (the image cache in a fresh temporary
folder each time); the wall time's median, min and max and the median CPU time (user + system,
the process and its children) are printed with the exit code and the error line.
Nothing here is a test: the figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]


def make_folder(root: Path, per_class: int = 3) -> Path:
    """``root/<class>/<i>.png``: two classes of ``per_class`` 16-px images."""
    rng = np.random.default_rng(0)
    for c, name in enumerate(["melanoma", "nevus"]):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = (rng.integers(0, 60, (16, 16, 3)) + 120 * c).astype(np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i}.png")
    return root


def cases(few: Path, enough: Path) -> dict[str, list[str]]:
    folder = 'dataset="folder" data-path="{}" partition="iid" image-size=16 model="tiny-cnn"'
    return {
        "config": ["--run-config", "num-server-round=2"],
        "too-few-images": ["--num-supernodes", "8", "--run-config", folder.format(few)],
        "check": ["--check", "--run-config", 'method="fedprox" proximal-mu=0.01 num-server-rounds=20'],
        "check-data": ["--check-data", "--run-config", folder.format(enough)],
    }


def run_once(app: Path, argv: list[str], work: Path) -> tuple[float, float, int, str]:
    """(wall seconds, CPU seconds, exit code, the first ``error:`` line or the last line) of one
    ``sim.py`` (CPU: user + system of it and its children, which a loaded machine does not inflate
    as it inflates the wall time)."""
    env = {**os.environ, "PYTHONPATH": str(app)}
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        argv = [*argv[:-1], f'{argv[-1]} cache-dir="{tmp}/cache" output-dir="{tmp}/out"']
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, str(app / "sim.py"), *argv], capture_output=True, text=True, cwd=app, env=env
        )
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
    first = next((ln for ln in lines if ln.startswith("error:")), lines[-1] if lines else "")
    return wall, cpu, proc.returncode, first[:160]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--app", default=str(ROOT), help="the checkout whose sim.py runs (default: this one)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", default="", help="comma-separated subset of the cases")
    args = parser.parse_args(argv)
    app = Path(args.app).resolve()
    with tempfile.TemporaryDirectory(prefix="first-errors-") as work:
        work = Path(work)
        todo = cases(make_folder(work / "few", 3), make_folder(work / "enough", 20))
        wanted = [c for c in args.cases.split(",") if c] or list(todo)
        print(
            f"app: {app} · {os.cpu_count()} CPUs · load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
        )
        for name in wanted:
            runs = [run_once(app, todo[name], work) for _ in range(args.repeats)]
            walls = [r[0] for r in runs]
            print(
                f"{name:15s} wall median {statistics.median(walls):6.2f} s (min {min(walls):.2f}, "
                f"max {max(walls):.2f}) · CPU median {statistics.median(r[1] for r in runs):5.2f} s · "
                f"exit {sorted({r[2] for r in runs})} · {runs[-1][3]}"
            )
        print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
