#!/usr/bin/env bash
# The claims experiments of one GPU session (docs/claims.md, "On a GPU"), from the repository root:
#
#     OUT=/some/folder bash bench/claims_device.sh [DEADLINE_S]
#
# Two pools of bench.sweep_pool side by side, each run on the in-process grid (no Ray): the
# [gpu] sections of the contradicted claims on CUDA (5 processes sharing the GPU), and
# pre-registered CPU sweeps on the other cores (one PyTorch thread per run, device "cpu").
# No run starts after DEADLINE_S (default 420) seconds; each sweep's table.md/table.json is written
# with what finished.  SiFT's text model: the MiniLM package (88 MB) does not fit what a session
# carries, so .minilm16 holds its weights rounded to float16 (made here with
# `AutoModel.from_pretrained(path).half().save_pretrained(".minilm16")` and its tokenizer; the
# weights then xz-compressed), loaded back as float32 there (class-text embeddings within cosine 0.9999995 of the package's).  $OUT
# gets the two pool logs and claims-dev.tgz: every sweep folder under /tmp/claims-dev without its
# checkpoints and models.
set -u
OUT=${OUT:?set OUT to the folder for the logs}
DEADLINE=${1:-420}
cd "$(dirname "$0")/.."
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
python3 -c "import torch, flwr, timm, server_app, client_app, bench.sweep_pool
print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name(0), '| flwr', flwr.__version__, '| timm', timm.__version__)" \
    || exit 3
nvidia-smi -L
git rev-parse --short HEAD 2>/dev/null
SETS=("cache-dir=\"$PWD/.devcache\"" "tensorboard=false")
python3 -c "import lzma, shutil, pathlib
from transformers import AutoModel, AutoTokenizer
half = pathlib.Path('/tmp/minilm16'); half.mkdir(exist_ok=True)
for f in pathlib.Path('.minilm16').iterdir():
    if f.suffix == '.xz':
        with lzma.open(f) as src, open(half / f.stem, 'wb') as dst: shutil.copyfileobj(src, dst)
    else: shutil.copy(f, half)
AutoModel.from_pretrained(half).float().save_pretrained('/tmp/minilm')
AutoTokenizer.from_pretrained(half).save_pretrained('/tmp/minilm')" || exit 4
python3 -m bench.sweep_pool --gpu --jobs 5 --deadline-s "$DEADLINE" --out /tmp/claims-dev \
    --set "${SETS[@]}" 'sift.text-model="/tmp/minilm"' \
    -- sweeps/claims/004-flbt.toml sweeps/claims/002-sift-head.toml >"$OUT/gpu_pool.log" 2>&1 &
python3 -m bench.sweep_pool --jobs 10 --deadline-s "$DEADLINE" --out /tmp/claims-dev --set "${SETS[@]}" 'device="cpu"' \
    -- sweeps/claims/000-fedclf-baselines.toml sweeps/claims/003-fedmim-skew.toml >"$OUT/cpu_pool.log" 2>&1 &
wait
tar czf "$OUT/claims-dev.tgz" --exclude='*.pt' --exclude='events.out*' -C /tmp claims-dev
ls -l "$OUT"
