#!/usr/bin/env bash
# The Docker federation, end to end, on one Docker host (docs/deploy.md, "Docker"):
#
#   1. finds a Docker engine (or starts dockerd when run as root and none answers; stopped at the
#      end) and a Compose CLI; without either it prints "SKIP: ..." and exits 0;
#   2. builds the images: on Flower's official flwr/* images when FEDDERM_DOCKER_BASE=official,
#      else (default) on a base made on this host: a Debian bookworm root file system from
#      debootstrap, `docker import`ed, plus docker/base.Dockerfile (Python venv with flwr, user
#      app, uid 49999), since Docker Hub may be unreachable.  With the local base, pip installs
#      from a wheelhouse (`pip download` on this host, served on 127.0.0.1 during the build);
#   3. makes certificates and keys (deploy/make_certs.py), the proxy's nginx.conf
#      (deploy/proxy.py --docker), one generated image folder per hospital, and an allow-list with
#      this checkout's app hash (fedderm-app-hash);
#   4. brings up docker/compose.yml: the SuperLink (TLS, SuperNode authentication) on the host's
#      127.0.0.1 and its proxy (nginx, the Fleet API only) on the public port, registers the three
#      hospitals' keys (register.sh, on the SuperLink's own address), then three SuperNodes
#      (fedderm-supernode, the warm launcher, with the allow-list), each with its own data folder
#      mounted read-only, connected through the proxy; checks that an outsider holding the CA
#      certificate gets 403 at the public port;
#   5. `flwr run`s a tiny fedderm run and checks Flower's status (finished:completed) and the
#      results (summary.json: every round, final metrics for each of the 3 hospitals);
#   6. tears everything down: `compose down --volumes`, then checks that no container, network
#      or volume of the project is left (the images stay, for the next run).
#
# Run from anywhere:  bash docker/test.sh     (exit 0: passed or skipped; 1: failed)
# Environment:
#   FEDDERM_DOCKER_BASE=local|official   base images (default local)
#   FEDDERM_DOCKER_CACHE=DIR             root file system tarball and wheelhouse (default ~/.cache/fedderm-docker)
#   FEDDERM_DOCKER_DATA_ROOT=DIR         dockerd --data-root when this script starts dockerd
#   FEDDERM_DOCKER_KEEP=1                keep the work folder (logs, results) after a pass
#   FEDDERM_DOCKER_ROUNDS=N              num-server-rounds of the test run (default 2)
#   FEDDERM_DOCKER_WHEEL_PORT=N          loopback port of the wheelhouse during builds (default 47613)
#   FEDDERM_DOCKER_CPU_SHARES=N          on a busy cgroup-v1 host: the cpu.shares of Docker's
#                                        cgroup while the test runs (restored after); see the docs
# (the body is one function, so that bash reads the whole file before it runs any of it)
main() {
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${FEDDERM_DOCKER_CACHE:-$HOME/.cache/fedderm-docker}"
BASE_KIND="${FEDDERM_DOCKER_BASE:-local}"
ROUNDS="${FEDDERM_DOCKER_ROUNDS:-2}"
PY="${PYTHON:-python3}"
HOSPITALS=(hospital-a hospital-b hospital-c)
CONNECTION=docker-test
PROJECT="fedderm-test-$$"
T_START=$(date +%s)

say() { echo "docker/test.sh: $*"; }
fail() { say "FAILED: $*"; exit 1; }
elapsed() { echo $(( $(date +%s) - $1 )); }

WORK=""
DOCKERD_PID=""
SERVER_PID=""
COMPOSE=()
UP=0
CLEANED=0
SHARES_FILE=/sys/fs/cgroup/cpu/docker/cpu.shares
OLD_SHARES=""
PASSED=0

cleanup() {
    local rc=$?
    [ "$CLEANED" = 1 ] && return
    CLEANED=1
    if [ "$UP" = 1 ]; then
        if [ "$rc" != 0 ] && [ -n "$WORK" ]; then
            "${COMPOSE[@]}" logs --no-color > "$WORK/compose.log" 2>&1 || true
            say "compose logs: $WORK/compose.log"
            tail -n 40 "$WORK/compose.log" | sed 's/^/  | /'
        fi
        "${COMPOSE[@]}" down --volumes --remove-orphans --timeout 20 > "$WORK/down.log" 2>&1 \
            || say "compose down failed: $(tail -n 3 "$WORK/down.log")"
        local left
        left="$(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT")"
        left+="$(docker network ls -q --filter "label=com.docker.compose.project=$PROJECT")"
        left+="$(docker volume ls -q --filter "label=com.docker.compose.project=$PROJECT")"
        if [ -n "$left" ]; then
            say "FAILED: left behind by project $PROJECT: $left"
            rc=1
        else
            say "teardown: no container, network or volume of project $PROJECT left"
        fi
    fi
    [ -n "$SERVER_PID" ] && kill "$SERVER_PID" 2>/dev/null && wait "$SERVER_PID" 2>/dev/null
    if [ -n "$OLD_SHARES" ] && [ -w "$SHARES_FILE" ]; then
        echo "$OLD_SHARES" > "$SHARES_FILE" && say "cpu.shares of Docker's cgroup back to $OLD_SHARES"
    fi
    if [ -n "$DOCKERD_PID" ]; then
        kill "$DOCKERD_PID" 2>/dev/null
        for _ in $(seq 60); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 1; done
        kill -0 "$DOCKERD_PID" 2>/dev/null && kill -9 "$DOCKERD_PID"
        say "stopped the dockerd this script started (pid $DOCKERD_PID)"
    fi
    if [ -n "$WORK" ]; then
        if [ "$rc" = 0 ] && [ "${FEDDERM_DOCKER_KEEP:-0}" != 1 ]; then
            rm -rf "$WORK"
        else
            say "work folder kept: $WORK"
        fi
    fi
    [ "$rc" = 0 ] && [ "$PASSED" = 1 ] && say "passed in $(elapsed "$T_START") s (images, federation, run, teardown)"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# -- 1. a Docker engine and a Compose CLI ---------------------------------------------------------
command -v docker > /dev/null || { echo "SKIP: no docker CLI on PATH"; exit 0; }
if ! docker info > /dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v dockerd > /dev/null; then
        mkdir -p "$CACHE"
        dockerd --data-root "${FEDDERM_DOCKER_DATA_ROOT:-/var/lib/docker}" > "$CACHE/dockerd.log" 2>&1 &
        DOCKERD_PID=$!
        for _ in $(seq 60); do docker info > /dev/null 2>&1 && break; sleep 1; done
        if ! docker info > /dev/null 2>&1; then
            kill "$DOCKERD_PID" 2>/dev/null; wait "$DOCKERD_PID" 2>/dev/null; DOCKERD_PID=""
            echo "SKIP: no Docker engine reachable (dockerd did not start: $CACHE/dockerd.log)"
            exit 0
        fi
        say "started dockerd (pid $DOCKERD_PID)"
    else
        echo "SKIP: no Docker engine reachable (docker info failed; start dockerd or set DOCKER_HOST)"
        exit 0
    fi
fi
if docker compose version > /dev/null 2>&1; then
    COMPOSE=(docker compose)
elif command -v docker-compose > /dev/null; then
    COMPOSE=(docker-compose)
else
    echo "SKIP: no Compose CLI (neither 'docker compose' nor 'docker-compose')"
    exit 0
fi
say "engine: Docker $(docker version --format '{{.Server.Version}}'), compose: $("${COMPOSE[@]}" version --short 2>/dev/null || echo '?')"
# the repo on PYTHONPATH must not shadow the `docker` package of a Python docker-compose
COMPOSE=(env -u PYTHONPATH "${COMPOSE[@]}" -p "$PROJECT" -f "$REPO/docker/compose.yml")

FLWR_VERSION="$("$PY" -c 'import flwr; print(flwr.__version__)')" || fail "the flwr CLI's Python ($PY) has no flwr"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/fedderm-docker-XXXXXX")"
chmod 755 "$WORK"

# -- 2. images ------------------------------------------------------------------------------------
T_BUILD=$(date +%s)
BUILD_ARGS=()
if [ "$BASE_KIND" = official ]; then
    export FLWR_TAG="${FLWR_TAG:-$FLWR_VERSION-py3.12-ubuntu24.04}"
    LINK_BASE="flwr/superlink:$FLWR_TAG"
    NODE_BASE="flwr/supernode:$FLWR_TAG"
    BUILD_NET=()
elif [ "$BASE_KIND" = local ]; then
    export FLWR_TAG="$FLWR_VERSION-local"
    ROOTFS_IMAGE=fedderm-rootfs:bookworm
    if ! docker image inspect "$ROOTFS_IMAGE" > /dev/null 2>&1; then
        TARBALL="$CACHE/rootfs-bookworm.tar"
        if [ ! -s "$TARBALL" ]; then
            command -v debootstrap > /dev/null \
                || fail "no $ROOTFS_IMAGE image and no debootstrap to make one (apt-get install debootstrap)"
            [ "$(id -u)" = 0 ] || fail "debootstrap needs root to make $ROOTFS_IMAGE"
            say "making a Debian bookworm root file system with debootstrap (once; cached in $TARBALL)"
            ROOTFS="$CACHE/rootfs-bookworm"
            rm -rf "$ROOTFS"
            debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
                bookworm "$ROOTFS" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" > "$CACHE/debootstrap.log" 2>&1 \
                || fail "debootstrap failed: $CACHE/debootstrap.log"
            rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
            tar -C "$ROOTFS" -cf "$TARBALL.tmp" . && mv "$TARBALL.tmp" "$TARBALL" && rm -rf "$ROOTFS"
        fi
        docker import "$TARBALL" "$ROOTFS_IMAGE" > /dev/null || fail "docker import $TARBALL failed"
        say "imported $ROOTFS_IMAGE from $TARBALL"
    fi
    # a wheelhouse made by this host's pip, served on loopback to the builds (--network host)
    WHEELS="$CACHE/wheelhouse"
    mkdir -p "$WHEELS"
    "$PY" "$REPO/docker/requirements.py" "$REPO/pyproject.toml" > "$WORK/requirements.txt"
    STAMP="$( (echo "flwr==$FLWR_VERSION"; cat "$WORK/requirements.txt") | sha256sum | cut -c1-16)"
    if [ "$(cat "$WHEELS/.complete" 2>/dev/null)" != "$STAMP" ]; then
        say "pip download: the requirements into $WHEELS (once per requirements set)"
        PIP_DISABLE_PIP_VERSION_CHECK=1 "$PY" -m pip download -q --only-binary=:all: -d "$WHEELS" \
            "flwr==$FLWR_VERSION" "setuptools>=68" -r "$WORK/requirements.txt" > "$WORK/pip-download.log" 2>&1 \
            || fail "pip download into $WHEELS failed: $(tail -n 5 "$WORK/pip-download.log")"
        echo "$STAMP" > "$WHEELS/.complete"
    fi
    # a fixed port keeps PIP_ARGS, and so Docker's build cache, the same from run to run
    PORT_WHEELS="${FEDDERM_DOCKER_WHEEL_PORT:-47613}"
    # (SO_REUSEADDR, as http.server binds: a previous run's connections in TIME_WAIT do not count)
    if ! "$PY" -c 'import socket, sys; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))' "$PORT_WHEELS" 2> /dev/null; then
        PORT_WHEELS=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
        say "port ${FEDDERM_DOCKER_WHEEL_PORT:-47613} is taken: wheelhouse on $PORT_WHEELS (the build cache is missed)"
    fi
    "$PY" -m http.server --bind 127.0.0.1 --directory "$WHEELS" "$PORT_WHEELS" > "$WORK/wheel-server.log" 2>&1 &
    SERVER_PID=$!
    PIP_ARGS="--no-index --find-links http://127.0.0.1:$PORT_WHEELS/"
    BUILD_ARGS=(--build-arg "PIP_ARGS=$PIP_ARGS")
    BUILD_NET=(--network host)
    LINK_BASE="fedderm-flwr-base:$FLWR_VERSION"
    NODE_BASE="$LINK_BASE"
    say "wheelhouse: $(ls "$WHEELS" | wc -l) wheels, $(du -sh "$WHEELS" | cut -f1) in $WHEELS"
    docker build -q "${BUILD_NET[@]}" "${BUILD_ARGS[@]}" --build-arg "ROOTFS_IMAGE=$ROOTFS_IMAGE" \
        --build-arg "FLWR_VERSION=$FLWR_VERSION" -f "$REPO/docker/base.Dockerfile" -t "$LINK_BASE" \
        "$REPO" > "$WORK/build-base.log" 2>&1 || fail "building $LINK_BASE: $(tail -n 20 "$WORK/build-base.log")"
else
    fail "FEDDERM_DOCKER_BASE must be local or official, not '$BASE_KIND'"
fi
if [ "$BASE_KIND" = official ]; then PROXY_BASE=debian:bookworm-slim; else PROXY_BASE="$ROOTFS_IMAGE"; fi
docker build "${BUILD_NET[@]}" --build-arg "BASE_IMAGE=$PROXY_BASE" -f "$REPO/docker/proxy.Dockerfile" \
    -t fedderm-proxy:bookworm "$REPO" > "$WORK/build-proxy.log" 2>&1 \
    || fail "building fedderm-proxy (apt-get install nginx): $(tail -n 20 "$WORK/build-proxy.log")"
for role in superlink supernode; do
    base="$LINK_BASE"; [ "$role" = supernode ] && base="$NODE_BASE"
    docker build "${BUILD_NET[@]}" "${BUILD_ARGS[@]}" --build-arg "BASE_IMAGE=$base" \
        --build-arg "FLWR_TAG=$FLWR_TAG" -f "$REPO/docker/$role.Dockerfile" -t "fedderm-$role:$FLWR_TAG" \
        "$REPO" > "$WORK/build-$role.log" 2>&1 || fail "building fedderm-$role: $(tail -n 20 "$WORK/build-$role.log")"
done
[ -n "$SERVER_PID" ] && kill "$SERVER_PID" 2>/dev/null && wait "$SERVER_PID" 2>/dev/null
SERVER_PID=""
say "images built in $(elapsed "$T_BUILD") s (base: $BASE_KIND):"
for image in "$LINK_BASE" "fedderm-superlink:$FLWR_TAG" "fedderm-supernode:$FLWR_TAG"; do
    [ "$BASE_KIND" = official ] && [ "$image" = "$LINK_BASE" ] && continue
    size=$(docker image inspect --format '{{.Size}}' "$image")
    say "  $image: $(( size / 1000000 )) MB"
done

# -- 3. certificates, data, allow-list --------------------------------------------------------------
cd "$REPO" || fail "cannot cd to $REPO"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
SECRETS="$WORK/secrets"
host_args=(--superlink-host host.docker.internal --superlink-host localhost --superlink-host 127.0.0.1)
free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
SUPERLINK_PORT=$(free_port)         # the proxy's public port (the hospitals')
SUPERLINK_ADMIN_PORT=$(free_port)   # the SuperLink's own, on 127.0.0.1 (the flwr CLI's)
hospital_args=(); for h in "${HOSPITALS[@]}"; do hospital_args+=(--hospital "$h"); done
"$PY" deploy/make_certs.py --out "$SECRETS" --connection "$CONNECTION" "${host_args[@]}" \
    "${hospital_args[@]}" > "$WORK/make-certs.log" 2>&1 || fail "make_certs: $(tail -n 5 "$WORK/make-certs.log")"
"$PY" - "$WORK/data" "${HOSPITALS[@]}" <<'EOF' || fail "generating the hospitals' data"
import sys
from pathlib import Path

from deploy.loopback import make_hospital_data

make_hospital_data(Path(sys.argv[1]), sys.argv[2:], per_class=12, image_size=32)
EOF
"$PY" -m deploy.proxy --docker --public "0.0.0.0:$SUPERLINK_PORT" --superlink "127.0.0.1:$SUPERLINK_ADMIN_PORT" \
    --out "$SECRETS/proxy/nginx.conf" > "$WORK/proxy.log" 2>&1 || fail "deploy.proxy: $(tail -n 5 "$WORK/proxy.log")"
APP_HASH="$("$PY" -m fedderm.accel app-hash "$REPO")" || fail "fedderm-app-hash"
printf '# this checkout of fedderm, approved for the Docker test\n%s\n' "$APP_HASH" > "$WORK/approved.txt"
# Flower's images run as uid 49999: the keys (mode 600) must be theirs; the data stays read-only
if [ "$(id -u)" = 0 ]; then
    chown -R 49999:49999 "$SECRETS"
else
    say "not root: the keys under $SECRETS must be readable by uid 49999 (sudo chown -R 49999:49999)"
fi
chmod -R a+rX "$WORK/data" "$WORK/approved.txt"
say "certificates (SAN host.docker.internal, localhost, 127.0.0.1), keys for ${HOSPITALS[*]}, the proxy's nginx.conf, 3 data folders" \
    "of $(find "$WORK/data" -name '*.png' | wc -l) images, allow-list with app hash ${APP_HASH:0:16}…"

# -- 4. the federation ------------------------------------------------------------------------------
export SUPERLINK_PORT SUPERLINK_ADMIN_PORT SECRETS_DIR="$SECRETS" ALLOW_LIST="$WORK/approved.txt"
export HOSPITAL_A_DATA="$WORK/data/hospital-a" HOSPITAL_B_DATA="$WORK/data/hospital-b" \
    HOSPITAL_C_DATA="$WORK/data/hospital-c"
export FLWR_HOME="$WORK/flwr-home" FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 COLUMNS=200
mkdir -p "$FLWR_HOME"
cat > "$FLWR_HOME/config.toml" <<EOF
[superlink]
default = "$CONNECTION"

[superlink.$CONNECTION]
address = "127.0.0.1:$SUPERLINK_ADMIN_PORT"
root-certificates = "$SECRETS/ca/ca.crt"
EOF
# an outsider: the CA certificate every hospital holds, and the public port
OUTSIDER_HOME="$WORK/outsider-home"
mkdir -p "$OUTSIDER_HOME"
printf '[superlink]\ndefault = "o"\n\n[superlink.o]\naddress = "127.0.0.1:%s"\nroot-certificates = "%s"\n' \
    "$SUPERLINK_PORT" "$SECRETS/ca/ca.crt" > "$OUTSIDER_HOME/config.toml"
# Under cgroup v1 all containers share Docker's cgroup, which weighs as much as ONE process of
# the host (cpu.shares 1024): on a busy host the ServerApp then cannot start within Flower's
# 30 s claim window (HEARTBEAT_DEFAULT_INTERVAL) and the SuperExec relaunches it again and again.
if [ -n "${FEDDERM_DOCKER_CPU_SHARES:-}" ]; then
    if [ -w "$SHARES_FILE" ]; then
        OLD_SHARES="$(cat "$SHARES_FILE")"
        echo "$FEDDERM_DOCKER_CPU_SHARES" > "$SHARES_FILE" || fail "cannot write $SHARES_FILE"
        say "cpu.shares of Docker's cgroup: $OLD_SHARES -> $FEDDERM_DOCKER_CPU_SHARES while the test runs"
    else
        say "FEDDERM_DOCKER_CPU_SHARES ignored: $SHARES_FILE is not writable (cgroup v2, or not root)"
    fi
fi
T_UP=$(date +%s)
UP=1
"${COMPOSE[@]}" up -d --no-build superlink proxy > "$WORK/up-superlink.log" 2>&1 \
    || fail "compose up superlink proxy: $(tail -n 10 "$WORK/up-superlink.log")"
json_field() { "$PY" -c '
import json, sys
text = sys.stdin.read(); start = text.find("{")
try:
    data = json.loads(text[start:]) if start >= 0 else {}
except ValueError:
    data = {}
print(eval(sys.argv[1], {"d": data}))' "$1"; }
for i in $(seq 90); do
    out="$(flwr supernode list "$CONNECTION" --format json 2>&1)"
    [ "$(echo "$out" | json_field 'd.get("success", False)')" = True ] && break
    [ "$i" = 90 ] && fail "the SuperLink did not answer on 127.0.0.1:$SUPERLINK_ADMIN_PORT within 90 s: $out"
    sleep 1
done
say "superlink: up on 127.0.0.1:$SUPERLINK_ADMIN_PORT (TLS, --enable-supernode-auth), proxy on port $SUPERLINK_PORT, in $(elapsed "$T_UP") s"
sh "$SECRETS/register.sh" > "$WORK/register.log" 2>&1 || fail "register.sh: $(tail -n 5 "$WORK/register.log")"
"${COMPOSE[@]}" up -d --no-build > "$WORK/up.log" 2>&1 || fail "compose up: $(tail -n 10 "$WORK/up.log")"
for i in $(seq 120); do
    online="$(flwr supernode list "$CONNECTION" --format json 2>&1 \
        | json_field 'sum(n.get("status") == "online" for n in d.get("nodes", []))')"
    [ "$online" = 3 ] && break
    [ "$i" = 120 ] && fail "SuperNodes online after 120 s: $online of 3"
    sleep 1
done
say "supernodes: 3/3 registered and online (fedderm-supernode, allow-list, data read-only, through the proxy) $(elapsed "$T_UP") s after start"
out="$(FLWR_HOME="$OUTSIDER_HOME" flwr supernode register "$SECRETS/hospitals/hospital-a/hospital-a.pub" o 2>&1)"
echo "$out" | grep -q "403 Forbidden" \
    || fail "an outsider with the CA certificate was not refused at the public port $SUPERLINK_PORT: $out"
out="$(FLWR_HOME="$OUTSIDER_HOME" flwr ls o --format json 2>&1)"
echo "$out" | grep -q "403 Forbidden" || fail "flwr ls at the public port was not refused: $out"
say "outsider at the public port: flwr supernode register and flwr ls refused (403 from the proxy)"

# -- 5. a fedderm run -------------------------------------------------------------------------------
RUN_CONFIG="method=\"fedavg\" model=\"tiny-cnn\" image-size=32 local-epochs=1 batch-size=16 optimizer=\"sgd\""
RUN_CONFIG+=" lr=0.05 lr-schedule=\"constant\" seed=0 min-clients=3 num-server-rounds=$ROUNDS"
RUN_CONFIG+=" output-dir=\"/app/fedderm-results\" run-name=\"docker-test\""
T_RUN=$(date +%s)
timeout 1200 flwr run "$REPO" "$CONNECTION" --stream --run-config "$RUN_CONFIG" > "$WORK/run.log" 2>&1
RUN_S=$(elapsed "$T_RUN")
RUN_ID="$(grep -o 'Successfully started run [0-9]*' "$WORK/run.log" | grep -o '[0-9]*$')"
[ -n "$RUN_ID" ] || fail "flwr run did not start a run: $(tail -n 20 "$WORK/run.log")"
STATUS="$(flwr ls "$CONNECTION" --run-id "$RUN_ID" --format json 2>&1 \
    | json_field "next((r['status'] for r in d.get('runs', []) if str(r['run-id']) == '$RUN_ID'), 'unknown')")"
say "run $RUN_ID: $STATUS in $RUN_S s (flwr run wall time, $ROUNDS rounds)"
[ "$STATUS" = finished:completed ] || fail "Flower reports run $RUN_ID as $STATUS: $(tail -n 30 "$WORK/run.log")"

LINK_CONTAINER="$("${COMPOSE[@]}" ps -q superlink)"
docker cp "$LINK_CONTAINER:/app/fedderm-results/docker-test" "$WORK/results" > /dev/null \
    || fail "no results folder /app/fedderm-results/docker-test in the superlink container"
"$PY" - "$WORK/results" "$ROUNDS" "${#HOSPITALS[@]}" <<'EOF' || fail "results check"
import json
import sys
from pathlib import Path

run_dir, rounds, clients = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
summary = json.loads((run_dir / "summary.json").read_text())
problems = []
if summary.get("method") != "fedavg":
    problems.append(f"method {summary.get('method')!r}")
done = sorted({r["round"] for r in summary.get("rounds", []) if r["round"] > 0})
if done != list(range(1, rounds + 1)):
    problems.append(f"rounds {done}, expected 1..{rounds}")
per_client = summary.get("final", {}).get("per_client", {})
if sorted(per_client) != [str(i) for i in range(clients)]:
    problems.append(f"final per-client metrics for {sorted(per_client)}, expected 0..{clients - 1}")
for pid, m in sorted(per_client.items()):
    if not 0.0 <= m.get("balanced_accuracy", -1) <= 1.0 or m.get("num-examples", 0) <= 0:
        problems.append(f"client {pid}: {m}")
for name in ("model.pt", "model-best.pt", "rounds.csv", "config.json"):
    if not (run_dir / name).is_file():
        problems.append(f"no {name}")
if problems:
    sys.exit("results: " + "; ".join(problems))
final = summary["final"]
print(
    f"docker/test.sh: results: {len(done)} rounds, final test balanced_accuracy "
    f"{final['balanced_accuracy']:.3f} (mean over clients); "
    + ", ".join(
        f"client {p}: {m['balanced_accuracy']:.3f} on {m['num-examples']} images"
        for p, m in sorted(per_client.items())
    )
)
EOF
grep -h "approved" <("${COMPOSE[@]}" logs --no-color supernode-a 2>&1) | tail -n 1 | sed 's/^/docker\/test.sh: hospital-a log: /'

# -- 6. teardown: the EXIT trap (cleanup above) -----------------------------------------------------
PASSED=1
exit 0
}
main "$@"
