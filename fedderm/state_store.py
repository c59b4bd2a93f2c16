"""Client state that survives: one folder per (run, client), one snapshot per server step.

A client's state between messages (MoCo's feature bank, MOON's previous model, SCAFFOLD's c_i,
FedDyn's h_k, FedMAE's kept parameters, FedBN's BatchNorm layers, a local model and its best
copy, ...) is a set of named entries: a dict of tensors (a safetensors file, read back
memory-mapped: no copy per message) and/or a dict of small scalars (JSON).

Steps.  The server numbers the intervals between its checkpoints: every message sent after
checkpoint ``k-1`` and up to checkpoint ``k`` carries step ``k`` (``checkpoint-...-round-R.pt``
records its step).  A client commits what it changed while handling a message as snapshot ``k``
(``step-<k>.json``, the manifest: entry -> file); an entry that did not change is not rewritten,
the manifest points to the file of an earlier step.  Every tensor file and manifest is written
to a temporary name and renamed, so a crash never leaves a half snapshot: at worst the newest
manifest is the previous one.

Resume.  A resumed server restarts from its newest checkpoint, step ``K``.  Its messages carry
``K`` and a token that is new for every server process; a client that sees a new token drops
the snapshots after ``K`` (the crashed run went on past the checkpoint) and continues from the
newest one at or before ``K``.  The newest ``keep`` steps before the current one are kept.

A file that does not match its manifest (truncated by a crash of the disk or the machine) is
reported naming the file, and the snapshot before it is used.  Every file is flushed to disk (file
and folder) before the manifest that names it is written: a power cut leaves the previous snapshot.

Where.  The folder belongs to the client: :func:`clients.state.state_folder` builds it from the
client's own node config, the run's name reduced to one safe folder name
(:func:`fedderm.paths.safe_component`), and, in a simulation, the run folder that the simulation's
server registered on this machine under a secret token (:func:`register_simulation`): nothing a
message says is a path.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
import socket
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from fedderm.atomic import atomic_path
from fedderm.paths import is_safe_component, safe_component

LOG = logging.getLogger("fedderm.state")
_MANIFEST = re.compile(r"step-(\d+)\.json$")
#: the largest step, resume step or keep a server message may give (a MetricRecord-safe int)
MAX_STEP = 2**31 - 1
_TOKEN = re.compile(r"[0-9a-f]{32}")


class StateError(RuntimeError):
    """The client's stored state cannot be used; the message names the file."""


def _atomic_write(path: Path, write) -> None:
    with atomic_path(path, fsync=True) as tmp:
        write(tmp)


def fedderm_cache() -> Path:
    """``$XDG_CACHE_HOME/fedderm`` (default ``~/.cache/fedderm``): this user's own fedderm folder."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "fedderm"


def default_root() -> Path:
    """Where a client without node-config ``state-dir`` keeps its state (one folder per run)."""
    return fedderm_cache() / "client-state"


def _registry() -> Path:
    return fedderm_cache() / "simulations"


def new_token() -> str:
    """A server process's token: 128 secret bits (``secrets``), never derived from the seed."""
    return secrets.token_hex(16)


def register_simulation(token: str, run_dir: Path) -> Path:
    """Tell this machine's simulated clients where their run keeps client state: a file named by
    the server's secret ``token`` (readable by this user only) that holds ``run_dir``.  A client
    given a token finds the run folder only if this machine's own simulation registered it, so a
    server elsewhere cannot choose where a hospital writes.  Returns the registration file."""
    if not _TOKEN.fullmatch(token):
        raise ValueError(f"not a server token: {token!r}")
    folder = _registry()
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    _drop_dead_registrations(folder)
    entry = {"run-dir": str(Path(run_dir).resolve()), "pid": os.getpid(), "host": socket.gethostname()}
    path = folder / token
    with atomic_path(path, mode=0o600) as tmp:
        tmp.write_text(json.dumps(entry))
    return path


def unregister_simulation(token: str) -> None:
    """Remove the registration of ``token`` (the simulation's run ended)."""
    if _TOKEN.fullmatch(str(token)):
        (_registry() / token).unlink(missing_ok=True)


def _drop_dead_registrations(folder: Path) -> None:
    """Registrations left by simulations of this host whose server process is gone (killed)."""
    host = socket.gethostname()
    for path in folder.iterdir():
        try:
            entry = json.loads(path.read_text())
            if entry.get("host") != host:
                continue
            os.kill(int(entry["pid"]), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue


def simulation_run_dir(token: object) -> Path | None:
    """The run folder this machine's simulation registered under ``token``, or None: the token is
    no server token, no such registration exists, or the file is not this user's own regular file."""
    token = str(token)
    if not _TOKEN.fullmatch(token):
        return None
    path = _registry() / token
    try:
        st = path.lstat()
        if not path.is_file() or path.is_symlink() or (hasattr(os, "getuid") and st.st_uid != os.getuid()):
            return None
        run_dir = json.loads(path.read_text()).get("run-dir")
    except (OSError, ValueError, AttributeError):
        return None
    return Path(run_dir) if isinstance(run_dir, str) and Path(run_dir).is_absolute() else None


def stamp_int(stamp: Mapping, key: str) -> int:
    """Field ``key`` of a server's ``fedderm-state`` record as an int in [0, :data:`MAX_STEP`]."""
    value = stamp.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_STEP:
        raise StateError(f"the server's fedderm-state record has a bad {key!r}: {value!r}")
    return value


class Snapshot:
    """A client's state as of one step: read entries (memory-mapped), change some, commit."""

    def __init__(self, store: StateStore | None, step: int, base_step: int | None, entries: dict):
        self.store, self.step, self.base_step = store, step, base_step
        self._entries = entries  # name -> {"file": str | None, "bytes": int, "meta": dict | None}
        self._loaded: dict[str, dict[str, torch.Tensor]] = {}
        self._changed: dict[str, tuple[dict[str, torch.Tensor] | None, dict | None]] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._changed or name in self._entries

    def names(self) -> list[str]:
        return sorted(set(self._entries) | set(self._changed))

    def tensors(self, name: str) -> dict[str, torch.Tensor] | None:
        """Entry ``name``'s tensors (CPU, memory-mapped from the file; do not modify), or None."""
        if name in self._changed:
            return self._changed[name][0]
        entry = self._entries.get(name)
        if entry is None or entry.get("file") is None:
            return None
        if name not in self._loaded:
            self._loaded[name] = self.store.read_tensors(entry)
        return self._loaded[name]

    def meta(self, name: str) -> dict | None:
        """Entry ``name``'s scalars, or None."""
        if name in self._changed:
            return self._changed[name][1]
        entry = self._entries.get(name)
        return None if entry is None else entry.get("meta")

    def put(
        self,
        name: str,
        tensors: Mapping[str, torch.Tensor] | None = None,
        meta: dict | None = None,
        *,
        copy: bool = True,
    ) -> None:
        """Set entry ``name`` (tensors and/or JSON scalars); written by :meth:`commit`.

        The tensors are copied (they may be a model's live parameters, trained on after this
        call); ``copy=False`` keeps the caller's CPU contiguous tensors as they are, for tensors
        nobody changes afterwards (a freshly computed c_i or h_k, views of a reply's bytes):
        one model-sized copy less per message."""
        if tensors is None and meta is None:
            raise ValueError(f"client state {name!r}: nothing to store")
        values = (
            None
            if tensors is None
            else {
                k: torch.as_tensor(v).detach().to("cpu", copy=copy).contiguous() for k, v in tensors.items()
            }
        )
        self._changed[name] = (values, None if meta is None else dict(meta))

    @property
    def changed(self) -> bool:
        return bool(self._changed)

    def commit(self) -> None:
        """Write the changed entries and this step's manifest (nothing if nothing changed; an
        in-memory snapshot, ``store`` None, keeps its changes)."""
        if self._changed and self.store is not None:
            self.store.commit(self)


class StateStore:
    """The snapshots of one client of one run, in ``folder`` (see the module docstring)."""

    def __init__(self, folder: Path, keep: int = 3, label: str = "client"):
        self.folder, self.keep, self.label = Path(folder), int(keep), label
        self.folder.mkdir(parents=True, exist_ok=True)

    # -- manifests ------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """The steps with a committed manifest, oldest first."""
        return sorted(int(m.group(1)) for p in self.folder.iterdir() if (m := _MANIFEST.match(p.name)))

    def _manifest_path(self, step: int) -> Path:
        return self.folder / f"step-{step}.json"

    def _read_manifest(self, step: int) -> dict:
        path = self._manifest_path(step)
        try:
            manifest = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise StateError(f"{self.label}: state manifest {path} is unreadable ({err})") from err
        entries = manifest.get("entries") if isinstance(manifest, dict) else None
        if not isinstance(entries, dict) or manifest.get("step") != step:
            raise StateError(f"{self.label}: state manifest {path} is not a fedderm client-state manifest")
        for name, entry in entries.items():
            file = entry.get("file") if isinstance(entry, dict) else ""
            if file is not None and not is_safe_component(file):
                raise StateError(
                    f"{self.label}: state manifest {path} names a bad file for {name!r}: {file!r}"
                )
        return manifest

    def _check(self, manifest: dict) -> dict[str, dict[str, torch.Tensor]]:
        """Every tensor file the manifest names exists, has its recorded size and a valid header.
        Returns the entries' tensors as read (memory-mapped), so that they are not opened twice."""
        loaded = {}
        for name, entry in manifest["entries"].items():
            if entry.get("file") is None:
                continue
            path = self.folder / entry["file"]
            size = path.stat().st_size if path.exists() else None
            if size != entry["bytes"]:
                found = "missing" if size is None else f"{size} bytes"
                raise StateError(
                    f"{self.label}: client-state file {path} (entry {name!r}) is damaged: "
                    f"{found}, expected {entry['bytes']} bytes (truncated by a crash?)"
                )
            loaded[name] = self.read_tensors(entry)
        return loaded

    def read_tensors(self, entry: dict) -> dict[str, torch.Tensor]:
        path = self.folder / entry["file"]
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                return {k: f.get_tensor(k) for k in f.keys()}
        except (OSError, SafetensorError) as err:
            raise StateError(f"{self.label}: client-state file {path} cannot be read ({err})") from err

    # -- resume ---------------------------------------------------------------------------
    def start_session(self, token: str, resume_step: int) -> str | None:
        """On the first message from a new server process (``token``): drop the snapshots
        after ``resume_step`` (the server's newest checkpoint).  Returns what was done, for the log."""
        marker = self.folder / "session.json"
        try:
            if json.loads(marker.read_text()).get("token") == token:
                return None
        except (OSError, ValueError):
            pass
        steps = self.steps()
        ahead = [s for s in steps if s > resume_step]
        for step in ahead:
            self._manifest_path(step).unlink(missing_ok=True)
        self._collect()
        _atomic_write(
            marker, lambda p: p.write_text(json.dumps({"token": token, "resume-step": resume_step}))
        )
        if ahead:
            kept = [s for s in steps if s <= resume_step]
            return (
                f"{self.label}: stored client state is at step {ahead[-1]}, the server resumes from its "
                f"checkpoint at step {resume_step}: rolled back to step {kept[-1] if kept else 0} "
                f"(dropped steps {ahead}) in {self.folder}"
            )
        return None

    # -- reading and writing --------------------------------------------------------------
    def open(self, step: int) -> Snapshot:
        """The state as of step ``step``: the newest usable snapshot at or before it.  A snapshot
        whose files are damaged is logged (naming the file) and the one before it used."""
        for base in reversed([s for s in self.steps() if s <= step]):
            try:
                manifest = self._read_manifest(base)
                loaded = self._check(manifest)
            except StateError as err:
                LOG.error("%s; using the state of the step before", err)
                continue
            snap = Snapshot(self, step, base, {k: dict(v) for k, v in manifest["entries"].items()})
            snap._loaded.update(loaded)
            return snap
        return Snapshot(self, step, None, {})

    def commit(self, snap: Snapshot) -> None:
        entries = {k: dict(v) for k, v in snap._entries.items()}
        for name, (tensors, meta) in snap._changed.items():
            entry = {"file": None, "bytes": 0, "meta": meta}
            if tensors is not None:
                file = self._free_name(name, snap.step)
                _atomic_write(self.folder / file, lambda p, t=tensors: save_file(t, str(p)))
                entry.update(file=file, bytes=(self.folder / file).stat().st_size)
            entries[name] = entry
        manifest = {"step": snap.step, "base": snap.base_step, "entries": entries}
        _atomic_write(self._manifest_path(snap.step), lambda p: p.write_text(json.dumps(manifest, indent=1)))
        snap._entries, snap._changed, snap._loaded = entries, {}, {}
        snap.base_step = snap.step
        self._prune(snap.step)

    def _free_name(self, name: str, step: int) -> str:
        safe = safe_component(name)[:96].rstrip(".-_") or "entry"
        n = 0
        while (self.folder / f"{safe}.s{step}.{n}.safetensors").exists():
            n += 1
        return f"{safe}.s{step}.{n}.safetensors"

    def _prune(self, step: int) -> None:
        """Keep the snapshots of the newest ``keep`` steps before ``step`` (0: all) and ``step``."""
        if self.keep <= 0:
            return
        older = [s for s in self.steps() if s < step]
        for old in older[: -self.keep] if len(older) > self.keep else []:
            self._manifest_path(old).unlink(missing_ok=True)
        self._collect()

    def _collect(self) -> None:
        """Delete tensor files no manifest names."""
        used = set()
        for step in self.steps():
            try:
                used |= {e["file"] for e in self._read_manifest(step)["entries"].values() if e.get("file")}
            except StateError:
                continue
        for path in self.folder.glob("*.safetensors"):
            if path.name not in used:
                path.unlink(missing_ok=True)

    def clear(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder.mkdir(parents=True, exist_ok=True)
