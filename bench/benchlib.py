"""Helpers shared by the performance benchmarks (bench/overhead.py, scale.py, throughput.py).

Nothing here is timed by a test: the benches print figures for the "Performance" page, docs/benchmarks.md.
Memory is the sum of the resident set sizes of a process and all its descendants (Ray's GCS,
raylet and worker processes included), sampled every ``interval`` seconds from ``/proc``.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from fedderm import procs

ROOT = Path(__file__).resolve().parents[1]
PAGE = os.sysconf("SC_PAGE_SIZE")


def machine() -> dict:
    """CPU count and model, library versions and the load average now."""
    import torch

    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        model = platform.processor()
    try:
        import flwr

        flwr_version = flwr.__version__
    except Exception:  # noqa: BLE001 - the plain benches run without Flower
        flwr_version = "n/a"
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model or "unknown",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "flwr": flwr_version,
        "torch_threads": torch.get_num_threads(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }


def print_machine(info: dict | None = None) -> dict:
    info = info or machine()
    print(
        f"machine: {info['cpus']} CPUs · {info['cpu_model']} · python {info['python']} · torch {info['torch']}"
        f" · flwr {info['flwr']} · load average {' '.join(f'{x:.2f}' for x in info['loadavg'])}"
    )
    return info


def report(text: str, info: dict, wall: float, out: str | None, payload: dict) -> None:
    """Print a benchmark's table, its wall time and the load average at its start (``info``, from
    :func:`machine`) and end; with ``out``, write the table there and ``payload`` with the wall
    time, the machine and the final load average beside it (``.json``)."""
    print(text)
    end = machine()["loadavg"]
    print(f"total wall {wall:.0f} s; load average at start {info['loadavg']}, at end {end}")
    if out:
        Path(out).write_text(text + "\n")
        Path(out).with_suffix(".json").write_text(
            json.dumps({**payload, "wall": wall, "machine": info, "loadavg_end": end}, indent=1)
        )


def tree_rss(pid: int) -> int:
    """Bytes resident in ``pid`` and every descendant process (0 once it is gone)."""
    kids, todo, total = procs.children(), [pid], 0
    seen = set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            with open(f"/proc/{p}/statm") as fh:
                total += int(fh.read().split()[1]) * PAGE
        except OSError:
            pass
        todo.extend(kids.get(p, []))
    return total


class PeakRSS:
    """Samples :func:`tree_rss` of ``pid`` in a thread; ``peak`` is the largest sum seen."""

    def __init__(self, pid: int, interval: float = 0.2):
        self.pid, self.interval, self.peak = pid, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_rss(self.pid))
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def run_child(args: list[str], env: dict | None = None, quiet: bool = True) -> tuple[dict, int, float]:
    """Run ``python <args>`` from the repo root; it must print one JSON line prefixed ``BENCH ``.

    Returns (that JSON, peak RSS of its process tree in bytes, wall seconds).  The child gets its
    launch time in ``BENCH_T0`` (``time.time()``), so it can report its own start-up.
    """
    env = {
        **os.environ,
        **(env or {}),
        "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}".rstrip(":"),
    }
    env["BENCH_T0"] = repr(time.time())
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE if quiet else None,
        text=True,
    )
    with PeakRSS(proc.pid) as mem:
        out, err = proc.communicate()
    wall = time.monotonic() - start
    lines = [line[6:] for line in out.splitlines() if line.startswith("BENCH ")]
    if proc.returncode or not lines:
        sys.stderr.write(out[-4000:] + (err or "")[-8000:])
        raise RuntimeError(f"benchmark child {' '.join(args)} failed (exit {proc.returncode})")
    return json.loads(lines[-1]), mem.peak, wall


def emit(result: dict) -> None:
    """Child side of :func:`run_child`."""
    print("BENCH " + json.dumps(result), flush=True)


def launch_time() -> float:
    return float(os.environ.get("BENCH_T0", time.time()))


def median(values) -> float:
    """The median of the values that were measured (``None`` and NaN left out); NaN if none was."""
    values = [v for v in values if v is not None and v == v]
    return statistics.median(values) if values else float("nan")


def mib(nbytes: float) -> float:
    return nbytes / 2**20


def table(rows: list[list], header: list[str]) -> str:
    """A Markdown table (also readable as plain text)."""
    cells = [[str(c) for c in row] for row in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    fmt = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join(
        [fmt(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *(fmt(r) for r in cells[1:])]
    )
