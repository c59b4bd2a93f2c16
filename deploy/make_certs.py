"""Create the certificates and keys of a fedderm deployment (one SuperLink, N hospitals).

    python deploy/make_certs.py --out deploy-secrets \\
        --superlink-host fl.example-hospital.org --superlink-host 10.1.2.3 \\
        --hospital hospital-a --hospital hospital-b --hospital hospital-c

Writes, under ``--out``:

    ca/ca.crt, ca/ca.key                 the private certificate authority (keep ca.key offline)
    superlink/ca.crt, server.pem, server.key
                                         the SuperLink's TLS certificate, valid for every
                                         ``--superlink-host`` (DNS name or IP address, as SAN)
    hospitals/<name>/ca.crt, <name>.key, <name>.pub
                                         one EC (NIST P-384) key pair per hospital in OpenSSH
                                         format: the private key authenticates that hospital's
                                         SuperNode, the public key is registered at the SuperLink
    register.sh                          the ``flwr supernode register`` commands, one per hospital

and prints what each host needs.  Pure Python (the ``cryptography`` package Flower already
depends on): no ``openssl`` or ``ssh-keygen`` needed, so it also runs on a Windows laptop.
An existing CA is reused (so hospitals can be added later without re-issuing everything);
existing hospital keys are never overwritten.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")


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


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    if private:
        os.chmod(path, 0o600)


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
    private, public = directory / f"{name}.key", directory / f"{name}.pub"
    if private.exists() and public.exists():
        return private, public
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


def make_certs(
    out: str | Path,
    superlink_hosts: list[str],
    hospitals: list[str],
    *,
    org: str = "fedderm",
    days: int = 825,
    connection: str = "fedderm",
) -> Secrets:
    """Create (or extend) a deployment's CA, SuperLink certificate and hospital key pairs."""
    out = Path(out).expanduser().resolve()
    hosts = list(dict.fromkeys(superlink_hosts or DEFAULT_HOSTS))
    names = [_check_name(h) for h in hospitals]
    if len(set(names)) != len(names):
        raise ValueError(f"hospital names must be unique, got {names}")
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
        folder = out / "hospitals" / name
        private, public = make_hospital_key(folder, name)
        _write(folder / "ca.crt", ca_pem)
        secrets.hospitals[name] = {"private": private, "public": public, "ca": folder / "ca.crt"}
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


def describe(secrets: Secrets, hosts: list[str], connection: str = "fedderm", port: int = 8000) -> str:
    """What each host needs, as printed by the script."""
    host = hosts[0] if hosts else "127.0.0.1"
    lines = [
        f"Certificates and keys are in {secrets.out}",
        "",
        f"Keep offline: {secrets.ca_key} (only needed to issue a new SuperLink certificate).",
        "",
        "Coordinating site (SuperLink host) needs:",
        f"  {secrets.superlink_ca}    -> flower-superlink --ssl-ca-certfile",
        f"  {secrets.server_cert}    -> flower-superlink --ssl-certfile",
        f"  {secrets.server_key}    -> flower-superlink --ssl-keyfile   (private)",
        f"  every hospital's .pub, to register:   sh {secrets.register_script}",
        "",
        "The flwr CLI (whoever starts runs) needs in $FLWR_HOME/config.toml:",
        f"  [superlink.{connection}]",
        f'  address = "{host}:{port}"',
        f'  root-certificates = "{secrets.ca_cert}"',
        "",
    ]
    for name, paths in secrets.hospitals.items():
        lines += [
            f"Hospital {name} (its SuperNode host) needs:",
            f"  {paths['ca']}    -> flower-supernode --root-certificates",
            f"  {paths['private']}    -> flower-supernode --auth-supernode-private-key   (private)",
            f"  and sends {paths['public']} to the coordinating site to be registered.",
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", required=True, help="output folder (created; an existing CA in it is reused)"
    )
    parser.add_argument(
        "--superlink-host",
        action="append",
        default=[],
        help="DNS name or IP address the hospitals use to reach the SuperLink; repeat for "
        f"several (default: {', '.join(DEFAULT_HOSTS)})",
    )
    parser.add_argument("--hospital", action="append", default=[], help="hospital name; repeat per hospital")
    parser.add_argument("--org", default="fedderm", help="organisation name in the certificates")
    parser.add_argument("--days", type=int, default=825, help="validity of the certificates in days")
    parser.add_argument(
        "--port", type=int, default=8000, help="the SuperLink's port (flower-superlink --port)"
    )
    parser.add_argument(
        "--connection",
        default="fedderm",
        help="name of the SuperLink connection in the flwr CLI's config.toml",
    )
    args = parser.parse_args(argv)
    hosts = args.superlink_host or list(DEFAULT_HOSTS)
    try:
        secrets = make_certs(
            args.out, hosts, args.hospital, org=args.org, days=args.days, connection=args.connection
        )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(describe(secrets, hosts, args.connection, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
