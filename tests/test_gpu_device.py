"""On a real device: every method on CUDA against the same run on CPU, fp16/bf16 learning
on CUDA, and what is bit-exact there (docs/gpu.md, "Tests marked gpu").

Marked ``gpu``: skipped with a reason where CUDA is absent.  ``FEDDERM_TEST_GPU_DEVICE`` names the
device of the "GPU side" (default ``cuda``); ``FEDDERM_TEST_GPU_DEVICE=cpu`` runs the whole file
CPU against CPU (the comparisons are then exact), which is how these tests are debugged on a
machine without a GPU.  ``FEDDERM_GPU_REPORT`` (a file) receives one line per finding of the
determinism test (what was bit-exact on this GPU).
"""

from __future__ import annotations

import json
import math
import os
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from test_gpu import _fit, _split  # the CPU test's data and model, trained here on the GPU

import registry
from fedderm.train import evaluate, train_epochs

# deterministic cuBLAS (torch.use_deterministic_algorithms) needs this before the first cuBLAS handle
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
GPU = os.environ.get("FEDDERM_TEST_GPU_DEVICE", "cuda")
ON_CUDA = torch.device(GPU).type == "cuda"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        ON_CUDA and not torch.cuda.is_available(),
        reason="CUDA is not available (FEDDERM_TEST_GPU_DEVICE=cpu runs these checks CPU against CPU)",
    ),
]

#: relative tolerance of losses and weights, CUDA against CPU.  With TF32 off (fixture below) both
#: run float32; only the summation order of the kernels differs (~1e-6 relative per operation),
#: which one round of a few steps amplifies by at most a few orders of magnitude.  A wrong device
#: path (other RNG draws, a missed cast, data on the wrong device) moves losses by 1e-2 or more.
RTOL = 5e-3
#: The final weights are compared as one vector (relative L2 over the whole model), not tensor by
#: tensor: Adam-type updates move a tensor whose gradients are near zero (a zero-initialised bias)
#: by about ±lr whatever the gradient's size, so float noise shows as a large share of such a small
#: tensor's norm (seen on an H100: 2.9 % for FedMAE's qkv bias, 66 % for a BatchNorm bias of
#: SSL-FL-BT whose norm is 0.013).  The worst tensor is written to the report.
#:
#: SSL-FL-BT pre-trains on its MSG-GAN's images rounded to uint8 (``fedderm.msggan.generate_images``):
#: float noise in the generator flips some pixels by one grey level, a discrete change of the
#: training data.  Measured on CPU: nudging every generator weight by a relative 1e-6 before the
#: images are drawn moves the final weights of its smallest run by 8.4e-3 (relative L2), while
#: changing torch's thread count moves them by 4.7e-7; on an H100, CUDA against CPU, 2.1e-2 with
#: every recorded loss (GAN losses included) within RTOL.  Its weights get a wider bound.
WEIGHT_RTOL = {"ssl-flbt": 5e-2}


@contextmanager
def _no_tf32():
    """float32 matmuls and convolutions in full float32 on CUDA (cuDNN allows TF32 by default)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _losses(node, path=()):
    """Every (path, value) of a number stored under a key holding 'loss' in a summary."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _losses(v, (*path, str(k)))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _losses(v, (*path, str(i)))
    elif isinstance(node, float) and any("loss" in p for p in path):
        yield "/".join(path), node


def _numbers(node):
    if isinstance(node, dict):
        for v in node.values():
            yield from _numbers(v)
    elif isinstance(node, list):
        for v in node:
            yield from _numbers(v)
    elif isinstance(node, float):
        yield node


def _run(method: str, device: str, tmp: Path) -> Path:
    from bench.loop_grid import run_app, tiny_text_model

    extra = {}
    if method == "sift":  # the text model runs once, on the server's CPU: a tiny local one will do
        folder = tmp / "text-model"
        extra["sift.text-model"] = str(folder if folder.exists() else tiny_text_model(folder))
    overrides = registry.smallest_run(
        method,
        **{"device": device, "output-dir": str(tmp / device), "cache-dir": str(tmp / "cache"), **extra},
    )
    return run_app(overrides, num_clients=2)


@pytest.mark.parametrize("method", sorted(registry.METHODS))
def test_method_on_gpu_is_close_to_cpu(method, tmp_path):
    """Each method's smallest run (tiny model, 2 clients, 16 px) on the GPU side gives
    finite numbers, losses and final weights within RTOL of the same run on CPU."""
    pytest.importorskip("flwr")
    with _no_tf32():
        cpu_dir = _run(method, "cpu", tmp_path)
        if ON_CUDA:
            torch.cuda.reset_peak_memory_stats()
        gpu_dir = _run(method, GPU, tmp_path)
        if ON_CUDA:
            assert torch.cuda.max_memory_allocated() > 0, "nothing was allocated on CUDA"
    cpu = json.loads((cpu_dir / "summary.json").read_text())
    gpu = json.loads((gpu_dir / "summary.json").read_text())
    assert cpu["status"] == gpu["status"] == "done", (cpu["error"], gpu["error"])
    assert all(math.isfinite(v) for v in _numbers(gpu["final"])), gpu["final"]
    pairs = dict(_losses(cpu["rounds"])), dict(_losses(gpu["rounds"]))
    assert pairs[0] and pairs[0].keys() == pairs[1].keys()
    for key, want in pairs[0].items():
        got = pairs[1][key]
        assert math.isfinite(got) and math.isclose(got, want, rel_tol=RTOL, abs_tol=1e-5), (key, want, got)
    if (cpu_dir / "model.pt").exists():
        a = torch.load(cpu_dir / "model.pt", map_location="cpu", weights_only=True)
        b = torch.load(gpu_dir / "model.pt", map_location="cpu", weights_only=True)
        assert a.keys() == b.keys()
        diff = total = 0.0
        worst = ("", 0.0)
        for name, w in a.items():
            if not w.is_floating_point():
                assert torch.equal(w, b[name]), name
                continue
            assert torch.isfinite(b[name]).all(), name
            d, n = float((b[name].double() - w.double()).norm()), float(w.double().norm())
            worst = max(worst, (name, d / (n + 1e-6)), key=lambda t: t[1])
            diff, total = diff + d**2, total + n**2
        whole = math.sqrt(diff / total)
        _report(
            f"{method}: final weights {GPU} vs cpu, relative L2 {whole:.2e} (worst tensor {worst[0]} {worst[1]:.2e})"
        )
        assert whole <= WEIGHT_RTOL.get(method, RTOL), ("whole model", whole, "worst tensor", worst)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_mixed_precision_learns_on_the_gpu(precision):
    """fp16 (autocast + GradScaler) and bf16 learn on the GPU as fp32 does (the CPU test's band:
    balanced accuracy > 0.8, chance 0.2); the weights stay float32."""
    if precision == "fp16" and not ON_CUDA:
        pytest.skip("fp16 needs CUDA (FEDDERM_TEST_GPU_DEVICE is not a CUDA device)")
    x, y, xt, yt = _split()
    model = _fit(precision, x, y, GPU)
    acc = evaluate(model, xt, yt, 5, device=GPU, precision=precision)["balanced_accuracy"]
    assert acc > 0.8, acc
    assert all(
        p.dtype == torch.float32 and p.device.type == torch.device(GPU).type for p in model.parameters()
    )
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _report(line: str) -> None:
    path = os.environ.get("FEDDERM_GPU_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def _twice(fn):
    first, second = fn(), fn()
    return all(torch.equal(a, b) for a, b in zip(first, second)), first, second


def _train_cnn():
    x, y, _, _ = _split()
    return [p.detach().cpu() for p in _fit("fp32", x, y, GPU, epochs=2).parameters()]


def _train_vit():
    """A few MAE steps of a ViT (gather/scatter of the masked tokens, attention, LayerNorm)."""
    from fedderm.mae import build_mae

    cfg = registry.load_config(
        registry.smallest_run(
            "fedmae",
            **{
                "model": "vit-micro",
                "fedmae.decoder-embed-dim": 32,
                "fedmae.decoder-depth": 1,
                "fedmae.decoder-num-heads": 2,
            },
        )
    )
    x, y, _, _ = _split()
    torch.manual_seed(0)
    mae = build_mae(cfg)

    def loss_fn(m, xb, yb, g):
        from fedderm.train import to_input

        return m(to_input(xb, torch.device(GPU)), 0.75, g)[0]

    train_epochs(mae, x, y, loss_fn, epochs=2, batch_size=8, lr=1e-3, optimizer="adamw", device=GPU)
    return [p.detach().cpu() for p in mae.parameters()]


def test_what_is_bit_exact_on_the_gpu():
    """The same seed twice on the GPU side.  With ``torch.use_deterministic_algorithms(True)`` and
    ``cudnn.deterministic`` (docs/gpu.md) the weights must be bit-identical; with the default flags
    they must be close, and whether they are bit-identical is what this GPU decides (written to
    FEDDERM_GPU_REPORT)."""
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    found = {}
    try:
        for name, fn in (("tiny-cnn supervised", _train_cnn), ("vit-micro MAE", _train_vit)):
            torch.use_deterministic_algorithms(False)
            torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = False, False
            exact, a, b = _twice(fn)
            found[(name, "default")] = exact
            for p, q in zip(a, b):
                assert torch.allclose(p, q, rtol=1e-3, atol=1e-5), name
            torch.use_deterministic_algorithms(True, warn_only=True)
            torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
            exact, _, _ = _twice(fn)
            found[(name, "deterministic")] = exact
    finally:
        torch.use_deterministic_algorithms(saved[0])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[1], saved[2]
    device = torch.cuda.get_device_name() if ON_CUDA else GPU
    for (name, flags), exact in found.items():
        _report(f"determinism on {device}: {name}, {flags} flags: same seed twice bit-exact = {exact}")
    assert found[("tiny-cnn supervised", "deterministic")], found
    assert found[("vit-micro MAE", "deterministic")], found
