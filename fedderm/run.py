"""``fedderm-run``: ``flwr run --stream`` that ends as ``sim.py`` does, non-zero with one ``error:``
line when the run failed or was stopped (``flwr run`` itself exits 0 whatever became of the run).

    fedderm-run . --run-config 'method="fedprox" num-server-rounds=20'
    fedderm-run . my-superlink --run-config my-run.toml

The arguments are ``flwr run``'s (``--stream`` is added).  Flower's output passes through
unchanged; when the run ends, the run folder's ``summary.json`` (when this host can read it: a
simulation, or a deployment whose ServerApp runs here) gives the status and the run's first error,
else Flower's status (``flwr ls``).  Exit codes: 0 the run completed; 1 it failed or was stopped,
with ``error: <the first error>`` and the run folder; 2 Flower refused to start it (a run-config
mistake is then named by ``fedderm-check``, run on the same ``--run-config``); 130 Ctrl-C (the
run goes on: ``flwr stop`` ends it).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

#: ``flwr run`` options that take a value (the rest of the arguments are APP and SUPERLINK)
_VALUED = {"--run-config", "-c", "--federation", "--federation-config", "--format"}
_STARTED = re.compile(r"Successfully started run (\d+)")
_FOLDER = re.compile(
    r"results (?:will be written to|continue in) (.+?) \(on the host running the ServerApp\)"
)


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


def _run_configs(args: list[str]) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a in ("--run-config", "-c")]


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


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__.strip())
        return 0
    if "--format" in args:
        print("error: fedderm-run streams the run; use flwr run --format json for JSON", file=sys.stderr)
        return 2
    positionals = _positionals(args)
    app = positionals[0] if positionals else "."
    superlink = positionals[1] if len(positionals) > 1 else None
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
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            if run_id is None and (m := _STARTED.search(line)):
                run_id = m.group(1)
            if folder is None and (m := _FOLDER.search(line)):
                folder = Path(m.group(1))
        proc.wait()
    except KeyboardInterrupt:
        proc.wait()
        if run_id is not None:
            where = f" {superlink}" if superlink else ""
            print(f"the run goes on; `flwr stop {run_id}{where}` ends it", file=sys.stderr)
        return 130
    if run_id is None:  # Flower refused the run: name the key at fault where it can be named
        print("error: Flower did not start the run (its message above)", file=sys.stderr)
        if (Path(app) / "sim.py").is_file():
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
