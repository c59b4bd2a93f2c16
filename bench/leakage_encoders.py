"""Which encoder should the relay's membership attack use? (docs/privacy.md "Which encoder").

A direct FedCLF loop (the same ``fedderm.moco`` functions as ``clients/fedclf.py``, FedAvg of the
replies, no Flower) on scikit-learn's bundled digits, 2 clients with ``--n-train`` training
images and ``--held-out`` (400) held-out images each.  The upload of round ``--rounds`` (0: the
initial upload, encoded by the global model itself) is attacked (:func:`fedderm.leakage.audit`) with

- ``received``: the global model the client started the round from (for round 0: the very encoder
  that made the keys);
- ``own``: the client's own model after the round (its train reply: what the server receives);
- ``next``: the FedAvg of the round's replies (what ``fedclf.leakage-audit`` uses, one round later).

    python -m bench.leakage_encoders --rounds 0 --n-train 200 --epochs 1 --views 0,8,32
    python -m bench.leakage_encoders --rounds 3 --n-train 128 --epochs 5 --views 0,8
    python -m bench.leakage_encoders --rounds 2 --n-train 90 --k 512 --epochs 6 --views 32 --sigmas 0 \
        --encoders next --audit-batch 64 --held-out 809 --tint      # as a FedCLF run audits

Prints one line per (encoder, client, σ, views) and the null standard deviation of the AUC.
"""

from __future__ import annotations

import argparse
import copy
import time

import numpy as np
import torch
import torch.nn.functional as F

from fedderm.leakage import audit
from fedderm.moco import FEATURE_DIM, FeatureQueue, build_moco, encode_keys, moco_round
from fedderm.relay_privacy import privatise


def digits16() -> torch.Tensor:
    """The 1,797 digits as uint8 N×3×16×16 (as tests/test_leakage.py)."""
    from sklearn.datasets import load_digits

    x, _ = load_digits(return_X_y=True)
    images = torch.from_numpy(x.reshape(-1, 1, 8, 8) * (255 / 16)).float()
    images = F.interpolate(images, size=16, mode="bilinear").round().clamp(0, 255)
    return images.to(torch.uint8).repeat(1, 3, 1, 1)


def fedavg(models: list) -> torch.nn.Module:
    """Equal-weight mean of the float entries of the models' state dicts (equal client sizes)."""
    states = [m.state_dict() for m in models]
    first = states[0]
    mean = {
        k: sum(s[k] for s in states) / len(states) if v.is_floating_point() else v for k, v in first.items()
    }
    out = copy.deepcopy(models[0])
    out.load_state_dict(mean)
    return out


def run(args) -> dict:
    torch.manual_seed(args.seed)
    images = digits16()
    if args.tint:  # dataset="digits" with 2 sites: each image in its site's colour cast (fedderm.data.digits)
        from fedderm.data.digits import load_digits_pool

        images = load_digits_pool(16, sites=2, seed=0).images
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(args.seed))
    half = len(images) // 2
    sites = (images[order[:half]], images[order[half:]])
    data = [(c[: args.n_train], c[args.n_train : args.n_train + args.held_out]) for c in sites]
    glob = build_moco("tiny-cnn", 16)
    banks = []
    for i, (train, _) in enumerate(data):
        keys, ids = encode_keys(
            copy.deepcopy(glob), train, args.k, batch_size=64, seed=args.seed * 7 + i, with_ids=True
        )
        banks.append(FeatureQueue(args.k, FEATURE_DIM, keys, ids=ids))
    encoders = [{"received": glob} for _ in data]
    remote = [b.features() for b in banks[::-1]]  # round 0: what each client received is the other's upload
    for r in range(1, args.rounds + 1):
        remote = [b.features() for b in banks[::-1]]
        replies = []
        for i, (train, _) in enumerate(data):
            model = copy.deepcopy(glob)
            moco_round(
                model, train, banks[i], remote=remote[i], feature_sharing=True, local_negatives=False,
                queue_size=args.k, temperature=0.2, key_momentum=args.key_momentum, epochs=args.epochs,
                batch_size=64, lr=0.03, seed=args.seed * 1000 + 10 * r + i,
            )  # fmt: skip
            replies.append(model)
        nxt = fedavg(replies)
        encoders = [
            {k: v for k, v in zip(("received", "own", "next"), (glob, replies[i], nxt)) if k in args.encoders}
            for i in range(len(data))
        ]
        glob = nxt
    out = {}
    for i, (train, held_out) in enumerate(data):
        ids = banks[i].image_ids()
        members = train[torch.unique(ids[ids >= 0])]
        for sigma in args.sigmas:
            relayed = torch.cat(
                [
                    privatise(
                        banks[i].features(), 1.0, sigma, insecure_seed=5
                    ),  # seeded: a bench that repeats
                    privatise(remote[i], 1.0, sigma, insecure_seed=6),
                ]
            )
            for name, enc in encoders[i].items():
                for v in args.views:
                    out[(name, i, sigma, v)] = audit(
                        copy.deepcopy(enc),
                        members,
                        held_out,
                        relayed,
                        views=v,
                        batch_size=args.audit_batch,
                        seed=args.seed,
                    )
        out[("sizes", i)] = (len(members), len(held_out))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=0, help="the round whose upload is attacked (0 = initial)")
    p.add_argument("--n-train", type=int, default=200, help="training images per client")
    p.add_argument("--k", type=int, default=256, help="fedclf.queue-size")
    p.add_argument("--epochs", type=int, default=1, help="local epochs per round")
    p.add_argument("--key-momentum", type=float, default=0.99, help="fedclf.momentum")
    p.add_argument("--views", default="0,8", help="fedclf.leakage-views values, comma-separated")
    p.add_argument("--sigmas", default="0,8", help="relay noise multipliers (clip 1), comma-separated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--encoders", default="received,own,next", help="which encoders attack, comma-separated")
    p.add_argument("--audit-batch", type=int, default=256, help="the audit's batch (BatchNorm statistics)")
    p.add_argument("--held-out", type=int, default=400, help="held-out images (non-members) per client")
    p.add_argument("--tint", action="store_true", help="the images of dataset=digits, 2 sites (colour casts)")
    args = p.parse_args(argv)
    args.views = [int(v) for v in args.views.split(",")]
    args.sigmas = [float(s) for s in args.sigmas.split(",")]
    args.encoders = args.encoders.split(",")
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    out = run(args)
    for key, value in out.items():
        if key[0] == "sizes":
            m, n = value
            se = np.sqrt((m + n + 1) / (12 * m * n))
            print(f"client {key[1]}: {m} members, {n} non-members, null sd of the AUC {se:.4f}")
    for key, value in out.items():
        if key[0] != "sizes":
            name, client, sigma, views = key
            print(f"{name:8s} client {client} sigma {sigma:g} views {views:2d}: AUC {value:.3f}")
    print(f"wall {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
