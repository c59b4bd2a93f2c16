"""Install fedderm into the active virtual environment with the PyTorch build this machine can use,
and say what was installed.

    python -m fedderm.install                  # from the checkout: torch's CPU build unless a GPU is found
    python -m fedderm.install --torch cuda     # the CUDA build (PyPI's torch on Linux)
    python -m fedderm.install --report         # only the last line: the environment's size, torch's build

On Linux, PyPI's torch is the CUDA build: with its NVIDIA libraries and Triton, about 5 GB that a
machine without an NVIDIA GPU never uses.  PyTorch publishes CPU builds on its own package index
(https://download.pytorch.org/whl/cpu), which pip does not look at unless told.  This command runs
pip twice: first torch and torchvision from that index when the build is the CPU one (``--torch
auto``, the default: the CPU build unless ``nvidia-smi`` lists a GPU), then ``pip install -e .``
(with the extras given), which keeps the torch it finds.  pip is told not to compile bytecode
(``--no-compile``, as uv does by default); ``compileall`` then compiles the environment's packages
on every core, where pip compiles one file after another (docs/benchmarks.md, "Installing:
bytecode").  Where the CPU index cannot be reached (an offline mirror, a firewall), it says so in one
line and pip installs torch from the sources it is configured with; ``--torch-index URL`` (or
``FEDDERM_TORCH_INDEX``) names a mirror of the CPU index.  macOS and Windows get PyPI's torch,
which is a CPU build there.

It ends with one line: the environment's folder and size on disk, and torch's version and build.
Run it with only the standard library (it is run before fedderm's dependencies are installed).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from pathlib import Path

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
#: seconds to wait for the CPU index to answer before installing without it
PROBE_TIMEOUT = 10.0


def has_nvidia_gpu() -> bool:
    """Whether ``nvidia-smi -L`` lists a GPU (the NVIDIA driver and a device are present)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU " in out.stdout


def reachable(url: str, timeout: float = PROBE_TIMEOUT) -> str:
    """ "" when ``url`` answers an HTTP request within ``timeout`` seconds, else why not (one line)."""
    request = urllib.request.Request(url.rstrip("/") + "/torch/", method="HEAD")
    try:
        with urllib.request.urlopen(request, timeout=timeout):
            return ""
    except urllib.error.HTTPError as err:
        return "" if err.code < 500 else f"HTTP {err.code}"
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        return " ".join(str(reason).split())[:160] or type(err).__name__


def choose_build(torch: str, platform: str = sys.platform, gpu=has_nvidia_gpu) -> str:
    """``cpu`` or ``cuda``: the build ``--torch`` asks for; ``auto`` is the CPU build on Linux unless
    ``gpu()`` finds one.  On other platforms PyPI's torch is already a CPU build (``default``)."""
    if platform != "linux":
        return "default"
    if torch != "auto":
        return torch
    return "cuda" if gpu() else "cpu"


def pip_commands(build: str, index: str, index_error: str, target: str) -> list[list[str]]:
    """The pip commands that install ``target`` (``.`` or ``.[test]``) with the ``build`` of torch:
    torch and torchvision from the CPU ``index`` first, unless ``index_error`` says it is out of
    reach."""
    pip = [sys.executable, "-m", "pip", "install", "--no-compile"]
    first = (
        [[*pip, "torch", "torchvision", "--index-url", index]] if build == "cpu" and not index_error else []
    )
    return [*first, [*pip, "-e", target]]


def compile_command() -> list[str]:
    """``compileall`` of this environment's packages on every core (``-j 0``); files already
    compiled are left as they are.  Quiet, also about a file that does not compile (pip ignores those
    too: some packages ship templates named ``.py``)."""
    folders = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    return [sys.executable, "-m", "compileall", "-qq", "-j", "0", *folders]


def folder_size(folder: Path) -> int:
    """Bytes ``folder`` takes on disk (allocated blocks, each hard-linked file once), as ``du``."""
    seen, total = set(), 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            total += getattr(st, "st_blocks", 0) * 512 or st.st_size
    return total


def torch_build(python: str = sys.executable) -> str:
    """``torch 2.9.1+cpu (CPU build)`` / ``torch 2.9.1 (CUDA 12.8 build)`` of ``python``'s
    environment, or why torch cannot be imported there."""
    code = "import torch; print(torch.__version__); print(torch.version.cuda or '')"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        return f"torch cannot be imported ({last})"
    version, cuda = (out.stdout.splitlines() + ["", ""])[:2]
    return f"torch {version} ({f'CUDA {cuda}' if cuda else 'CPU'} build)"


def report(prefix: Path | None = None, python: str = sys.executable) -> str:
    """The environment's folder and size on disk, and torch's version and build."""
    prefix = Path(prefix or sys.prefix)
    return f"environment: {prefix}, {folder_size(prefix) / 2**30:.1f} GiB on disk · {torch_build(python)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fedderm.install",
        description="pip install -e . with the PyTorch build this machine can use (the CPU build unless "
        "an NVIDIA GPU is found), then one line: the environment's size and torch's build",
    )
    parser.add_argument(
        "--torch",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="the PyTorch build: auto (default) is the CPU build unless nvidia-smi lists a GPU",
    )
    parser.add_argument(
        "--torch-index",
        default=os.environ.get("FEDDERM_TORCH_INDEX", CPU_INDEX),
        metavar="URL",
        help=f"the package index of the CPU build (default {CPU_INDEX}, or $FEDDERM_TORCH_INDEX)",
    )
    parser.add_argument(
        "--extras", default="", metavar="NAMES", help="fedderm's extras to install too, e.g. test or docs"
    )
    parser.add_argument(
        "--report", action="store_true", help="only print the environment's size and torch's build"
    )
    args = parser.parse_args(argv)
    if args.report:
        print(report())
        return 0
    if sys.prefix == sys.base_prefix:
        print(
            "error: no virtual environment is active: create one outside the checkout and activate it "
            "(python3 -m venv ~/.venvs/fedderm && . ~/.venvs/fedderm/bin/activate)",
            file=sys.stderr,
        )
        return 2
    app = Path(__file__).resolve().parents[1]
    build = choose_build(args.torch)
    why = reachable(args.torch_index) if build == "cpu" else ""
    if build == "cpu" and why:
        print(
            f"install: the CPU build's index {args.torch_index} cannot be reached ({why}): torch comes "
            "from pip's own package sources (on Linux PyPI's torch is the CUDA build, ~5 GB); "
            "--torch-index URL names a mirror of it",
            flush=True,
        )
    else:
        print(f"install: torch's {build if build != 'default' else 'default'} build", flush=True)
    target = f"{app}[{args.extras}]" if args.extras else str(app)
    for cmd in pip_commands(build, args.torch_index, why, target):
        if subprocess.run(cmd).returncode != 0:
            print(f"error: {' '.join(cmd[2:])} failed (pip's message above)", file=sys.stderr)
            return 1
    start = time.monotonic()
    subprocess.run(compile_command())  # its exit status counts files that do not compile: not an error
    print(
        f"install: bytecode compiled on {os.cpu_count()} cores in {time.monotonic() - start:.0f} s",
        flush=True,
    )
    line = report()
    print(line)
    if build == "cpu" and not why and "CPU build" not in line:
        print("error: torch's CPU build was asked for, but the environment has another", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
