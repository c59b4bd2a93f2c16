"""Use a trained model: load a run's ``model.pt`` (or ``model-best.pt``) and label images.

    from fedderm.inference import load_model
    clf = load_model("~/fedderm-results/fedavg-npz-.../model-best.pt")
    clf.classes                          # ['actinic keratosis', ...] in label order
    clf.predict(images)                  # [('melanoma', 0.91), ...]

The class names and the network (``model``, ``image-size``) come from the model file's metadata
(``state_dict._metadata["fedderm"]``, written by :class:`fedderm.results.RunRecorder`).  Images are
``uint8`` tensors N×3×S×S at the run's ``image-size`` (as the data pipeline makes them) or PIL images,
which are resized as the data sources do (:func:`fedderm.data.pool.resize_square`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .data.pool import resize_square
from .models import create_model
from .train import predict

__all__ = ["Classifier", "load_model", "model_metadata"]


def model_metadata(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state dict, fedderm metadata) of a model file; raises naming the file when it has none."""
    path = Path(path).expanduser()
    state = torch.load(path, map_location="cpu", weights_only=True)
    meta = dict((getattr(state, "_metadata", None) or {}).get("fedderm") or {})
    if not meta.get("classes"):
        raise ValueError(
            f"{path} carries no fedderm metadata (class names); it was written before "
            "fedderm recorded them, or is not a model.pt / model-best.pt of a run"
        )
    return state, meta


@dataclass
class Classifier:
    """A loaded model with its class names; :meth:`predict` labels images."""

    model: torch.nn.Module
    classes: list[str]
    image_size: int
    meta: dict[str, Any]

    def probabilities(self, images) -> torch.Tensor:
        """Softmax probabilities (N, C) in ``classes`` order."""
        return predict(self.model, self._tensor(images))

    def predict(self, images) -> list[tuple[str, float]]:
        """(class name, probability) of the most likely class of every image."""
        probs = self.probabilities(images)
        conf, idx = probs.max(dim=1)
        return [(self.classes[int(i)], float(c)) for i, c in zip(idx, conf)]

    def _tensor(self, images) -> torch.Tensor:
        if isinstance(images, torch.Tensor):
            x = images if images.ndim == 4 else images.unsqueeze(0)
            if x.dtype != torch.uint8 or tuple(x.shape[1:]) != (3, self.image_size, self.image_size):
                raise ValueError(
                    f"images must be uint8 N×3×{self.image_size}×{self.image_size} "
                    f"(the run's image-size), got {x.dtype} {tuple(x.shape)}"
                )
            return x
        pics = images if isinstance(images, (list, tuple)) else [images]
        arrays = np.stack([resize_square(p, self.image_size) for p in pics])
        return torch.from_numpy(arrays).permute(0, 3, 1, 2).contiguous()


def load_model(path: str | Path) -> Classifier:
    """The classifier in ``path`` with its class names, ready to :meth:`Classifier.predict`."""
    state, meta = model_metadata(path)
    classes, network = list(meta["classes"]), meta.get("network", "classifier")
    size = int(meta["image_size"])
    if network == "classifier":
        model = create_model(meta["model"], len(classes), size, vit_pool=meta.get("vit_pool", "avg"))
    elif network == "projected":
        from .flbt import build_projected_net

        model = build_projected_net(meta["model"], len(classes), size, int(meta["proj_dim"]))
    elif network == "sift":  # the text-guided head's P and W travel in the state dict
        from .sift import sift_model_from_state

        model = sift_model_from_state(
            meta["model"],
            state,
            image_size=size,
            temperature=float(meta["sift_temperature"]),
            variant=str(meta["sift_variant"]),
        )
    else:
        raise ValueError(
            f"{path}: method {meta.get('method')!r} saves no plain classifier "
            f"(network {network!r}); fedderm.inference cannot rebuild it"
        )
    model.load_state_dict(state, strict=True)
    return Classifier(model=model.eval(), classes=classes, image_size=size, meta=meta)
