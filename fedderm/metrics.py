"""Classification metrics for federated evaluation (pure numpy / scikit-learn).

Every client computes :func:`classification_metrics` on its own validation or test
split; the server reports the *unweighted* mean over clients with
:func:`mean_over_clients`, so every hospital counts the same regardless of size.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping

import numpy as np

__all__ = [
    "METRIC_NAMES",
    "NON_METRIC_KEYS",
    "SELECTION_METRIC",
    "classification_metrics",
    "mean_over_clients",
    "confusion",
    "per_class_metrics",
    "CONFUSION_KEY",
]

#: Metric names in the fixed order used for tables and CSV columns.
METRIC_NAMES: tuple[str, ...] = (
    "balanced_accuracy",
    "precision",
    "recall",
    "f1",
    "specificity",
    "auc",
    "accuracy",
    "ap",
)

#: The metric that chooses the best round on the validation split.
SELECTION_METRIC = "balanced_accuracy"

#: Keys that may appear in a client's metric dict but are not averaged.
NON_METRIC_KEYS: frozenset[str] = frozenset(
    {
        "num-examples",
        "num_examples",
        "partition-id",
        "partition_id",
        "client",
        "round",
        "split",
        "confusion-matrix",
    }
)

#: The key of a client's evaluation metrics that carries its confusion matrix, row-major and
#: flattened (a MetricRecord holds flat lists): ``cm[i * C + j]`` = images of class i predicted j.
CONFUSION_KEY = "confusion-matrix"


def classification_metrics(y_true, y_prob, num_classes: int) -> dict[str, float]:
    """Compute the classification metrics of one client.

    Args:
        y_true: integer labels, shape ``(N,)``, values in ``[0, num_classes)``.
        y_prob: softmax probabilities, shape ``(N, num_classes)``.  The predicted
            class is ``argmax(y_prob, axis=1)``.
        num_classes: number of classes of the task (checked against ``y_prob``).

    Returns:
        ``{name: value for name in METRIC_NAMES}`` as Python floats.  The loss is
        *not* included; the caller adds it.

    Label sets (this matters for clients that do not see every class):

    * ``balanced_accuracy`` -- sklearn ``balanced_accuracy_score``: mean recall over
      the classes **present in y_true** (classes only predicted are ignored).  NaN when
      y_true holds fewer than 2 classes: a "balanced" accuracy of one class is that class's
      recall, and reporting it as e.g. 1.000 would pass a one-class test set off as success.
    * ``precision``, ``recall``, ``f1`` -- sklearn macro averages with
      ``zero_division=0`` over ``labels = classes present in y_true ∪ classes
      present in y_pred``.  Classes that appear in neither are left out, as
      sklearn does by default; a class that is predicted but absent from ``y_true``
      counts with recall 0 (so ``recall`` can be lower than
      ``balanced_accuracy``).
    * ``specificity`` -- macro average over the same labels of TN / (TN + FP) per
      class, from the confusion matrix (0 when TN + FP = 0, mirroring
      ``zero_division=0``).
    * ``auc`` -- macro one-vs-rest ROC-AUC over the classes **present in y_true**:
      for each such class ``c``, ``roc_auc_score(y_true == c, y_prob[:, c])``,
      then the mean.  NaN when fewer than 2 classes are present (undefined).
    * ``accuracy`` -- plain fraction of correct predictions.
    * ``ap`` -- macro one-vs-rest average precision (area under the PR curve, sklearn
      ``average_precision_score``) over the classes **present in y_true** (paper 004 §IV-B).

    With no samples at all every metric is NaN.
    """
    y_true = np.asarray(y_true).astype(np.int64).reshape(-1)
    y_prob = np.asarray(y_prob, dtype=np.float64)
    if y_prob.ndim != 2:
        raise ValueError(f"y_prob must be 2-D (N, C), got shape {y_prob.shape}")
    if y_prob.shape[0] != y_true.shape[0]:
        raise ValueError(f"y_true has {y_true.shape[0]} samples but y_prob has {y_prob.shape[0]}")
    if y_prob.shape[1] != num_classes:
        raise ValueError(f"y_prob has {y_prob.shape[1]} columns but num_classes={num_classes}")
    if y_true.size and (y_true.min() < 0 or y_true.max() >= num_classes):
        raise ValueError(f"y_true values must lie in [0, {num_classes}), got {np.unique(y_true)}")
    if y_true.size == 0:
        return {name: float("nan") for name in METRIC_NAMES}

    # imported here: deployed SuperNodes start a process per message, and train messages
    # need no metrics (scikit-learn + scipy take seconds to import)
    from sklearn.metrics import (
        accuracy_score,
        average_precision_score,
        balanced_accuracy_score,
        confusion_matrix,
        precision_recall_fscore_support,
        roc_auc_score,
    )

    y_pred = np.argmax(y_prob, axis=1)
    present = np.unique(y_true)
    labels = np.union1d(present, np.unique(y_pred))

    with warnings.catch_warnings():
        # balanced_accuracy_score warns when y_pred holds classes absent from y_true.
        warnings.simplefilter("ignore", category=UserWarning)
        bal_acc = balanced_accuracy_score(y_true, y_pred) if present.size >= 2 else float("nan")

    precision, recall, f1, _ = precision_recall_fscore_support(
        y_true, y_pred, labels=labels, average="macro", zero_division=0
    )

    cm = confusion_matrix(y_true, y_pred, labels=labels).astype(np.float64)
    total = cm.sum()
    tp = np.diag(cm)
    fp = cm.sum(axis=0) - tp
    fn = cm.sum(axis=1) - tp
    tn = total - tp - fp - fn
    denom = tn + fp
    spec_per_class = np.divide(tn, denom, out=np.zeros_like(tn), where=denom > 0)
    specificity = float(spec_per_class.mean())

    if present.size >= 2:
        auc = float(np.mean([roc_auc_score(y_true == c, y_prob[:, c]) for c in present]))
    else:
        auc = float("nan")
    ap = float(np.mean([average_precision_score(y_true == c, y_prob[:, c]) for c in present]))

    return {
        "balanced_accuracy": float(bal_acc),
        "precision": float(precision),
        "recall": float(recall),
        "f1": float(f1),
        "specificity": specificity,
        "auc": auc,
        "accuracy": float(accuracy_score(y_true, y_pred)),
        "ap": ap,
    }


def confusion(y_true, y_pred, num_classes: int) -> np.ndarray:
    """The ``num_classes`` × ``num_classes`` confusion matrix over the *full* class list (sklearn
    ``confusion_matrix`` with ``labels=range(num_classes)``): row = true class, column = predicted."""
    from sklearn.metrics import confusion_matrix

    return confusion_matrix(
        np.asarray(y_true).reshape(-1), np.asarray(y_pred).reshape(-1), labels=np.arange(num_classes)
    ).astype(np.int64)


def per_class_metrics(cm, classes: list[str]) -> dict[str, dict[str, float]]:
    """Recall (sensitivity), precision, specificity and support of every class of ``classes``, in
    order, from a confusion matrix (rows true, columns predicted).

    Each is computed one-vs-rest for the class: recall = TP/(TP+FN), precision = TP/(TP+FP),
    specificity = TN/(TN+FP); a ratio whose denominator is 0 is NaN (undefined: e.g. the recall of a
    class with no test image), never 0 or 1.
    """
    cm = np.asarray(cm, dtype=np.float64)
    c = len(classes)
    if cm.shape != (c, c):
        raise ValueError(f"confusion matrix has shape {cm.shape}, expected ({c}, {c}) for classes {classes}")
    tp = np.diag(cm)
    fn = cm.sum(axis=1) - tp
    fp = cm.sum(axis=0) - tp
    tn = cm.sum() - tp - fn - fp

    def ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
        return np.divide(num, den, out=np.full_like(num, np.nan), where=den > 0)

    recall, precision, specificity = ratio(tp, tp + fn), ratio(tp, tp + fp), ratio(tn, tn + fp)
    return {
        name: {
            "recall": float(recall[i]),
            "precision": float(precision[i]),
            "specificity": float(specificity[i]),
            "support": int(tp[i] + fn[i]),
        }
        for i, name in enumerate(classes)
    }


def _as_float(value) -> float | None:
    """Return ``value`` as a float, or None if it is not a number."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def mean_over_clients(per_client: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """Unweighted mean over clients of every metric (NaN-ignoring).

    ``per_client`` maps a client id to its metric dict.  Keys in
    :data:`NON_METRIC_KEYS` (e.g. ``num-examples``) and non-numeric values are
    skipped.  NaN values (and clients lacking a metric) are ignored; a metric that
    is NaN for every client is NaN.  Keys follow :data:`METRIC_NAMES` order first,
    then any other metrics (e.g. ``loss``) in first-seen order.
    """
    values: dict[str, list[float]] = {}
    for metrics in per_client.values():
        for key, value in metrics.items():
            if key in NON_METRIC_KEYS:
                continue
            number = _as_float(value)
            if number is None:
                continue
            values.setdefault(key, []).append(number)

    ordered = [k for k in METRIC_NAMES if k in values] + [k for k in values if k not in METRIC_NAMES]
    result: dict[str, float] = {}
    for key in ordered:
        finite = [v for v in values[key] if not math.isnan(v)]
        result[key] = float(np.mean(finite)) if finite else float("nan")
    return result
