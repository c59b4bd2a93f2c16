"""What a person reads while a run goes: the round line with labelled fields, the time a round
took, and an estimate of the time left for the whole run (every stage: pre-training and
fine-tuning), from a :class:`Progress` per run.

A stage's rounds are timed by the clock between one round's line and the next (everything a
round costs: training, evaluation, checkpoint).  The first round of a stage also starts the
clients (and, in a simulation, Ray's actors), so once a stage has two rounds its pace leaves the
first out.  A stage that has not started yet is estimated at the pace of the stage before it.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass


def duration(seconds: float) -> str:
    """``seconds`` for a person: ``8 s``, ``45 s``, ``1 min 10 s``, ``12 min``, ``2 h 05 min``
    (coarser as it grows: an estimate has no more digits than it is worth)."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s} s"
    if s < 600:
        s = 5 * round(s / 5)
        return f"{s // 60} min" + (f" {s % 60} s" if s % 60 else "")
    if s < 3600:
        return f"{round(s / 60)} min"
    m = round(s / 60)
    return f"{m // 60} h {m % 60:02d} min"


def round_line(
    stage: str,
    server_round: int,
    num_rounds: int,
    fields: Iterable[tuple[str, str]],
    seconds: float | None = None,
    left: float | None = None,
) -> str:
    """``[stage ]round r/N · <label> <value> · ... · 12.6 s this round · ~1 min 10 s left``.

    Every value carries its label; ``seconds`` (this round's wall time) and ``left`` (the run's
    estimated time left) are left out when unknown (None or NaN)."""
    parts = [f"{stage + ' ' if stage else ''}round {server_round}/{num_rounds}"]
    parts += [f"{label} {value}" for label, value in fields]
    if seconds is not None and not math.isnan(seconds):
        parts.append(f"{seconds:.1f} s this round")
    if left is not None and left >= 1:  # NaN compares False: no estimate
        parts.append(f"~{duration(left)} left")
    return " · ".join(parts)


def metric_label(name: str) -> str:
    """A metric's key as words (``balanced_accuracy`` -> ``balanced accuracy``)."""
    return name.replace("_", " ").replace("-", " ")


def reached(targets: dict[str, int | None]) -> str:
    """``rounds_to_target`` for a person: ``0.5 in round 2 · 0.8 not reached``."""
    return " · ".join(f"{t} " + ("not reached" if r is None else f"in round {r}") for t, r in targets.items())


@dataclass
class _Stage:
    name: str
    rounds: int
    done: int = 0  # rounds finished (a resumed stage starts with those of its checkpoint)
    started: float | None = None  # the clock when the stage began in this process
    first: float | None = None  # the clock when its first round in this process finished
    timed: int = 0  # rounds finished in this process
    last: float | None = None  # the clock when its last round finished


class Progress:
    """The stages of one run (in order, each with its rounds) and the time their rounds took.

    ``plan`` declares the stages a run will go through before the first starts (pre-training
    and fine-tuning), ``start`` marks a stage's beginning (adding it when it was not planned),
    ``finish_round`` marks a round's end and returns the estimated seconds left for the run.
    ``clock`` is a monotonic clock in seconds (a test passes a fake one)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.stages: list[_Stage] = []
        self.current: _Stage | None = None

    def _get(self, name: str) -> _Stage | None:
        return next((s for s in self.stages if s.name == name), None)

    def plan(self, stages: Iterable[tuple[str, int]]) -> None:
        """The run's stages ``(name, rounds)`` in the order they run; a stage already known keeps
        what it measured and takes the new number of rounds."""
        for name, rounds in stages:
            known = self._get(name)
            if known is None:
                self.stages.append(_Stage(name, int(rounds)))
            else:
                known.rounds = int(rounds)

    def start(self, name: str, rounds: int, done: int = 0) -> None:
        """Stage ``name`` (``rounds`` rounds, ``done`` of them finished before: a resume) begins now."""
        stage = self._get(name)
        if stage is None:
            stage = _Stage(name, int(rounds))
            self.stages.append(stage)
        stage.rounds, stage.done = int(rounds), int(done)
        stage.started, stage.first, stage.last, stage.timed = self.clock(), None, None, 0
        self.current = stage

    def finish_round(self, name: str, server_round: int) -> float | None:
        """Round ``server_round`` of stage ``name`` has ended; returns :meth:`left`."""
        stage = self._get(name)
        if stage is None or stage.started is None:  # not started through start(): timed from now on
            self.start(name, max(server_round, stage.rounds if stage else 0), server_round)
            return self.left()
        now = self.clock()
        if server_round > 0:  # round 0 is the evaluation before training: no round of the stage
            stage.timed += 1
            if stage.first is None:
                stage.first = now
            stage.last = now
            stage.done = max(stage.done, server_round)
        self.current = stage
        return self.left()

    @staticmethod
    def _pace(stage: _Stage) -> float | None:
        """Seconds per round of ``stage``: from its second round on, the rounds after the first."""
        if stage.timed >= 2:
            return (stage.last - stage.first) / (stage.timed - 1)
        if stage.timed == 1:
            return stage.first - stage.started
        return None

    def left(self) -> float | None:
        """Estimated seconds until the last round of the last planned stage ends; None until a
        round has been timed."""
        if self.current is None:
            return None
        at = self.stages.index(self.current)
        pace = None
        for stage in reversed(self.stages[: at + 1]):
            if (pace := self._pace(stage)) is not None:
                break
        if pace is None:
            return None
        total = 0.0
        for stage in self.stages[at:]:
            own = self._pace(stage)
            total += max(stage.rounds - stage.done, 0) * (pace if own is None else own)
        return total


_RUNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def of(run) -> Progress:
    """The :class:`Progress` of ``run`` (the run's :class:`fedderm.results.RunRecorder`): one per
    run, made on first use, gone with the run."""
    progress = _RUNS.get(run)
    if progress is None:
        progress = _RUNS[run] = Progress()
    return progress
