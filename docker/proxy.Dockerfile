# fedderm's proxy image: Debian's nginx, in front of the SuperLink on the coordinating host.  It
# runs the configuration that deploy/proxy.py writes (docs/deploy.md, "The proxy"):
#
#   python -m deploy.proxy --docker --public 0.0.0.0:8000 --superlink 127.0.0.1:9093 \
#       --out deploy-secrets/proxy/nginx.conf
#
# mounted at /etc/fedderm/nginx.conf, the SuperLink's certificate folder at /etc/fedderm/certs
# (docker/compose.yml's proxy service).  It forwards only the Fleet API, which the hospitals'
# SuperNodes use, and refuses every other request with 403.
# BASE_IMAGE: Debian's image by default; docker/test.sh passes its locally made Debian root file
# system when Docker Hub is out of reach.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}

RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends nginx \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /var/lib/fedderm-proxy/tmp \
    && nginx -v

# in the foreground, its logs on stderr/stdout (docker logs), as the generated configuration says
ENTRYPOINT ["nginx", "-p", "/var/lib/fedderm-proxy", "-c", "/etc/fedderm/nginx.conf", "-e", "stderr"]
