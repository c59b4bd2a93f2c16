"""Live experiment tracking: TensorBoard event files in the run folder (run-config ``tensorboard``).

:class:`fedderm.results.RunRecorder` owns one :class:`Tracker` when the run config says
``tensorboard = true`` (the ServerApp's recorder; the clients never write any).  Every row the
recorder appends to ``rounds.csv`` becomes a scalar here, with the same value:

* ``<split>/<metric>/mean`` and ``<split>/<metric>/client-<id>`` at step = round, for every
  numeric column of ``rounds.csv`` (``loss``, the metrics of :data:`fedderm.metrics.METRIC_NAMES`,
  ``train_loss`` on the mean row) and every split but the final test ones (``test``,
  ``global-test``: their step would be the best round, not a time; they are in the text);
* extra curves (encoder probes, privacy) through :meth:`Tracker.scalars`;
* the final table (``final_table.txt``) as the text ``final_table`` when the run finishes.

``tensorboard --logdir <output-dir>`` shows every run folder under ``output-dir`` side by side.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["Tracker", "FINAL_SPLITS"]

#: splits whose rows are not written as scalars (they are one-off evaluations, in the text)
FINAL_SPLITS = frozenset({"test", "global-test"})


def _finite(value: Any) -> float | None:
    if value is None or isinstance(value, (bool, str)):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


class Tracker:
    """A :class:`torch.utils.tensorboard.SummaryWriter` on ``run_dir`` that is flushed after
    every round, so ``tensorboard`` shows a run while it runs."""

    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.run_dir = Path(run_dir)
        self.writer = SummaryWriter(log_dir=str(self.run_dir), flush_secs=10)

    def scalars(self, prefix: str, step: int, values: Mapping[str, Any]) -> None:
        """``<prefix>/<name>`` = value at ``step`` for every finite value (NaN/None skipped)."""
        for name, value in values.items():
            number = _finite(value)
            if number is not None:
                self.writer.add_scalar(f"{prefix}/{name}", number, global_step=int(step))
        self.writer.flush()

    def rows(self, split: str, step: int, rows: Mapping[str, Mapping[str, Any]]) -> None:
        """The rows of one round of ``rounds.csv`` (client id or ``mean`` -> column -> value):
        ``<split>/<column>/<client-id | mean>``."""
        if split in FINAL_SPLITS:
            return
        for who, columns in rows.items():
            tag = "mean" if who == "mean" else f"client-{who}"
            for column, value in columns.items():
                number = _finite(value)
                if number is not None:
                    self.writer.add_scalar(f"{split}/{column}/{tag}", number, global_step=int(step))
        self.writer.flush()

    def text(self, tag: str, text: str) -> None:
        """``text`` as a preformatted TensorBoard text (markdown: every line indented 4 spaces)."""
        self.writer.add_text(tag, "\n".join("    " + line for line in text.splitlines()))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
