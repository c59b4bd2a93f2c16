"""ClientApp cold start: what a fresh ClientApp process pays before and while it handles one message.

    python -m bench.cold_start                          # this checkout: 5 repeats, fedavg + fedmae
    python -m bench.cold_start --baseline dd520ec       # and an earlier commit, alternating with it
    python -m bench.cold_start --repeats 7 --message fedavg:evaluate --message fedavg:query.info

Under stock Flower (``flower-supernode``) every message starts a new ``flwr-clientapp`` process
that imports the app (``client_app``: Python, Flower, torch and fedderm) and then handles the one
message.  For each code tree (this checkout, and ``--baseline``'s commit unpacked with
``git archive``), in fresh processes, alternating between the trees at every repeat:

- **import**: wall seconds of ``python -c "import client_app"``;
- **importtime**: ``python -X importtime -c "import client_app"``'s cumulative seconds of
  ``client_app``, of ``torch`` and of ``flwr`` (each the import of the package and all it pulls
  in), and the rest, ``client_app − torch − flwr``: what fedderm adds (its own modules and the
  libraries they import beyond torch and Flower, e.g. torchvision);
- **message**: one real message through the whole ClientApp (its mods: pack, state, audit,
  transport; the client session: config, data; the method's handler): the first message of a
  type (``--message METHOD:TYPE``, a prefix of the type; ``train`` by default) of the method's
  smallest run (``registry.smallest_run``), captured once from the
  ServerApp over the in-process grid of ``bench/loop_grid.py`` with the Context its node has at
  that moment, pickled, then handed to ``client_app.app`` in a fresh process.  Seconds from just
  before the process starts to ``dispatch`` starting the message's work (``to handler``: Python,
  the imports, the mods, the session's config and data, the handler's module; the work is the
  val-in-train evaluation of the model received, then the handler) and to the reply (``to
  reply``: plus that work), and the libraries the process had imported by then (and, right after
  ``import client_app``, those libraries and the ``clients`` modules).

The machine is often shared: the load average is printed with every figure, and the paired
ratio (baseline / this checkout, per repeat) is the figure that survives the noise.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import pickle
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from bench.benchlib import median

ROOT = Path(__file__).resolve().parents[1]

#: libraries a ClientApp process may load beyond torch and Flower, reported per message
LIBRARIES = (
    "torchvision",
    "torchvision.models",
    "torch._dynamo",
    "timm",
    "transformers",
    "sklearn",
    "scipy",
    "pandas",
    "peft",
    "datasets",
    "matplotlib",
)

#: the child: import the app, read the captured (message, context), hand it to the app; the time
#: of the handler call is when ``dispatch`` enters ``use_bn_stats``, right before the handler
_CHILD = r"""
import sys, time
t0 = float(sys.argv[1])
import client_app
t_import = time.monotonic() - t0
import json, pickle
libraries = json.loads(sys.argv[3])
at_import = sorted(m for m in sys.modules if m in libraries or m.startswith("clients."))
with open(sys.argv[2], "rb") as f:
    msg, context = pickle.load(f)
seen = []
_enter = client_app.use_bn_stats
def _spy(*args, **kwargs):
    seen.append(time.monotonic() - t0)
    return _enter(*args, **kwargs)
client_app.use_bn_stats = _spy
reply = client_app.app(msg, context)
t_reply = time.monotonic() - t0
error = reply.error.reason if reply.has_error() else None
print(json.dumps({
    "import": t_import,
    "handler": seen[0] if seen else None,
    "reply": t_reply,
    "error": error,
    "app": client_app.__file__,
    "at import": at_import,
    "libraries": sorted(m for m in libraries if m in sys.modules),
}))
"""


class _Captured(Exception):
    pass


def capture(method: str, path: Path, kind: str = "train", **overrides) -> str:
    """Run ``method``'s smallest run in this process until the ServerApp pushes its first message
    whose type starts with ``kind`` (the messages before it are handled here); pickle that message
    (as delivered) with its node's Context to ``path``; return its type."""
    from flwr.app import Context, RecordDict

    import registry
    import server_app
    import sim
    from bench.loop_grid import LoopGrid
    from client_app import app as client_app

    class CapturingGrid(LoopGrid):
        def push_messages(self, messages):
            messages = list(messages)
            for msg in messages:
                if msg.metadata.message_type.startswith(kind):
                    msg.metadata.__dict__["_message_id"] = "cold-start"
                    context = self.contexts[msg.metadata.dst_node_id]
                    with open(path, "wb") as f:
                        pickle.dump((copy.deepcopy(msg), copy.deepcopy(context)), f)
                    raise _Captured(msg.metadata.message_type)
            return super().push_messages(messages)

    run_config = sim.resolved_run_config(registry.smallest_run(method, **overrides))
    grid = CapturingGrid(run_config, 2, client_app)
    context = Context(
        run_id=grid.run_id, node_id=0, node_config={}, state=RecordDict(), run_config=run_config
    )
    try:
        server_app.main(grid, context)
    except _Captured as done:
        return str(done)
    raise RuntimeError(f"{method}: the ServerApp sent no {kind!r} message")


def _env(tree: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree)
    env.pop("PYTHONSTARTUP", None)
    return env


def import_seconds(tree: Path) -> float:
    """Wall seconds of ``python -c "import client_app"`` in ``tree``."""
    t0 = time.monotonic()
    subprocess.run(
        [sys.executable, "-c", "import client_app"], cwd=tree, env=_env(tree), check=True, capture_output=True
    )
    return time.monotonic() - t0


def importtime(tree: Path) -> dict[str, float]:
    """``-X importtime`` cumulative seconds of client_app, torch and flwr, and the rest."""
    res = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import client_app"],
        cwd=tree,
        env=_env(tree),
        check=True,
        capture_output=True,
        text=True,
    )
    cumulative: dict[str, float] = {}
    for line in res.stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        _, cum, name = line.split("|", 2)
        name = name.strip()
        if name in ("client_app", "torch", "flwr") and name not in cumulative:
            cumulative[name] = int(cum) / 1e6
    out = {k: cumulative.get(k, 0.0) for k in ("client_app", "torch", "flwr")}
    out["fedderm adds"] = out["client_app"] - out["torch"] - out["flwr"]
    return out


def message_seconds(tree: Path, captured: Path) -> dict:
    """One captured message through ``client_app.app`` in a fresh process in ``tree``."""
    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-c", _CHILD, repr(t0), str(captured), json.dumps(LIBRARIES)],
        cwd=tree,
        env=_env(tree),
        capture_output=True,
        text=True,
    )
    if res.returncode != 0:
        raise RuntimeError(f"the ClientApp process in {tree} failed:\n{res.stderr[-3000:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    if out["error"]:
        raise RuntimeError(f"the ClientApp in {tree} replied with an error: {out['error']}")
    if Path(out["app"]).resolve().parent != tree.resolve():
        raise RuntimeError(f"the ClientApp process in {tree} imported {out['app']}")
    return out


def unpack(ref: str, into: Path) -> Path:
    """``git archive ref`` of this checkout, unpacked into ``into``."""
    into.mkdir(parents=True, exist_ok=True)
    tar = into.with_suffix(".tar")
    subprocess.run(["git", "archive", "-o", str(tar), ref], cwd=ROOT, check=True)
    with tarfile.open(tar) as t:
        t.extractall(into, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    tar.unlink()
    return into


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline", default="", help="a git ref of this checkout to compare with")
    parser.add_argument(
        "--message",
        action="append",
        default=None,
        help="METHOD[:TYPE] to send the first message of (TYPE a prefix of the message type, default "
        "train); repeat for several (default fedavg:train and fedmae:train)",
    )
    parser.add_argument("--json", default="", help="also write every figure to this file")
    args = parser.parse_args(argv)
    messages = [m if ":" in m else f"{m}:train" for m in (args.message or ["fedavg", "fedmae"])]

    with tempfile.TemporaryDirectory(prefix="fedderm-cold-start-") as tmp:
        work = Path(tmp)
        trees = {"this checkout": ROOT}
        if args.baseline:
            trees = {f"baseline {args.baseline}": unpack(args.baseline, work / "baseline"), **trees}
        captured = {}
        for i, spec in enumerate(messages):
            method, kind = spec.split(":", 1)
            captured[spec] = work / f"message-{i}.pkl"
            kind = capture(method, captured[spec], kind, **{"output-dir": str(work / "results")})
            print(f"captured: {method}'s first {kind!r} message of its smallest run", flush=True)

        rows: dict[str, dict[str, list]] = {name: {} for name in trees}
        loads = []
        for r in range(args.repeats):
            order = list(trees) if r % 2 == 0 else list(reversed(trees))
            for name in order:
                tree, row = trees[name], rows[name]
                loads.append(os.getloadavg()[0])
                row.setdefault("import", []).append(import_seconds(tree))
                for key, value in importtime(tree).items():
                    row.setdefault(f"importtime {key}", []).append(value)
                for spec in messages:
                    out = message_seconds(tree, captured[spec])
                    row.setdefault(f"{spec} to handler", []).append(out["handler"])
                    row.setdefault(f"{spec} to reply", []).append(out["reply"])
                    row[f"{spec} libraries"] = out["libraries"]
            print(f"repeat {r + 1}/{args.repeats} done, load average {os.getloadavg()[0]:.2f}", flush=True)

        print(
            f"\nClientApp cold start, {args.repeats} repeats, medians in seconds "
            f"(load average over the runs: median {median(loads):.2f}, min {min(loads):.2f}, max {max(loads):.2f};"
            f" {os.cpu_count()} CPUs)"
        )
        keys = [k for k in next(iter(rows.values())) if not k.endswith("libraries")]
        names = list(trees)
        header = (
            "| figure | " + " | ".join(names) + (" | paired ratio (median) |" if len(names) == 2 else " |")
        )
        print(header)
        print("|---" * (header.count("|") - 1) + "|")
        for key in keys:
            cells = [f"{median(rows[n][key]):.2f}" for n in names]
            if len(names) == 2:
                a, b = rows[names[0]][key], rows[names[1]][key]
                ratios = [x / y for x, y in zip(a, b, strict=True) if x is not None and y]
                cells.append(f"{median(ratios):.2f}×" if ratios else "n/a")
            print(f"| {key} | " + " | ".join(cells) + " |")
        for spec in messages:
            for n in names:
                loaded = rows[n][f"{spec} libraries"]
                print(
                    f"{n}: the {spec} message's process imported: {', '.join(loaded) or 'none'} (of {', '.join(LIBRARIES)})"
                )
        if args.json:
            Path(args.json).write_text(
                json.dumps(
                    {"rows": rows, "loadavg": loads, "trees": {n: str(t) for n, t in trees.items()}}, indent=1
                )
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
