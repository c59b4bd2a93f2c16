#!/usr/bin/env bash
# Check fedderm against a given Flower release in a scratch environment: the launcher's version
# gate and behavioural self-tests, the launcher and Flower-API tests, and the loopback deployment
# tests (stock Flower and the accelerator, TLS, SuperNode authentication).
#
#   bash bench/flower_compat.sh 'flwr==1.42.0'
#   bash bench/flower_compat.sh 'flwr-nightly==1.43.0.dev20261026' /tmp/flwr143
#
# The first argument is a pip requirement for Flower (a release or a nightly); the second, a folder
# for the scratch virtual environment (default: a new temporary folder; an environment already
# there is reused, so that a change is re-checked without installing again). fedderm is installed there
# editable and without its own Flower pin, its other dependencies as pyproject.toml states them.
# A version that passes goes into fedderm.accel.gate.VERIFIED_FLOWER (docs/flower-versions.md).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: bash bench/flower_compat.sh FLOWER_REQUIREMENT [SCRATCH_DIR]" >&2; exit 2; }
flower=$1
scratch=${2:-$(mktemp -d -t fedderm-flower-XXXX)}
env="$scratch/venv"

if [ -x "$env/bin/python" ] && "$env/bin/python" -c "import flwr" 2>/dev/null; then
    echo "flower_compat: reusing $env (flwr $("$env/bin/python" -c 'import flwr; print(flwr.__version__)'))"
else
python3 -m venv "$env"
# fedderm's dependencies without Flower (a nightly is another distribution of the same `flwr` module)
deps=$("$env/bin/python" - <<'EOF'
import re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
reqs = project["dependencies"] + project["optional-dependencies"]["test"]
print("\n".join(r for r in reqs if not re.match(r"flwr(\[|\s|>|<|=|$)", r)))
EOF
)
# with its simulation extra (Ray), as fedderm's own pin asks for it
"$env/bin/pip" install -q packaging 2>&1 | grep -v "^WARNING: Location" || true
flower=$("$env/bin/python" -c 'import sys; from packaging.requirements import Requirement as R; r = R(sys.argv[1]); r.extras.add("simulation"); print(r)' "$flower")
echo "flower_compat: installing $flower into $env"
mapfile -t dep_list <<<"$deps"
"$env/bin/pip" install -q "${dep_list[@]}" "$flower" 2>&1 | grep -v "^WARNING: Location" || true
"$env/bin/pip" install -q --no-deps -e . 2>&1 | grep -v "^WARNING: Location" || true
fi

export PATH="$env/bin:$PATH" PYTHONPATH="$PWD" FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1
# -c, not a script on stdin: the fork server's tasks import the parent's __main__ file (multiprocessing)
check=$(cat <<'EOF'
from fedderm.accel import gate, superlink

print(f"flower_compat: flwr {gate.flower_version()}; verified: {', '.join(gate.VERIFIED_FLOWER)}")
for role in ("superlink", "supernode", "superexec"):
    why = gate.why_stock(role)
    print(f"flower_compat: fedderm-{role}: {'patched (self-tests passed)' if not why else 'stock: ' + why}")
print(f"flower_compat: held-pull self-test (1 s hold): {superlink.self_test_held_pull(1.0) or 'held'}")
EOF
)
"$env/bin/python" -c "$check"
"$env/bin/python" -m pytest -n 0 -p no:cacheprovider -q --durations=10 \
    tests/test_flower_api.py tests/test_flower_private.py tests/test_launcher.py tests/test_flwr_stop.py tests/test_deploy.py \
    tests/test_loopback_stock.py tests/test_loopback.py
