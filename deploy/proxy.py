"""The coordinating site's reverse proxy: nginx on the public address, the SuperLink on loopback.

Flower's SuperLink serves all its APIs on one HTTPS port: the Fleet API the hospitals' SuperNodes
use (``/v1/fleet/...``, every request signed with a registered key under
``--enable-supernode-auth``), and the Control API of the ``flwr`` CLI (``/v1/control/...``:
register a SuperNode, start, list and stop runs), which has no login in Flower's open-source
SuperLink, next to the ServerApp's runtime API and health routes.  Anyone who reaches that port
with the CA certificate every hospital holds could register a SuperNode of their own and join
the federation.  So the SuperLink listens on 127.0.0.1 only, and nginx, on the public address,
forwards exactly the Fleet API paths an authenticated SuperNode calls and refuses every other
request with 403 (docs/deploy.md, "The proxy"; docs/deploy-internals.md, "The proxy").

    # the server block, for the system's nginx (Debian: /etc/nginx/conf.d/ is read inside http {})
    python -m deploy.proxy --public 0.0.0.0:8000 --superlink 127.0.0.1:9093 \\
        --secrets deploy-secrets --out /etc/nginx/conf.d/fedderm.conf
    nginx -t && nginx -s reload

    # a whole nginx.conf for an nginx of its own (the loopback federation, the Docker proxy)
    python -m deploy.proxy --standalone --prefix /srv/fedderm/proxy ... --out proxy/nginx.conf
    nginx -p /srv/fedderm/proxy -c proxy/nginx.conf -e /srv/fedderm/proxy/error.log

Only the paths are checked here, on the request line exactly as the client sent it (no query, no
percent-encoding, no ``..``: what nginx would normalise is refused, never normalised and
forwarded); who may use them is the SuperLink's node authentication, which the proxy leaves
intact (the signed headers pass through and nginx talks TLS to the SuperLink, which
``--enable-supernode-auth`` requires).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from fedderm.accel.superlink import is_loopback

#: The Fleet API paths a SuperNode with a registered key calls (Flower 1.42's
#: ``flwr.supernode.fleet_http_connection``; all but ``deactivate-node``, the SuperNode's goodbye at
#: the end of its connection, are in a loopback run's access log).  Left out:
#: ``/v1/fleet/register-node`` and ``/v1/fleet/unregister-node``, which only a SuperNode without
#: a key calls to register itself (Flower refuses them under ``--enable-supernode-auth``; the proxy
#: refuses them even if that flag were forgotten).
FLEET_PATHS = (
    "/v1/fleet/activate-node",
    "/v1/fleet/deactivate-node",
    "/v1/fleet/send-node-heartbeat",
    "/v1/fleet/pull-messages",
    "/v1/fleet/push-messages",
    "/v1/fleet/get-run",
    "/v1/fleet/get-fab",
    "/v1/fleet/push-object",
    "/v1/fleet/pull-object",
    "/v1/fleet/confirm-message-received",
)

#: The SuperLink's own address on the coordinating host (``flower-superlink --host/--port``);
#: the ``flwr`` CLI of the coordinator uses it there (or through an SSH tunnel).
DEFAULT_SUPERLINK = "127.0.0.1:9093"
#: Where the hospitals reach the proxy.
DEFAULT_PUBLIC = "0.0.0.0:8000"

#: Flower's HTTP clients wait 30 s for an answer (``ProtobufClient``), ``fedderm-superlink`` holds
#: an idle pull up to ``FEDDERM_PULL_HOLD`` <= 10 s: nginx waits longer than either, so that a held
#: pull or a slow push is never cut by the proxy.
READ_TIMEOUT_S = 120
#: Flower sends arrays in chunks of at most 5 MiB (``FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE``); a request
#: body larger than this is refused (413) before it reaches the SuperLink.
MAX_BODY_MB = 64

#: ``--docker``: where docker/compose.yml's proxy service mounts the certificates, and its own folder
DOCKER_CERTS = Path("/etc/fedderm/certs")
DOCKER_PREFIX = Path("/var/lib/fedderm-proxy")
#: the unprivileged user of nginx's workers in the proxy image (Debian's nobody and nogroup)
DOCKER_USER = "nobody nogroup"

REFUSED = "fedderm proxy: this address serves only the Fleet API of SuperNodes (docs/deploy.md)"

#: the hostname nginx checks in the SuperLink's certificate (make_certs.py always puts it in the SAN)
UPSTREAM_TLS_NAME = "localhost"


@dataclass
class ProxyConfig:
    """What the nginx configuration is made from (paths absolute, as nginx reads them)."""

    public_host: str
    public_port: int
    superlink_host: str
    superlink_port: int
    cert: Path
    key: Path
    ca: Path
    read_timeout_s: int = READ_TIMEOUT_S
    max_body_mb: int = MAX_BODY_MB


def split_address(address: str, what: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); a clear error naming ``what`` otherwise."""
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} must be HOST:PORT, got {address!r}")
    if any(c.isspace() or c in ";{}'\"\\#$" for c in host):
        raise ValueError(f"{what}: {host!r} is not a host name or address")
    return host, int(port)


def _listen(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _path(path: Path) -> str:
    text = str(path)
    if any(c.isspace() or c in ";{}'\"\\#$" for c in text):
        raise ValueError(
            f"{text!r}: nginx paths here may not hold spaces, quotes, ';', '{{', '}}', '#' or '$'"
        )
    return text


def server_block(cfg: ProxyConfig) -> str:
    """The ``map``, ``upstream`` and ``server`` blocks (nginx's ``http`` context)."""
    paths = "|".join(p.removeprefix("/v1/fleet/") for p in FLEET_PATHS)
    upstream = _listen(cfg.superlink_host, cfg.superlink_port)
    return f"""\
# fedderm: the SuperLink's Fleet API, and nothing else, on the public address.
# Generated by deploy/proxy.py; regenerate it rather than editing it (docs/deploy.md, "The proxy").

# 1 for a request line that is exactly one of the Fleet API paths an authenticated SuperNode calls
# (case-sensitive, no query string, no percent-encoding, no "..": compared before nginx decodes it)
map $request_uri $fedderm_fleet_path {{
    default 0;
    "~^/v1/fleet/(?:{paths})$" 1;
}}

upstream fedderm_superlink {{
    server {upstream};
    keepalive 32;
}}

server {{
    listen {_listen(cfg.public_host, cfg.public_port)} ssl;
    server_name _;
    server_tokens off;

    ssl_certificate {_path(cfg.cert)};
    ssl_certificate_key {_path(cfg.key)};
    ssl_protocols TLSv1.2 TLSv1.3;
    ssl_session_cache shared:fedderm_tls:1m;

    client_max_body_size {cfg.max_body_mb}m;
    default_type text/plain;

    # in the server's rewrite phase, before any location is chosen
    if ($fedderm_fleet_path = 0) {{
        return 403 "{REFUSED}\\n";
    }}

    location / {{
        limit_except POST {{
            deny all;
        }}
        proxy_pass https://fedderm_superlink;
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        proxy_set_header X-Forwarded-For $remote_addr;
        # the SuperLink's own TLS (--enable-supernode-auth requires it), checked against the CA
        proxy_ssl_verify on;
        proxy_ssl_trusted_certificate {_path(cfg.ca)};
        proxy_ssl_name {UPSTREAM_TLS_NAME};
        proxy_ssl_session_reuse on;
        # held pulls (fedderm-superlink) and large pushes pass at once, in both directions
        proxy_buffering off;
        proxy_request_buffering off;
        proxy_connect_timeout 10s;
        proxy_read_timeout {cfg.read_timeout_s}s;
        proxy_send_timeout {cfg.read_timeout_s}s;
    }}
}}
"""


def standalone_config(
    cfg: ProxyConfig, prefix: Path, *, user: str | None = None, log_to_stderr: bool = False
) -> str:
    """A whole ``nginx.conf`` for an nginx of its own, in the foreground (``daemon off``: the
    process that starts it stops it), with its pid file and temporary files under ``prefix``, its
    logs there too or (``log_to_stderr``, a container's) on stderr and stdout."""
    prefix_s = _path(prefix)
    user_line = f"user {user};\n" if user else ""
    if log_to_stderr:
        error_log, access_log = "stderr", "/dev/stdout"
    else:
        error_log, access_log = f"{prefix_s}/error.log", f"{prefix_s}/access.log"
    return f"""\
# fedderm's proxy as an nginx of its own: nginx -p {prefix_s} -c <this file> -e {error_log}
{user_line}daemon off;
worker_processes 1;
pid {prefix_s}/nginx.pid;
error_log {error_log} warn;

events {{
    worker_connections 1024;
}}

http {{
    access_log {access_log};
    client_body_temp_path {prefix_s}/tmp/client_body;
    proxy_temp_path {prefix_s}/tmp/proxy;
    fastcgi_temp_path {prefix_s}/tmp/fastcgi;
    uwsgi_temp_path {prefix_s}/tmp/uwsgi;
    scgi_temp_path {prefix_s}/tmp/scgi;

{_indent(server_block(cfg))}}}
"""


def _indent(text: str) -> str:
    return "".join(f"    {line}" if line.strip() else line for line in text.splitlines(keepends=True))


def find_nginx() -> str:
    """The nginx executable (``FEDDERM_NGINX``, else PATH, else Debian's /usr/sbin/nginx)."""
    found = os.environ.get("FEDDERM_NGINX") or shutil.which("nginx")
    if not found and Path("/usr/sbin/nginx").is_file():
        found = "/usr/sbin/nginx"
    if not found:
        raise FileNotFoundError(
            "nginx is not installed: the SuperLink's public address is served by nginx, which forwards "
            "only the Fleet API (Debian/Ubuntu: apt-get install -y nginx; docs/deploy.md, 'The proxy')"
        )
    return found


def write_standalone(cfg: ProxyConfig, prefix: Path) -> Path:
    """Write ``<prefix>/nginx.conf`` and the folders it names; return the file."""
    prefix = Path(prefix).resolve()
    (prefix / "tmp").mkdir(parents=True, exist_ok=True)
    user = _worker_user() if os.geteuid() == 0 else None
    conf = prefix / "nginx.conf"
    conf.write_text(standalone_config(cfg, prefix, user=user))
    return conf


def _worker_user() -> str:
    """As root, nginx runs its workers as an unprivileged user: ``nobody`` with its own group
    (``nogroup`` on Debian; nginx's default group ``nobody`` does not exist there)."""
    import grp
    import pwd

    nobody = pwd.getpwnam("nobody")
    return f"nobody {grp.getgrgid(nobody.pw_gid).gr_name}"


def nginx_argv(conf: Path, prefix: Path, nginx: str | None = None) -> list[str]:
    """The command that runs the standalone config in the foreground."""
    return [nginx or find_nginx(), "-p", str(prefix), "-c", str(conf), "-e", str(Path(prefix) / "error.log")]


def check_config(conf: Path, prefix: Path, nginx: str | None = None) -> str:
    """``nginx -t`` on a standalone config: "" if nginx accepts it, else nginx's complaint."""
    res = subprocess.run([*nginx_argv(conf, prefix, nginx), "-t", "-q"], capture_output=True, text=True)
    return "" if res.returncode == 0 else (res.stderr or res.stdout).strip()


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    public_host, public_port = split_address(args.public, "--public")
    link_host, link_port = split_address(args.superlink, "--superlink")
    if args.docker:  # the paths inside the proxy container
        folder = DOCKER_CERTS
    elif args.secrets:
        folder = Path(args.secrets).expanduser().resolve() / "superlink"
    else:
        folder = None

    def pick(value: str | None, name: str) -> Path:
        if value:
            return Path(value).expanduser().resolve()
        if folder is None:
            raise ValueError(f"give --secrets (make_certs.py's --out) or --{name}")
        return folder / {"cert": "server.pem", "key": "server.key", "ca": "ca.crt"}[name]

    return ProxyConfig(
        public_host,
        public_port,
        link_host,
        link_port,
        cert=pick(args.cert, "cert"),
        key=pick(args.key, "key"),
        ca=pick(args.ca, "ca"),
        read_timeout_s=args.read_timeout,
        max_body_mb=args.max_body_mb,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--public", default=DEFAULT_PUBLIC, help=f"where hospitals connect (default {DEFAULT_PUBLIC})"
    )
    parser.add_argument(
        "--superlink",
        default=DEFAULT_SUPERLINK,
        help=f"the SuperLink's --host:--port (default {DEFAULT_SUPERLINK}; keep it on loopback)",
    )
    parser.add_argument("--secrets", help="make_certs.py's --out folder: its superlink/ files are used")
    parser.add_argument("--cert", help="TLS certificate (default <secrets>/superlink/server.pem)")
    parser.add_argument("--key", help="its private key (default <secrets>/superlink/server.key)")
    parser.add_argument(
        "--ca", help="the CA that signed the SuperLink's certificate (default <secrets>/superlink/ca.crt)"
    )
    parser.add_argument(
        "--read-timeout", type=int, default=READ_TIMEOUT_S, help="seconds nginx waits for the SuperLink"
    )
    parser.add_argument("--max-body-mb", type=int, default=MAX_BODY_MB, help="largest request body (MB)")
    parser.add_argument("--standalone", action="store_true", help="a whole nginx.conf (with --prefix)")
    parser.add_argument(
        "--prefix", help="--standalone: the folder for its pid file, logs and temporary files"
    )
    parser.add_argument(
        "--docker",
        action="store_true",
        help=f"the whole nginx.conf of docker/compose.yml's proxy service (certificates in {DOCKER_CERTS}, "
        "its mount of <secrets>/superlink; logs on stderr and stdout)",
    )
    parser.add_argument("--out", help="write here (default: print)")
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
        if args.docker:
            text = standalone_config(cfg, DOCKER_PREFIX, user=DOCKER_USER, log_to_stderr=True)
        elif args.standalone:
            if not args.prefix:
                raise ValueError(
                    "--standalone needs --prefix (the folder for its pid file, logs, temp files)"
                )
            text = standalone_config(cfg, Path(args.prefix).expanduser().resolve())
        else:
            text = server_block(cfg)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not is_loopback(cfg.superlink_host):
        print(
            f"warning: --superlink {args.superlink} is not a loopback address: whoever reaches it "
            "bypasses the proxy (docs/deploy.md, 'The proxy')",
            file=sys.stderr,
        )
    if args.out:
        out = Path(args.out).expanduser()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"wrote {out}: {args.public} -> https://{args.superlink}, the Fleet API only")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
