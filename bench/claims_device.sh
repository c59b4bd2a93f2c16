#!/usr/bin/env bash
# The claims experiments of one GPU session (docs/claims.md, "On a GPU"), from the repository root:
#
#     OUT=/some/folder bash bench/claims_device.sh [DEADLINE_S]
#
# Two pools of bench.sweep_pool side by side, each run on the in-process grid (no Ray): the
# [gpu] sections of the contradicted claims on CUDA (GPU_JOBS processes sharing the GPU, default 5),
# CPU_JOBS single-thread processes for the CPU sweeps (default 10),
# and pre-registered CPU sweeps on the other cores (one PyTorch thread per run, device "cpu").
# After DEADLINE_S (default 420) seconds no run starts and the ones running stop; each sweep's
# table.md/table.json is written with what finished.  GPU_SWEEPS and CPU_SWEEPS name the files
# (default: 002-sift-head on the GPU, none on the CPU; every GPU experiment of the ledger has run,
# docs/claims.md "On a GPU" names them and their commands).  SiFT's text model: the MiniLM package
# (88 MB) does not fit what a session carries, so .minilm16 (needed only for SiFT runs) holds its weights rounded to float16
# (made here with `AutoModel.from_pretrained(path).half().save_pretrained(".minilm16")` and its
# tokenizer; the weights then xz-compressed), loaded back as float32 there (class-text embeddings
# within cosine 0.9999995 of the package's).  $OUT gets the pool logs and claims-dev.tgz: every
# sweep folder under /tmp/claims-dev, its tables, logs and each run's summary.json and config.json.
# The GPU machine has torch, timm, transformers and grpcio but neither Ray nor flwr: carry .whl, the
# cp312 manylinux wheels (`pip download --no-deps --only-binary=:all: --python-version 3.12`) of
# flwr 1.42.0, cryptography, cffi, pycparser, pycryptodome, iterators, typer, click, rich, tomli,
# tomli-w, protobuf, grpcio-health-checking, fastapi, starlette, pydantic, pydantic-core,
# annotated-types, typing-inspection, typing-extensions, sqlalchemy, alembic, mako, flwr-datasets,
# datasets, dill and multiprocess (18 MB), installed with `pip install --no-deps --target`.
set -u
OUT=${OUT:?set OUT to the folder for the logs}
DEADLINE=${1:-420}
cd "$(dirname "$0")/.."
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
python3 -c "import torch, flwr, timm, server_app, client_app, bench.sweep_pool
print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name(0), '| flwr', flwr.__version__, '| timm', timm.__version__)" \
    || exit 3
nvidia-smi -L
# the commit only where the files are that commit's (a copied working tree may carry a stale .git)
if commit=$(git rev-parse --short HEAD 2>/dev/null) && git diff --quiet HEAD 2>/dev/null; then
    echo "commit $commit"
else
    echo "commit unknown (no .git, or the files differ from its HEAD ${commit:-}): name it yourself"
fi
SETS=("cache-dir=\"$PWD/.devcache\"" "tensorboard=false")
TEXT_SET=()
if [ -d .minilm16 ]; then
TEXT_SET=('sift.text-model="/tmp/minilm"')
python3 -c "import lzma, shutil, pathlib
from transformers import AutoModel, AutoTokenizer
half = pathlib.Path('/tmp/minilm16'); half.mkdir(exist_ok=True)
for f in pathlib.Path('.minilm16').iterdir():
    if f.suffix == '.xz':
        with lzma.open(f) as src, open(half / f.stem, 'wb') as dst: shutil.copyfileobj(src, dst)
    else: shutil.copy(f, half)
AutoModel.from_pretrained(half).float().save_pretrained('/tmp/minilm')
AutoTokenizer.from_pretrained(half).save_pretrained('/tmp/minilm')" || exit 4
else
    echo "no .minilm16: SiFT runs would need sift.text-model set another way"
fi
GPU_SWEEPS=${GPU_SWEEPS-sweeps/claims/002-sift-head.toml}
CPU_SWEEPS=${CPU_SWEEPS-}
if [ -n "$GPU_SWEEPS" ]; then
    # shellcheck disable=SC2086
    python3 -m bench.sweep_pool --gpu --jobs "${GPU_JOBS:-5}" --deadline-s "$DEADLINE" --out /tmp/claims-dev \
        --set "${SETS[@]}" "${TEXT_SET[@]}" -- $GPU_SWEEPS >"$OUT/gpu_pool.log" 2>&1 &
fi
if [ -n "$CPU_SWEEPS" ]; then
    # shellcheck disable=SC2086
    python3 -m bench.sweep_pool --jobs "${CPU_JOBS:-10}" --deadline-s "$DEADLINE" --out /tmp/claims-dev \
        --set "${SETS[@]}" 'device="cpu"' -- $CPU_SWEEPS >"$OUT/cpu_pool.log" 2>&1 &
fi
wait
# what the tables and the ledger need (run folders also hold predictions: too big to bring back)
(cd /tmp && find claims-dev \( -name summary.json -o -name config.json -o -name rounds.csv -o -name provenance.json -o -name 'table.*' -o -name '*.log' \) -print0 \
    | tar czf "$OUT/claims-dev.tgz" --null -T -)
ls -l "$OUT"
