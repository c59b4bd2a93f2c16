"""Ring-hop latency of a real deployment on loopback: before and after fedderm's polling changes.

    python -m bench.ring_latency                   # 3 SuperNodes, 9 hops per setting
    python -m bench.ring_latency --hops 12 --no-fedderm-imports

Starts the TLS + node-auth loopback federation of deploy/loopback.py twice:
  * Flower's own ``flower-supernode``: a new ClientApp process per message, SuperExec poll 1 s,
    idle SuperNode pull 3 s, object-pull back-off 1, 2, 4, 8 s;
  * fedderm's warm launcher (``python -m fedderm.accel supernode``): forked pre-warmed
    ClientApps, every idle wait ``FEDDERM_POLL_INTERVAL`` (0.05 s);
and in each runs bench/ringprobe, which passes an array around the ring one node at a time with
Flower's ``Grid.send_and_receive`` (3 s between pulls), with fedderm's
``strategies.fastpoll.send_and_receive_fast`` (0.1 s, object pulls as fedderm's ServerApp), and
through fedderm's ``FastPollGrid`` (the same, each message packed into one ConfigRecord: how
fedderm's ServerApp sends every deployed message, a ring hop of SiFT included).
Prints the hop times of every setting.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

if __name__ == "__main__" and not __package__:
    # run as a file (python bench/ring_latency.py): run it again as the module from this checkout,
    # the folder and arguments unchanged (deploy/ is a folder of the checkout, not an installed package)
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    os.execve(
        sys.executable,
        [sys.executable, "-m", "bench.ring_latency", *sys.argv[1:]],
        {**os.environ, "PYTHONPATH": pythonpath},
    )

from deploy.loopback import Loopback  # noqa: E402

PROBE = ROOT / "bench" / "ringprobe"


def measure(
    workdir: Path,
    launcher: str,
    hops: int,
    nodes: int,
    import_fedderm: bool,
    modes: str = "flower,fast,fedderm",
) -> dict:
    """The ring probe's hop times on a fresh loopback federation, with the load average (1 min)
    before and after: on a shared machine the figures only compare at a similar load."""
    load_before = os.getloadavg()[0]
    with Loopback(workdir, nodes, fast_superexec=False, per_class=4, launcher=launcher) as fed:
        fed.start()
        out = workdir / "ringprobe.json"
        run_id, status, _ = fed.flwr_run(
            PROBE,
            {
                "hops": hops,
                "min-nodes": nodes,
                "modes": modes,
                "import-fedderm": import_fedderm,
                "out": str(out),
            },
            "ringprobe",
            timeout=1800,
        )
        if status != "finished:completed" or not out.exists():
            raise RuntimeError(f"ring probe run {run_id} ended {status!r}; see {workdir / 'logs'}")
        return {**json.loads(out.read_text()), "load": (load_before, os.getloadavg()[0])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hops", type=int, default=9)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument(
        "--no-fedderm-imports",
        action="store_true",
        help="numpy-only ClientApp (pure messaging cost, no torch start-up per hop)",
    )
    parser.add_argument(
        "--launcher",
        action="append",
        choices=("flower", "warm"),
        help="SuperNode side to measure; repeat for both (default both)",
    )
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    root = Path(args.workdir or tempfile.mkdtemp(prefix="fedderm-ring-"))
    rows, loads = [], []
    sides = {"flower": "flower-supernode", "warm": "fedderm launcher"}
    for launcher in args.launcher or ["flower", "warm"]:
        res = measure(root / launcher, launcher, args.hops, args.nodes, not args.no_fedderm_imports)
        for mode, m in res["modes"].items():
            rows.append((sides[launcher], mode, m))
        loads.append(f"{sides[launcher]} {res['load'][0]:.1f} -> {res['load'][1]:.1f}")
    print(
        f"ring hop time on loopback, {args.nodes} SuperNodes, TLS + node auth, {args.hops} hops per setting, "
        f"ClientApp {'without' if args.no_fedderm_imports else 'with'} fedderm's imports"
    )
    print(
        f"{'SuperNode side':<22} {'ServerApp side':<36} {'median':>7} {'mean':>7} {'min':>6} {'max':>6}"
        f" | mean of: {'pickup':>7} {'startup':>8} {'work':>6} {'return':>7}"
    )
    names = {
        "flower": "Grid.send_and_receive (3 s pulls)",
        "fast": "send_and_receive_fast (0.1 s)",
        "fedderm": "FastPollGrid (0.1 s, packed)",
    }
    for side, mode, m in rows:
        p = m.get("parts_mean_s", {})
        print(
            f"{side:<22} {names[mode]:<36} {m['median_s']:>6.2f}s {m['mean_s']:>6.2f}s "
            f"{m['min_s']:>5.2f}s {m['max_s']:>5.2f}s |          "
            + " ".join(
                f"{p.get(k, float('nan')):>{w}.2f}s"
                for k, w in (("pickup", 6), ("startup", 7), ("work", 5), ("return", 6))
            )
        )
    print(
        "pickup: push -> ClientApp process started or forked (SuperNode idle poll, SuperExec poll); "
        "startup: process start -> handler (imports, the task input and message objects pulled from "
        "the SuperNode, which may still be pulling them from the SuperLink); return: reply -> ServerApp has it (SuperNode "
        "reply push, ServerApp poll)"
    )
    print(
        f"load average (1 min) before -> after, {os.cpu_count()} CPUs: {'; '.join(loads)} "
        "(idle is < 1; at a load of several times the CPUs every figure is inflated)"
    )
    print(f"(logs under {root})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
