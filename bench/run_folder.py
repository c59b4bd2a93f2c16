"""A run folder on disk: each file's size, and the bytes written to summary.json during the run.

    python -m bench.run_folder                                       # the default run
    python -m bench.run_folder --run-config '{"image-size": 16, "num-server-rounds": 3}'
    python -m bench.run_folder --num-supernodes 4 --run-config '{"model": "tiny-cnn", "num-server-rounds": 25}'

One run of the ServerApp and ClientApps in this process (``bench/loop_grid.py``'s ``simulate``, as
``python sim.py`` computes it), in a temporary output folder (``--out`` keeps it) with its own
``XDG_CACHE_HOME``.  Prints every file of the run folder with its size, the total, and the bytes
that the recorder's atomic writes put on disk per file (``summary.json``, ``config.json``, ...):
with summary.json rewritten whole every round these grow with the square of the rounds.  Run it
on two checkouts (``PYTHONPATH`` and the current folder set to each) to compare them
(docs/results.md, "Disk").
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-config", default="{}", help="run-config overrides as JSON (default: none)")
    parser.add_argument("--num-supernodes", type=int, default=None, help="clients (default: min-clients)")
    parser.add_argument("--out", default="", help="keep the output here (default: a temporary folder)")
    args = parser.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="fedderm-run-folder-"))
    os.environ["XDG_CACHE_HOME"] = str(out / "xdg")

    import fedderm.results as results

    written: dict[str, int] = {}
    write = results.atomic_write_bytes

    def counting(path, data, *rest, **kwargs):
        written[Path(path).name] = written.get(Path(path).name, 0) + len(data)
        return write(path, data, *rest, **kwargs)

    results.atomic_write_bytes = counting
    from bench.loop_grid import simulate

    overrides = {
        "output-dir": str(out / "runs"),
        "cache-dir": str(out / "cache"),
        **json.loads(args.run_config),
    }
    started = time.monotonic()
    run = simulate(overrides, args.num_supernodes)
    seconds = time.monotonic() - started
    total = 0
    for path in sorted(run.rglob("*")):
        if path.is_file():
            total += path.stat().st_size
            print(f"{path.stat().st_size:>12}  {path.relative_to(run)}")
    print(f"total {total} bytes ({total / 2**20:.1f} MiB) in {run}, run of {seconds:.0f} s")
    print("bytes written by the recorder's atomic writes:", json.dumps(written))


if __name__ == "__main__":
    main()
