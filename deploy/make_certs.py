"""Create the certificates and keys of a fedderm deployment (one SuperLink, N hospitals).

Each hospital makes its own key pair and sends only the public key (the default)::

    python deploy/make_certs.py --keypair hospital-a --out hospital-a-keys      # at hospital A

and the coordinating site issues the certificates and registers the public keys it was sent::

    python deploy/make_certs.py --out deploy-secrets \\
        --superlink-host fl.example-hospital.org --superlink-host 10.1.2.3 \\
        --public-key hospital-a=received/hospital-a.pub --public-key hospital-b=received/hospital-b.pub

(``--hospital NAME`` instead makes a hospital's key pair here, for a rehearsal on one machine.)
Writes, under ``--out``:

    ca/ca.crt, ca/ca.key                 the private certificate authority (keep ca.key offline)
    superlink/ca.crt, server.pem, server.key
                                         the TLS certificate of the SuperLink and its proxy, valid
                                         for every ``--superlink-host`` (DNS name or IP address, as
                                         SAN) and for localhost / 127.0.0.1 (the SuperLink's own
                                         address, which the proxy and the flwr CLI use)
    hospitals/<name>/ca.crt, <name>.pub  what each hospital gets back (ca.crt) and its public key,
                                         registered at the SuperLink; ``<name>.key`` too for a
                                         ``--hospital`` (an EC P-384 key pair in OpenSSH format)
    register.sh                          the ``flwr supernode register`` commands, one per hospital

and prints what each host needs.  Private keys are created with mode 0600 from their first byte,
in folders of mode 0700, whatever the umask.  Pure Python (the ``cryptography`` package Flower
already depends on): no ``openssl`` or ``ssh-keygen`` needed, so it also runs on a Windows laptop.
An existing CA is reused (so hospitals can be added later without re-issuing everything);
existing hospital keys are never overwritten.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import secrets as _secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")
#: always in the SuperLink's certificate: the address it listens on behind the proxy, which the
#: proxy (``proxy_ssl_name localhost``), its own ServerApp and the coordinator's flwr CLI use
INTERNAL_HOSTS = ("localhost", "127.0.0.1")
#: the SuperLink's own port on 127.0.0.1 (deploy/proxy.py's DEFAULT_SUPERLINK) and the proxy's public port
SUPERLINK_PORT = 9093
PUBLIC_PORT = 8000
#: Flower accepts SuperNode keys on these curves (``flwr supernode register``)
NIST_CURVES = ("secp256r1", "secp384r1", "secp521r1")


@dataclass
class Secrets:
    """Where :func:`make_certs` put everything (all absolute paths)."""

    out: Path
    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    superlink_ca: Path
    hospitals: dict[str, dict[str, Path]] = field(default_factory=dict)
    register_script: Path | None = None


def private_dir(path: Path) -> Path:
    """Create ``path`` (and its parents) if needed and make it 0700, whatever the umask."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def _write(path: Path, data: bytes, private: bool = False) -> None:
    """Write ``path`` atomically (a new file, renamed over it).  A private file is created 0600 by
    ``os.open`` itself, so no moment exists when another user could read it (nor a half-written
    key after a crash); its folder is made 0700."""
    if private:
        private_dir(path.parent)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{_secrets.token_hex(8)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(tmp, flags, 0o600)
    try:
        os.fchmod(fd, 0o600 if private else 0o644)  # the umask only ever removed bits: set exactly
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _pem_key(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )


def _san(hosts: list[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def _check_name(name: str) -> str:
    if not name or not all(c.isalnum() or c in "-_." for c in name) or name.startswith("."):
        raise ValueError(
            f"hospital name {name!r} must be letters, digits, '-', '_' or '.' "
            "(it names files and the SuperNode)"
        )
    return name


def _load_or_create_ca(out: Path, org: str, days: int) -> tuple[x509.Certificate, rsa.RSAPrivateKey]:
    ca_crt, ca_key = out / "ca" / "ca.crt", out / "ca" / "ca.key"
    if ca_crt.exists() and ca_key.exists():
        key = serialization.load_pem_private_key(ca_key.read_bytes(), password=None)
        return x509.load_pem_x509_certificate(ca_crt.read_bytes()), key
    key = rsa.generate_private_key(public_exponent=65537, key_size=4096)
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, org),
            x509.NameAttribute(NameOID.COMMON_NAME, f"{org} federation CA"),
        ]
    )
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write(ca_key, _pem_key(key), private=True)
    _write(ca_crt, cert.public_bytes(serialization.Encoding.PEM))
    return cert, key


def _server_cert(ca: x509.Certificate, ca_key, hosts: list[str], org: str, days: int):
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.ORGANIZATION_NAME, org),
                    x509.NameAttribute(NameOID.COMMON_NAME, hosts[0]),
                ]
            )
        )
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(_san(hosts), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_encipherment=True,
                content_commitment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def make_hospital_key(directory: Path, name: str) -> tuple[Path, Path]:
    """An EC P-384 key pair in OpenSSH format (what ``flower-supernode`` and ``flwr supernode
    register`` read); an existing pair is kept."""
    _check_name(name)
    private, public = directory / f"{name}.key", directory / f"{name}.pub"
    if private.exists():  # never replaced; its public half written again if it went missing
        if not public.exists():
            _write(public, _public_of(private) + f" {name}\n".encode())
        return private, public
    if public.exists():
        raise ValueError(
            f"{public} exists without its private key (the key the hospital sent?): give it with "
            f"--public-key {name}={public}, or remove it to make a new pair here"
        )
    key = ec.generate_private_key(ec.SECP384R1())
    _write(
        private,
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
        ),
        private=True,
    )
    _write(
        public,
        key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        + f" {name}\n".encode(),
    )
    return private, public


def read_public_key(path: str | Path) -> bytes:
    """A hospital's OpenSSH public key file, checked as Flower will check it (an EC key on a NIST
    curve); returned as one OpenSSH line.  The file came from elsewhere: its errors name it."""
    path = Path(path).expanduser()
    try:
        with open(path, "rb") as fh:
            data = fh.read(16385)
    except OSError as err:
        raise ValueError(f"public key {path}: {err.strerror}") from None
    if len(data) > 16384:
        raise ValueError(f"public key {path}: larger than 16 KB, not an OpenSSH public key")
    try:
        key = serialization.load_ssh_public_key(data.strip())
    except (ValueError, TypeError, IndexError, UnsupportedAlgorithm) as err:
        raise ValueError(f"public key {path}: not an OpenSSH public key ({err})") from None
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name not in NIST_CURVES:
        kind = key.curve.name if isinstance(key, ec.EllipticCurvePublicKey) else type(key).__name__
        raise ValueError(
            f"public key {path}: a {kind} key; Flower's SuperNodes authenticate with an EC key on a "
            f"NIST curve ({', '.join(NIST_CURVES)}): ssh-keygen -t ecdsa -b 384"
        )
    return key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)


def add_public_key(directory: Path, name: str, source: str | Path) -> Path:
    """Put hospital ``name``'s public key (from ``source``) at ``directory/<name>.pub``.  A key
    already there is kept if it is the same key, and never silently replaced by another."""
    _check_name(name)
    key = read_public_key(source)
    target = directory / f"{name}.pub"
    if target.exists():
        if read_public_key(target) == key:
            return target
        raise ValueError(
            f"{target} already holds another public key for {name}; {source} differs. If the hospital "
            "made a new key pair, unregister its node (flwr supernode unregister) and remove the old file first"
        )
    _write(target, key + f" {name}\n".encode())
    return target


def make_keypair(out: str | Path, name: str) -> tuple[Path, Path]:
    """At a hospital: its own key pair in ``out`` (0700), the private key 0600.  Only the ``.pub``
    goes to the coordinating site."""
    return make_hospital_key(private_dir(Path(out).expanduser().resolve()), name)


def make_certs(
    out: str | Path,
    superlink_hosts: list[str],
    hospitals: list[str],
    *,
    public_keys: dict[str, str | Path] | None = None,
    org: str = "fedderm",
    days: int = 825,
    connection: str = "fedderm",
) -> Secrets:
    """Create (or extend) a deployment's CA and SuperLink certificate, register the public keys
    the hospitals sent (``public_keys``: name -> .pub file) and make a key pair for each of
    ``hospitals`` (a rehearsal's hospitals, whose private keys are then made here)."""
    out = Path(out).expanduser().resolve()
    hosts = list(dict.fromkeys([*(superlink_hosts or DEFAULT_HOSTS), *INTERNAL_HOSTS]))
    public_keys = dict(public_keys or {})
    names = [_check_name(h) for h in [*hospitals, *public_keys]]
    if len(set(names)) != len(names):
        raise ValueError(f"hospital names must be unique, got {names}")
    for path in public_keys.values():
        read_public_key(path)  # every key Flower would refuse is named before anything is written
    private_dir(out)
    ca, ca_key = _load_or_create_ca(out, org, days)
    ca_pem = ca.public_bytes(serialization.Encoding.PEM)
    cert, key = _server_cert(ca, ca_key, hosts, org, days)
    link = out / "superlink"
    _write(link / "server.key", _pem_key(key), private=True)
    _write(link / "server.pem", cert.public_bytes(serialization.Encoding.PEM))
    _write(link / "ca.crt", ca_pem)
    secrets = Secrets(
        out=out,
        ca_cert=out / "ca" / "ca.crt",
        ca_key=out / "ca" / "ca.key",
        server_cert=link / "server.pem",
        server_key=link / "server.key",
        superlink_ca=link / "ca.crt",
    )
    for name in names:
        folder = private_dir(out / "hospitals" / name)
        if name in public_keys:
            public = add_public_key(folder, name, public_keys[name])
            private = folder / f"{name}.key"
            if private.exists() and read_public_key(public) != _public_of(private):
                raise ValueError(f"{private} is not the private key of {public}: remove one of them")
            paths = {"public": public, "ca": folder / "ca.crt"}
            if private.exists():
                paths["private"] = private
        else:
            private, public = make_hospital_key(folder, name)
            paths = {"private": private, "public": public, "ca": folder / "ca.crt"}
        _write(folder / "ca.crt", ca_pem)
        secrets.hospitals[name] = paths
    lines = [
        "#!/usr/bin/env sh",
        "# Run on the machine with the flwr CLI that administers the SuperLink",
        f"# (connection {connection!r} in $FLWR_HOME/config.toml).",
        "set -e",
    ]
    lines += [
        f'flwr supernode register "{p["public"]}" {connection} --name {n}'
        for n, p in secrets.hospitals.items()
    ]
    secrets.register_script = out / "register.sh"
    _write(secrets.register_script, ("\n".join(lines) + "\n").encode())
    os.chmod(secrets.register_script, 0o755)
    return secrets


def _public_of(private: Path) -> bytes:
    key = serialization.load_ssh_private_key(private.read_bytes(), None)
    return key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)


def describe(
    secrets: Secrets,
    hosts: list[str],
    connection: str = "fedderm",
    port: int = PUBLIC_PORT,
    superlink_port: int = SUPERLINK_PORT,
) -> str:
    """What each host needs, as printed by the script."""
    host = hosts[0] if hosts else "127.0.0.1"
    link = f"127.0.0.1:{superlink_port}"
    lines = [
        f"Certificates and keys are in {secrets.out}",
        "",
        f"Keep offline: {secrets.ca_key} (only needed to issue a new SuperLink certificate).",
        "",
        "Coordinating site (SuperLink host) needs:",
        f"  {secrets.superlink_ca}    -> fedderm-superlink --ssl-ca-certfile",
        f"  {secrets.server_cert}    -> fedderm-superlink --ssl-certfile",
        f"  {secrets.server_key}    -> fedderm-superlink --ssl-keyfile   (private)",
        f"  the SuperLink on loopback only: fedderm-superlink ... --host 127.0.0.1 --port {superlink_port}",
        f"  the proxy on the public address (the Fleet API only): python -m deploy.proxy --secrets {secrets.out} \\",
        f"      --public 0.0.0.0:{port} --superlink {link} --out /etc/nginx/conf.d/fedderm.conf",
        f"  every hospital's .pub, to register:   sh {secrets.register_script}",
        "",
        "The flwr CLI (on the SuperLink host, or through `ssh -N -L "
        f"{superlink_port}:{link} <SuperLink host>`) needs in $FLWR_HOME/config.toml:",
        f"  [superlink.{connection}]",
        f'  address = "{link}"',
        f'  root-certificates = "{secrets.ca_cert}"',
        "",
    ]
    for name, paths in secrets.hospitals.items():
        lines += [
            f"Hospital {name} (its SuperNode host) needs:",
            f"  {paths['ca']}    -> fedderm-supernode --root-certificates",
            f"  --superlink {host}:{port}",
        ]
        if "private" in paths:
            lines += [
                f"  {paths['private']}    -> fedderm-supernode --auth-supernode-private-key   (private;"
                " made here: a rehearsal's key, never sent by e-mail)",
            ]
        else:
            lines += [f"  its own private key for {paths['public'].name}   -> --auth-supernode-private-key"]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", required=True, help="output folder (created, mode 0700; an existing CA in it is reused)"
    )
    parser.add_argument(
        "--keypair",
        metavar="NAME",
        help="at a hospital: make only its own key pair NAME.key / NAME.pub in --out, and send NAME.pub",
    )
    parser.add_argument(
        "--superlink-host",
        action="append",
        default=[],
        help="DNS name or IP address the hospitals use to reach the SuperLink's proxy; repeat for "
        f"several (default: {', '.join(DEFAULT_HOSTS)}; {' and '.join(INTERNAL_HOSTS)} are always added)",
    )
    parser.add_argument(
        "--public-key",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="a hospital's public key (the .pub it sent): registered as hospital NAME; repeat per hospital",
    )
    parser.add_argument(
        "--hospital",
        action="append",
        default=[],
        help="rehearsal: make hospital NAME's key pair here (its private key then has to reach it); repeat",
    )
    parser.add_argument("--org", default="fedderm", help="organisation name in the certificates")
    parser.add_argument("--days", type=int, default=825, help="validity of the certificates in days")
    parser.add_argument(
        "--port", type=int, default=PUBLIC_PORT, help=f"the proxy's public port (default {PUBLIC_PORT})"
    )
    parser.add_argument(
        "--superlink-port",
        type=int,
        default=SUPERLINK_PORT,
        help=f"the SuperLink's own port on 127.0.0.1 (default {SUPERLINK_PORT})",
    )
    parser.add_argument(
        "--connection",
        default="fedderm",
        help="name of the SuperLink connection in the flwr CLI's config.toml",
    )
    args = parser.parse_args(argv)
    try:
        if args.keypair:
            private, public = make_keypair(args.out, args.keypair)
            print(f"private key (stays here, mode 0600): {private}")
            print(f"public key (send it to the coordinating site): {public}")
            return 0
        public_keys = {}
        for item in args.public_key:
            name, sep, path = item.partition("=")
            if not sep or not path:
                raise ValueError(f"--public-key takes NAME=FILE, got {item!r}")
            if name in public_keys:
                raise ValueError(f"--public-key {name} given twice")
            public_keys[name] = path
        hosts = args.superlink_host or list(DEFAULT_HOSTS)
        secrets = make_certs(
            args.out,
            hosts,
            args.hospital,
            public_keys=public_keys,
            org=args.org,
            days=args.days,
            connection=args.connection,
        )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(describe(secrets, hosts, args.connection, args.port, args.superlink_port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
