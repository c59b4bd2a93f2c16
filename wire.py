"""The wire protocol shared by the ServerApp (``strategies/``) and the ClientApp (``clients/``):
the names of the records and messages both sides read, the fast zero-copy conversions between
torch tensors and Flower ArrayRecords, FedAvg's weighted mean on them, and the ``transport-dtype``
message codec.  ``strategies/`` and ``clients/`` never import each other; what they share is here.

Fast conversions.  Flower keeps every ``Array`` as the bytes of a ``.npy`` file.  ``Array.numpy()``
parses the header (``ast.literal_eval``) and copies the data on every call, and ``Array(ndarray)``
writes through a ``BytesIO`` (two copies).  For a ResNet-18 that is ~0.1 s per model and
direction, paid several times per round.  Here:

* :func:`values` is a zero-copy, read-only view of an Array's numbers;
* :func:`to_array` / :func:`to_record` write the very bytes ``Array(ndarray)`` writes, with one copy;
* :func:`weighted_mean` is Flower's ``aggregate_arrayrecords`` (same operations in the same order,
  so the same bits) on those views, without the decode/encode round trips.

They are the one way fedderm converts records: ``to_record(model.state_dict())`` to send a model,
``model.load_state_dict(to_state_dict(record))`` to load one, :func:`values` to read an array.
"""

from __future__ import annotations

import io
import json
import math
import warnings
from collections.abc import Callable, Mapping

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedderm import transport as codec

# -- record names that both sides read (beyond Flower's "arrays", "config" and "metrics") ------------
FEATURES = "features"  # FedCLF reply record: this client's local feature bank Q_l (000 §III-B)
REMOTE = "remote-features"  # FedCLF instruction record: Q_r, the other clients' features (de-identified)
PSEUDO = "pseudo-images"  # SSL-FL-BT reply record: a centre's synthetic images (004 §III-C)
LOCAL_RECORD = "local-arrays"  # FedMAE: the clients' excluded parameters, sent once, in the last round
GPU_PEAK = "gpu-peak-mib"  # reply metric on CUDA: the client's peak GPU memory of that message (MiB)
STAMP = "fedderm-state"  # every server message: run name, step, resume step (clients/state.py's store)
VAL_METRICS = "val-metrics"  # train reply (val-in-train): val metrics of the model the message carried
VAL_ROUND = (
    "val-round"  # train config (val-in-train): evaluate the received model on val first, for this round
)
PR_CURVE = "pr-curve"  # FL-BT family test reply: per-class precision-recall curves (004 §IV)
PEFT_BACKBONE = "query.peft_backbone"  # peft="lora": the frozen backbone, sent once to every client
PEFT_PERSONAL_INIT = "peft-personal-init"  # ... with peft-personal: the initial personal adapter and head
PACKED = "fedderm-packed"  # deployment: a whole message as one ConfigRecord (see pack_content)
PACKED_ARRAY = "fedderm-packed-array"  # ... its arrays' bytes as one Array when over one chunk

_MAGIC = b"\x93NUMPY"
#: the ``stype`` of an Array that holds ``.npy`` bytes, as ``Array(ndarray)`` writes it
NUMPY_STYPE = Array(np.zeros(0, dtype=np.uint8)).stype
#: Flower cuts an Array's bytes into chunks of 5 MiB (its default): a packed message whose bytes are
#: longer travels as one Array (:func:`pack_content`); tests/test_wire.py checks Flower still does
FLOWER_CHUNK_BYTES = 5 * 1024 * 1024


def values(array: Array) -> np.ndarray:
    """The numbers of ``array`` as a read-only NumPy view of its bytes (no copy).

    Anything but a plain C-order ``.npy`` payload falls back to Flower's ``Array.numpy()``."""
    data = array.data
    if array.stype != NUMPY_STYPE or not isinstance(data, bytes) or data[:6] != _MAGIC:
        return array.numpy()
    major = data[6]
    if major == 1:
        start = 10 + int.from_bytes(data[8:10], "little")
    elif major in (2, 3):
        start = 12 + int.from_bytes(data[8:12], "little")
    else:
        return array.numpy()
    header = data[:start]
    dtype = np.dtype(array.dtype)
    if (
        dtype.hasobject
        or b"'fortran_order': False" not in header
        or f"'descr': '{dtype.str}'".encode() not in header
    ):
        return array.numpy()
    count = math.prod(array.shape)
    if len(data) - start != count * dtype.itemsize:
        return array.numpy()
    return np.frombuffer(data, dtype=dtype, count=count, offset=start).reshape(array.shape)


def tensor(array: Array) -> torch.Tensor:
    """:func:`values` as a torch tensor sharing the (read-only) bytes: read it, never write to it."""
    view = values(array)
    if view.flags.writeable:
        return torch.from_numpy(view)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "The given NumPy array is not writable"
        return torch.from_numpy(view)


def to_state_dict(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """``record`` as read-only tensors (for ``load_state_dict``, which copies): no decoding copies."""
    return {key: tensor(array) for key, array in record.items()}


def _npy_header(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, np.lib.format.header_data_from_array_1_0(array))
    return buffer.getvalue()


def to_array(value: np.ndarray | torch.Tensor) -> Array:
    """An Array with the same bytes as ``Array(value)``, written with one copy."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    value = np.asarray(value)
    if value.dtype.hasobject or not value.flags.c_contiguous:
        return Array(np.ascontiguousarray(value) if not value.dtype.hasobject else value)
    data = b"".join((_npy_header(value), memoryview(value.reshape(-1)).cast("B")))
    return Array(
        dtype=str(value.dtype), shape=tuple(int(d) for d in value.shape), stype=NUMPY_STYPE, data=data
    )


def to_record(state: Mapping[str, torch.Tensor | np.ndarray]) -> ArrayRecord:
    """``ArrayRecord(state_dict)`` with :func:`to_array` (same keys, order and bytes)."""
    return ArrayRecord({key: to_array(value) for key, value in state.items()})


def copy_record(record: ArrayRecord) -> ArrayRecord:
    """A new ArrayRecord holding the same (immutable) Arrays: a copy that costs no data copy."""
    return ArrayRecord({key: array for key, array in record.items()})


def weighted_mean(records: list[ArrayRecord], weights: list[float]) -> ArrayRecord:
    """Σ_k (n_k / n) · w_k over every key of ``records`` (FedAvg, McMahan et al. 2017, Eq. 1 with
    n_k = ``weights``), bit-identical to Flower's ``aggregate_arrayrecords``: the same NumPy
    operations in the same order (factors ``w / sum(w)``, ``values × factor`` with NumPy's weak
    scalar promotion, summed in record order), but on zero-copy views and written with one copy.
    Integer buffers come back as float64, exactly like Flower's (``strategies.common.cast_like``
    restores their dtype).

    NumPy rather than torch: on a loaded 2-core machine torch's two intra-op threads made the same
    sums 5-10x slower, and single-threaded torch was no faster than NumPy on views."""
    total = sum(weights)
    factors = [w / total for w in weights]
    out: dict[str, np.ndarray] = {}
    for record, factor in zip(records, factors, strict=True):
        for key, array in record.items():
            term = values(array) * factor
            if key in out:
                out[key] += term
            else:
                out[key] = term
    return ArrayRecord({key: to_array(np.asarray(value)) for key, value in out.items()})


# -- transport precision on the wire (``transport-dtype``) --------------------------------------------
def recode(content: RecordDict, fn: Callable[[np.ndarray], np.ndarray]) -> RecordDict:
    """``content`` with every array passed through ``fn``.  Arrays ``fn`` returns unchanged, and
    records with no change, are kept as they are (the same objects): the default transport
    costs nothing."""
    out = RecordDict()
    for name, record in content.items():
        if name in content.array_records:
            arrays, changed = dict(record.items()), {}
            for key, array in arrays.items():
                view = values(array)
                new = fn(view)
                if new is not view:  # np.require keeps 0-d arrays 0-d (ascontiguousarray would not)
                    changed[key] = to_array(np.require(new, requirements="C"))
            if changed:
                record = ArrayRecord({key: changed.get(key, array) for key, array in arrays.items()})
        out[name] = record
    return out


def encode_message(msg: Message, transport: str) -> Message:
    """``msg`` with its arrays in the transport dtype (in place; returns ``msg``)."""
    if transport != "float32" and msg.has_content():
        msg.content = recode(msg.content, lambda v: codec.encode(v, transport))
    return msg


def decode_message(msg: Message, transport: str) -> Message:
    """``msg`` with float16 arrays back in float32 (in place; returns ``msg``)."""
    if transport != "float32" and msg.has_content():
        msg.content = recode(msg.content, lambda v: codec.decode(v, transport))
    return msg


# -- packing: one record per message in a deployment -------------------------------------------
def _chunk_size() -> int:
    """Flower's largest Array chunk (:data:`FLOWER_CHUNK_BYTES`)."""
    return FLOWER_CHUNK_BYTES


def is_packed(content: RecordDict) -> bool:
    """Whether ``content`` is what :func:`pack_content` made."""
    return PACKED in content and PACKED in content.config_records


def pack_content(content: RecordDict) -> RecordDict:
    """``content`` as one ConfigRecord (:data:`PACKED`): every record, bytes as they are, and an
    index to undo it (:func:`unpack_content`).

    Flower moves a message as a tree of objects, one HTTP request per object and hop
    (ServerApp -> SuperLink -> SuperNode -> ClientApp and back): the Message, its RecordDict,
    every record, every Array and every chunk of it (~33 objects for a 10-tensor model).  Packed,
    it is 3 (Message, RecordDict, this record): the arrays' bytes joined into one ``bytes`` value,
    the config and metric records as Flower serialises them (``deflate``).  A blob larger than
    one Flower chunk (5 MB) travels as one Array (:data:`PACKED_ARRAY`) instead, which Flower
    chunks and moves two chunks at a time: 5 + n_chunks objects."""
    if not content or is_packed(content):
        return content
    names = set(content.array_records)
    if not names and len(content) < 2:
        return content  # one record without arrays: already as few objects as packed
    order, arrays, blobs, offset, packed = [], [], [], 0, {}
    for i, (name, record) in enumerate(content.items()):
        if name in names:
            order.append([name, "arrays"])
            for key, array in record.items():
                data = bytes(array.data) if not isinstance(array.data, bytes) else array.data
                arrays.append([name, key, array.dtype, list(array.shape), array.stype, offset, len(data)])
                blobs.append(data)
                offset += len(data)
        else:
            order.append([name, "config" if name in content.config_records else "metrics"])
            packed[f"record.{i}"] = record.deflate()
    blob = b"".join(blobs)
    packed["index"] = json.dumps({"order": order, "arrays": arrays})
    out = RecordDict()
    if len(blob) > _chunk_size():
        out[PACKED_ARRAY] = ArrayRecord(
            {"bytes": Array(dtype="uint8", shape=(len(blob),), stype="bytes", data=blob)}
        )
    else:
        packed["blob"] = blob
    out[PACKED] = ConfigRecord(packed)
    return out


def unpack_content(content: RecordDict) -> RecordDict:
    """The RecordDict :func:`pack_content` packed, record for record and byte for byte."""
    if not is_packed(content):
        return content
    packed = content[PACKED]
    index = json.loads(str(packed["index"]))
    data = packed["blob"] if "blob" in packed else content[PACKED_ARRAY]["bytes"].data
    blob = memoryview(data)
    records: dict[str, dict[str, Array]] = {}
    for name, key, dtype, shape, stype, start, length in index["arrays"]:
        data = bytes(blob[start : start + length])
        records.setdefault(name, {})[key] = Array(dtype=dtype, shape=tuple(shape), stype=stype, data=data)
    out = RecordDict()
    for i, (name, kind) in enumerate(index["order"]):
        if kind == "arrays":
            out[name] = ArrayRecord(records.get(name, {}))
        else:
            cls = ConfigRecord if kind == "config" else MetricRecord
            out[name] = cls.inflate(bytes(packed[f"record.{i}"]))
    return out


def pack_message(msg: Message) -> Message:
    """``msg`` with its content packed (in place; returns ``msg``)."""
    if msg.has_content():
        msg.content = pack_content(msg.content)
    return msg


def unpack_message(msg: Message) -> Message:
    """``msg`` with its content unpacked if it was packed (in place; returns ``msg``)."""
    if msg.has_content() and is_packed(msg.content):
        msg.content = unpack_content(msg.content)
    return msg


# -- simulation: Arrays through Ray's object store out of band ------------------------------------
def _array_to_ray(array: Array) -> tuple:
    """What Ray stores of an Array: its fields, its bytes as a NumPy uint8 view (no copy)."""
    return array.dtype, tuple(array.shape), array.stype, np.frombuffer(array.data, dtype=np.uint8)


def _array_from_ray(fields: tuple) -> Array:
    """The Array :func:`_array_to_ray` stored: the same fields and bytes (one copy out of Ray's store)."""
    dtype, shape, stype, data = fields
    return Array(dtype=dtype, shape=tuple(shape), stype=stype, data=data.tobytes())


def ray_out_of_band(*, only_in_ray: bool = False) -> bool:
    """Let Ray move Flower Arrays out of band (simulation: ServerApp <-> ClientApp actors).

    Flower's simulation hands each message to a Ray actor and gets the reply back through Ray,
    which pickles an Array's ``bytes`` in band: copied into the pickle stream, then into the
    object store, then out again.  Registered here (``ray.util.register_serializer``), an Array
    travels as a NumPy view of its bytes, which Ray writes to its store in one copy, and comes
    back with one copy: the same fields and bytes (timings: docs/benchmarks.md).  The process that
    sends registers: the simulation's driver (:func:`sim.simulate`; with ``flwr run`` the ServerApp,
    in the driver, after its handshake) and every ClientApp actor (``client_app``).

    ``only_in_ray``: register only in a process where Ray is already initialised (a Ray worker),
    never importing Ray (a deployment's ClientApp).  Returns whether it registered."""
    import sys

    if only_in_ray:
        ray = sys.modules.get("ray")
        if ray is None or not ray.is_initialized():
            return False
    else:
        try:
            import ray
        except ImportError:  # no simulation extra: nothing moves through Ray
            return False
    from ray.util import register_serializer

    register_serializer(Array, serializer=_array_to_ray, deserializer=_array_from_ray)
    return True
