"""Mixed precision, GPU shares and Ray clusters (docs/gpu.md), checked on CPU.

The checks that need CUDA are those marked ``gpu``; these run everywhere.
"""

import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import sim
from fedderm.config import ConfigError
from fedderm.data.synthetic import generate
from fedderm.models import create_model
from fedderm.train import Amp, GpuPeak, evaluate, predict, train_supervised, use_precision

ROOT = Path(__file__).resolve().parent.parent


def _split():
    pool = generate(1, 40, 16, 0)
    perm = torch.randperm(len(pool.labels), generator=torch.Generator().manual_seed(0))
    cut = int(0.75 * len(perm))
    x, y = pool.images, torch.as_tensor(pool.labels)
    return x[perm[:cut]], y[perm[:cut]], x[perm[cut:]], y[perm[cut:]]


def _fit(precision, x, y, device="cpu", epochs=6):
    """tiny-cnn trained on the :func:`_split` data (also tests/test_gpu_device.py, on the GPU)."""
    torch.manual_seed(0)
    model = create_model("tiny-cnn", 5, 16)
    kw = dict(epochs=epochs, batch_size=16, lr=3e-3, optimizer="adam", seed=0, device=device)
    with use_precision(precision):  # how the ClientApp sets it for every loop of a message
        train_supervised(model, x, y, **kw)
    return model


def test_bf16_learns_on_cpu_like_fp32():
    """Bf16 autocast on CPU learns, in the same accuracy band as fp32; the
    weights stay float32 (what is aggregated and sent) and bf16 really changed the arithmetic."""
    x, y, xt, yt = _split()
    fp32, bf16 = _fit("fp32", x, y), _fit("bf16", x, y)
    acc = {
        name: evaluate(m, xt, yt, 5, precision=name)["balanced_accuracy"]
        for name, m in (("fp32", fp32), ("bf16", bf16))
    }
    assert acc["fp32"] > 0.8 and acc["bf16"] > 0.8, acc  # chance is 0.2 (5 classes)
    assert abs(acc["fp32"] - acc["bf16"]) <= 0.1, acc
    assert all(p.dtype == torch.float32 for p in bf16.parameters())
    assert all(v.dtype in (torch.float32, torch.int64) for v in bf16.state_dict().values())
    assert any(not torch.equal(a, b) for a, b in zip(fp32.parameters(), bf16.parameters()))
    probs = predict(bf16, xt[:8], precision="bf16")
    assert probs.dtype == torch.float32 and torch.allclose(probs.sum(1), torch.ones(8), atol=1e-3)


def test_explicit_precision_equals_the_ambient_one():
    x, y, _, _ = _split()
    torch.manual_seed(0)
    explicit = create_model("tiny-cnn", 5, 16)
    train_supervised(explicit, x[:32], y[:32], epochs=1, batch_size=16, lr=0.01, seed=1, precision="bf16")
    torch.manual_seed(0)
    ambient = create_model("tiny-cnn", 5, 16)
    with use_precision("bf16"):
        train_supervised(ambient, x[:32], y[:32], epochs=1, batch_size=16, lr=0.01, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(explicit.parameters(), ambient.parameters()))


def test_fp16_on_cpu_is_an_error_naming_the_key():
    with pytest.raises(ValueError, match="'precision' is \"fp16\", which needs a CUDA device"):
        Amp("cpu", "fp16")
    with pytest.raises(ValueError, match="'precision' must be one of"):
        Amp("cpu", "fp8")
    no_cuda = SimpleNamespace(is_available=lambda: False)
    with pytest.raises(ConfigError, match="'precision' is \"fp16\""):
        sim.check_gpus({"precision": "fp16", "device": "auto"}, 0.0, cuda=no_cuda)


def _fake_cuda(total_gib: float, count: int = 1):
    props = SimpleNamespace(total_memory=int(total_gib * 2**30), name="Fake GPU")
    return SimpleNamespace(
        is_available=lambda: True, device_count=lambda: count, get_device_properties=lambda i: props
    )


def test_gpus_per_client_needs_cuda():
    no_cuda = SimpleNamespace(is_available=lambda: False)
    cfg = {"precision": "fp32", "device": "auto", "model": "tiny-cnn", "optimizer": "adam"}
    with pytest.raises(ConfigError, match="--gpus-per-client 0.25 .* CUDA is not available"):
        sim.check_gpus(cfg, 0.25, cuda=no_cuda)
    sim.check_gpus(cfg, 0.0, cuda=no_cuda)  # CPU only: fine
    sim.check_gpus(cfg, 0.25, ray_address="127.0.0.1:6379", cuda=no_cuda)  # the cluster's GPUs


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_gpus_per_client_without_cuda_is_one_line_before_ray(tmp_path):
    """On CPU: the command fails at once with one line, exit 2."""
    out = subprocess.run(
        [sys.executable, "sim.py", "--gpus-per-client", "0.25", "--run-config", f'output-dir="{tmp_path}"'],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert lines == [
        "error: --gpus-per-client 0.25 asks for a GPU share per client, but CUDA is not available on this "
        "machine (torch.cuda.is_available() is False): leave it at 0 to run on CPU"
    ]
    assert not list(tmp_path.iterdir())  # no run folder: stopped before Ray and the ServerApp


def test_gpu_memory_share_check():
    """resnet18 (11.2 M parameters) with Adam needs >= 16 B/parameter = 0.17 GiB per client."""
    cfg = {"precision": "fp32", "device": "auto", "model": "resnet18", "optimizer": "adam", "image-size": 32}
    params = sum(p.numel() for p in create_model("resnet18", 2, 32).parameters())
    assert sim.static_training_bytes(cfg) == 16 * params
    assert sim.static_training_bytes({**cfg, "optimizer": "sgd"}) == 12 * params
    sim.check_gpus(cfg, 0.25, cuda=_fake_cuda(1.0))  # 0.25 GiB each: fits
    with pytest.raises(ConfigError, match=r"each client gets about 0\.12 GiB of the 0\.5 GiB of Fake GPU"):
        sim.check_gpus(cfg, 0.25, cuda=_fake_cuda(0.5))
    with pytest.raises(ConfigError, match="more than the 1 GPU"):
        sim.check_gpus(cfg, 2, cuda=_fake_cuda(80))
    sim.check_gpus({**cfg, "device": "cpu"}, 0.0, cuda=_fake_cuda(0.01))  # device=cpu: no GPU check


def test_backend_config_local_or_cluster():
    local = sim.backend_config(1, 0.25)
    assert local["client_resources"] == {"num_cpus": 1, "num_gpus": 0.25}
    assert local["init_args"]["num_cpus"] >= 1 and "address" not in local["init_args"]
    cluster = sim.backend_config(1, 0.0, "127.0.0.1:6379", verbose=True)
    # ray.init refuses num_cpus when it joins a cluster: the nodes bring their own
    assert cluster["init_args"] == {"address": "127.0.0.1:6379"}


def test_the_other_local_loops_run_in_bf16():
    """FL-BT's loop, the MSG-GAN and the SSL-FL-BT multitask loop take the ambient precision too:
    finite losses, float32 weights, and different weights than in fp32."""
    from fedderm.flbt import build_projected_net, frozen_copy, train_flbt
    from fedderm.msggan import train_msggan
    from fedderm.ssl_pseudo import pretrain_multitask

    x, y, _, _ = _split()
    x, y = x[:16], y[:16] % 3
    out = {}
    for precision in ("fp32", "bf16"):
        with use_precision(precision):
            torch.manual_seed(0)
            net = build_projected_net("tiny-cnn", 3, 16, proj_dim=8)
            flbt = train_flbt(
                net, frozen_copy(net), x, y, mu=1.0, lambd=0.005, epochs=1, batch_size=8, lr=0.01
            )
            gan, gan_m = train_msggan(x[:8], steps=2, batch_size=4, latent_dim=8, width=8)
            pretrain_multitask(
                x[:8], torch.arange(8) % 2, model="tiny-cnn", num_centres=2, epochs=1, batch_size=4
            )
        assert math.isfinite(flbt["train_loss"]) and math.isfinite(gan_m["gan_d_loss"])
        assert all(p.dtype == torch.float32 for p in [*net.parameters(), *gan.parameters()])
        out[precision] = [p.detach().clone() for p in net.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(out["fp32"], out["bf16"]))


def test_channels_last_runs_and_stays_close(monkeypatch, tmp_path):
    """The CUDA path's channels_last ResNets (fedderm.train.to_channels_last), exercised on CPU by
    allowing it there: a whole FedAvg run (weights sent, aggregated, saved from NHWC tensors) gives
    the NCHW run's losses within a relative 5e-3 (CPU NHWC kernels sum in another order)."""
    import json

    import fedderm.train as train
    import registry
    from bench.loop_grid import run_app

    base = registry.smallest_run("fedavg", **{"cache-dir": str(tmp_path / "c"), "num-server-rounds": 2})
    nchw = run_app({**base, "output-dir": str(tmp_path / "a")})
    converted = []

    def on_cpu_too(model, device):
        converted.append(any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules()))
        return converted[-1]

    monkeypatch.setattr(train, "wants_channels_last", on_cpu_too)
    nhwc = run_app({**base, "output-dir": str(tmp_path / "b")})
    assert converted and all(converted)
    a, b = (json.loads((d / "summary.json").read_text())["rounds"] for d in (nchw, nhwc))
    losses = [(x["metrics"]["loss"], y["metrics"]["loss"]) for x, y in zip(a, b)]
    assert len(losses) == 3 and all(math.isclose(u, v, rel_tol=5e-3) for u, v in losses), losses
    model = torch.load(nhwc / "model.pt", weights_only=True)
    conv = next(v for k, v in model.items() if v.dim() == 4)
    assert torch.isfinite(conv).all()


def test_wants_channels_last_only_for_batchnorm_cnns_on_cuda():
    from fedderm.train import wants_channels_last

    resnet, vit = create_model("resnet18", 2, 32), create_model("vit-micro", 2, 16)
    assert not wants_channels_last(resnet, "cpu")
    assert wants_channels_last(resnet, "cuda")  # no CUDA needed: it only looks at the device type
    assert not wants_channels_last(vit, "cuda")


def test_gpu_peak_reads_cuda_and_stays_none_on_cpu():
    calls = []
    fake = SimpleNamespace(
        reset_peak_memory_stats=lambda d: calls.append(("reset", str(d))),
        max_memory_allocated=lambda d: 3 * 2**20 + 2**19,
    )
    with GpuPeak("cuda:0", cuda=fake) as peak:
        assert calls == [("reset", "cuda:0")]  # the peak of this message only
    assert peak.mib == 3.5
    with GpuPeak("cpu", cuda=fake) as cpu:
        pass
    assert cpu.mib is None and len(calls) == 1


class _Peak100:
    """As GpuPeak on a GPU where every message peaked at 100 MiB."""

    def __init__(self, device):
        self.mib = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.mib = 100.0


def test_clients_gpu_peaks_reach_summary_not_train_metrics(tmp_path, monkeypatch):
    """Peak memory per client: every train reply carries its client's peak CUDA memory,
    which the server keeps per client and round (summary.json ``gpu_peak_mib``), out of the metrics."""
    from flwr.app import ArrayRecord

    import client_app
    import registry
    from fedderm.results import RunRecorder
    from strategies import fedavg
    from strategies.common import run_federated
    from tests.fake_grid import FakeGrid

    rc = {
        "method": "fedavg",
        "dataset": "synthetic",
        "model": "tiny-cnn",
        "image-size": 16,
        "num-server-rounds": 2,
        "local-epochs": 1,
        "tensorboard": False,
    }
    cfg = registry.load_config(rc)
    rec = RunRecorder(tmp_path / "run", "fedavg", cfg.to_flat())
    strategy = fedavg.build_strategy(cfg, rec)
    torch.manual_seed(0)
    grid = FakeGrid(rc, 2)
    monkeypatch.setattr(client_app, "GpuPeak", _Peak100)
    run_federated(strategy, grid, ArrayRecord(create_model("tiny-cnn", 5, 16).state_dict()))
    log = rec.extra["gpu_peak_mib"]
    assert [(e["stage"], e["round"]) for e in log] == [(strategy.stage, 1), (strategy.stage, 2)]
    assert all(sorted(e["per_client"]) == ["0", "1"] for e in log)
    assert all(v == 100.0 for e in log for v in e["per_client"].values())
    assert all("gpu-peak-mib" not in m for m in strategy.train_per_client.values())


@pytest.mark.parametrize("flag", [False, True])
def test_compile_key_compiles_each_client_model_once(flag):
    """``compile = true``: a client's model is wrapped by ``torch.compile`` (``nn.Module.compile``)
    when it is built, once per process; the same object comes back for the next message."""
    import registry
    from clients.common import ClientSession

    cfg = registry.load_config({"method": "fedavg", "model": "tiny-cnn", "image-size": 16, "compile": flag})
    s = ClientSession(cfg, SimpleNamespace(num_classes=5), torch.device("cpu"), 0, None)
    m = s.model(key="probe", factory=lambda: create_model("tiny-cnn", 5, 16))
    assert (m._compiled_call_impl is not None) is flag
    assert s.model(key="probe") is m
    assert set(m.state_dict()) == set(create_model("tiny-cnn", 5, 16).state_dict())  # same keys on the wire


def test_a_resumed_run_keeps_the_gpu_peaks_of_its_earlier_rounds(in_process, tmp_path, monkeypatch):
    """The peaks are results like the metrics: a run killed after round 1's checkpoint and resumed
    has round 1's peaks and round 2's in summary.json, not round 2's alone."""
    import json

    import client_app
    import strategies.common as common

    class Killed(Exception):
        pass

    save = common.save_checkpoint

    def save_then_die(run_dir, stage, server_round, payload, keep=3):
        path = save(run_dir, stage, server_round, payload, keep)
        if server_round == 1:
            raise Killed
        return path

    monkeypatch.setattr(client_app, "GpuPeak", _Peak100)
    monkeypatch.setattr(common, "save_checkpoint", save_then_die)
    rc = {
        "model": "tiny-cnn",
        "image-size": 16,
        "synthetic-per-class": 8,
        "num-server-rounds": 2,
        "local-epochs": 1,
        "tensorboard": False,
        "output-dir": str(tmp_path),
        "cache-dir": str(tmp_path / "cache"),
        "run-name": "cut",
    }
    with pytest.raises(Killed):
        sim.simulate(rc)
    monkeypatch.setattr(common, "save_checkpoint", save)
    run_dir = sim.simulate({"resume": str(tmp_path / "cut")})
    log = json.loads((run_dir / "summary.json").read_text())["gpu_peak_mib"]
    assert [e["round"] for e in log] == [1, 2]
    assert all(e["per_client"] == {"0": 100.0, "1": 100.0} for e in log)
