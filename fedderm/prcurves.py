"""Precision-recall curves per client (paper 004 §IV-B, Fig. 6): computed by each client on its
own test split, sent as a few hundred numbers (no image, no per-sample score), drawn by the server."""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["pr_curves", "plot_pr_curves"]


def pr_curves(y_true, y_prob, num_classes: int, max_points: int = 101) -> dict[str, list[float] | float]:
    """One-vs-rest PR curve and AP of every class present in ``y_true``.

    Returns flat keys ``precision-<c>``, ``recall-<c>`` (at most ``max_points`` points, first and
    last kept) and ``ap-<c>`` -- the shape of a Flower ConfigRecord.
    """
    # imported here, as in fedderm.metrics: scikit-learn (with scipy and pandas) is slow to
    # import, which the ServerApp's start-up need not pay (it only draws the curves)
    from sklearn.metrics import average_precision_score, precision_recall_curve

    y_true = np.asarray(y_true).astype(np.int64).reshape(-1)
    y_prob = np.asarray(y_prob, dtype=np.float64)
    out: dict[str, list[float] | float] = {}
    for c in np.unique(y_true):
        precision, recall, _ = precision_recall_curve(y_true == c, y_prob[:, c])
        keep = np.unique(
            np.linspace(0, len(precision) - 1, min(max_points, len(precision))).round().astype(int)
        )
        out[f"precision-{c}"] = [float(v) for v in precision[keep]]
        out[f"recall-{c}"] = [float(v) for v in recall[keep]]
        out[f"ap-{c}"] = float(average_precision_score(y_true == c, y_prob[:, c]))
    return out


def plot_pr_curves(path: Path, curves: dict, class_names: list[str] | None, title: str) -> Path:
    """One PNG: the PR curve of every class in ``curves`` (a :func:`pr_curves` dict), AP in the legend."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.5, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    classes = sorted(int(k.split("-", 1)[1]) for k in curves if k.startswith("ap-"))
    for c in classes:
        name = class_names[c] if class_names and c < len(class_names) else f"class {c}"
        ax.step(
            curves[f"recall-{c}"],
            curves[f"precision-{c}"],
            where="post",
            label=f"{name} (AP {curves[f'ap-{c}']:.3f})",
        )
    aps = [curves[f"ap-{c}"] for c in classes]
    ax.set_title(f"{title}\nmacro AP {np.mean(aps):.3f}" if aps else title)
    ax.set_xlabel("recall")
    ax.set_ylabel("precision")
    ax.set_xlim(-0.02, 1.02)
    ax.set_ylim(-0.02, 1.02)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small", loc="lower left")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, format="png", dpi=100)
    return path
