"""The runs of one or more sweeps side by side in worker processes, each on the in-process grid.

    python -m bench.sweep_pool --jobs 10 --set 'device="cpu"' --out DIR sweeps/claims/a.toml ...
    python -m bench.sweep_pool --gpu --jobs 5 --out DIR sweeps/claims/b.toml   # their [gpu] sections

For a machine with many cores and no Ray (the GPU machine, where only wheels can be carried):
every run is ``sim.sweep_run`` in a fresh process (one PyTorch thread, ``--threads``) over
:func:`bench.loop_grid.simulate`, which computes a Ray simulation's numbers at one thread per
client (``bench/loop_grid.py``).  Runs start in file order, sweep after sweep, in ``DIR/<sweep
name>`` (``-gpu`` with ``--gpu``); a folder that holds a finished run is skipped, as
``sim.py --sweep --out`` does.  Once ``--deadline-s`` has passed no run starts and the ones still
running are stopped, so that every sweep's table.md and table.json are written with what finished
(a run that did not finish is a failed replicate there, with the reason).  Each sweep folder also
gets ``provenance.json`` (commit, machine, versions) and ``val_curves.png``, as with ``sim.py --sweep``;
``python -m fedderm.ledger import DIR/<sweep name> --sweep-file FILE`` turns it into records.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time
from pathlib import Path


def _folder(out: Path, path: str, gpu: bool) -> Path:
    return out / f"{Path(path).stem}{'-gpu' if gpu else ''}"


def _work(job: tuple) -> str:
    path, out, gpu, sets, index, threads = job
    import torch

    torch.set_num_threads(threads)
    import sim
    from bench import loop_grid

    spec, folder = sim.sweep_spec(path, out=str(out), sets=sets, gpu=gpu)
    run = spec.runs()[index]
    _, how = sim.sweep_run(
        spec, run, folder, lambda overrides: loop_grid.simulate(overrides, spec.num_supernodes)
    )
    return f"{spec.name} run {index + 1}/{len(spec.runs())}: {run.describe()}{how}"


def _not_finished(overrides, *_, **__):
    """The table's reason for a run the pool did not finish: its worker's failure, or the deadline."""
    import sim

    log = Path(overrides["output-dir"]) / "logs" / f"{overrides['run-name']}.log"
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    failed = [line[len(sim.FAILED_LINE) :] for line in lines if line.startswith(sim.FAILED_LINE)]
    if failed:
        raise RuntimeError(failed[-1])
    raise RuntimeError(
        f"{'stopped' if lines else 'not started'}: bench.sweep_pool's deadline passed before it finished"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("sweeps", nargs="+", help="sweep files, run in this order")
    parser.add_argument("--out", required=True, help="the folder of the sweep folders")
    parser.add_argument(
        "--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 1), help="worker processes"
    )
    parser.add_argument("--threads", type=int, default=1, help="PyTorch threads per run")
    parser.add_argument("--gpu", action="store_true", help="apply each file's [gpu] section")
    parser.add_argument("--set", nargs="*", default=None, metavar="KEY=VALUE", help="as sim.py --set")
    parser.add_argument("--deadline-s", type=float, default=0.0, help="start no run after this many seconds")
    args = parser.parse_args(argv)
    import sim

    sets = sim.parse_sets(args.set) if args.set else None
    out = Path(args.out).expanduser().resolve()
    jobs, folders = [], {}
    for path in args.sweeps:  # every file checked before the first run starts
        spec, folders[path] = sim.sweep_spec(
            path, out=str(_folder(out, path, args.gpu)), sets=sets, gpu=args.gpu
        )
        jobs += [(path, folders[path], args.gpu, sets, run.index, args.threads) for run in spec.runs()]
    from fedderm import sweep_plots

    for folder in folders.values():  # where the runs ran, before the first starts
        sweep_plots.write_provenance(folder)
    print(f"{len(jobs)} runs of {len(args.sweeps)} sweep(s) over {args.jobs} processes -> {out}", flush=True)
    started = time.monotonic()
    pool = multiprocessing.get_context("spawn").Pool(args.jobs, maxtasksperchild=1)
    pending = [pool.apply_async(_work, (job,)) for job in jobs]
    try:
        while pending:
            if args.deadline_s and time.monotonic() - started > args.deadline_s:
                print(f"deadline: {len(pending)} run(s) stopped or not started", flush=True)
                break
            for task in [t for t in pending if t.ready()]:
                pending.remove(task)
                try:
                    print(f"[{time.monotonic() - started:5.0f} s] {task.get()}", flush=True)
                except Exception as err:  # noqa: BLE001 - the table records the run as failed
                    print(
                        f"[{time.monotonic() - started:5.0f} s] error: {type(err).__name__}: {err}",
                        flush=True,
                    )
            time.sleep(1.0)
    finally:
        pool.terminate()
        pool.join()
    for path, folder in folders.items():
        table = sim.run_sweep(
            path, out=str(folder), sets=sets, gpu=args.gpu, echo=lambda *_: None, simulate_fn=_not_finished
        )
        print(f"table: {table}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
