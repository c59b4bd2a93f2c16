"""Byte counting: what a message's arrays weigh on the wire under ``transport-dtype``."""

from __future__ import annotations

from flwr.app import ArrayRecord, RecordDict

import wire
from fedderm.transport import wire_nbytes


def record_bytes(record: ArrayRecord, transport: str = "float32") -> int:
    """Flower's ``ArrayRecord.count_bytes()`` (serialised arrays and their key names), with
    the arrays that travel as float16 under ``transport-dtype`` counted at their float16 size."""
    total = record.count_bytes()
    if transport == "float32":
        return total
    return total - sum(
        values.nbytes - wire_nbytes(values, transport)
        for values in (wire.values(array) for array in record.values())
    )


def array_bytes(content: RecordDict, transport: str = "float32") -> int:
    """Bytes of every ArrayRecord in a message's content on the wire under ``transport``."""
    return sum(record_bytes(record, transport) for record in content.array_records.values())
