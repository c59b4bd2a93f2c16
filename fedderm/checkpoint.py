"""Per-round server checkpoints: global model, round, strategy state and results so far.

One file per stage and round in the run folder (``checkpoint-round-3.pt`` for the single-stage
methods, ``checkpoint-<stage>-round-3.pt`` for the stages of a multi-stage plan), written
atomically so that a crash never leaves a half-written latest checkpoint.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from fedderm.atomic import atomic_path

DEFAULT_STAGE = "train"


def checkpoint_name(stage: str, server_round: int) -> str:
    prefix = "checkpoint" if stage == DEFAULT_STAGE else f"checkpoint-{stage}"
    return f"{prefix}-round-{server_round}.pt"


def _rounds(run_dir: Path, stage: str) -> list[tuple[int, Path]]:
    prefix = "checkpoint" if stage == DEFAULT_STAGE else f"checkpoint-{stage}"
    pattern = re.compile(re.escape(prefix) + r"-round-(\d+)\.pt$")
    found = [
        (int(m.group(1)), p)
        for p in Path(run_dir).glob("checkpoint*-round-*.pt")
        if (m := pattern.match(p.name))
    ]
    return sorted(found)


def save_checkpoint(
    run_dir: Path, stage: str, server_round: int, payload: dict[str, Any], keep: int = 3
) -> Path:
    """Write ``payload`` for (stage, round); keep the newest ``keep`` of this stage (0 = all)."""
    path = Path(run_dir) / checkpoint_name(stage, server_round)
    with atomic_path(path) as tmp:
        torch.save({"stage": stage, "round": server_round, **payload}, tmp)
    if keep:
        for _, old in _rounds(run_dir, stage)[:-keep]:
            old.unlink(missing_ok=True)
    return path


def resume_step(run_dir: Path) -> int:
    """The client-state step of the newest checkpoint in ``run_dir`` (every stage), 0 if none:
    the step a resumed run's clients roll back to (:mod:`fedderm.state_store`)."""
    steps = [0]
    for path in Path(run_dir).glob("checkpoint*-round-*.pt"):
        payload = torch.load(path, weights_only=False, mmap=True, map_location="cpu")
        steps.append(int(payload.get("state-step") or 0))
    return max(steps)


def latest_checkpoint(run_dir: Path, stage: str) -> dict[str, Any] | None:
    """The newest complete checkpoint of ``stage`` in ``run_dir``, or None."""
    rounds = _rounds(run_dir, stage)
    if not rounds:
        return None
    return torch.load(rounds[-1][1], weights_only=False)
