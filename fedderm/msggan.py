"""A small multi-scale gradient GAN (MSG-GAN, Karnewar & Wang 2020), used by 004 §III-A to make
each centre's pseudo images.

The generator emits an image at every scale (s0, 2·s0, …, S); the discriminator reads the real or
fake image of every scale, concatenated to its own features at that scale ("simple" combine φ),
so gradients reach every generator scale directly.  Loss: relativistic average hinge (MSG-GAN's
default); Adam with lr 0.003 (004 §IV-C) and betas (0, 0.99).  Sized to train a few hundred steps
at 32 px on a CPU in about a minute (``width``); a GPU run can afford the paper's scale.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .augment import Augment
from .train import Amp, random_flips, to_input

__all__ = [
    "scales_for",
    "snapshot_steps",
    "Generator",
    "Discriminator",
    "train_msggan",
    "generate_images",
    "count_parameters",
]


def scales_for(image_size: int) -> list[int]:
    """Scales s0, 2·s0, …, S with 4 <= s0 < 8 where possible (S = 32 -> 4, 8, 16, 32; 28 -> 7, 14, 28)."""
    k = 0
    while image_size % (2 ** (k + 1)) == 0 and image_size // 2 ** (k + 1) >= 4:
        k += 1
    if k == 0:
        raise ValueError(
            f"image-size {image_size} cannot be built by doubling from a size >= 4; "
            "use an even size such as 32 or 64 for the GAN stage"
        )
    s0 = image_size // 2**k
    return [s0 * 2**i for i in range(k + 1)]


def _channels(width: int, n: int) -> list[int]:
    return [max(width // 2**i, 16) for i in range(n)]


class EqConv2d(nn.Conv2d):
    """Conv with the equalised learning rate of ProGAN/MSG-GAN: N(0, 1) weights scaled by the He
    constant at run time, so that Adam's lr 0.003 suits every layer."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        nn.init.normal_(self.weight)
        nn.init.zeros_(self.bias)
        self.scale = math.sqrt(2.0 / self.weight[0].numel())

    def forward(self, x):
        return self._conv_forward(x, self.weight * self.scale, self.bias)


class EqLinear(nn.Linear):
    """Linear layer with the equalised learning rate (see :class:`EqConv2d`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        nn.init.normal_(self.weight)
        nn.init.zeros_(self.bias)
        self.scale = math.sqrt(2.0 / self.in_features)

    def forward(self, x):
        return F.linear(x, self.weight * self.scale, self.bias)


class PixelNorm(nn.Module):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(dim=1, keepdim=True) + 1e-8)


class Generator(nn.Module):
    """z -> images at every scale (list, coarse to fine), values in [-1, 1]."""

    def __init__(self, image_size: int, latent_dim: int = 64, width: int = 64):
        super().__init__()
        self.scales = scales_for(image_size)
        ch = _channels(width, len(self.scales))
        self.latent_dim, self.s0 = latent_dim, self.scales[0]
        self.stem = EqLinear(latent_dim, ch[0] * self.s0**2)
        self.blocks = nn.ModuleList()
        self.to_rgb = nn.ModuleList()
        for i, c in enumerate(ch):
            cin = ch[0] if i == 0 else ch[i - 1]
            self.blocks.append(
                nn.Sequential(
                    EqConv2d(cin, c, 3, padding=1),
                    nn.LeakyReLU(0.2),
                    PixelNorm(),
                    EqConv2d(c, c, 3, padding=1),
                    nn.LeakyReLU(0.2),
                    PixelNorm(),
                )
            )
            self.to_rgb.append(EqConv2d(c, 3, 1))

    def forward(self, z: torch.Tensor) -> list[torch.Tensor]:
        x = F.leaky_relu(self.stem(PixelNorm()(z)), 0.2).view(len(z), -1, self.s0, self.s0)
        outs = []
        for i, (block, rgb) in enumerate(zip(self.blocks, self.to_rgb)):
            if i > 0:
                x = F.interpolate(x, scale_factor=2, mode="nearest")
            x = block(x)
            outs.append(torch.tanh(rgb(x)))
        return outs


class Discriminator(nn.Module):
    """Images at every scale (coarse to fine) -> one realness score per sample."""

    def __init__(self, image_size: int, width: int = 64):
        super().__init__()
        self.scales = scales_for(image_size)
        ch = _channels(width, len(self.scales))[::-1]  # fine -> coarse
        self.from_rgb = EqConv2d(3, ch[0], 1)
        self.blocks = nn.ModuleList()
        for i in range(len(ch) - 1):
            cin = ch[i] + (3 if i > 0 else 0)
            self.blocks.append(
                nn.Sequential(
                    EqConv2d(cin, ch[i], 3, padding=1),
                    nn.LeakyReLU(0.2),
                    EqConv2d(ch[i], ch[i + 1], 3, padding=1),
                    nn.LeakyReLU(0.2),
                    nn.AvgPool2d(2),
                )
            )
        s0, c = self.scales[0], ch[-1]
        self.final = nn.Sequential(
            EqConv2d(c + 3 + 1, c, 3, padding=1), nn.LeakyReLU(0.2), nn.Flatten(), EqLinear(c * s0 * s0, 1)
        )

    def forward(self, images: list[torch.Tensor]) -> torch.Tensor:
        fine_to_coarse = images[::-1]
        x = F.leaky_relu(self.from_rgb(fine_to_coarse[0]), 0.2)
        for i, block in enumerate(self.blocks):
            if i > 0:
                x = torch.cat([x, fine_to_coarse[i]], dim=1)
            x = block(x)
        x = torch.cat([x, fine_to_coarse[-1]], dim=1)
        std = x.std(dim=0, unbiased=False).mean().expand(len(x), 1, *x.shape[2:])  # minibatch std-dev
        return self.final(torch.cat([x, std], dim=1)).view(-1)


def _pyramid(x: torch.Tensor, scales: list[int]) -> list[torch.Tensor]:
    return [F.adaptive_avg_pool2d(x, s) if s != x.shape[-1] else x for s in scales]


def snapshot_steps(steps: int, count: int) -> list[int]:
    """``count`` evenly spaced steps ending at ``steps`` (e.g. 300, 4 -> [75, 150, 225, 300])."""
    return sorted({max(1, round(steps * (i + 1) / count)) for i in range(count)})


def train_msggan(
    images: torch.Tensor,
    *,
    steps: int = 300,
    batch_size: int = 32,
    latent_dim: int = 64,
    width: int = 64,
    lr: float = 0.003,
    seed: int = 0,
    device: torch.device | str = "cpu",
    snapshot_at: Sequence[int] = (),
    snapshots: list | None = None,
    augment: Augment = random_flips,
    precision: str | None = None,
) -> tuple[Generator, dict[str, float]]:
    """Train an MSG-GAN on uint8 images (N, 3, S, S) for ``steps`` D+G updates.

    Returns the generator (eval mode) and ``{"gan_d_loss", "gan_g_loss", "gan_seconds", "gan_cpu_seconds"}`` (wall and CPU time).
    After every step in ``snapshot_at`` (1-based) ``(step, generator state dict copy)`` is appended to
    ``snapshots`` (for choosing a generator by FID, :func:`fedderm.fid.select_pseudo_images`).
    The real images of each step are ``augment``-ed (the run's pre-training policy).
    """
    if len(images) < 2:
        raise ValueError(f"the GAN stage needs at least 2 images, the centre has {len(images)}")
    device = torch.device(device)
    gen_seed = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    size = images.shape[-1]
    G, D = Generator(size, latent_dim, width).to(device), Discriminator(size, width).to(device)
    opt_g = torch.optim.Adam(G.parameters(), lr=lr, betas=(0.0, 0.99))
    opt_d = torch.optim.Adam(D.parameters(), lr=lr, betas=(0.0, 0.99))
    scales = G.scales
    amp = Amp(device, precision)  # the run's precision (fedderm.train.use_precision); one scaler, D and G
    start, cpu_start = time.monotonic(), time.process_time()
    d_loss = g_loss = torch.zeros(())
    wanted = set(snapshot_at)
    for step in range(1, steps + 1):
        idx = torch.randint(0, len(images), (min(batch_size, len(images)),), generator=gen_seed)
        real = _pyramid(to_input(augment(images[idx], gen_seed), device), scales)
        z = torch.randn(len(idx), latent_dim, generator=gen_seed).to(device)
        # discriminator: relativistic average hinge
        with amp.autocast():
            fake = [f.detach() for f in G(z)]
            r, f = D(real).float(), D(fake).float()
            d_loss = F.relu(1 - (r - f.mean())).mean() + F.relu(1 + (f - r.mean())).mean()
        opt_d.zero_grad(set_to_none=True)
        amp.step(d_loss, opt_d, update=False)
        # generator
        with amp.autocast():
            fake = G(z)
            r, f = D(real).float(), D(fake).float()
            g_loss = F.relu(1 + (r - f.mean())).mean() + F.relu(1 - (f - r.mean())).mean()
        opt_g.zero_grad(set_to_none=True)
        amp.step(g_loss, opt_g)
        if step in wanted and snapshots is not None:
            snapshots.append((step, {k: v.detach().clone() for k, v in G.state_dict().items()}))
    G.eval()
    return G, {
        "gan_d_loss": float(d_loss.item()),
        "gan_g_loss": float(g_loss.item()),
        "gan_seconds": time.monotonic() - start,
        "gan_cpu_seconds": time.process_time() - cpu_start,
    }


@torch.no_grad()
def generate_images(generator: Generator, n: int, seed: int = 0, batch_size: int = 256) -> torch.Tensor:
    """``n`` pseudo images from the finest scale, as uint8 (n, 3, S, S) like the data pools."""
    g = torch.Generator().manual_seed(seed)
    device = next(generator.parameters()).device
    out = []
    for i in range(0, n, batch_size):
        z = torch.randn(min(batch_size, n - i), generator.latent_dim, generator=g).to(device)
        x = generator(z)[-1].cpu()
        out.append(((x * 0.5 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8))
    return (
        torch.cat(out)
        if out
        else torch.empty(0, 3, generator.scales[-1], generator.scales[-1], dtype=torch.uint8)
    )


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
