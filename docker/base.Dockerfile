# A stand-in for Flower's official base image, for a Docker host that cannot pull flwr/* images
# (docker/test.sh builds it here).  Hospitals keep the official images: see BASE_IMAGE in
# docker/superlink.Dockerfile and docker/supernode.Dockerfile.
#
# It reproduces what fedderm's images rely on in Flower's images: Python with `flwr` in a
# virtual environment at /python/venv (on PATH), a user `app` with uid 49999 who owns it, and
# WORKDIR /app.  ROOTFS_IMAGE is any Debian/Ubuntu root file system with python3 and python3-venv;
# docker/test.sh makes one with debootstrap (Debian bookworm: Python 3.11) and `docker import`.
#
#   docker build -f docker/base.Dockerfile --build-arg ROOTFS_IMAGE=fedderm-rootfs:bookworm \
#       -t fedderm-flwr-base:1.41.0 .
ARG ROOTFS_IMAGE=fedderm-rootfs:bookworm
FROM ${ROOTFS_IMAGE}

ARG FLWR_VERSION=1.41.0
ARG PIP_ARGS=""
RUN useradd --create-home --uid 49999 --user-group app \
    && install -d -o app -g app /python /app
USER app
ENV HOME=/home/app \
    PATH=/python/venv/bin:$PATH \
    LANG=C.UTF-8 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
RUN python3 -m venv /python/venv \
    && python -m pip install --no-cache-dir ${PIP_ARGS} flwr==${FLWR_VERSION}
WORKDIR /app
