#!/usr/bin/env bash
# every GPU check in one go, on the GPU machine, from the repository root:
#
#     OUT=/some/folder bash bench/gpu_session.sh              # on the GPU (≤ 12 minutes on an H100)
#     OUT=/some/folder bash bench/gpu_session.sh overhead gpu-rows   # only these steps
#     OUT=/tmp/gpuout bash bench/gpu_session.sh --cpu-check   # without CUDA: the same steps, tiny, on CPU
#
# Assumes the dependencies (torch, timm, flwr + Ray) are installed; PYTHONPATH defaults to this
# folder.  Every step runs under `timeout` (the GPU steps add up to 740 s; name steps to run fewer) and a failing step does
# not stop the next.  Six flat log files land in $OUT: session.log (each step's exit status and
# seconds), gpu_tests.log (nvidia-smi -L and `pytest -m gpu`), gpu_facts.log (what was bit-exact,
# from the determinism test), throughput.log, overhead.log, gpu_rows.log.
set -u
OUT=${OUT:?set OUT to the folder for the logs}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH=${PYTHONPATH:-$PWD}
MODE=${1:-gpu}
STEPS=" $* "  # step names to run (none: all)
SESSION="$OUT/session.log"
: >"$SESSION"
: >"$OUT/gpu_facts.log"

step() {  # step NAME SECONDS LOGFILE COMMAND...
    local name=$1 limit=$2 log=$3
    shift 3
    if [ "$MODE" != "--cpu-check" ] && [ "$STEPS" != "  " ] && [[ "$STEPS" != *" $name "* ]]; then
        return 0
    fi
    local t0=$SECONDS
    echo "### $name: $*" >>"$log"
    timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
    local rc=$?
    echo "$name: exit $rc after $((SECONDS - t0)) s (limit $limit s)$([ $rc = 124 ] && echo ', TIMED OUT')" \
        | tee -a "$SESSION"
}

{
    # the commit only where the files are that commit's (a copied working tree may carry a stale .git)
    if commit=$(git rev-parse --short HEAD 2>/dev/null) && git diff --quiet HEAD 2>/dev/null; then
        where="commit $commit"
    else
        where="commit unknown (no .git, or the files differ from its HEAD ${commit:-}: name the commit yourself)"
    fi
    echo "fedderm GPU session, mode $MODE, $(date -u +%FT%TZ), $where"
    python -c "import torch; print('torch', torch.__version__, '· CUDA', torch.version.cuda, '· available', torch.cuda.is_available())"
} >>"$SESSION" 2>&1

if [ "$MODE" = "--cpu-check" ]; then
    # no CUDA: the GPU side of the gpu tests on CPU (exact comparisons), the benches tiny
    step gpu-tests 600 "$OUT/gpu_tests.log" env FEDDERM_TEST_GPU_DEVICE=cpu FEDDERM_GPU_REPORT="$OUT/gpu_facts.log" \
        python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_device.py -k "fedavg or mixed or bit_exact"
    step throughput 300 "$OUT/throughput.log" python -m bench.throughput --quick --images 32 --batch-size 8 \
        --repeats 1 --cases supervised --device cpu
    step gpu-rows 300 "$OUT/gpu_rows.log" python -m bench.gpu --quick --rows flbt --device cpu
    echo "overhead: not run in --cpu-check (it starts Ray: minutes on a small machine)" | tee -a "$SESSION"
    exit 0
fi

step nvidia-smi 5 "$OUT/gpu_tests.log" nvidia-smi -L
# deterministic cuBLAS for the determinism test (needed before the first cuBLAS handle)
step gpu-tests 190 "$OUT/gpu_tests.log" env CUBLAS_WORKSPACE_CONFIG=:4096:8 FEDDERM_GPU_REPORT="$OUT/gpu_facts.log" \
    python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_device.py
# the issue's target: fedderm / plain >= 0.9 at ResNet-18, batch 128 (224 px); the MAE and MoCo cases
step throughput 65 "$OUT/throughput.log" python -m bench.throughput --device cuda --batch-size 128 \
    --image-size 224 --images 1024 --repeats 3 --cases supervised,mae,moco
# fedderm (Ray, 4 clients, 0.5 GPU each) against 2 plain GPU workers; ResNet-18 64 px, 5 rounds
step overhead 240 "$OUT/overhead.log" python -m bench.overhead --device cuda --repeats 1
# one paper-scale row per family: 10 clients, 64 images each, 2 + 2 rounds (each row prints as it ends)
step gpu-rows 240 "$OUT/gpu_rows.log" python -m bench.gpu --device cuda
