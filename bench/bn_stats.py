"""What does ``bn-stats="round"`` cost per round, against the local training it is part of, and
what would a post-training re-estimation pass (PreciseBN) cost instead?

    python -m bench.bn_stats [--model resnet18] [--image-size 64] [--images 128] [--epochs 1 2] [--repeats 3]

One client's local round of ``fedderm.train.train_supervised`` (Adam, batch 32, random flips) on
``--images`` random uint8 images, timed in one process with both settings interleaved (so load
changes hit both alike):

* ``ema``: PyTorch's BatchNorm statistics (the local loop as before ``bn-stats``);
* ``round``: the statistics reset at the first batch of the last local epoch and accumulated as a
  cumulative average (:class:`fedderm.train.RoundStats`); the added work itself (reset + momentum
  swap of every BatchNorm layer) is timed on its own as well;
* ``precise``: after an ``ema`` round, one forward pass in train mode over the client's training
  images with the statistics reset (``torch.optim.swa_utils.update_bn``, Wu & Johnson 2021's
  PreciseBN over the whole local set): its time is the extra cost.

Prints each median and the ratios to the ``ema`` round (the issue's bound: <= 5 % of local training).

    python -m bench.bn_stats --accuracy

What each choice gives (no timing): the report's federation in plain PyTorch (scikit-learn's digits
0-4, 60 per class, two IID clients of ~90 training images, tiny CNN 32 px, Adam 1e-3, batch 32, one
local epoch = 3 steps per round, FedAvg of every state entry, 6 rounds); after every round the global
model's balanced accuracy in eval mode and the share of its most predicted class on the held-out
images, for ``ema``, ``round`` and ``precise``, and for ``ema``'s weights with statistics
re-estimated on the training images.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet18")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--images", type=int, default=128, help="training images of the client")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, nargs="+", default=[1, 2], help="local epochs per round")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="auto")
    p.add_argument("--accuracy", action="store_true", help="the report's federation instead of timings")
    args = p.parse_args(argv)
    if args.accuracy:
        return accuracy()

    import torch
    from torch.optim.swa_utils import update_bn

    from bench.benchlib import print_machine
    from fedderm.models import create_model
    from fedderm.train import RoundStats, resolve_device, to_input, train_supervised

    device = resolve_device(args.device)
    print_machine()
    g = torch.Generator().manual_seed(0)
    images = torch.randint(
        0, 256, (args.images, 3, args.image_size, args.image_size), dtype=torch.uint8, generator=g
    )
    labels = torch.randint(0, 7, (args.images,), generator=g)
    torch.manual_seed(0)
    model = create_model(args.model, num_classes=7, image_size=args.image_size).to(device)
    start = {k: v.clone() for k, v in model.state_dict().items()}

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def local_round(mode: str, epochs: int) -> float:
        model.load_state_dict(start)
        sync()
        t = time.perf_counter()
        train_supervised(
            model,
            images,
            labels,
            epochs=epochs,
            batch_size=args.batch_size,
            lr=1e-3,
            optimizer="adam",
            device=device,
            bn_stats=mode,
        )
        sync()
        return time.perf_counter() - t

    def precise_pass() -> float:
        sync()
        t = time.perf_counter()
        with torch.no_grad():
            batches = (
                to_input(images[i : i + args.batch_size], device)
                for i in range(0, len(images), args.batch_size)
            )
            update_bn(batches, model, device=device)
        sync()
        return time.perf_counter() - t

    def round_stats_work() -> float:
        sync()
        t = time.perf_counter()
        with RoundStats(model, 1, "round") as stats:
            stats.before_batch(0)
        sync()
        return time.perf_counter() - t

    layers = sum(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    print(
        f"{args.model} {args.image_size} px on {device.type}: {args.images} images, batch {args.batch_size}, "
        f"{layers} BatchNorm layers, {args.repeats} repeats (medians)"
    )
    local_round("ema", 1)  # warm-up: allocator, cuDNN autotuning, thread pools
    for epochs in args.epochs:
        times: dict[str, list[float]] = {"ema": [], "round": [], "precise": [], "reset": []}
        for _ in range(args.repeats):
            times["ema"].append(local_round("ema", epochs))
            times["precise"].append(precise_pass())
            times["round"].append(local_round("round", epochs))
            times["reset"].append(round_stats_work())
        m = {k: statistics.median(v) for k, v in times.items()}
        print(
            f"local-epochs {epochs}: round with ema {m['ema']:.3f} s · with round {m['round']:.3f} s "
            f"({m['round'] / m['ema'] - 1:+.1%}) · the reset itself {m['reset'] * 1e3:.2f} ms "
            f"({m['reset'] / m['ema']:.3%}) · PreciseBN pass {m['precise']:.3f} s (+{m['precise'] / m['ema']:.1%})"
        )
    return 0


def accuracy(rounds: int = 6, size: int = 32) -> int:
    import copy

    import numpy as np
    import torch
    import torch.nn.functional as F
    from torch.optim.swa_utils import update_bn

    from fedderm.data.digits import digits_arrays
    from fedderm.metrics import classification_metrics
    from fedderm.models import create_model
    from fedderm.train import predict, to_input, train_supervised

    images, labels = digits_arrays(8)
    rng = np.random.default_rng(0)
    pick = np.concatenate([rng.permutation(np.flatnonzero(labels == c))[:60] for c in range(5)])
    pick = pick[rng.permutation(len(pick))]
    x = F.interpolate(torch.from_numpy(images[pick])[:, None].float(), size=size, mode="bilinear")
    x = x.round().clamp(0, 255).to(torch.uint8).repeat(1, 3, 1, 1)
    y = torch.from_numpy(labels[pick])
    train, held = np.arange(180), np.arange(180, 300)  # 90 training images per client, 120 held out
    clients = [train[0::2], train[1::2]]

    def score(model) -> str:
        probs = predict(model, x[held])
        top = np.bincount(probs.argmax(1).numpy(), minlength=5).max() / len(held)
        bacc = classification_metrics(y[held].numpy(), probs.numpy(), 5)["balanced_accuracy"]
        return f"{bacc:.3f} ({top:.0%})"

    def reestimated(model):
        model = copy.deepcopy(model)
        with torch.no_grad():
            update_bn((to_input(x[train[i : i + 32]], torch.device("cpu")) for i in range(0, 180, 32)), model)
        return model

    print("balanced accuracy on 120 held-out images per round (share of the most predicted class)")
    for mode in ("ema", "round", "precise"):
        torch.manual_seed(0)
        global_model = create_model("tiny-cnn", num_classes=5, image_size=size)
        line = []
        for r in range(1, rounds + 1):
            states = []
            for i, idx in enumerate(clients):
                local = copy.deepcopy(global_model)
                kw = dict(
                    epochs=1, batch_size=32, lr=1e-3, optimizer="adam", weight_decay=5e-4, seed=10 * r + i
                )
                train_supervised(local, x[idx], y[idx], bn_stats="round" if mode == "round" else "ema", **kw)
                if mode == "precise":
                    with torch.no_grad():
                        batches = (
                            to_input(x[idx[j : j + 32]], torch.device("cpu")) for j in range(0, len(idx), 32)
                        )
                        update_bn(batches, local)
                states.append(local.state_dict())
            global_model.load_state_dict(
                {k: (sum(s[k].double() for s in states) / 2).to(states[0][k].dtype) for k in states[0]}
            )
            line.append(
                score(global_model)
                + (f" / re-estimated {score(reestimated(global_model))}" if mode == "ema" else "")
            )
        print(f"{mode:8s}", " · ".join(f"r{r} {v}" for r, v in enumerate(line, start=1)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
