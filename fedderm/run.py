"""``fedderm-run``: ``flwr run --stream`` that checks the run config first and ends as ``sim.py``
does, non-zero with one ``error:`` line when the run failed or was stopped (``flwr run`` itself
exits 0 whatever became of the run).

    fedderm-run . --run-config 'method="fedprox" num-server-rounds=20'
    fedderm-run . my-superlink --run-config my-run.toml
    fedderm-run --stop-local              # stop the local SuperLink that flwr run left running

The arguments are flwr run's (--stream is added), plus --verbose (every line of Flower's stream)
and --stop-local.  Before Flower starts, the run config is checked as fedderm-check checks it
(every key known, every value of its type and range, every method's check; on the local
SuperLink also the data paths and, with --federation-config num-supernodes, min-clients): a
mistake is one error: line naming the key, exit 2.  Flower's output then passes through, without
the lines that are not the user's business (Flower's and Ray's start-up notes and warnings, the
strategies' per-round chatter: --verbose or flwr log RUN_ID shows them).  When the run ends, the
run folder's summary.json (when this host can read it: a simulation, or a deployment whose
ServerApp runs here) gives the status and the run's first error, else Flower's status (flwr ls).
Exit codes: 0 the run completed; 1 it failed or was stopped, with error: <the first error> and
the run folder; 2 a run-config mistake, or Flower refused to start the run; 130 Ctrl-C (the run
goes on: flwr stop ends it).

flwr run starts a local SuperLink (and its SuperExec) the first time and leaves them running for
the next run.  --stop-local stops them, and every process under them, by process ID: only those
of this Flower home ($FLWR_HOME, default ~/.flwr) and this user.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import tomllib

#: ``flwr run`` options that take a value (the rest of the arguments are APP and SUPERLINK)
_VALUED = {"--run-config", "-c", "--federation", "--federation-config", "--format"}
_STARTED = re.compile(r"Successfully started run (\d+)")
_FOLDER = re.compile(
    r"results (?:will be written to|continue in) (.+?) \(on the host running the ServerApp\)"
)
#: Lines of Flower's stream that are not the user's business, left out of fedderm-run's console
#: (``--verbose`` and ``flwr log RUN_ID`` keep them), each with why.  ``next`` drops the line after too.
QUIET = [
    # Flower's simulation start-up: a note about a default that changed in 2024, and how to resize
    (re.compile(r"Since flwr 1\.32, default simulated SuperNodes changed"), False),
    (re.compile(r"To change federation size, use the following command"), True),
    # Ray's tip about an environment variable of GPU placement (its text says how to silence it)
    (re.compile(r"FutureWarning: Tip: In future versions of Ray"), True),
    # Flower's actors as they end with the run
    (re.compile(r"Manually terminating ClientAppActor"), False),
    # Flower's strategies, every round: fedderm's round line says the same with its labels
    (re.compile(r"(configure|aggregate)_(train|evaluate): (Sampled|Received) "), False),
    # progress bars of libraries loading weights in the clients (SiFT's text model)
    (re.compile(r"Loading weights"), False),
]


def _flwr() -> str:
    """The ``flwr`` of this interpreter's environment (else the one on PATH)."""
    local = Path(sys.executable).parent / "flwr"
    return str(local) if local.exists() else shutil.which("flwr") or "flwr"


def _positionals(args: list[str]) -> list[str]:
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in _VALUED:
            skip = True
        elif not arg.startswith("-"):
            out.append(arg)
    return out


def _values(args: list[str], *names: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a in names]


def _run_configs(args: list[str]) -> list[str]:
    return _values(args, "--run-config", "-c")


def flower_home() -> Path:
    """Flower's home folder, as ``flwr`` finds it: ``$FLWR_HOME``, else ``~/.flwr``."""
    return Path(os.environ.get("FLWR_HOME") or "~/.flwr").expanduser()


def is_local(superlink: str | None) -> bool:
    """Whether ``flwr run`` with this SUPERLINK argument (None: the default) runs on the local
    SuperLink, a simulation on this machine: the connection's ``address`` in Flower's
    ``config.toml`` is ``:local:`` (or ``:local-in-memory:``).  A Flower home without a config
    file gets Flower's default one, whose default connection is the local one."""
    try:
        with open(flower_home() / "config.toml", "rb") as fh:
            links = tomllib.load(fh).get("superlink", {})
    except (OSError, tomllib.TOMLDecodeError):
        return superlink is None
    name = superlink or links.get("default", "")
    connection = links.get(name)
    if not isinstance(connection, dict):
        return superlink is None and not links
    return str(connection.get("address", "")).startswith(":local")


def federation_size(args: list[str]) -> int | None:
    """``num-supernodes`` of ``--federation-config`` (a local simulation's number of clients), or None."""
    from .cli import parse_pairs
    from .config import ConfigError

    for text in _values(args, "--federation-config"):
        try:
            size = parse_pairs(text).get("num-supernodes")
        except ConfigError:
            return None  # Flower names its own option's mistakes
        if isinstance(size, int):
            return size
    return None


def check_first(app: Path, args: list[str], superlink: str | None) -> int:
    """The app's own config check (``sim.py --check-config``: fedderm-check's, without the data)
    on flwr run's ``--run-config``, before Flower starts; prints its ``error:`` line and returns 2
    on a mistake, else 0.  On the local SuperLink the data paths are this machine's and are
    checked too, and ``--federation-config num-supernodes`` against ``min-clients``."""
    cmd = [sys.executable, str((app / "sim.py").resolve()), "--check-config"]
    if is_local(superlink):
        cmd.append("--with-paths")
        size = federation_size(args)
        if size is not None:
            cmd += ["--num-supernodes", str(size), "--size-option", "--federation-config num-supernodes"]
    configs = _run_configs(args)
    if configs:
        cmd += ["--run-config", *configs]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode == 2:  # a mistake, named
        print(res.stderr.strip() or res.stdout.strip(), file=sys.stderr)
        return 2
    if res.returncode != 0:  # the check itself failed: the run's own checks still apply
        why = (res.stderr.strip() or res.stdout.strip() or f"exit code {res.returncode}").splitlines()[-1]
        print(f"warning: the run config could not be checked before the run ({why})", file=sys.stderr)
    return 0


def stop_local(home: Path | None = None, grace: float = 10.0) -> int:
    """Stop the local SuperLink that ``flwr run`` started for Flower home ``home`` (default
    :func:`flower_home`), its SuperExec and every process under them (a run's ``flwr-simulation``
    and Ray), by process ID: SIGTERM, then SIGKILL after ``grace`` seconds.  Only this user's
    processes whose command line names this home's SuperLink log file.  Prints what it stopped."""
    from . import procs

    home = home or flower_home()
    # flwr passes the log file as it joins it to $FLWR_HOME, which may be relative or a link
    logs = {str(h / "local-superlink" / "superlink.log") for h in (home, home.resolve(), home.absolute())}
    links = [
        pid
        for pid in procs.own_pids()
        if "flower-superlink" in (cmd := procs.cmdline(pid)) and any(f"--log-file {f}" in cmd for f in logs)
    ]
    home = home.resolve()
    if not links:
        print(f"no local SuperLink of {home} is running")
        return 0
    stopped = procs.stop_tree(links, grace)
    print(
        f"stopped the local SuperLink of {home} (process {', '.join(map(str, links))}) and "
        f"{len(stopped) - len(links)} process(es) under it"
    )
    return 0


def flower_status(run_id: str, superlink: str | None) -> tuple[str, str]:
    """(status, status details) of ``run_id`` as ``flwr ls`` reports them; ("unknown", why) when
    it cannot say."""
    cmd = [_flwr(), "ls", *([superlink] if superlink else []), "--run-id", run_id, "--format", "json"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    try:
        (run,) = [r for r in json.loads(res.stdout[res.stdout.index("{") :])["runs"] if r["run-id"] == run_id]
    except (ValueError, KeyError, TypeError):
        return "unknown", " ".join((res.stdout + res.stderr).split())[-300:]
    return str(run.get("status", "unknown")), str(run.get("status-details") or "")


def outcome(flower: tuple[str, str], folder: Path | None) -> tuple[int, str]:
    """(exit code, the one line to print or "") from Flower's (status, details) and the run folder."""
    summary = None
    if folder is not None and (folder / "summary.json").is_file():
        summary = json.loads((folder / "summary.json").read_text())
    status, details = flower
    if summary is not None and summary.get("status") != "running":
        if summary["status"] == "done" and status in ("finished:completed", "unknown"):
            return 0, ""
        return 1, summary.get("error") or f"summary.json says {summary['status']}, Flower says {status}"
    if status == "finished:completed":
        return 0, ""
    first = details.strip().splitlines()[0] if details.strip() else ""
    return 1, f"the run ended as {status}" + (f": {first}" if first else "")


def quiet(lines, out, verbose: bool = False):
    """Copy Flower's stream ``lines`` to ``out`` without the :data:`QUIET` lines (all of them with
    ``verbose``); yields every line (the caller reads the run id and folder from them)."""
    skip_next = False
    for line in lines:
        yield line
        if verbose:
            out.write(line)
        elif skip_next:
            skip_next = False
        elif (hit := next((nxt for pattern, nxt in QUIET if pattern.search(line)), None)) is not None:
            skip_next = hit
        else:
            out.write(line)
        out.flush()


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"]):
        from .cli import plain

        print(plain(__doc__).strip())
        return 0
    if "--stop-local" in args:
        if len(args) > 1:
            print("error: --stop-local takes no other argument", file=sys.stderr)
            return 2
        return stop_local()
    verbose = "--verbose" in args
    args = [a for a in args if a != "--verbose"]
    if "--format" in args:
        print("error: fedderm-run streams the run; use flwr run --format json for JSON", file=sys.stderr)
        return 2
    positionals = _positionals(args)
    app = positionals[0] if positionals else "."
    superlink = positionals[1] if len(positionals) > 1 else None
    fedderm_app = (Path(app) / "sim.py").is_file()
    if fedderm_app and check_first(Path(app), args, superlink):
        return 2
    proc = subprocess.Popen(
        [_flwr(), "run", *args, *([] if "--stream" in args else ["--stream"])],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        encoding="utf-8",
        errors="replace",
        bufsize=1,
    )
    run_id, folder = None, None
    try:
        for line in quiet(proc.stdout, sys.stdout, verbose):
            if run_id is None and (m := _STARTED.search(line)):
                run_id = m.group(1)
            if folder is None and (m := _FOLDER.search(line)):
                folder = Path(m.group(1))
        proc.wait()
    except KeyboardInterrupt:  # the terminal's Ctrl-C reached flwr run too
        proc.wait()
        if run_id is not None:
            where = f" {superlink}" if superlink else ""
            print(f"the run goes on; `flwr stop {run_id}{where}` ends it", file=sys.stderr)
        return 130
    if run_id is None:  # Flower refused the run: name the key at fault where it can be named
        print("error: Flower did not start the run (its message above)", file=sys.stderr)
        if fedderm_app:
            from fedderm import check

            configs = _run_configs(args)
            if check.main([app, *(["--run-config", *configs] if configs else [])]) == 0:
                print("fedderm-check finds nothing wrong with the run config", file=sys.stderr)
        return 2
    exit_code, line = outcome(flower_status(run_id, superlink), folder)
    if exit_code:
        print(f"error: {line}", file=sys.stderr)
        if folder is not None:
            print(f"the run's folder records why (summary.json: status, error): {folder}", file=sys.stderr)
    return exit_code


def entry() -> None:
    """The ``fedderm-run`` console script."""
    sys.exit(main())


if __name__ == "__main__":
    sys.exit(main())
