"""Overhead of fedderm over a plain PyTorch loop doing the same local work.

    python -m bench.overhead                    # ResNet-18, 64 px, 4 clients x 255 images, 5 rounds, 3 x (A, B)
    python -m bench.overhead --method fedprox   # any of: fedavg, fedprox, fedbn
    python -m bench.overhead --quick            # tiny-cnn, 32 px, 2 rounds, 2 x (A, B): a fast check
    python -m bench.overhead --device cuda      # on one GPU: 2 plain workers / 2 clients at a time (0.5 GPU each)

A (plain): the simulation's layout without Flower: 2 single-threaded worker processes pull
clients from a queue, the weights cross the process boundary as numpy arrays, the main process
averages them (weighted by examples).  Per round: every client trains ``local-epochs`` on its
labelled split (Adam, shuffled batches, random flips, cross-entropy), then every client evaluates
the new global model on its val split (the same metrics fedderm computes); round 0 evaluates the
initial model and a final wave evaluates on test, as fedderm's plan does.  The data are the very
tensors fedderm's clients get (``fedderm.data.load_client_data``, embedded synthetic source).

B (fedderm): ``sim.simulate`` with the same settings (``--num-supernodes 4``, 1 CPU per client)
and A's message layout: ``val-in-train=false``, each round's validation its own message (fedderm's
default rides round r's validation in round r+1's train message, one exchange fewer per round, and
then round 0 cannot be timed apart from round 1; ``bench.deployment`` measures that default).

The two alternate (A B A B ...), each in a fresh process; medians over the repeats are printed:
start-up (launch -> first evaluation message), round 0 (evaluation of the initial model), time
per round (median over rounds), ``work`` (seconds inside the local train/eval loops per round,
all clients), time outside training per round (per-round time - work / 2 workers) and peak memory
(sum of RSS over the process tree, sampled every 0.2 s).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from bench import benchlib  # noqa: E402

PLAIN_METHODS = ("fedavg", "fedprox", "fedbn")
METHOD_KEYS = {"fedprox": {"proximal-mu": 0.01}}
WORKERS = 2


@dataclasses.dataclass
class Settings:
    method: str = "fedavg"
    model: str = "resnet18"
    image_size: int = 64
    clients: int = 4
    per_class: int = 85  # 5 classes x 85 per site, 60 % train -> 255 labelled images per client
    epochs: int = 1
    batch_size: int = 32
    rounds: int = 5
    seed: int = 0
    workdir: str = ""
    extra: dict = dataclasses.field(default_factory=dict)  # more run-config keys (bench/scale.py)
    device: str = "cpu"  # cuda: the plain workers and fedderm's clients train on the GPU

    def gpu_share(self) -> float:
        """fedderm's --gpus-per-client: WORKERS clients at a time share one GPU, as A's workers."""
        return 1 / WORKERS if self.device == "cuda" else 0.0

    def overrides(self) -> dict:
        return {
            "method": self.method,
            "model": self.model,
            "image-size": self.image_size,
            "synthetic-per-class": self.per_class,
            "local-epochs": self.epochs,
            "batch-size": self.batch_size,
            "num-server-rounds": self.rounds,
            "seed": self.seed,
            "min-clients": self.clients,
            "optimizer": "adam",
            "lr": 1e-3,
            "lr-schedule": "cosine",
            "val-in-train": False,  # A's layout: validation is its own message (module docstring)
            "cache-dir": str(Path(self.workdir) / "cache"),
            "output-dir": str(Path(self.workdir) / "runs"),
            **METHOD_KEYS.get(self.method, {}),
            **({"device": self.device} if self.device != "cpu" else {}),
            **self.extra,
        }


# ----------------------------------------------------------------------------- A: plain loop
def _plain_train(model, images, labels, *, epochs, batch_size, lr, weight_decay, seed, mu):
    import torch
    import torch.nn.functional as F

    device = next(model.parameters()).device
    images, labels = images.to(device), labels.to(device)  # the whole split once, batches cut there
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    reference = [p.detach().clone() for p in params] if mu > 0 else None
    g = torch.Generator().manual_seed(seed)
    n = len(labels)
    for _ in range(epochs):
        order = torch.randperm(n, generator=g)
        for i in range(0, n, batch_size):
            idx = order[i : i + batch_size]
            if len(idx) < 2:
                continue
            x = images[idx.to(device)]
            h, v = torch.rand(len(idx), generator=g) < 0.5, torch.rand(len(idx), generator=g) < 0.5
            h, v = h.to(device), v.to(device)
            x = torch.where(h[:, None, None, None], x.flip(-1), x)
            x = torch.where(v[:, None, None, None], x.flip(-2), x)
            x = (x.float() / 255.0 - 0.5) / 0.5
            loss = F.cross_entropy(model(x), labels[idx.to(device)])
            if reference is not None:
                loss = loss + mu / 2 * sum(((p - r) ** 2).sum() for p, r in zip(params, reference))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()


def _plain_eval(model, images, labels, num_classes):
    import torch

    from fedderm.metrics import classification_metrics

    device = next(model.parameters()).device
    model.eval()
    with torch.no_grad():
        probs = torch.cat(
            [
                torch.softmax(model((images[i : i + 256].to(device).float() / 255.0 - 0.5) / 0.5), 1).cpu()
                for i in range(0, len(images), 256)
            ]
        )
    return classification_metrics(labels.numpy(), probs.numpy(), num_classes)


def plain_worker(tasks, results, s: Settings) -> None:
    """One single-threaded worker: pull (kind, client, round, weights) tasks until None."""
    import torch

    torch.set_num_threads(1)
    import registry
    from fedderm.data import load_client_data
    from fedderm.models import create_model
    from fedderm.train import round_lr

    cfg = registry.load_config(s.overrides())
    data, model = {}, None
    results.put(("ready", os.getpid()))
    while (task := tasks.get()) is not None:
        kind, pid, rnd, weights = task
        if pid not in data:
            data[pid] = load_client_data(cfg, pid, s.clients)
        d = data[pid]
        if model is None:
            model = create_model(cfg.model, d.num_classes, cfg.image_size).to(s.device)
        if kind == "load":
            results.put((kind, pid, None, 0.0))
            continue
        model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=False)
        t = time.perf_counter()
        if kind == "train":
            images, labels = d.tensors("labelled")
            _plain_train(
                model,
                images,
                labels,
                epochs=cfg.local_epochs,
                batch_size=cfg.batch_size,
                lr=round_lr(cfg.lr, rnd, cfg.num_server_rounds, cfg.lr_schedule),
                seed=rnd * 100 + pid,
                weight_decay=cfg.weight_decay,
                mu=cfg.proximal_mu if s.method == "fedprox" else 0.0,
            )
            if s.device == "cuda":
                torch.cuda.synchronize()  # CUDA runs asynchronously: the work ends when the GPU is done
            work = time.perf_counter() - t
            out = {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}
            results.put((kind, pid, (out, len(labels)), work))
        else:
            images, labels = d.tensors(kind)
            metrics = _plain_eval(model, images, labels, d.num_classes)
            results.put((kind, pid, metrics, time.perf_counter() - t))
    peak = torch.cuda.max_memory_allocated() if s.device == "cuda" else 0
    results.put(("peak", os.getpid(), peak, 0.0))


def _average(replies: list[tuple[dict, int]], local_keys: set[str]) -> dict:
    """Weighted mean in torch (integer buffers rounded back to their dtype), leaving out
    ``local_keys`` (FedBN: the BatchNorm entries stay with each client)."""
    import torch

    total = sum(n for _, n in replies)
    out = {}
    for key, first in replies[0][0].items():
        if key in local_keys:
            continue
        acc = sum(torch.from_numpy(w[key]).double() * (n / total) for w, n in replies)
        out[key] = (
            (acc.round() if first.dtype.kind in "iu" else acc).to(torch.from_numpy(first).dtype).numpy()
        )
    return out


def run_plain(s: Settings) -> dict:
    import multiprocessing as mp

    import torch

    import registry
    from fedderm.models import create_model

    t0 = benchlib.launch_time()
    torch.manual_seed(s.seed)
    ctx = mp.get_context("spawn")
    tasks, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=plain_worker, args=(tasks, results, s), daemon=True) for _ in range(WORKERS)]
    for p in procs:
        p.start()
    for _ in procs:
        results.get()
    cfg = registry.load_config(s.overrides())
    model = create_model(cfg.model, 5, cfg.image_size)
    weights = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    if s.method == "fedbn":
        from fedderm.flbt import batchnorm_keys

        bn = set(batchnorm_keys(model))
    else:
        bn = set()
    local: dict[int, dict] = {}  # FedBN: every client's own BatchNorm entries

    def wave(kind: str, rnd: int) -> tuple[list, float]:
        for pid in range(s.clients):
            tasks.put((kind, pid, rnd, {**weights, **local.get(pid, {})}))
        got = [results.get() for _ in range(s.clients)]
        return got, sum(g[3] for g in got)

    wave("load", 0)  # every client's data (fedderm's handshake does the same)
    ev = {"start": time.time()}
    work = {0: wave("val", 0)[1]}
    ev["round-0"] = time.time()
    ends = {}
    for rnd in range(1, s.rounds + 1):
        got, w_train = wave("train", rnd)
        replies = [g[2] for g in got]
        weights = {**weights, **_average(replies, bn)}
        for _, pid, (w, _), _ in got:
            if bn:
                local[pid] = {k: v for k, v in w.items() if k in bn}
        work[rnd] = w_train + wave("val", rnd)[1]
        ends[rnd] = time.time()
    wave("test", s.rounds)
    for _ in procs:
        tasks.put(None)
    gpu_peak = max(results.get()[2] for _ in procs)
    for p in procs:
        p.join()
    return {**_summarise(t0, ev["start"], ev["round-0"], ends, work, time.time()), "gpu_peak": gpu_peak}


# ----------------------------------------------------------------------------- B: fedderm
def run_fedderm(s: Settings) -> dict:
    t0 = benchlib.launch_time()
    Path(s.workdir).mkdir(parents=True, exist_ok=True)
    trace = tempfile.mkdtemp(prefix="trace-", dir=s.workdir)
    os.environ["FEDDERM_BENCH_TRACE"] = trace
    import sim
    import strategies.common as common
    from bench.timed_app import app, read_trace

    ev: dict = {}
    ends: dict[int, float] = {}
    evaluate_round, configure_train, save = (
        common.Tracked.evaluate_round,
        common.Tracked.configure_train,
        common.save_checkpoint,
    )

    def timed_evaluate_round(self, grid, server_round, *args, **kwargs):
        ev.setdefault("start", time.time())
        return evaluate_round(self, grid, server_round, *args, **kwargs)

    def timed_configure_train(self, server_round, *args, **kwargs):
        if server_round == 1:
            ev.setdefault("round-0", time.time())
        return configure_train(self, server_round, *args, **kwargs)

    def timed_save(run_dir, stage, server_round, *args, **kwargs):
        out = save(run_dir, stage, server_round, *args, **kwargs)
        ends[server_round] = time.time()
        return out

    common.Tracked.evaluate_round = timed_evaluate_round
    common.Tracked.configure_train = timed_configure_train
    common.save_checkpoint = timed_save
    sim.simulate(s.overrides(), num_supernodes=s.clients, gpus_per_client=s.gpu_share(), client_app=app)
    t_end = time.time()
    entries = read_trace(trace)
    bounds = [ev["start"], ev["round-0"]] + [ends[r] for r in range(1, s.rounds + 1)]
    work = {}
    for rnd in range(0, s.rounds + 1):
        lo, hi = bounds[rnd], bounds[rnd + 1]
        work[rnd] = sum(e["work"] for e in entries if lo <= e["t0"] < hi)
    result = _summarise(t0, ev["start"], ev["round-0"], ends, work, t_end)
    result["threads"] = sorted({e.get("threads") for e in entries})
    result["gpu_peak"] = max((e.get("gpu_peak", 0) for e in entries), default=0)
    result["workers"] = len({e["pid"] for e in entries})
    return result


def _summarise(t0, start, round0_end, ends, work, t_end) -> dict:
    rounds = sorted(ends)
    times, prev = {}, round0_end
    for r in rounds:
        times[r] = ends[r] - prev
        prev = ends[r]
    per_round = benchlib.median(times.values())
    work_round = benchlib.median(work[r] for r in rounds)
    return {
        "startup": start - t0,
        "round0": round0_end - start,
        "round_times": times,
        "per_round": per_round,
        "work": work_round,
        "outside": benchlib.median(times[r] - work[r] / WORKERS for r in rounds),
        "finish": t_end - ends[rounds[-1]],
    }


# ----------------------------------------------------------------------------- driver
def child(which: str, s: Settings) -> None:
    result = run_plain(s) if which == "A" else run_fedderm(s)
    benchlib.emit(result)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="fedavg", choices=PLAIN_METHODS)
    ap.add_argument("--model", default=None)
    ap.add_argument("--image-size", type=int, default=None)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--per-class", type=int, default=None, help="synthetic images per class per client")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None, help="runs of A and of B (alternating)")
    ap.add_argument("--quick", action="store_true", help="tiny-cnn, 32 px, 2 rounds, 2 repeats")
    ap.add_argument("--workdir", default=None, help="cache and run folders (default: a temp folder)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--child", choices=("A", "B"), help=argparse.SUPPRESS)
    ap.add_argument("--settings", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, Settings(**json.loads(args.settings)))
        return 0

    quick = {"model": "tiny-cnn", "image_size": 32, "per_class": 20, "rounds": 2} if args.quick else {}
    s = Settings(method=args.method, clients=args.clients, device=args.device, **quick)
    for key in ("model", "image_size", "per_class", "rounds"):
        if getattr(args, key) is not None:
            setattr(s, key, getattr(args, key))
    repeats = args.repeats or (2 if args.quick else 3)
    s.workdir = args.workdir or tempfile.mkdtemp(prefix="fedderm-overhead-")
    info = benchlib.print_machine()
    print(
        f"settings: {s.method} · {s.model} · {s.image_size} px · {s.clients} clients · "
        f"{s.per_class} images/class/client · {s.epochs} local epoch · {s.rounds} rounds · {repeats} x (A, B)"
        f" · device {s.device}"
        + (f", {WORKERS} clients at a time, {s.gpu_share()} GPU each" if s.gpu_share() else "")
    )
    # generate the data once, outside the timings
    benchlib.run_child(
        [
            "-m",
            "bench.overhead",
            "--child",
            "A",
            "--settings",
            json.dumps({**dataclasses.asdict(s), "rounds": 1}),
        ]
    )
    runs: dict[str, list] = {"A": [], "B": []}
    for i in range(repeats):
        for which in ("A", "B"):
            result, peak, wall = benchlib.run_child(
                ["-m", "bench.overhead", "--child", which, "--settings", json.dumps(dataclasses.asdict(s))]
            )
            result.update(peak=peak, wall=wall)
            runs[which].append(result)
            print(
                f"  {which}{i + 1}: start-up {result['startup']:.2f} s · round 0 {result['round0']:.2f} s · "
                f"per round {result['per_round']:.3f} s (work {result['work']:.3f} s, outside "
                f"{result['outside']:.3f} s) · peak {benchlib.mib(peak):.0f} MiB · "
                f"peak GPU memory per client process {result.get('gpu_peak', 0) / 2**30:.2f} GiB · load "
                f"{os.getloadavg()[0]:.2f}",
                flush=True,
            )
    med = {
        w: {
            k: benchlib.median(r[k] for r in rs)
            for k in ("startup", "round0", "per_round", "work", "outside", "peak", "finish", "gpu_peak")
        }
        for w, rs in runs.items()
    }
    a, b = med["A"], med["B"]
    rows = [
        [
            name,
            f"{m['startup']:.2f}",
            f"{m['round0']:.2f}",
            f"{m['per_round']:.3f}",
            f"{m['work']:.3f}",
            f"{m['outside']:.3f}",
            f"{benchlib.mib(m['peak']):.0f}",
            f"{m['gpu_peak'] / 2**30:.2f}",
        ]
        for name, m in (("A plain PyTorch", a), (f"B fedderm {s.method}", b))
    ]
    rows.append(
        [
            "B / A",
            f"{b['startup'] / a['startup']:.2f}",
            "",
            f"{b['per_round'] / a['per_round']:.3f}",
            f"{b['work'] / a['work']:.3f}",
            f"+{b['per_round'] - a['per_round']:.3f} s",
            f"{b['peak'] / a['peak']:.2f}",
            "",
        ]
    )
    print()
    print(
        benchlib.table(
            rows,
            [
                "",
                "start-up s",
                "round 0 s",
                "per round s",
                "work s",
                "outside s",
                "peak MiB",
                "GPU peak/client GiB",
            ],
        )
    )
    print(
        f"\nper-round ratio B/A {b['per_round'] / a['per_round']:.3f} · fedderm per round outside training "
        f"{b['outside']:.3f} s (plain {a['outside']:.3f} s) · start-up {b['startup']:.1f} s vs "
        f"{a['startup']:.1f} s · memory {b['peak'] / a['peak']:.2f}x · load average at start "
        f"{' '.join(map(str, info['loadavg']))}, now {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
