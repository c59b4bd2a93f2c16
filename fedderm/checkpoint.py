"""Per-round server checkpoints: global model, round, strategy state and results so far.

One file per stage and round in the run folder (``checkpoint-round-3.pt`` for the single-stage
methods, ``checkpoint-<stage>-round-3.pt`` for the stages of a multi-stage plan), written
atomically and flushed to disk (file and folder), so that neither a crash nor a power cut leaves
a half-written checkpoint under a checkpoint's name.

Disk: a checkpoint holds no model itself.  Its global model goes to ``global[-<stage>]-round-<r>.pt``
and its best-on-val model is named by reference: the global-model file of the best round (the
best model is that round's global model), else a ``best[-<stage>]-round-<b>.pt`` written once.
After each save the newest ``keep`` checkpoints of the stage stay (``keep-checkpoints``; 0 keeps
all), with the model files they name; the rest is deleted.  Two checkpoints of a run whose best
round is older than both take three models, not four; three checkpoints took six before.

Loading: ``torch.load(weights_only=True)`` only (a checkpoint is a file on disk: it may have been
replaced); what is stored is tensors, dicts, lists, tuples, numbers, strings and None.  A resumed
run takes the newest *intact* checkpoint of a stage: a damaged one (empty or cut short by a power
cut or a full disk) is logged naming the file and the one before it is used.  A file that
``weights_only`` refuses (written by an older fedderm, or a pickle that would run code) stops the
resume with :class:`CheckpointError` naming the file: it is never executed.
"""

from __future__ import annotations

import logging
import pickle
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedderm.atomic import atomic_path

DEFAULT_STAGE = "train"
#: how a payload names a file of tensors it does not hold itself (the best-on-val model)
FILE_REF = "fedderm-file"
#: how a payload holds a numpy array or scalar (as a tensor, which weights_only loads): given back as numpy
NDARRAY = "fedderm-ndarray"
#: the console's logger: the damaged-checkpoint lines appear beside the round lines
_log = logging.getLogger("flwr")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used safely: written by an older fedderm, or not by fedderm."""


class DamagedCheckpoint(RuntimeError):
    """A checkpoint file that cannot be read whole (empty, cut short, not a checkpoint)."""


def _prefix(stage: str, kind: str = "checkpoint") -> str:
    return kind if stage == DEFAULT_STAGE else f"{kind}-{stage}"


def checkpoint_name(stage: str, server_round: int) -> str:
    return f"{_prefix(stage)}-round-{server_round}.pt"


def global_name(stage: str, server_round: int) -> str:
    """The file of the global model after ``server_round`` of ``stage``."""
    return f"{_prefix(stage, 'global')}-round-{server_round}.pt"


def best_name(stage: str, server_round: int) -> str:
    """The file of the best-on-val model of ``server_round`` of ``stage`` when it is no round's
    global model (round 0's initial model, a method's own best)."""
    return f"{_prefix(stage, 'best')}-round-{server_round}.pt"


def _numbered(run_dir: Path, prefix: str) -> list[tuple[int, Path]]:
    pattern = re.compile(re.escape(prefix) + r"-round-(\d+)\.pt$")
    found = [(int(m.group(1)), p) for p in Path(run_dir).glob("*.pt") if (m := pattern.match(p.name))]
    return sorted(found)


def _rounds(run_dir: Path, stage: str) -> list[tuple[int, Path]]:
    """(round, path) of ``stage``'s checkpoints in ``run_dir``, oldest first."""
    return _numbered(run_dir, _prefix(stage))


def _stages(run_dir: Path) -> set[str]:
    stages = set()
    for path in Path(run_dir).glob("checkpoint*-round-*.pt"):
        m = re.fullmatch(r"checkpoint(?:-(.+))?-round-\d+\.pt", path.name)
        if m:
            stages.add(m.group(1) or DEFAULT_STAGE)
    return stages


# -- writing ----------------------------------------------------------------------------------
def _same_tensors(a: Mapping, b: Mapping) -> bool:
    """Whether two state dicts hold equal tensors key by key (a model and its best copy)."""
    if a.keys() != b.keys():
        return False
    for key, x in a.items():
        y = b[key]
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
            return False
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        same_memory = x.data_ptr() == y.data_ptr() and x.stride() == y.stride()
        if not same_memory and not torch.equal(x, y):
            return False
    return True


def _mapped(obj: Any, leaf) -> Any:
    """``obj`` with ``leaf(x)`` in place of every part ``x`` for which it is not None, walking dicts,
    lists and tuples; a container none of whose parts changed is returned as it is (the same object)."""
    new = leaf(obj)
    if new is not None:
        return new
    if isinstance(obj, dict):
        items = {k: _mapped(v, leaf) for k, v in obj.items()}
        return obj if all(items[k] is v for k, v in obj.items()) else items
    if isinstance(obj, (list, tuple)):
        values = [_mapped(v, leaf) for v in obj]
        return obj if all(a is b for a, b in zip(values, obj)) else type(obj)(values)
    return obj


def _as_marked_tensor(obj: Any) -> Any:
    if isinstance(obj, (np.ndarray, np.generic)) and obj.dtype.kind in "biufc":
        return {NDARRAY: torch.from_numpy(np.array(obj, copy=True))}
    return None


def _as_numpy(obj: Any) -> Any:
    if isinstance(obj, dict) and set(obj) == {NDARRAY} and isinstance(obj[NDARRAY], torch.Tensor):
        array = obj[NDARRAY].numpy()
        return array[()] if array.ndim == 0 else array
    return None


def _storable(obj: Any) -> Any:
    """``obj`` with every numpy array and scalar as a tensor marked :data:`NDARRAY` (their dtype
    kept), so that ``weights_only`` loads it; :func:`_restored` gives them back as numpy.  Parts
    without numpy are returned as they are (the same objects)."""
    return _mapped(obj, _as_marked_tensor)


def _restored(obj: Any) -> Any:
    """``obj`` with the numpy values :func:`_storable` marked given back as numpy."""
    return _mapped(obj, _as_numpy)


def _save(path: Path, obj: Any) -> None:
    with atomic_path(path, fsync=True) as tmp:
        torch.save(_storable(obj), tmp)


def _holds(path: Path, arrays: Mapping) -> bool:
    """Whether the model file ``path`` holds exactly ``arrays``."""
    try:
        stored = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return isinstance(stored, dict) and _same_tensors(stored.get("arrays") or {}, arrays)
    except Exception:  # noqa: BLE001 - missing or damaged: it does not
        return False


def _is_model(arrays: Any) -> bool:
    return (
        isinstance(arrays, Mapping)
        and bool(arrays)
        and all(isinstance(v, torch.Tensor) for v in arrays.values())
    )


def save_checkpoint(
    run_dir: Path, stage: str, server_round: int, payload: dict[str, Any], keep: int = 2
) -> Path:
    """Write ``payload`` for (stage, round); keep the newest ``keep`` of this stage (0 = all) and
    the model files they name.

    The global model (``arrays``) goes to :func:`global_name`'s file; the strategy state's
    ``best_arrays`` (of ``best_round``) are named by reference: to that round's global-model file
    when it holds them (the usual case: the best model is a round's global model), else to
    :func:`best_name`'s file, written once."""
    run_dir = Path(run_dir)
    payload = {"stage": stage, "round": server_round, **payload}
    arrays = payload.get("arrays")
    if _is_model(arrays):  # always written: a crashed run may have left another model of this round
        name = global_name(stage, server_round)
        _save(run_dir / name, {"stage": stage, "round": server_round, "arrays": arrays})
        payload["arrays"] = {FILE_REF: name}
    strategy = payload.get("strategy")
    if (
        isinstance(strategy, Mapping)
        and _is_model(strategy.get("best_arrays"))
        and strategy.get("best_round") is not None
    ):
        best, best_round = strategy["best_arrays"], int(strategy["best_round"])
        if best_round == server_round and _is_model(arrays) and _same_tensors(arrays, best):
            name = global_name(stage, best_round)
        elif _holds(run_dir / global_name(stage, best_round), best):
            name = global_name(stage, best_round)
        else:
            name = best_name(stage, best_round)
            if not _holds(run_dir / name, best):
                _save(run_dir / name, {"stage": stage, "round": best_round, "arrays": best})
        payload["strategy"] = {**strategy, "best_arrays": {FILE_REF: name}}
    path = run_dir / checkpoint_name(stage, server_round)
    _save(path, payload)
    prune_checkpoints(run_dir, stage, keep)
    return path


def _references(payload: Any) -> set[str]:
    """The names of the files ``payload`` refers to (:data:`FILE_REF`)."""
    if isinstance(payload, Mapping):
        if set(payload) == {FILE_REF}:
            return {str(payload[FILE_REF])}
        return set().union(*(_references(v) for v in payload.values())) if payload else set()
    return set()


def prune_checkpoints(run_dir: Path, stage: str, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints of ``stage`` (0: none) and the model files
    (global and best) no remaining checkpoint names.  Only files of this stage's three name
    patterns in ``run_dir`` are ever deleted."""
    run_dir = Path(run_dir)
    rounds = _rounds(run_dir, stage)
    if keep:
        for _, old in rounds[:-keep]:
            old.unlink(missing_ok=True)
        rounds = rounds[-keep:]
    named: set[str] = set()
    for _, path in rounds:
        try:
            named |= _references(torch.load(path, map_location="cpu", weights_only=True, mmap=True))
        except Exception:  # noqa: BLE001 - a checkpoint that cannot be read: keep every model file
            return
    for kind in ("global", "best"):
        for _, model in _numbered(run_dir, _prefix(stage, kind)):
            if model.name not in named:
                model.unlink(missing_ok=True)


# -- reading ----------------------------------------------------------------------------------
def _load(path: Path, mmap: bool = False) -> Any:
    """``torch.load(weights_only=True)`` of a file of the run folder."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"{path} cannot be loaded safely (torch.load weights_only refuses "
            f"{' '.join(str(err).split())[:160]!r}): it was written by a fedderm older than its "
            "weights-only checkpoints, or not by fedderm, and loading it could run code. Move it "
            "out of the run folder to resume from the checkpoint before it, or start the run again"
        ) from None
    except Exception as err:  # noqa: BLE001 - torch raises many types for a damaged file
        size = path.stat().st_size if path.exists() else None
        found = "missing" if size is None else f"{size} bytes"
        raise DamagedCheckpoint(
            f"{path} is damaged ({found}; {type(err).__name__}: {' '.join(str(err).split())[:160]})"
        ) from None


def _resolve(run_dir: Path, payload: Any, stage: str) -> Any:
    """``payload`` with every :data:`FILE_REF` replaced by the tensors of the file it names."""
    if not isinstance(payload, dict):
        return payload
    if set(payload) == {FILE_REF}:
        name = str(payload[FILE_REF])
        kinds = "|".join(re.escape(_prefix(stage, kind)) for kind in ("global", "best"))
        if not re.fullmatch(rf"(?:{kinds})-round-\d+\.pt", name):
            raise DamagedCheckpoint(f"names {name!r}, which is no model file of stage {stage!r}")
        stored = _load(run_dir / name)
        if not isinstance(stored, dict) or not isinstance(stored.get("arrays"), dict):
            raise DamagedCheckpoint(f"{run_dir / name} is not a model file of a checkpoint")
        return stored["arrays"]
    return {k: _resolve(run_dir, v, stage) for k, v in payload.items()}


def load_checkpoint(path: Path, stage: str, server_round: int) -> dict[str, Any]:
    """The checkpoint in ``path``, the files it names read in; raises :class:`DamagedCheckpoint`
    (or :class:`CheckpointError`) naming the file at fault."""
    path = Path(path)
    payload = _load(path)
    if not isinstance(payload, dict) or payload.get("stage") != stage or payload.get("round") != server_round:
        raise DamagedCheckpoint(f"{path} is not the checkpoint of {stage} round {server_round}")
    try:
        return _restored(_resolve(path.parent, payload, stage))
    except DamagedCheckpoint as err:
        raise DamagedCheckpoint(f"{path}: {err}") from None


def intact_checkpoints(run_dir: Path, stage: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(round, payload) of ``stage``'s checkpoints that load whole, newest first; each damaged one
    is logged, naming the file, and skipped."""
    for server_round, path in reversed(_rounds(run_dir, stage)):
        try:
            payload = load_checkpoint(path, stage, server_round)
        except DamagedCheckpoint as err:
            _log.error("checkpoint %s skipped: %s; using the one before it", path.name, err)
            continue
        yield server_round, payload


def latest_checkpoint(run_dir: Path, stage: str) -> dict[str, Any] | None:
    """The newest intact checkpoint of ``stage`` in ``run_dir``, or None."""
    return next((payload for _, payload in intact_checkpoints(run_dir, stage)), None)


def resume_step(run_dir: Path) -> int:
    """The client-state step of the newest intact checkpoint of every stage in ``run_dir`` (the
    largest), 0 if none: the step a resumed run's clients roll back to (:mod:`fedderm.state_store`).
    The same checkpoints :func:`latest_checkpoint` resumes from."""
    steps = [0]
    for stage in _stages(run_dir):
        latest = latest_checkpoint(run_dir, stage)
        if latest is not None:
            steps.append(int(latest.get("state-step") or 0))
    return max(steps)
