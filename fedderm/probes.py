"""Encoder probes during self-supervised pre-training (run-config ``probe-every``).

Every ``probe-every`` pre-training rounds each client takes the current global encoder, computes
frozen features of its labelled training images and of its validation images, and scores two
classifiers trained on the former on the latter (the usual SSL monitors):

* **kNN**: scikit-learn ``KNeighborsClassifier`` with cosine distance and k = 20 (fewer when the
  client has fewer labelled images), uniform votes (the vote shares are the probabilities);
* **linear probe**: standardised features + ``LogisticRegression`` (L2, lbfgs, scikit-learn's
  defaults, 1000 iterations).

Both report every metric of :func:`fedderm.metrics.classification_metrics`.  The encoder is the
fine-tuning stage's starting point: ``cfg.model``'s backbone loaded with the method's mapping from
its pre-training model (``Method.probe`` in the registry: one of the ``backbone_from_*`` below).
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from fedderm.metrics import classification_metrics
from fedderm.train import to_input

__all__ = [
    "KNN_K",
    "knn_probe",
    "linear_probe",
    "probe_metrics",
    "encode",
    "backbone_from_prefix",
    "backbone_from_vit",
    "backbone_from_ssl_flbt",
]

KNN_K = 20


def _full_proba(proba: np.ndarray, classes: np.ndarray, num_classes: int) -> np.ndarray:
    """Probabilities over the classes seen in training -> over all ``num_classes`` columns."""
    out = np.zeros((len(proba), num_classes))
    out[:, classes.astype(int)] = proba
    return out


def _one_class(train_y: np.ndarray, n: int, num_classes: int) -> np.ndarray:
    out = np.zeros((n, num_classes))
    out[:, int(train_y[0])] = 1.0
    return out


def knn_probe(train_x, train_y, test_x, test_y, num_classes: int, k: int = KNN_K) -> dict[str, float]:
    """Metrics of a cosine kNN classifier (``k`` neighbours, uniform votes) on frozen features."""
    from sklearn.neighbors import KNeighborsClassifier

    train_x, test_x = np.asarray(train_x, np.float64), np.asarray(test_x, np.float64)
    train_y, test_y = np.asarray(train_y), np.asarray(test_y)
    knn = KNeighborsClassifier(n_neighbors=min(k, len(train_x)), metric="cosine", algorithm="brute")
    knn.fit(train_x, train_y)
    proba = _full_proba(knn.predict_proba(test_x), knn.classes_, num_classes)
    return classification_metrics(test_y, proba, num_classes)


def linear_probe(train_x, train_y, test_x, test_y, num_classes: int, seed: int = 0) -> dict[str, float]:
    """Metrics of a logistic-regression probe (standardised features) on frozen features."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    train_x, test_x = np.asarray(train_x, np.float64), np.asarray(test_x, np.float64)
    train_y, test_y = np.asarray(train_y), np.asarray(test_y)
    if len(np.unique(train_y)) < 2:  # nothing to separate: the one class seen is always predicted
        return classification_metrics(test_y, _one_class(train_y, len(test_y), num_classes), num_classes)
    clf = make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000, random_state=seed))
    with warnings.catch_warnings():  # a probe that has not fully converged is still a probe
        warnings.simplefilter("ignore")
        clf.fit(train_x, train_y)
    proba = _full_proba(clf.predict_proba(test_x), clf.classes_, num_classes)
    return classification_metrics(test_y, proba, num_classes)


def probe_metrics(train_x, train_y, test_x, test_y, num_classes: int, seed: int = 0) -> dict[str, dict]:
    """``{"knn": metrics, "linear": metrics}`` of both probes."""
    return {
        "knn": knn_probe(train_x, train_y, test_x, test_y, num_classes),
        "linear": linear_probe(train_x, train_y, test_x, test_y, num_classes, seed),
    }


@torch.no_grad()
def encode(
    model: torch.nn.Module, images: torch.Tensor, *, batch_size: int = 256, device: torch.device | str = "cpu"
) -> np.ndarray:
    """``model.forward_features`` of uint8 images in eval mode (no augmentation), as numpy."""
    model.eval()
    out = [
        model.forward_features(to_input(images[i : i + batch_size], torch.device(device))).float().cpu()
        for i in range(0, len(images), batch_size)
    ]
    return torch.cat(out).numpy() if out else np.zeros((0, 0), np.float32)


# -- the methods' mappings from their pre-training model to cfg.model's backbone (Method.probe) --
def backbone_from_prefix(cfg, state: dict[str, torch.Tensor], prefix: str = "backbone.") -> dict:
    """MoCo, SimCLR, rotation (FedCLF family): the pre-training model's ``backbone.*`` keys."""
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def backbone_from_vit(cfg, state: dict[str, torch.Tensor]) -> dict:
    """MAE / BEiT: the encoder mapped onto the timm ViT backbone (as for fine-tuning)."""
    from fedderm.mae import vit_backbone_state
    from fedderm.models import create_classifier

    target = create_classifier(cfg, 2).backbone.state_dict()
    return vit_backbone_state(state, target_keys=list(target))


def backbone_from_ssl_flbt(cfg, state: dict[str, torch.Tensor]) -> dict:
    """SSL-FL-BT: the pre-training network of ``ssl.tasks`` on original images (``encoder.backbone.*``
    or, for SimCLR, ``backbone.*``), or the server's pseudo-image encoder (``backbone.*``)."""
    from fedderm.ssl_pseudo import encoder_prefix

    where, tasks = cfg.option("ssl.pretrain"), str(cfg.option("ssl.tasks"))
    prefix = "" if where == "pseudo" else encoder_prefix(tasks)
    return backbone_from_prefix(cfg, state, prefix + "backbone.")
