"""Transport precision of model arrays: what crosses the network, in which dtype.

``transport-dtype = "float16"`` halves the traffic of every method: floating-point arrays
(float32/float64) travel as float16 and are turned back into float32 on arrival, on both sides.
The server keeps its global model, its averages and its best model in float32; clients train in
float32 from the float16-rounded weights they receive.  Integer arrays (BatchNorm's
``num_batches_tracked``, labels) are never touched, and an array that float16 cannot hold
(a magnitude above 65504, or NaN/inf, which the server's screening must still see as such)
travels in its own dtype.
"""

from __future__ import annotations

import numpy as np

TRANSPORT_DTYPES = ("float32", "float16")
FLOAT16_MAX = float(np.finfo(np.float16).max)


def fits_float16(values: np.ndarray) -> bool:
    """True when ``values`` is a float32/float64 array that float16 holds without overflow."""
    if values.dtype.kind != "f" or values.dtype.itemsize <= 2:
        return False
    if values.size == 0:
        return True
    finite = np.isfinite(values).all()
    return bool(finite and np.abs(values).max() <= FLOAT16_MAX)


def encode(values: np.ndarray, transport: str) -> np.ndarray:
    """``values`` as they travel: float16 when ``transport`` is float16 and it fits, else as is."""
    if transport == "float16" and fits_float16(values):
        return values.astype(np.float16)
    return values


def decode(values: np.ndarray, transport: str) -> np.ndarray:
    """An array that arrived: float16 becomes float32 again when ``transport`` is float16."""
    if transport == "float16" and values.dtype == np.float16:
        return values.astype(np.float32)
    return values


def wire_nbytes(values: np.ndarray, transport: str) -> int:
    """Bytes of ``values`` on the wire under ``transport`` (without serialisation overhead)."""
    if transport == "float16" and fits_float16(values):
        return values.size * 2
    return values.nbytes
