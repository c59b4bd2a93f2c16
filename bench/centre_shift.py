"""How far apart are the centres of an embedded data set?  Training and validation data only.

    python -m bench.centre_shift [--dataset stained-digits] [--centres 3] [--seed 1000] [--image-size 16]

Deals the data out as a simulation with ``partition="source"`` does (one centre per client, each
client's own train/val split, ``fedderm.data.load_client_data``), then for every centre A trains a
tiny CNN on A's training images alone (SGD lr 0.02, momentum 0.9, batch 16, 004's augmentation:
the settings of ``sweeps/claims/004-flbt-centres.toml``) and prints:

* the per-channel mean and SD of every centre's training images (the statistics the first
  BatchNorm layer sees);
* the accuracy of A's model on every centre B's *validation* split, with A's BatchNorm statistics
  and with statistics re-estimated on B's training images (no labels: what FedBN's per-centre
  statistics give a centre, AdaBN, Li et al. 2016).

A model that loses accuracy on another centre's validation split, and gets it back with that
centre's statistics, is the feature shift 004's centres have.  Test splits are never read.
"""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="stained-digits", choices=["stained-digits", "digits", "synthetic"])
    p.add_argument("--centres", type=int, default=3)
    p.add_argument("--seed", type=int, default=1000, help="not a seed any claims sweep registers")
    p.add_argument("--image-size", type=int, default=16, help="16: the claims sweep's size")
    p.add_argument("--epochs", type=int, default=20)
    args = p.parse_args(argv)

    import numpy as np
    import torch
    from torch.optim.swa_utils import update_bn

    from bench.benchlib import print_machine
    from fedderm.augment import policy
    from fedderm.config import parse_config
    from fedderm.data import load_client_data
    from fedderm.models import create_model
    from fedderm.train import evaluate, seed_everything, to_input, train_supervised

    print_machine()
    torch.set_num_threads(1)
    cfg = parse_config(
        {
            "dataset": args.dataset,
            "partition": "source",
            "image-size": args.image_size,
            "seed": args.seed,
            "min-clients": args.centres,
        }
    )
    data = [load_client_data(cfg, c, args.centres) for c in range(args.centres)]
    print(f"{args.dataset}, {args.centres} centres, seed {args.seed}, {args.image_size} px")
    for c, d in enumerate(data):
        x = d.tensors("train")[0].float() / 255
        mean, sd = x.mean((0, 2, 3)).tolist(), x.std((0, 2, 3)).tolist()
        print(
            f"centre {c}: train {len(d.split.train)}, val {len(d.split.val)}; RGB mean "
            + " ".join(f"{v:.3f}" for v in mean)
            + ", SD "
            + " ".join(f"{v:.3f}" for v in sd)
        )
    own, other = np.zeros((args.centres, args.centres)), np.zeros((args.centres, args.centres))
    for a, da in enumerate(data):
        seed_everything(args.seed + a)
        model = create_model("tiny-cnn", da.num_classes, args.image_size)
        train_supervised(
            model,
            *da.tensors("train"),
            epochs=args.epochs,
            batch_size=16,
            lr=0.02,
            momentum=0.9,
            weight_decay=5e-4,
            seed=args.seed + a,
            augment=policy("004", "finetune"),
        )
        state = {k: v.clone() for k, v in model.state_dict().items()}
        for b, db in enumerate(data):
            model.load_state_dict(state)
            other[a, b] = evaluate(model, *db.tensors("val"), db.num_classes)["accuracy"]
            images = to_input(db.tensors("train")[0], torch.device("cpu"))
            update_bn(torch.utils.data.DataLoader(images, batch_size=64), model)
            own[a, b] = evaluate(model, *db.tensors("val"), db.num_classes)["accuracy"]
    for title, table in (
        ("validation accuracy (%), trained on row, BatchNorm statistics of the row", other),
        ("the same, BatchNorm statistics re-estimated on the column's training images", own),
    ):
        print(
            f"\n{title}\n| trained on \\ val of | "
            + " | ".join(f"centre {b}" for b in range(args.centres))
            + " |"
        )
        print("|---" * (args.centres + 1) + "|")
        for a in range(args.centres):
            print(f"| centre {a} | " + " | ".join(f"{100 * v:.1f}" for v in table[a]) + " |")
    off = ~np.eye(args.centres, dtype=bool)
    print(
        f"\nmean own-centre {100 * np.diag(other).mean():.1f}, other centres {100 * other[off].mean():.1f}, "
        f"other centres with their own statistics {100 * own[off].mean():.1f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
