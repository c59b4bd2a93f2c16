"""Node config: what one SuperNode (one hospital) says about itself.

The run config (``--run-config``) is the same for every client; the node config
(``flower-supernode --node-config '...'``) is each hospital's own: its images never leave the
hospital.  The client reports its ``dataset`` and ``data-path`` (the string as written here) with
its image counts in the handshake, and the run folder records them (``client-data``), so that
results name the data they came from.  In simulation Flower sets ``partition-id``/``num-partitions``
itself and nothing else is needed.

| key | type | meaning |
|---|---|---|
| ``data-path`` | str | this hospital's data (image folder, CSV file or ``.npz``); all of it is this client's |
| ``dataset`` | str | its format (``folder`` \\| ``csv`` \\| ``npz`` \\| ``synthetic``); default: run-config ``dataset`` |
| ``partition-id`` | int | the client's number in logs and results (``per_client`` keys); distinct per hospital |
| ``num-partitions`` | int | simulation only: the number of partitions of the shared pool |
| ``site`` | str | a readable hospital name for the server's log |
| ``state-dir`` | str | a folder for client state that must outlive a ClientApp process and the run |
| ``cache-dir`` | str | where this hospital caches decoded images; default: ``<state-dir>/cache``, else ``$XDG_CACHE_HOME/fedderm/cache`` (a simulation's node: run-config ``cache-dir``) |
| ``insecure-reproducible-noise`` | bool | ``true``: accept the run config's switch of that name (the relay noise then seeded from the run config, which the server knows); default: a client with no simulation's node config refuses it (docs/privacy.md) |
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NODE_KEYS = {
    "data-path": str,
    "dataset": str,
    "partition-id": int,
    "num-partitions": int,
    "site": str,
    "state-dir": str,
    "cache-dir": str,
    "insecure-reproducible-noise": bool,
}
# Without ``partition-id`` a deployed client is numbered from its node id (stable for one
# SuperNode key); results then show that number.  Kept below 2**31 for MetricRecord/seeds.
_NODE_ID_MODULUS = 1_000_000


def simulated_node(node_config: Mapping[str, Any]) -> bool:
    """Whether this node is one of a simulation's: its node config (the SuperNode's own, never the
    server's) is what Flower's simulation and fedderm's in-process grids give a node, a
    ``num-partitions`` of a shared pool and no ``data-path`` of its own.  A hospital's SuperNode
    names its own data, so nothing the server sends makes it one."""
    return "num-partitions" in node_config and "data-path" not in node_config


class NodeConfigError(ValueError):
    """A node-config key has the wrong type or value; the message names it."""


@dataclass(frozen=True)
class NodeSettings:
    """One SuperNode's parsed node config (see the module docstring for the keys)."""

    partition_id: int
    num_partitions: int = 1
    data_path: str | None = None
    dataset: str | None = None
    site: str = ""
    state_dir: Path | None = None
    cache_dir: str | None = None
    insecure_reproducible_noise: bool = False

    @property
    def label(self) -> str:
        """``site`` if given, else ``client <partition-id>``."""
        return self.site or f"client {self.partition_id}"


def parse_node_config(node_config: Mapping[str, Any], node_id: int = 0) -> NodeSettings:
    """Validate ``context.node_config``; unknown keys are ignored (Flower may add its own)."""
    values: dict[str, Any] = {}
    for key, kind in NODE_KEYS.items():
        if key not in node_config:
            continue
        value = node_config[key]
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise NodeConfigError(
                f"node-config key {key!r} must be an integer, got {value!r} (e.g. --node-config '{key}=0')"
            )
        if kind is bool and not isinstance(value, bool):
            raise NodeConfigError(
                f"node-config key {key!r} must be true or false, got {value!r} (e.g. --node-config '{key}=false')"
            )
        if kind is str and not isinstance(value, str):
            raise NodeConfigError(
                f"node-config key {key!r} must be a string in double quotes, got {value!r} "
                f"(e.g. --node-config '{key}=\"...\"')"
            )
        values[key] = value
    for key in ("data-path", "state-dir", "cache-dir"):
        if key in values and not values[key].strip():
            raise NodeConfigError(f"node-config key {key!r} is empty")
    pid = values.get("partition-id", int(node_id) % _NODE_ID_MODULUS)
    if pid < 0:
        raise NodeConfigError(f"node-config key 'partition-id' must be >= 0, got {pid}")
    num = values.get("num-partitions", 1)
    if num < 1:
        raise NodeConfigError(f"node-config key 'num-partitions' must be >= 1, got {num}")
    if "data-path" not in values and "num-partitions" in values and pid >= num:
        raise NodeConfigError(f"node-config 'partition-id' {pid} must be < 'num-partitions' {num}")
    state = Path(values["state-dir"]).expanduser().resolve() if "state-dir" in values else None
    cache = str(Path(values["cache-dir"]).expanduser().resolve()) if "cache-dir" in values else None
    return NodeSettings(
        partition_id=pid,
        num_partitions=num,
        data_path=values.get("data-path"),
        dataset=values.get("dataset"),
        site=values.get("site", ""),
        state_dir=state,
        cache_dir=cache,
        insecure_reproducible_noise=values.get("insecure-reproducible-noise", False),
    )
