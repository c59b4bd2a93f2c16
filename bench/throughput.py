"""Local-training throughput: fedderm's loops against a plain PyTorch loop.

    python -m bench.throughput            # ResNet-18 64 px (supervised, MoCo), ViT-tiny 64 px (MAE), 1 thread
    python -m bench.throughput --quick    # tiny-cnn / vit-micro at 32 px: a fast check
    python -m bench.throughput --threads 2
    python -m bench.throughput --device cuda --batch-size 128 --image-size 224 --cases supervised,mae

Same model, same uint8 images (generated tensors), same batch size and optimiser; every case
alternates fedderm / plain (``--repeats`` times, medians of images per second):

* supervised: ``fedderm.train.train_supervised`` (random flips, Adam, cross-entropy) against a
  hand-written loop doing the same;
* MoCo: ``fedderm.moco.moco_round`` (two augmented views, momentum encoder, InfoNCE, queue) against
  the same model steps on un-augmented views; the difference is the data pipeline
  (``fedderm.augment.ContrastiveAugment``, batched on tensors), also timed alone;
* MAE: ``fedderm.train.train_epochs`` with the MAE loss of ``clients/fedmae.py`` against a plain loop
  calling the same model.

"pipeline share" = 1 − plain/fedderm images per second: the part of fedderm's time not spent in
the model's forward/backward (data handling, augmentation, bookkeeping).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench import benchlib  # noqa: E402


def _data(n: int, size: int, classes: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, 256, (n, 3, size, size), generator=g, dtype=torch.uint8),
        torch.randint(0, classes, (n,), generator=g),
    )


def _normal(x):
    return (x.float() / 255.0 - 0.5) / 0.5


CPU = torch.device("cpu")


def _sync(device) -> None:
    """Wait for the GPU's queued work, so that a timer measures it (CUDA runs asynchronously)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _batches(n, batch_size, g):
    order = torch.randperm(n, generator=g)
    return [order[i : i + batch_size] for i in range(0, n, batch_size) if len(order[i : i + batch_size]) > 1]


# ----------------------------------------------------------------------------- supervised
def supervised_fedderm(model, images, labels, bs, device=CPU):
    from fedderm.train import train_supervised

    train_supervised(
        model,
        images,
        labels,
        epochs=1,
        batch_size=bs,
        lr=1e-3,
        optimizer="adam",
        weight_decay=5e-4,
        seed=1,
        device=device,
    )


def supervised_plain(model, images, labels, bs, device=CPU):
    """The plain loop copies the whole uint8 data set to ``device`` once and cuts batches there."""
    model.to(device).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=5e-4)
    g = torch.Generator().manual_seed(1)
    images, labels = images.to(device), labels.to(device)
    for idx in _batches(len(labels), bs, g):
        x = images[idx.to(device)]
        h, v = torch.rand(len(idx), generator=g) < 0.5, torch.rand(len(idx), generator=g) < 0.5
        h, v = h.to(device), v.to(device)
        x = torch.where(h[:, None, None, None], x.flip(-1), x)
        x = torch.where(v[:, None, None, None], x.flip(-2), x)
        loss = F.cross_entropy(model(_normal(x)), labels[idx.to(device)])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


# ----------------------------------------------------------------------------- MoCo
def _bank():
    """A full bank of 256 random unit features (as after a few rounds)."""
    return F.normalize(torch.randn(256, 128, generator=torch.Generator().manual_seed(3)), dim=1)


def moco_fedderm(model, images, labels, bs, device=CPU):
    from fedderm.moco import FeatureQueue, moco_round

    bank = FeatureQueue(256, 128, _bank(), device=device)
    moco_round(
        model,
        images,
        bank,
        remote=None,
        feature_sharing=False,
        local_negatives=True,
        queue_size=256,
        temperature=0.2,
        key_momentum=0.99,
        epochs=1,
        batch_size=bs,
        lr=1e-3,
        optimizer="adam",
        seed=1,
        device=device,
    )


def moco_plain(model, images, labels, bs, device=CPU):
    """The same steps without augmentation: both views are the normalised images."""
    from fedderm.moco import FeatureQueue, info_nce

    model.to(device).train()
    opt = torch.optim.Adam(model.main_parameters(), lr=1e-3)
    queue = FeatureQueue(256, 128, _bank(), device=device)
    g = torch.Generator().manual_seed(1)
    images = images.to(device)
    for idx in _batches(len(images), bs, g):
        x = _normal(images[idx.to(device)])
        q = model(x)
        model.momentum_update(0.99)
        k = model.keys(x)
        loss = info_nce(q, k, queue.features(), 0.2)
        queue.enqueue(k)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def augment_only(images, bs, device=CPU) -> float:
    """Images per second of fedderm's two contrastive views alone (the images already on ``device``)."""
    from fedderm.augment import ContrastiveAugment
    from fedderm.moco import two_views

    augment, g = ContrastiveAugment(images.shape[-1]), torch.Generator().manual_seed(0)
    images = images.to(device)
    _sync(device)
    t = time.perf_counter()
    for i in range(0, len(images), bs):
        two_views(images[i : i + bs], augment, g, device)
    _sync(device)
    return len(images) / (time.perf_counter() - t)


# ----------------------------------------------------------------------------- MAE
def mae_fedderm(model, images, labels, bs, device=CPU):
    from fedderm.train import random_flips, to_input, train_epochs

    def loss_fn(m, xb, yb, generator):
        return m(to_input(random_flips(xb, generator), device), 0.75, generator)[0]

    train_epochs(
        model,
        images,
        labels,
        loss_fn,
        epochs=1,
        batch_size=bs,
        lr=1e-3,
        optimizer="adam",
        seed=1,
        device=device,
    )


def mae_plain(model, images, labels, bs, device=CPU):
    model.to(device).train()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    g = torch.Generator().manual_seed(1)
    images = images.to(device)
    for idx in _batches(len(images), bs, g):
        loss = model(_normal(images[idx.to(device)]), 0.75, g)[0]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def _models(quick: bool, size: int):
    import registry
    from fedderm.mae import build_mae
    from fedderm.moco import build_moco
    from fedderm.models import create_model

    cnn, vit = ("tiny-cnn", "vit-micro") if quick else ("resnet18", "vit-tiny")
    mae_cfg = registry.load_config(
        {
            "method": "fedmae",
            "model": vit,
            "image-size": size,
            "fedmae.decoder-embed-dim": 64 if quick else 128,
            "fedmae.decoder-depth": 2,
            "fedmae.decoder-num-heads": 4,
        }
    )
    return {
        "supervised": (f"{cnn}", lambda: create_model(cnn, 5, size), supervised_fedderm, supervised_plain),
        "moco": (f"{cnn} MoCo", lambda: build_moco(cnn, size), moco_fedderm, moco_plain),
        "mae": (f"{vit} MAE", lambda: build_mae(mae_cfg), mae_fedderm, mae_plain),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--images", type=int, default=None, help="images per epoch (default 256)")
    ap.add_argument("--image-size", type=int, default=None, help="default 64, quick 32")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a simulation worker uses 1)")
    ap.add_argument("--repeats", type=int, default=None, help="alternations per case (default 3)")
    ap.add_argument(
        "--cases", default="supervised,moco,mae", help="comma-separated; add +compile for torch.compile"
    )
    ap.add_argument("--device", default="cpu", help="cpu or cuda (CUDA timers synchronise)")
    args = ap.parse_args(argv)
    from fedderm.train import resolve_device

    device = resolve_device(args.device)
    cuda = device.type == "cuda"
    torch.set_num_threads(args.threads)
    n = args.images or 256
    size = args.image_size or (32 if args.quick else 64)
    repeats = args.repeats or 3
    info = benchlib.print_machine()
    print(
        f"settings: {n} images of {size} px per epoch · batch {args.batch_size} · {args.threads} torch thread(s)"
        f" · {repeats} alternations · device {device}"
        + (
            f" ({torch.cuda.get_device_name(device)}; PyTorch's TF32 defaults: matmul "
            f"{torch.backends.cuda.matmul.allow_tf32}, cuDNN {torch.backends.cudnn.allow_tf32})"
            if cuda
            else ""
        )
    )
    images, labels = _data(n, size)
    rows = []
    models = _models(args.quick, size)
    for case in args.cases.split(","):
        base, _, variant = case.partition("+")  # "supervised+compile": the same case, model compiled
        name, build, ours, plain = models[base]
        torch.manual_seed(0)
        model = build()
        if variant == "compile":  # what run-config compile=true does (clients/common.py)
            model.compile()
            name += " compiled"
        elif variant:
            raise SystemExit(f"unknown case variant {variant!r} in {case!r}; the only one is +compile")
        warm = images[: 2 * args.batch_size], labels[: 2 * args.batch_size], args.batch_size, device
        t = time.perf_counter()
        ours(model, *warm)  # warm-up (and cuDNN's kernel choice on CUDA; the compile with +compile)
        plain(model, *warm)
        _sync(device)
        warm_s = time.perf_counter() - t
        rates = {"fedderm": [], "plain": []}
        peak = {}
        for _ in range(repeats):
            for which, fn in (("fedderm", ours), ("plain", plain)):
                if cuda:
                    torch.cuda.reset_peak_memory_stats(device)
                _sync(device)
                t = time.perf_counter()
                fn(model, images, labels, args.batch_size, device)
                _sync(device)
                rates[which].append(n / (time.perf_counter() - t))
                if cuda:
                    peak[which] = max(peak.get(which, 0), torch.cuda.max_memory_allocated(device))
        a, b = benchlib.median(rates["fedderm"]), benchlib.median(rates["plain"])
        extra = (
            f"augmentation alone {augment_only(images, args.batch_size, device):.0f} img/s"
            if case == "moco"
            else f"warm-up incl. compile {warm_s:.1f} s"
            if variant
            else ""
        )
        mem = [f"{peak['fedderm'] / 2**30:.2f}", f"{peak['plain'] / 2**30:.2f}"] if cuda else []
        rows.append(
            [case, name, f"{a:.1f}", f"{b:.1f}", f"{a / b:.2f}", f"{max(0.0, 1 - a / b):.0%}", *mem, extra]
        )
        print(f"  {case}: fedderm {a:.1f} img/s · plain {b:.1f} img/s {extra}", flush=True)
    print()
    head = ["case", "model", "fedderm img/s", "plain img/s", "ratio", "pipeline share"]
    if cuda:
        head += ["peak GiB fedderm", "peak GiB plain"]
    print(benchlib.table(rows, [*head, ""]))
    print(
        f"load average at start {' '.join(map(str, info['loadavg']))}, now "
        f"{' '.join(f'{x:.2f}' for x in __import__('os').getloadavg())}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
