"""Reply screening: why a client's reply cannot be used, and the useful end of a client's error.

Every reply is read as if an adversary wrote it: its weights (:func:`reply_problem`), its weight
in the mean (:func:`count_problem`: a finite integer no larger than what the client declared at
the handshake), its metrics (:func:`metrics_problem`, :func:`evaluation_problem`), how far its
update moved (:func:`l2_distance`), the handshake itself (:func:`info_problem`) and the records
some methods add (:func:`pr_curve_problem`, :func:`pseudo_problem`).  Each returns a reason
(one line, naming the key at fault) or None; the strategies reject a reply with a reason, log it
and record it (``summary.json`` ``missing_clients``), and go on with the others.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import ArrayRecord

import wire
from fedderm.metrics import CONFUSION_KEY, METRIC_NAMES


def reply_problem(reply: ArrayRecord | None, template: ArrayRecord) -> str | None:
    """Why a client's returned weights cannot be aggregated, or None when they can:
    missing or extra keys, another shape or dtype than what was sent, non-finite values."""
    if reply is None:
        return "no 'arrays' record in the reply"
    missing, extra = sorted(set(template) - set(reply)), sorted(set(reply) - set(template))
    if missing or extra:
        return f"keys differ from the global model (missing {missing[:3]}, extra {extra[:3]})"
    for key, sent in template.items():
        got = reply[key]
        if tuple(got.shape) != tuple(sent.shape) or got.dtype != sent.dtype:
            return f"{key!r} is {got.dtype}{list(got.shape)}, expected {sent.dtype}{list(sent.shape)}"
        values = wire.values(got)  # a view: no decoding copy
        if values.dtype.kind == "f" and not np.isfinite(values).all():
            return f"{key!r} holds non-finite values (NaN or inf)"
    return None


def l2_distance(reply: ArrayRecord, template: ArrayRecord) -> float:
    """‖w − w_sent‖₂ over the floating-point arrays of ``reply`` (BatchNorm statistics included,
    integer buffers left out), summed in float64; ``reply`` holds keys of ``template`` only
    (screened by :func:`reply_problem` first)."""
    total = 0.0
    for key, array in reply.items():
        got = wire.values(array)
        if got.dtype.kind != "f":
            continue
        delta = (got.astype(np.float64) - wire.values(template[key])).ravel()
        total += float(np.dot(delta, delta))
    return math.sqrt(total)


def _number(value: Any) -> float | None:
    """``value`` as a float when it is one number (int or float, not bool or a list), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:  # an int beyond float: not a count any client has
        return math.inf


def count_problem(
    key: str, value: Any, most: int | None = None, least: int = 1, declared: str = ""
) -> str | None:
    """Why ``value`` is not a count in [``least``, ``most``] (a finite integer), or None.
    ``declared`` says where ``most`` comes from, for the reason (e.g. "labelled images it declared
    at the handshake")."""
    number = _number(value)
    if number is None:
        return f"{key!r} is {type(value).__name__} {value!r}, expected one integer"
    if not math.isfinite(number):
        return f"{key!r} = {value!r} is not a finite number"
    if number != math.floor(number):
        return f"{key!r} = {value!r} is not an integer"
    if number < least:
        return f"{key!r} = {int(number)} is below {least}"
    if most is not None and number > most:
        return f"{key!r} = {int(number)} exceeds the {most} {declared or 'allowed'}"
    return None


def metrics_problem(metrics: Mapping[str, Any], allow_nan: bool = False) -> str | None:
    """Why a MetricRecord's values are not all finite numbers (or lists of them), or None;
    ``allow_nan``: NaN is a value (an evaluation's AUC with one class present), inf never is."""
    for key, value in metrics.items():
        for item in value if isinstance(value, list) else [value]:
            number = _number(item)
            if number is None:
                return f"metric {key!r} holds {type(item).__name__} {item!r}, expected numbers"
            if math.isinf(number) or (math.isnan(number) and not allow_nan):
                return f"metric {key!r} = {item!r} is not a finite number"
    return None


def unit_problem(metrics: Mapping[str, Any], keys) -> str | None:
    """Why one of ``keys`` present in ``metrics`` is not a number in [0, 1] (or NaN), or None."""
    for key in keys:
        if key in metrics:
            number = _number(metrics[key])
            if number is None or not (math.isnan(number) or 0.0 <= number <= 1.0):
                return f"metric {key!r} = {metrics[key]!r} is outside [0, 1]"
    return None


def evaluation_problem(
    metrics: Mapping[str, Any], most: int | None, num_classes: int | None, prefix: str = ""
) -> str | None:
    """Why one evaluation's metrics (:func:`fedderm.train.evaluate`, under ``prefix``, e.g.
    ``knn.`` for a probe) cannot be recorded, or None: numbers only (NaN allowed: a balanced
    accuracy or AUC of one class present), every classification metric in [0, 1], ``loss`` ≥ 0,
    ``num-examples`` an integer in [0, ``most``] (the split size declared at the handshake), the
    confusion matrix ``num_classes`` × ``num_classes`` non-negative integers summing to
    ``num-examples``."""
    problem = metrics_problem(metrics, allow_nan=True)
    problem = problem or unit_problem(metrics, [prefix + name for name in METRIC_NAMES])
    loss = metrics.get(prefix + "loss")
    if problem is None and loss is not None and (_number(loss) is None or loss < 0):
        problem = f"metric {prefix + 'loss'!r} = {loss!r} is not a number >= 0"
    if problem is None and "num-examples" in metrics:
        problem = count_problem(
            "num-examples",
            metrics["num-examples"],
            most,
            least=0,
            declared="images of that split it declared",
        )
    cm = metrics.get(CONFUSION_KEY)
    if problem is None and cm is not None:
        cells = cm if isinstance(cm, list) else [cm]
        side = math.isqrt(len(cells))
        if (num_classes is not None and len(cells) != num_classes**2) or side * side != len(cells):
            want = f"{num_classes}×{num_classes}" if num_classes is not None else "a square"
            problem = f"{CONFUSION_KEY!r} has {len(cells)} cells, expected {want}"
        elif any(not math.isfinite(c) or c < 0 or c != math.floor(c) for c in cells):
            problem = f"{CONFUSION_KEY!r} holds counts that are not integers >= 0"
        elif "num-examples" in metrics and sum(cells) != metrics["num-examples"]:
            problem = (
                f"{CONFUSION_KEY!r} counts {int(sum(cells))} images, 'num-examples' {metrics['num-examples']}"
            )
    return problem


def pr_curve_problem(
    curves: Mapping[str, Any], num_classes: int | None, most_points: int | None
) -> str | None:
    """Why a ``pr-curve`` record (:func:`fedderm.prcurves.pr_curves`) cannot be drawn, or None:
    keys ``ap-c``, ``precision-c``, ``recall-c`` for classes c in [0, ``num_classes``), each AP
    in [0, 1], each curve at most ``most_points`` numbers in [0, 1], precision and recall of one
    class the same length."""
    classes: set[int] = set()
    for key in curves:
        kind, _, c = str(key).partition("-")
        if kind not in ("ap", "precision", "recall") or not c.isdigit():
            return f"pr-curve key {key!r} is not ap-<class>, precision-<class> or recall-<class>"
        if num_classes is not None and int(c) >= num_classes:
            return f"pr-curve key {key!r} names a class beyond the {num_classes} of the run"
        classes.add(int(c))
    for c in sorted(classes):
        keys = (f"ap-{c}", f"precision-{c}", f"recall-{c}")
        if not all(k in curves for k in keys):
            return f"pr-curve of class {c} lacks one of {list(keys)}"
        ap, precision, recall = (curves[k] for k in keys)
        if unit_problem({keys[0]: ap}, keys[:1]) or _number(ap) is None or math.isnan(ap):
            return f"pr-curve {keys[0]!r} = {ap!r} is not a number in [0, 1]"
        for key, curve in zip(keys[1:], (precision, recall)):
            if not isinstance(curve, list) or (most_points is not None and len(curve) > most_points):
                return f"pr-curve {key!r} is not a list of at most {most_points} numbers"
            if any(_number(v) is None or not 0.0 <= v <= 1.0 for v in curve):
                return f"pr-curve {key!r} holds values outside [0, 1]"
        if len(precision) != len(recall):
            return f"pr-curve of class {c}: precision and recall differ in length"
    return None


def pseudo_problem(record: ArrayRecord | None, count: Any, most: int, image_size: int) -> str | None:
    """Why an SSL-FL-BT ``pseudo-images`` record cannot join the server's pre-training set, or
    None: one uint8 array of 1 to ``most`` (``ssl.pseudo-per-centre``) images 3 × ``image_size``²,
    as many as the reply's ``num-examples``."""
    name = wire.PSEUDO
    if record is None:
        return f"no {name!r} record"
    if list(record.keys()) != [name]:
        return f"the {name!r} record holds {sorted(record.keys())[:3]}, expected [{name!r}]"
    array = record[name]
    shape, want = tuple(array.shape), (3, image_size, image_size)
    if array.dtype != "uint8" or len(shape) != 4 or shape[1:] != want or not 1 <= shape[0] <= most:
        return (
            f"pseudo images {array.dtype}{list(shape)}, expected uint8[1..{most}, {', '.join(map(str, want))}] "
            "(ssl.pseudo-per-centre, image-size)"
        )
    problem = count_problem("num-examples", count, most, declared="pseudo images of ssl.pseudo-per-centre")
    if problem is None and int(count) != shape[0]:
        problem = f"'num-examples' = {count} but the record holds {shape[0]} images"
    return problem


#: what a client reports at the handshake (``clients.common.info``): key -> kind
INFO_KEYS = {
    "partition-id": "count",
    "classes": "names",
    "train": "count",
    "labelled": "count",
    "val": "count",
    "test": "count",
    "skipped-files": "count",
    "torch": "text",
    "torch-threads": "count",
    "device": "text",
}
#: the optional ones (older clients, node-config data)
INFO_OPTIONAL = {"site": "text", "dataset": "text", "data-path": "text", "data-source": "text"}


def info_problem(info: Any) -> str | None:
    """Why a client's handshake reply (``query.info``'s ``info`` record) cannot be used, or None:
    every key of :data:`INFO_KEYS` of its kind, at most as many labelled images as training
    images, class counts (when sent) of the class list's length and summing to the splits."""
    if not isinstance(info, Mapping):
        return "no 'info' record"
    for key, kind in {**INFO_KEYS, **{k: v for k, v in INFO_OPTIONAL.items() if k in info}}.items():
        if key not in info:
            return f"no {key!r}"
        value = info[key]
        if kind == "count" and count_problem(key, value, least=0):
            return count_problem(key, value, least=0)
        if kind == "text" and not isinstance(value, str):
            return f"{key!r} is {type(value).__name__}, expected text"
        if kind == "names" and (
            not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value)
        ):
            return f"{key!r} is not a list of class names"
    if info["labelled"] > info["train"]:
        return f"'labelled' = {info['labelled']} exceeds 'train' = {info['train']}"
    splits = {"class-counts": ("train", "val", "test")} | {
        f"counts-{s}": (s,) for s in ("train", "labelled", "val", "test")
    }
    for key, parts in splits.items():
        if key not in info:
            continue
        counts = info[key]
        if (
            not isinstance(counts, list)
            or len(counts) != len(info["classes"])
            or any(count_problem(key, c, least=0) for c in counts)
        ):
            return f"{key!r} is not one count per class"
        if sum(counts) != sum(info[p] for p in parts):
            return (
                f"{key!r} sums to {sum(counts)}, not to {' + '.join(parts)} = {sum(info[p] for p in parts)}"
            )
    return None


def partition_problem(node: int, metrics: Mapping[str, Any], known: Mapping[int, int]) -> str | None:
    """Why a reply from ``node`` claiming ``metrics["partition-id"]`` cannot be filed, or None: with a
    handshake (``known``: node id -> partition id; empty without one), the node must have answered
    it, and a claimed partition id must be the one it gave the node."""
    if not known:
        return None
    if node not in known:
        return f"node {node} did not answer the handshake (query.info): nothing it declared to check against"
    claim = metrics.get("partition-id")
    if claim is not None and claim != known[node]:
        return f"it claims partition-id {claim!r}; the handshake gave node {node} partition {known[node]}"
    return None


def short_reason(reason: str, limit: int = 300) -> str:
    """The useful end of a client's error (Ray wraps it in a long traceback)."""
    tail = reason.rsplit("Message:", 1)[-1].strip().strip("'>").strip()
    return tail if len(tail) <= limit else tail[:limit] + "…"
