"""FedMAE's decoder: the papers' (the MAE reference's 512 × 8 × 16, fedderm's default until the
decoder was sized to its encoder) against the one sized to the encoder (the default).

    python -m bench.mae_decoder               # sizes: a default vit-micro FedMAE run with each decoder
    python -m bench.mae_decoder --quality     # the matched quality check instead (4 runs)

**Sizes.** A default FedMAE run on ``vit-micro`` (``method="fedmae" model="vit-micro"``, every other
key at its default: synthetic data at 64 px, 2 clients), shortened to one round of one epoch per
stage (the bytes of a round do not depend on the number of rounds).  Per decoder: the bytes of one
pre-training round (summary.json ``bytes_per_round``, stage ``pretrain``: the server's messages to
every client plus their replies, the arrays as Flower counts them), the size of
``model-pretrained.pt`` and the decoder's share of the MAE's parameters.

**Quality** (``--quality``).  The FedMAE row of ``sweeps/000-fedmae-table4.toml --quick`` (digits,
2 IID clients, ``vit-micro`` at 32 px, 3 × 4 epochs of pre-training, 4 × 5 epochs of federated
fine-tuning, seed 0), fine-tuned on the class token (FedMAE's default), with each decoder, with
pre-training and without (``fedmae.pretrain=false``).  The decoder's size changes the encoder's
initial weights (its mask token is drawn between the class token and the blocks, as in the MAE
reference), so each decoder's pre-training is compared with its own control: the same initial
encoder, no pre-training.  One seed: a difference of a few points is within its noise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the papers' decoder (000, 003: the MAE reference's ViT-B decoder), the former default
PAPER = {"fedmae.decoder-embed-dim": 512, "fedmae.decoder-depth": 8, "fedmae.decoder-num-heads": 16}
#: the default: sized to the encoder (fedderm.mae.decoder_defaults)
AUTO = {"fedmae.decoder-embed-dim": -1, "fedmae.decoder-depth": -1, "fedmae.decoder-num-heads": -1}
DECODERS = {"papers' (512 × 8 × 16)": PAPER, "sized to the encoder (default)": AUTO}
#: a default vit-micro FedMAE run, one round of one epoch per stage
SIZE_RUN = {
    "method": "fedmae",
    "model": "vit-micro",
    "num-server-rounds": 1,
    "local-epochs": 1,
    "finetune-rounds": 1,
    "finetune-epochs": 1,
}


def run(overrides: dict, work: Path, name: str, num_supernodes: int = 2) -> Path:
    """One in-process run (``bench.loop_grid.simulate``: sim.py's checks and apps, no Ray)."""
    from bench.loop_grid import simulate

    return simulate(
        {
            **overrides,
            "output-dir": str(work / "runs"),
            "cache-dir": str(work / "cache"),
            "run-name": name,
            "tensorboard": False,
        },
        num_supernodes=num_supernodes,
    )


def decoder_of(config: dict) -> str:
    return " × ".join(str(config[k]) for k in PAPER)


def sizes(run_dir: Path) -> dict:
    """Bytes of a pre-training round, of model-pretrained.pt, and the decoder's share of the MAE."""
    import torch

    summary = json.loads((run_dir / "summary.json").read_text())
    rounds = [e for e in summary["bytes_per_round"] if e["stage"] == "pretrain"]
    state = torch.load(run_dir / "model-pretrained.pt", weights_only=True)
    decoder = sum(v.numel() for k, v in state.items() if k.startswith(("decoder_", "mask_token")))
    return {
        "decoder": decoder_of(summary["config"]),
        "round_mb": statistics.fmean(e["bytes"] for e in rounds) / 1e6,
        "pretrained_mb": (run_dir / "model-pretrained.pt").stat().st_size / 1e6,
        "decoder_share": decoder / sum(v.numel() for v in state.values()),
    }


def quick_fedmae_row() -> dict:
    """The run config of the FedMAE row of ``sweeps/000-fedmae-table4.toml --quick``, seed 0."""
    import registry
    from fedderm import sweep as fs
    from fedderm.config import default_config

    sweep = fs.load_sweep(
        ROOT / "sweeps" / "000-fedmae-table4.toml",
        quick=True,
        load_config=registry.load_config,
        valid_keys=sorted([*default_config(), *registry.method_options()]),
    )
    (row,) = [r for r in sweep.runs() if r.overrides.get("method") == "fedmae"]
    return dict(row.overrides)


def final(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    return {k: 100 * summary["final"][k] for k in ("balanced_accuracy", "accuracy")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quality", action="store_true", help="run the matched quality check instead of the sizes"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fedderm-mae-decoder-") as tmp:
        work = Path(tmp)
        if args.quality:
            return quality(work)
        print("A default vit-micro FedMAE run (64 px, 2 clients), per decoder:")
        print(
            "| decoder | width × blocks × heads | MB per pre-training round | model-pretrained.pt (MB) | decoder share |"
        )
        print("|---|---|---|---|---|")
        for label, decoder in DECODERS.items():
            s = sizes(run({**SIZE_RUN, **decoder}, work, f"size-{len(label)}"))
            print(
                f"| {label} | {s['decoder']} | {s['round_mb']:.2f} | {s['pretrained_mb']:.2f} "
                f"| {100 * s['decoder_share']:.1f} % |",
                flush=True,
            )
    return 0


def quality(work: Path) -> int:
    """The matched quality check (see the module's docstring); prints a Markdown table."""
    base = {**quick_fedmae_row(), "vit-pool": "token"}
    lines = [
        "The 000-fedmae-table4 quick FedMAE row (seed 0), class-token pooling: recall / accuracy (%)",
        "| decoder | no pre-training | FedMAE | pre-training's gain |",
        "|---|---|---|---|",
    ]
    for i, (label, decoder) in enumerate(DECODERS.items()):
        none = final(run({**base, **decoder, "fedmae.pretrain": False}, work, f"q{i}-none"))
        pre = final(run({**base, **decoder}, work, f"q{i}-pre"))
        cells = [f"{r['balanced_accuracy']:.2f} / {r['accuracy']:.2f}" for r in (none, pre)]
        gain = {k: pre[k] - none[k] for k in pre}
        lines.append(
            f"| {label} | {cells[0]} | {cells[1]} | {gain['balanced_accuracy']:+.2f} / {gain['accuracy']:+.2f} |"
        )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
