"""The health check of every evaluation: a model that trains but predicts one class must not pass
as a result.

It reads only what the clients already return (their confusion matrices, ``CONFUSION_KEY``, and
the mean metrics), so it costs nothing on the clients.  Two signs are checked
(docs/failures.md, "The model predicts one class"):

* **one class**: the model predicts one class for >= :data:`ONE_CLASS_SHARE` of a client's images
  while that client's labels hold >= 2 classes and are not themselves that concentrated on it.  On
  ``val`` it must hold in two consecutive rounds (>= 1) of a stage, whichever class (a model driven
  to one class by too large steps jumps between classes; one that is one-class for one early round
  and leaves it is still training); on a test split (the model reported) at once.
* **chance**: the mean val balanced accuracy stays within the chance band (1/K plus the larger of
  0.05 and two binomial standard errors of a random guess on the val images) for
  :data:`CHANCE_ROUNDS` consecutive rounds (>= 1) while the mean train loss falls.

Each finding is one line (which client, which class, the likely causes, what to try), logged once
as a warning and kept in :attr:`HealthCheck.warnings` (``summary.json`` ``warnings``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

#: share of a client's predictions in one class from which the model counts as collapsed
ONE_CLASS_SHARE = 0.95
#: consecutive val rounds in the chance band (train loss falling) that raise the chance warning
CHANCE_ROUNDS = 3
#: the chance band's smallest half-width above 1/K
CHANCE_MARGIN = 0.05


def one_class(cm: np.ndarray) -> tuple[int, float] | None:
    """(class, share of predictions) when the confusion matrix ``cm`` (rows true, columns
    predicted) shows >= :data:`ONE_CLASS_SHARE` of the predictions in one class while >= 2 classes
    are present and the labels hold less than that share of that class; else None."""
    cm = np.asarray(cm, dtype=float)
    n = cm.sum()
    if n <= 0:
        return None
    true, predicted = cm.sum(axis=1) / n, cm.sum(axis=0) / n
    c = int(predicted.argmax())
    if predicted[c] >= ONE_CLASS_SHARE and (true > 0).sum() >= 2 and true[c] < ONE_CLASS_SHARE:
        return c, float(predicted[c])
    return None


def chance_band(num_classes: int, num_images: int) -> float:
    """Upper edge of the chance band of balanced accuracy: 1/K + max(0.05, 2·√(p(1−p)/n)), p = 1/K
    (the standard error of a random guess's balanced accuracy on n images, K classes)."""
    p = 1.0 / max(num_classes, 1)
    return p + max(CHANCE_MARGIN, 2 * math.sqrt(p * (1 - p) / max(num_images, 1)))


def _causes(config: Mapping[str, Any]) -> str:
    ema = config.get("bn-stats") == "ema"
    return (
        "likely: "
        + ('BatchNorm statistics lagging the weights (bn-stats="ema", few steps per round), ' if ema else "")
        + "lr too high, too few images or local steps, wrong labels; try "
        + ('bn-stats="round", ' if ema else "")
        + "lr / 10, more local-epochs, checking the labels (docs/failures.md)"
    )


class HealthCheck:
    """Watches the evaluations a :class:`fedderm.results.RunRecorder` records; :meth:`see` returns
    the new warning lines of one evaluation."""

    def __init__(self, config: Mapping[str, Any] | None = None):
        self.config = dict(config or {})
        self.warnings: list[str] = []
        self._last_round = -1
        self._collapsed: dict[str, int] = {}  # client -> the one class it predicted in the previous val round
        self._chance: list[tuple[int, float]] = []  # (round, train loss) of the current run of chance rounds
        self._said: set[tuple] = set()

    def state(self) -> dict[str, Any]:
        return {
            "warnings": list(self.warnings),
            "last_round": self._last_round,
            "collapsed": dict(self._collapsed),
            "chance": [list(x) for x in self._chance],
            "said": [list(x) for x in sorted(self._said, key=str)],
        }

    def restore(self, state: Mapping[str, Any] | None) -> None:
        state = state or {}
        self.warnings = list(state.get("warnings", []))
        self._last_round = int(state.get("last_round", -1))
        self._collapsed = {str(k): int(v) for k, v in (state.get("collapsed") or {}).items()}
        self._chance = [(int(r), float(t)) for r, t in state.get("chance", [])]
        self._said = {tuple(x) for x in state.get("said", [])}

    def see(
        self,
        round: int,  # noqa: A002 - as RunRecorder.log_round
        split: str,
        confusions: Mapping[str, Sequence[Sequence[float]]],
        class_names: Sequence[str],
        mean_balanced_accuracy: float | None = None,
        train_loss: float | None = None,
        num_images: int | None = None,
    ) -> list[str]:
        """Check one evaluation: ``confusions`` per client (rows true, columns predicted), the mean
        balanced accuracy, the mean train loss and the number of images evaluated.  Returns the
        warning line it adds (at most one per evaluation; each finding once per run), or []."""
        split = str(split)
        is_test = split.endswith("test")
        if split != "val" and not is_test:
            return []
        if split == "val":
            if round <= self._last_round:  # a new stage (e.g. fine-tuning after pre-training) starts over
                self._collapsed, self._chance = {}, []
            self._last_round = round
            if round < 1:  # the untrained model: nothing to judge
                return []
        collapsed: dict[str, int] = {}
        found: list[str] = []
        for client, cm in confusions.items():
            hit = one_class(np.asarray(cm))
            if hit is None:
                continue
            c, share = hit
            collapsed[client] = c
            name = class_names[c] if c < len(class_names) else str(c)
            key = ("one-class", str(client))
            if (is_test or client in self._collapsed) and key not in self._said:
                self._said.add(key)
                found.append(f"client {client}: class {name!r} for {share:.0%}")
        parts = []
        if found:
            where = f"of its {split} images" if is_test else f"of val images in rounds {round - 1}-{round}"
            parts.append(
                f"the model predicts one class ({'; '.join(found)} {where}) though 2+ classes are present"
            )
        if split == "val":
            self._collapsed = collapsed
            chance = self._chance_rounds(round, confusions, mean_balanced_accuracy, train_loss, num_images)
            if chance and (found or not self.warnings):  # after a one-class warning it says nothing new
                parts.append(chance)
        if not parts:
            return []
        line = f"health: {'; '.join(parts)}: {_causes(self.config)}"
        self.warnings.append(line)
        return [line]

    def _chance_rounds(self, round, confusions, bacc, train_loss, num_images) -> str:  # noqa: A002
        """The chance finding of this val round ("" if none): :data:`CHANCE_ROUNDS` consecutive
        rounds in the chance band, the train loss lower at the last than at the first."""
        sizes = {len(cm) for cm in confusions.values()}
        if bacc is None or bacc != bacc or train_loss is None or train_loss != train_loss or len(sizes) != 1:
            self._chance = []
            return ""
        k = sizes.pop()
        n = num_images or int(sum(np.asarray(cm).sum() for cm in confusions.values()))
        if bacc > chance_band(k, n):
            self._chance = []
            return ""
        self._chance = [*self._chance, (round, float(train_loss))][-CHANCE_ROUNDS:]
        if len(self._chance) < CHANCE_ROUNDS or not self._chance[-1][1] < self._chance[0][1]:
            return ""
        if ("chance",) in self._said:
            return ""
        self._said.add(("chance",))
        first, last = self._chance[0], self._chance[-1]
        return (
            f"mean val balanced accuracy at chance ({bacc:.3f} <= {chance_band(k, n):.3f} for {k} classes) in "
            f"rounds {first[0]}-{last[0]} while the train loss fell ({first[1]:.3f} -> {last[1]:.3f})"
        )
