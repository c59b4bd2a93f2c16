"""Reply screening: why a client's returned weights cannot be aggregated, and the useful end of a
client's error."""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord

import wire


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


def short_reason(reason: str, limit: int = 300) -> str:
    """The useful end of a client's error (Ray wraps it in a long traceback)."""
    tail = reason.rsplit("Message:", 1)[-1].strip().strip("'>").strip()
    return tail if len(tail) <= limit else tail[:limit] + "…"
