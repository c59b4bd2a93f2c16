"""Where should the SiFT long-term model's BatchNorm statistics come from? (``sift.long-bn``)

    python -m bench.sift_long_bn

One client of the embedded data (tiny CNN, 32 px), one epoch of SGD per step followed by the
long-term update of Eq. 2 (β = 0.9); prints the validation balanced accuracy of the long-term
model after each update for ``recompute``, ``ema`` and ``copy``, and of the short-term model.
"""

from __future__ import annotations

import sys
import time


def main() -> int:
    import torch

    import registry
    from fedderm.data import load_client_data
    from fedderm.sift import (
        LONG_BN_MODES,
        build_sift_model,
        class_text_embeddings,
        sift_model_from_state,
        update_long_term,
    )
    from fedderm.train import evaluate, train_supervised

    torch.set_num_threads(1)
    cfg = registry.load_config(
        {"model": "tiny-cnn", "image-size": 32, "synthetic-per-class": 40, "partition": "iid"}
    )
    data = load_client_data(cfg, 0, 1)
    W = class_text_embeddings(cfg.option("sift.text-model"), data.classes, cache_dir=cfg.cache_path)
    x, y = data.tensors("train")
    xv, yv = data.tensors("val")
    started = time.monotonic()
    for bn in LONG_BN_MODES:
        torch.manual_seed(0)
        short = build_sift_model("tiny-cnn", W, image_size=32)
        long = {k: v.clone() for k, v in short.state_dict().items()}
        long_acc, short_acc = [], []
        for step in range(15):
            train_supervised(short, x, y, epochs=1, batch_size=16, lr=0.05, optimizer="sgd", seed=step)
            long = update_long_term(long, short, 0.9, bn=bn, images=x, batch_size=16)
            model = sift_model_from_state("tiny-cnn", long, image_size=32, temperature=0.1, variant="full")
            long_acc.append(evaluate(model, xv, yv, 5)["balanced_accuracy"])
            short_acc.append(evaluate(short, xv, yv, 5)["balanced_accuracy"])
        print(f"long-term, sift.long-bn={bn:<9}: " + " ".join(f"{a:.2f}" for a in long_acc))
    print("short-term                     : " + " ".join(f"{a:.2f}" for a in short_acc))
    print(f"({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
