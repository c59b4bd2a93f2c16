"""fedderm.accel: the accelerator's hooks into Flower, its fork server, the allow-list, the app hash.

The accelerator end to end (forked ClientApps answering real messages, a refused app bundle) is in
tests/test_loopback.py's federation.
"""

from __future__ import annotations

import hashlib
import importlib
import multiprocessing
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fedderm.accel import allow, forkserver, gate, superlink, supernode, waits

APP_DIR = Path(__file__).resolve().parents[1]


def test_the_flower_internals_the_launcher_patches_exist():
    """Fails loudly, naming the internal, when a flwr release moves one of them."""
    import flwr

    assert gate.check_flower_internals() == [], (
        f"flwr {flwr.__version__}: fedderm.accel was verified with {gate.VERIFIED_FLOWER}"
    )


def test_fast_object_pulls_sets_the_shared_backoff_defaults():
    from flwr.supercore.inflatable import inflatable_utils as iu

    fns = (iu.pull_objects, iu.pull_and_inflate_object_from_tree)
    saved = [dict(fn.__kwdefaults__) for fn in fns]
    try:
        for fn in fns:  # Flower's defaults (another test may have patched them in this process)
            fn.__kwdefaults__.update(initial_backoff=1, backoff_cap=10)
        waits.fast_object_pulls(0.05)
        for fn in fns:
            assert fn.__kwdefaults__["initial_backoff"] == 0.05
            assert fn.__kwdefaults__["backoff_cap"] == pytest.approx(0.2)
    finally:
        for fn, kw in zip(fns, saved):
            fn.__kwdefaults__.update(kw)


def test_clamped_time_caps_sleep_and_delegates_the_rest():
    clamped = waits.ClampedTime(0.01)
    start = time.monotonic()
    clamped.sleep(3)  # Flower's idle SuperNode pull
    assert time.monotonic() - start < 0.5
    assert clamped.monotonic() >= start and clamped.time() > 0


@pytest.mark.parametrize(
    ("name", "module", "read", "default", "good", "bads"),
    [
        ("FEDDERM_POLL_INTERVAL", waits, "poll_interval", "DEFAULT_POLL_INTERVAL", 0.2, ("fast", "0", "100")),
        ("FEDDERM_PULL_HOLD", superlink, "pull_hold", "DEFAULT_PULL_HOLD", 0, ("soon", "-1", "60")),
    ],
)
def test_seconds_from_environment(monkeypatch, name, module, read, default, good, bads):
    """Unset: the default; a value in range: that value; anything else: one line naming the key."""
    read = getattr(module, read)
    monkeypatch.delenv(name, raising=False)
    assert read() == getattr(module, default)
    monkeypatch.setenv(name, str(good))
    assert read() == good
    for bad in bads:
        monkeypatch.setenv(name, bad)
        with pytest.raises(SystemExit, match=f"{name}="):
            read()


def test_allow_list_parsing_and_errors_name_the_file_and_line(tmp_path):
    good = hashlib.sha256(b"app").hexdigest()
    path = tmp_path / "approved.txt"
    path.write_text(f"# fedderm 0.1.0, reviewed 2026-11-20\n\n{good.upper()}  # v0.1.0\n")
    assert allow.read_allow_list(path) == {good}
    path.write_text(f"{good}\nnot-a-hash\n")
    with pytest.raises(SystemExit, match=r"approved.txt:2: 'not-a-hash' is not a sha256"):
        allow.read_allow_list(path)
    with pytest.raises(SystemExit, match="missing.txt does not exist"):
        allow.read_allow_list(tmp_path / "missing.txt")


def _copy_app(dst: Path) -> Path:
    ignore = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info", ".pytest_cache", "site")
    shutil.copytree(APP_DIR, dst, ignore=ignore)
    return dst


def test_app_hash_is_the_sha256_of_the_bundle_flwr_run_ships(tmp_path):
    from flwr.cli.build import build_fab_from_disk

    app = _copy_app(tmp_path / "app")
    # what the app's .gitignore leaves out, which app_hash does not walk: the bundle is the same
    for ignored in (
        ".venv/lib/site.py",
        "strategies/__pycache__/x.pyc",
        "results/run/summary.json",
        "site/a.md",
    ):
        (app / ignored).parent.mkdir(parents=True, exist_ok=True)
        (app / ignored).write_text("x = 1\n")
    (app / "linked.py").symlink_to(app / "client_app.py")
    digest = allow.app_hash(app)
    assert digest == hashlib.sha256(build_fab_from_disk(app)).hexdigest()
    copy = allow.copy_bundle_files(app, tmp_path / "copy")
    assert not (copy / ".venv").exists() and not (copy / "linked.py").exists()
    assert (copy / "client_app.py").read_bytes() == (app / "client_app.py").read_bytes()
    assert allow.app_hash(app) == digest  # the same files, the same hash
    (app / "client_app.py").write_text((app / "client_app.py").read_text() + "\n# changed\n")
    assert allow.app_hash(app) != digest  # any edit to shipped code changes what must be approved
    out = subprocess.run(
        [sys.executable, "-m", "fedderm.accel", "app-hash", str(app)],
        capture_output=True,
        text=True,
        check=True,
        cwd=APP_DIR,
    )
    assert out.stdout.strip() == allow.app_hash(app)
    bad = subprocess.run(
        [sys.executable, "-m", "fedderm.accel", "app-hash", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=APP_DIR,
    )
    assert bad.returncode != 0 and "has no pyproject.toml" in bad.stderr


def test_each_fedderm_script_runs_the_role_it_is_named_after(monkeypatch):
    """pyproject.toml's ``fedderm-<role>`` scripts share one entry: the role is the script's name."""
    import tomllib

    scripts = tomllib.loads((APP_DIR / "pyproject.toml").read_text())["project"]["scripts"]
    roles = [
        name.removeprefix("fedderm-")
        for name, target in scripts.items()
        if target == "fedderm.accel.gate:entry"
    ]
    assert sorted(roles) == ["app-hash", "superexec", "superlink", "supernode"]
    ran = []
    monkeypatch.setattr(gate, "main", lambda argv: ran.append(argv))
    for role in roles:
        monkeypatch.setattr(sys, "argv", [f"/venv/bin/fedderm-{role}", "--insecure"])
        gate.entry()
    assert ran == [[role, "--insecure"] for role in roles]


def test_install_guard_refuses_a_bundle_off_the_list_before_installing_it(monkeypatch, caplog):
    rc = importlib.import_module("flwr.supernode.runtime.run_clientapp")

    installed = []
    monkeypatch.setattr(rc, "install_from_fab", lambda content, **kw: installed.append(content))
    approved = b"approved bundle"
    allow.guard_install({hashlib.sha256(approved).hexdigest()}, "/etc/fedderm/approved.txt")
    with pytest.raises(PermissionError, match="not on this hospital's allow-list"):
        rc.install_from_fab(b"something else", skip_prompt=True)
    assert installed == []  # nothing unpacked, so no app code can have run
    assert any("refused: app bundle sha256" in r.getMessage() for r in caplog.records)
    rc.install_from_fab(approved, skip_prompt=True)
    assert installed == [approved]


def test_no_allow_list_approves_everything(monkeypatch):
    rc = importlib.import_module("flwr.supernode.runtime.run_clientapp")

    installed = []
    monkeypatch.setattr(rc, "install_from_fab", lambda content, **kw: installed.append(content))
    allow.guard_install(None, "")
    rc.install_from_fab(b"any", skip_prompt=True)
    assert installed == [b"any"]


def test_superexec_popen_is_redirected_to_the_launcher_with_a_wake_up_pipe(monkeypatch):
    monkeypatch.setattr(waits, "WAKE_FDS", [])
    popen = supernode.SuperExecPopen(["--allow-list", "/x"])
    seen = []
    popen._subprocess = type(
        "S", (), {"Popen": staticmethod(lambda cmd, *a, **k: seen.append((cmd, k))), "PIPE": -1}
    )()
    popen.Popen(["flower-superexec", "--insecure", "--runtime-api-address", "127.0.0.1:1"])
    popen.Popen(["other", "x"])
    command, kwargs = seen[0]
    assert command[:-2] == [
        sys.executable,
        "-m",
        "fedderm.accel",
        "superexec",
        "--insecure",
        "--runtime-api-address",
        "127.0.0.1:1",
        "--allow-list",
        "/x",
    ]
    assert command[-2] == "--wake-fd" and kwargs["pass_fds"] == (int(command[-1]),)
    assert seen[1] == (["other", "x"], {}) and popen.PIPE == -1
    (write_fd,) = waits.WAKE_FDS
    os.close(write_fd)  # (the read end was closed after the start, as in the SuperNode)


def test_superexec_sleep_ends_when_the_supernode_wakes_it(monkeypatch):
    """The SuperExec's task poll sleeps until the SuperNode stored a message (or the fallback)."""
    read_fd, write_fd = os.pipe()
    monkeypatch.setattr(waits, "WAKE_FDS", [write_fd])
    clock = waits.WakeableTime(read_fd, fallback=0.3)
    start = time.monotonic()
    clock.sleep(0.01)  # nothing to do: sleeps the fallback, not Flower's interval
    assert 0.25 < time.monotonic() - start < 2
    pull = waits.waking_object_pull(lambda ids, pull_object_fn: {i: b"x" for i in ids})
    assert pull(["a"], pull_object_fn=None) == {"a": b"x"}  # a task exists: the SuperExec is woken
    waits.wake_superexec()  # two wake-ups pending: one sleep consumes both
    start = time.monotonic()
    clock.sleep(5)
    assert time.monotonic() - start < 0.2
    start = time.monotonic()
    clock.sleep(0.01)
    assert time.monotonic() - start > 0.25  # both consumed
    os.close(write_fd)  # the SuperNode is gone: plain sleeps from now on
    clock.sleep(0.01)
    assert clock.fd == -1
    start = time.monotonic()
    clock.sleep(0.05)
    assert 0.04 < time.monotonic() - start < 0.25
    waits.wake_superexec()  # writing to a closed pipe drops it
    assert waits.WAKE_FDS == []


def test_install_guard_unpacks_an_approved_bundle_once(monkeypatch, tmp_path):
    """Flower unzips and re-hashes the bundle for every message; the launcher skips that once
    Flower has installed this exact sha256 (and only then)."""
    rc = importlib.import_module("flwr.supernode.runtime.run_clientapp")
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    calls = []

    def install(content, **kw):
        calls.append(content)
        folder = tmp_path / "apps" / f"x.y.1.{hashlib.sha256(content).hexdigest()[:8]}"
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    monkeypatch.setattr(rc, "install_from_fab", install)
    allow.guard_install(None, "")
    first = rc.install_from_fab(b"bundle one", skip_prompt=True)
    assert rc.install_from_fab(b"bundle one", skip_prompt=True) == first and calls == [b"bundle one"]
    rc.install_from_fab(b"bundle two", skip_prompt=True)  # another hash: installed by Flower
    assert calls == [b"bundle one", b"bundle two"]
    shutil.rmtree(first)  # the installed folder gone: Flower installs it again
    rc.install_from_fab(b"bundle one", skip_prompt=True)
    assert calls == [b"bundle one", b"bundle two", b"bundle one"]


def _client_app_spec(task_id: int, port: int):
    """A ClientApp task whose Runtime API (``port``: a socket that never answers) keeps it waiting."""
    from flwr.supercore.constant import TaskType
    from flwr.supercore.superexec.executor.types import ExecutionSpec

    return ExecutionSpec(
        task_type=TaskType.CLIENT_APP,
        runtime_api_address=f"127.0.0.1:{port}",
        token="token",
        insecure=True,
        root_certificates_path=None,
        runtime_dependency_install=False,
        parent_pid=os.getpid(),
        suppress_output=False,
        task_id=task_id,
    )


@pytest.fixture
def silent_runtime_api():
    """The port of a listening socket that accepts connections and never answers."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield sock.getsockname()[1]


# A SuperExec stand-in: a thread running (as Flower's parent monitor), the fork server started,
# one ClientApp task launched; prints the pids, then closes the executor or waits to be killed.
_SUPEREXEC_SCRIPT = """
import os, sys, threading, time
from fedderm.accel import forkserver
from test_launcher import _client_app_spec  # tests/ on PYTHONPATH

if __name__ == "__main__":
    import psutil

    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
    forkserver.start_fork_server(preload=("flwr.supernode.runtime.run_clientapp",))
    executor = forkserver.ForkExecutor(None, "", preload=("flwr.supernode.runtime.run_clientapp",))
    assert executor.launch(_client_app_spec(8, int(sys.argv[1]))).status == "accepted"
    task = executor.tasks[0].pid
    print(threading.active_count(), psutil.Process(task).ppid(), task, flush=True)
    if sys.argv[2] == "close":
        sys.stdin.readline()
        executor.close()
        print("closed", flush=True)
    time.sleep(600)
"""


def _superexec(port: int, then: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _SUPEREXEC_SCRIPT, str(port), then],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=APP_DIR,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(APP_DIR / "tests"), str(APP_DIR)])},
    )


def test_a_task_is_forked_by_the_fork_server_not_the_threaded_superexec(silent_runtime_api):
    """The SuperExec runs threads (Flower's parent monitor): the ClientApp is a child of the
    fork server, a fresh interpreter the SuperExec started; closing the executor (the
    SuperExec's exit) stops the task."""
    import psutil

    superexec = _superexec(silent_runtime_api, "close")
    try:
        threads, server, task = (int(x) for x in superexec.stdout.readline().split())
        server, task = psutil.Process(server), psutil.Process(task)
        assert threads >= 2
        assert task.ppid() == server.pid != superexec.pid and server.ppid() == superexec.pid
        assert "multiprocessing.forkserver" in " ".join(server.cmdline())
        assert task.status() != psutil.STATUS_ZOMBIE
        superexec.stdin.write("\n")
        superexec.stdin.flush()
        assert superexec.stdout.readline().strip() == "closed"
        assert not task.is_running() or task.status() == psutil.STATUS_ZOMBIE
    finally:
        superexec.kill()
        superexec.wait()
    gone, alive = psutil.wait_procs([server], timeout=30)
    assert alive == []


def test_the_fork_server_and_its_tasks_end_when_the_superexec_is_killed(silent_runtime_api):
    """A SuperExec killed outright (SIGKILL: no exit handler runs) leaves neither its fork server
    nor a running ClientApp behind (the task's Flower parent monitor watches the SuperExec)."""
    import psutil

    superexec = _superexec(silent_runtime_api, "wait")
    try:
        _, server, task = (int(x) for x in superexec.stdout.readline().split())
        server, task = psutil.Process(server), psutil.Process(task)
        assert task.ppid() == server.pid and server.ppid() == superexec.pid
        assert task.status() != psutil.STATUS_ZOMBIE
    finally:
        superexec.kill()
        superexec.wait()
    gone, alive = psutil.wait_procs([server, task], timeout=30)
    assert alive == []


_SELF_TEST_SCRIPT = """
from fedderm.accel import forkserver

if __name__ == "__main__":
    print(forkserver.self_test_fork_server(preload=("json",)))
"""


def test_fork_server_self_test_passes_with_the_server_and_names_a_task_not_forked_by_it(monkeypatch):
    res = subprocess.run(
        [sys.executable, "-c", _SELF_TEST_SCRIPT], capture_output=True, text=True, cwd=APP_DIR
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "None"

    class ForkContext:  # tasks forked by this very process, not by a fork server
        def __getattr__(self, name):
            return getattr(multiprocessing.get_context("fork"), name)

    monkeypatch.setattr(forkserver, "start_fork_server", lambda preload: ForkContext())
    failure = forkserver.self_test_fork_server(preload=("json",))
    assert failure is not None and f"forked by pid {os.getpid()}" in failure


def test_superlink_keeps_link_state_and_objects_in_memory_and_registrations_in_the_database_file(
    tmp_path, monkeypatch
):
    """``fedderm-superlink --database FILE``: the messages' objects (model arrays) in Flower's
    in-memory store, the link state Flower's in-memory one with its registrations kept in FILE;
    ``:flwr-in-memory:`` stays Flower's."""
    from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState
    from flwr.supercore.object_store.in_memory_object_store import InMemoryObjectStore
    from flwr.superlink import config_loader
    from flwr.superlink import main as superlink_main
    from flwr.superlink.federation.noop_federation_manager import NoOpFederationManager

    from fedderm.accel.node_registry import RegisteredNodesLinkState

    flower, _ = config_loader.get_objectstore_linkstate_factories(str(tmp_path / "flower.db"), None)
    assert not isinstance(flower.store(), InMemoryObjectStore)  # Flower's: objects in the SQLite file

    monkeypatch.setattr(superlink_main, "get_objectstore_linkstate_factories", None)
    superlink.link_state_in_memory()
    factories = superlink_main.get_objectstore_linkstate_factories
    db = tmp_path / "superlink.db"
    objects, links = factories(str(db), NoOpFederationManager())
    assert isinstance(objects.store(), InMemoryObjectStore)
    assert links.objectstore_factory is objects
    state = links.state()
    assert isinstance(state, RegisteredNodesLinkState) and links.state() is state
    assert state.object_store is objects.store()
    assert db.is_file()
    objects, links = factories(":flwr-in-memory:", NoOpFederationManager())
    assert isinstance(objects.store(), InMemoryObjectStore) and not (tmp_path / ":flwr-in-memory:").exists()
    assert type(links.state()) is InMemoryLinkState


def _registry(db, objects=None):
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.superlink.federation.noop_federation_manager import NoOpFederationManager

    from fedderm.accel.node_registry import link_state_factory

    objects = objects or ObjectStoreFactory()
    return link_state_factory(db, NoOpFederationManager(), objects).state()


def test_registered_supernodes_survive_a_superlink_restart_and_unregistered_ones_stay_so(tmp_path):
    """Registrations in FILE: after a restart (a new link state on the same FILE) a registered
    node has its node id, owner and key back and can come online again (status registered, not
    the online it had); an unregistered one stays unregistered and its key unusable, as in Flower."""
    from flwr.supercore.constant import NodeStatus

    db = tmp_path / "superlink.db"
    state = _registry(db)
    kept = state.create_node("owner-aid", "owner-name", b"public-key-a", 30.0)
    gone = state.create_node("owner-aid", "owner-name", b"public-key-b", 30.0)
    assert state.activate_node(kept, 30.0)
    state.delete_node("owner-aid", gone)
    assert state.get_node_id_by_public_key(b"public-key-b") is None

    restarted = _registry(db)
    assert restarted.get_node_id_by_public_key(b"public-key-a") == kept
    assert restarted.get_node_id_by_public_key(b"public-key-b") is None
    (info,) = restarted.get_node_info(node_ids=[kept])
    assert (info.owner_aid, info.owner_name, info.public_key) == ("owner-aid", "owner-name", b"public-key-a")
    assert info.status == NodeStatus.REGISTERED
    assert restarted.get_node_info(node_ids=[gone])[0].status == NodeStatus.UNREGISTERED
    assert restarted.activate_node(kept, 30.0)
    assert restarted.get_node_info(node_ids=[kept])[0].status == NodeStatus.ONLINE
    with pytest.raises(ValueError, match="Public key already in use"):
        restarted.create_node("owner-aid", "owner-name", b"public-key-b", 30.0)
    assert not restarted.run_ids  # runs are not kept: in memory only


def test_registration_that_cannot_be_written_is_refused_and_not_kept_in_memory(tmp_path):
    import sqlite3

    db = tmp_path / "superlink.db"
    state = _registry(db)
    node = state.create_node("owner-aid", "owner-name", b"public-key-a", 30.0)
    with sqlite3.connect(db) as conn:  # the file turns read-only under the SuperLink
        conn.execute(
            "CREATE TRIGGER refuse BEFORE INSERT ON fedderm_registered_nodes BEGIN "
            "SELECT RAISE(ABORT, 'disk refused'); END"
        )
    with pytest.raises(sqlite3.DatabaseError, match="disk refused"):
        state.create_node("owner-aid", "owner-name", b"public-key-b", 30.0)
    assert state.get_node_id_by_public_key(b"public-key-b") is None
    assert [n.node_id for n in state.get_node_info()] == [node]
    with pytest.raises(sqlite3.DatabaseError, match="disk refused"):
        state.delete_node("owner-aid", node)  # INSERT OR REPLACE: the trigger refuses it too
    assert state.get_node_id_by_public_key(b"public-key-a") == node  # still registered
    assert _registry(db).get_node_id_by_public_key(b"public-key-a") == node


def test_registrations_in_a_file_of_flowers_sql_link_state_are_imported_once(tmp_path):
    """A FILE written by ``flower-superlink --database FILE`` (or an earlier fedderm): its
    registered nodes are there after the switch, unregistered ones stay unregistered."""
    from flwr.server.superlink.linkstate.sql_linkstate import SqlLinkState
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.superlink.federation.noop_federation_manager import NoOpFederationManager

    db = tmp_path / "superlink.db"
    objects = ObjectStoreFactory()
    flower = SqlLinkState(str(db), NoOpFederationManager(), objects.store())
    flower.initialize()
    kept = flower.create_node("owner-aid", "owner-name", b"public-key-a", 30.0)
    gone = flower.create_node("owner-aid", "owner-name", b"public-key-b", 30.0)
    flower.delete_node("owner-aid", gone)
    flower._engine.dispose()

    state = _registry(db, objects)
    assert state.get_node_id_by_public_key(b"public-key-a") == kept
    assert state.get_node_id_by_public_key(b"public-key-b") is None
    later = state.create_node("owner-aid", "owner-name", b"public-key-c", 30.0)
    restarted = _registry(db, objects)  # the import is not repeated over fedderm's own table
    assert {n.node_id for n in restarted.get_node_info()} == {kept, gone, later}


class _FakeLinkState:
    """The three link-state methods HeldPulls wraps: instructions per node, stored by the ServerApp."""

    def __init__(self):
        self.waiting: dict[int, list[str]] = {}
        self.lock = threading.Lock()
        self.queries = 0

    def get_message_ins(self, node_id, limit, *, run_id=None):
        with self.lock:
            self.queries += 1
            return [self.waiting.pop(node_id)] if node_id in self.waiting else []

    def store_message_ins(self, message):
        node_id, text = message
        with self.lock:
            self.waiting[node_id] = text
        return text

    def store_message_and_object_tree(self, message, object_tree, session_id):
        return self.store_message_ins((message.node_id, message.text)) is not None, []


def _held(hold: float, max_held: int = 16) -> _FakeLinkState:
    return superlink.HeldPulls(hold, max_held).wrap(_FakeLinkState())


def _pull_in_thread(state, node_id: int) -> tuple:
    result: dict = {}

    def pull():
        start = time.monotonic()
        result["messages"] = state.get_message_ins(node_id=node_id, limit=1)
        result["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=pull)
    thread.start()
    return thread, result


def test_held_pull_answers_nothing_after_the_hold_and_a_waiting_message_at_once():
    state = _held(1.5)
    start = time.monotonic()
    assert state.get_message_ins(node_id=7, limit=1) == []
    assert 1.45 <= time.monotonic() - start < 5.0
    state.store_message_ins((7, "train"))
    start = time.monotonic()
    assert state.get_message_ins(node_id=7, limit=1) == ["train"]
    assert time.monotonic() - start < 1.0


@pytest.mark.parametrize("push", ["store_message_ins", "store_message_and_object_tree"])
def test_held_pull_gets_a_message_stored_while_it_waits(push):
    """A SuperNode's pull waiting at the SuperLink gets the ServerApp's message as soon as it is
    stored (either of Flower's two ways of storing one), not at the end of the hold."""
    from types import SimpleNamespace

    state = _held(5.0)
    thread, result = _pull_in_thread(state, 7)
    time.sleep(0.3)
    if push == "store_message_ins":
        state.store_message_ins((7, "train"))
    else:
        message = SimpleNamespace(node_id=7, text="train", metadata=SimpleNamespace(reply_to_message_id=""))
        state.store_message_and_object_tree(message, None, "session")
    thread.join(10)
    assert result["messages"] == ["train"]
    assert 0.25 <= result["seconds"] < 4.0


def test_held_pull_keeps_waiting_when_another_nodes_message_is_stored():
    state = _held(1.5)
    thread, result = _pull_in_thread(state, 7)
    time.sleep(0.2)
    state.store_message_ins((8, "for another hospital"))
    thread.join(10)
    assert result["messages"] == [] and result["seconds"] >= 1.45
    assert state.get_message_ins(node_id=8, limit=1) == ["for another hospital"]


def test_server_pulls_and_pulls_beyond_the_cap_are_answered_at_once():
    from flwr.common.constant import SUPERLINK_NODE_ID

    state = _held(3.0, max_held=1)
    start = time.monotonic()
    assert state.get_message_ins(node_id=SUPERLINK_NODE_ID, limit=None, run_id=5) == []
    assert state.get_message_ins(node_id=7, limit=1, run_id=5) == []  # the ServerApp's, by run
    assert time.monotonic() - start < 1.5
    thread, result = _pull_in_thread(state, 7)  # takes the only slot
    time.sleep(0.2)
    start = time.monotonic()
    assert state.get_message_ins(node_id=9, limit=1) == []
    assert time.monotonic() - start < 1.5
    state.store_message_ins((7, "train"))
    thread.join(10)
    assert result["messages"] == ["train"]


def test_superlink_link_state_holds_idle_pulls(tmp_path, monkeypatch):
    """``fedderm-superlink``'s factories (file and ``:flwr-in-memory:``) hand Flower's real link
    state out with its pulls held: a SuperNode's pull with nothing waiting answers after the hold,
    the ServerApp's at once; the same instance every time. The SuperNode's pull goes through
    Flower's own Fleet handler, whichever link-state method the installed Flower pulls with."""
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.proto.fleet_pb2 import PullMessagesRequest
    from flwr.proto.node_pb2 import Node
    from flwr.superlink import main as superlink_main
    from flwr.superlink.federation.noop_federation_manager import NoOpFederationManager
    from flwr.superlink.servicer.fleet import fleet_handlers

    monkeypatch.setattr(
        superlink_main,
        "get_objectstore_linkstate_factories",
        superlink_main.get_objectstore_linkstate_factories,
    )
    superlink.link_state_in_memory()
    superlink.hold_pulls(2.0)
    factories = superlink_main.get_objectstore_linkstate_factories
    for database in (str(tmp_path / "superlink.db"), ":flwr-in-memory:"):
        objects, links = factories(database, NoOpFederationManager())
        state = links.state()
        assert links.state() is state
        start = time.monotonic()
        request = PullMessagesRequest(node=Node(node_id=1234))
        assert list(fleet_handlers.pull_messages(request, state, objects.store()).messages_list) == []
        assert 1.95 <= time.monotonic() - start < 6.0, database
        start = time.monotonic()
        server_pull = getattr(state, "get_messages", None)
        if server_pull is not None:  # Flower 1.43
            assert server_pull(dst_node_id=SUPERLINK_NODE_ID, run_id=1) == []
        else:
            assert state.get_message_ins(node_id=SUPERLINK_NODE_ID, limit=None, run_id=1) == []
        assert time.monotonic() - start < 1.5, database


def test_held_pull_self_test_passes_on_this_flower_and_names_an_inert_hold(monkeypatch):
    """The start-up self-test pulls through Flower's own Fleet handler: it passes with the
    installed Flower and fails, naming the held pull, when the wrap misses the method Flower
    pulls with (as the 1.42 wrap did on 1.43, whose Fleet handler calls ``get_messages``)."""
    assert superlink.self_test_held_pull(0.2) is None
    monkeypatch.setattr(superlink.HeldPulls, "wrap", lambda self, state: state)
    failure = superlink.self_test_held_pull(0.2)
    assert failure is not None and failure.startswith("held pull:")


def test_short_wait_self_test_passes_and_names_an_inert_back_off_and_restores_flowers(monkeypatch):
    from flwr.supercore.inflatable import inflatable_utils

    before = dict(inflatable_utils.pull_objects.__kwdefaults__)
    assert waits.self_test_short_wait(0.01) is None
    assert inflatable_utils.pull_objects.__kwdefaults__ == before  # the self-test patches nothing
    monkeypatch.setattr(waits, "fast_object_pulls", lambda interval: None)
    failure = waits.self_test_short_wait(0.01)
    assert failure.startswith("short wait: Flower's object pull retried after ")
    assert float(failure.split(" after ")[1].split(" s")[0]) >= 0.8  # Flower's 1 s back-off, ±20 %


def test_a_self_test_that_raises_runs_stock(monkeypatch, stock_commands, caplog):
    def broken():
        raise AttributeError("moved")

    monkeypatch.setattr(gate, "SELF_TESTS", {"superlink": (broken,)})
    monkeypatch.setattr(
        superlink, "superlink_main", lambda argv: pytest.fail("patched despite a failed self-test")
    )
    with caplog.at_level("WARNING", logger="flwr"):
        gate.main(["superlink", "--insecure"])
    assert stock_commands == [["flower-superlink", "--insecure"]]
    assert any("broken: AttributeError('moved')" in r.getMessage() for r in caplog.records)


def test_refusal_self_test_passes_and_names_a_guard_that_lets_a_bundle_through(monkeypatch):
    assert allow.self_test_refusal() is None
    monkeypatch.setattr(allow, "guard_install", lambda allowed, source: None)
    assert allow.self_test_refusal() == "refusal: a bundle off the allow-list was installed"


@pytest.fixture
def stock_commands(monkeypatch):
    """Each role's stock Flower command replaced by a recorder of ``sys.argv``."""
    ran: list[list[str]] = []
    for module, function, _ in gate.STOCK_COMMANDS.values():
        monkeypatch.setattr(importlib.import_module(module), function, lambda: ran.append(list(sys.argv)))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    return ran


@pytest.mark.parametrize("role", ["supernode", "superlink", "superexec"])
def test_an_unverified_flower_runs_stock_with_one_warning_and_patches_nothing(
    role, monkeypatch, stock_commands, caplog
):
    monkeypatch.setattr(gate, "flower_version", lambda: "9.9.0")
    monkeypatch.delenv("FEDDERM_ALLOW_LIST", raising=False)
    patched = []
    for module, name in [
        (supernode, "supernode_main"),
        (supernode, "superexec_main"),
        (supernode, "fast_object_pulls"),
        (superlink, "superlink_main"),
        (superlink, "hold_pulls"),
        (forkserver, "start_fork_server"),  # no fork server for a stock SuperExec
    ]:
        monkeypatch.setattr(module, name, lambda *a, _n=name: patched.append(_n))
    with caplog.at_level("WARNING", logger="flwr"):
        gate.main([role, "--insecure", "--wake-fd", "5"])
    command = gate.STOCK_COMMANDS[role][2]
    assert stock_commands == [[command, "--insecure"]] and patched == []
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "9.9.0" in warnings[0] and command in warnings[0]
    assert "1.42.0" in warnings[0]  # names the verified versions


def test_an_unverified_flower_with_an_allow_list_refuses_to_start(monkeypatch, stock_commands, tmp_path):
    """Stock Flower has no allow-list: the SuperNode does not start rather than run any bundle."""
    monkeypatch.setattr(gate, "flower_version", lambda: "9.9.0")
    allow = tmp_path / "allow.txt"
    allow.write_text("0" * 64 + "\n")
    with pytest.raises(SystemExit, match=r"9\.9\.0.*cannot enforce the allow-list .*allow\.txt"):
        gate.main(["supernode", "--insecure", "--allow-list", str(allow)])
    monkeypatch.setenv("FEDDERM_ALLOW_LIST", str(allow))
    for role in ("superexec", "supernode"):  # the SuperNode's SuperExec child reads the variable
        with pytest.raises(SystemExit, match="cannot enforce the allow-list"):
            gate.main([role, "--insecure"])
    assert stock_commands == []


def test_a_failed_self_test_runs_stock_on_a_verified_flower(monkeypatch, stock_commands, caplog):
    monkeypatch.setattr(gate, "SELF_TESTS", {"superlink": (lambda: "held pull: answered at once",)})
    monkeypatch.setattr(
        superlink, "superlink_main", lambda argv: pytest.fail("patched despite a failed self-test")
    )
    with caplog.at_level("WARNING", logger="flwr"):
        gate.main(["superlink", "--insecure"])
    assert stock_commands == [["flower-superlink", "--insecure"]]
    assert any(
        "self-test failed" in r.getMessage() and "answered at once" in r.getMessage() for r in caplog.records
    )


def test_a_verified_flower_whose_self_tests_pass_is_patched(monkeypatch, stock_commands):
    ran = []
    monkeypatch.setattr(superlink, "superlink_main", lambda argv: ran.append(argv))
    monkeypatch.setattr(gate, "SELF_TESTS", {"superlink": (lambda: None,)})
    gate.main(["superlink", "--insecure"])
    assert ran == [["--insecure"]] and stock_commands == []
