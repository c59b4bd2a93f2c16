#!/usr/bin/env bash
# The claims experiments of one GPU session (docs/claims.md, "On a GPU"), from the repository root:
#
#     OUT=/some/folder bash bench/claims_device.sh [DEADLINE_S]
#
# Two pools of bench.sweep_pool side by side, each run on the in-process grid (no Ray): the
# [gpu] sections of the contradicted claims on CUDA (5 processes sharing the GPU), and
# pre-registered CPU sweeps on the other cores (one PyTorch thread per run, device "cpu").
# No run starts after DEADLINE_S (default 420) seconds; each sweep's table.md/table.json is written
# with what finished.  SiFT's class-text embeddings come from .devcache/sift-text (the MiniLM
# package is not on the GPU machine).  $OUT gets the two pool logs and claims-dev.tgz: every
# sweep folder under /tmp/claims-dev without its checkpoints and models.
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
python3 -m bench.sweep_pool --gpu --jobs 5 --deadline-s "$DEADLINE" --set "${SETS[@]}" --out /tmp/claims-dev \
    sweeps/claims/004-flbt.toml sweeps/claims/002-sift-head.toml >"$OUT/gpu_pool.log" 2>&1 &
python3 -m bench.sweep_pool --jobs 10 --deadline-s "$DEADLINE" --set "${SETS[@]}" 'device="cpu"' --out /tmp/claims-dev \
    sweeps/claims/000-fedclf-baselines.toml sweeps/claims/002-sift-accuracy.toml >"$OUT/cpu_pool.log" 2>&1 &
wait
tar czf "$OUT/claims-dev.tgz" --exclude='*.pt' --exclude='events.out*' -C /tmp claims-dev
ls -l "$OUT"
