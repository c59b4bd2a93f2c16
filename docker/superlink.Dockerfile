# fedderm superlink image: Flower's official superlink image plus fedderm's dependencies and
# `fedderm-superlink` (flower-superlink with the messages' objects in memory and only the link
# state in --database: docs/deploy.md).
# Build from the repository root:  docker build -f docker/superlink.Dockerfile -t fedderm-superlink .
# Why: the ServerApp runs inside this container (isolation subprocess): it needs
# fedderm's dependencies (torch, ...), and writes results to /app/fedderm-results.
# The app code itself is not in the image: `flwr run` ships it (the FAB) with every run; the image
# installs only the `fedderm` core package, for fedderm-superlink.
#
# FLWR_TAG: an Ubuntu variant (PyTorch has no wheels for the Alpine default tags); its flwr must
# satisfy pyproject.toml's range (checked below).  BASE_IMAGE: Flower's image by default; a host
# that cannot pull it builds docker/base.Dockerfile and passes that (docker/test.sh does).
# PIP_ARGS: extra pip options, e.g. "--index-url <a CPU-only PyTorch index>" for a smaller image
# on hosts without a GPU, or "--no-index --find-links <a wheelhouse URL>" (docker/test.sh).
ARG FLWR_TAG=1.41.0-py3.12-ubuntu24.04
ARG BASE_IMAGE=flwr/superlink:${FLWR_TAG}
FROM ${BASE_IMAGE}

ARG PIP_ARGS=""
WORKDIR /app
# the same two steps as docker/supernode.Dockerfile: on one base image both share this layer
COPY --chown=app:app pyproject.toml docker/requirements.py /app/build/
RUN python /app/build/requirements.py /app/build/pyproject.toml > /app/build/requirements.txt \
    && python -m pip install --no-cache-dir ${PIP_ARGS} -r /app/build/requirements.txt \
    && python /app/build/requirements.py --check /app/build/pyproject.toml

# fedderm's core package (fedderm-superlink), without dependencies: they are all installed above
COPY --chown=app:app README.md /app/build/
COPY --chown=app:app fedderm /app/build/fedderm
RUN python -m pip install --no-cache-dir --no-deps ${PIP_ARGS} /app/build \
    && rm -rf /app/build && mkdir -p /app/state /app/fedderm-results \
    && command -v fedderm-superlink

# Apps run with the dependencies installed above, never a `uv sync` at run time.  The SuperLink's
# SuperExec keeps Flower's 1 s task poll: it only starts a run's ServerApp.
ENV FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 \
    FLWR_TELEMETRY_ENABLED=0

ENTRYPOINT ["fedderm-superlink"]
