"""Test certificates, made in the test with the `cryptography` package: a CA, and server and client
certificates it signs (written as PEM files)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pem:
    cert: Path
    key: Path

    def read(self) -> tuple[bytes, bytes]:
        return self.cert.read_bytes(), self.key.read_bytes()


class Authority:
    def __init__(self, folder: Path, name: str) -> None:
        self.folder = folder
        self.name = name
        self._key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self._subject = subject
        self.cert = (
            _builder(subject, subject, self._key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"{name}.pem"
        self.path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, name: str, server: bool) -> Pem:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        builder = _builder(subject, self._subject, key.public_key())
        if server:
            sans: list[x509.GeneralName] = [
                x509.DNSName("localhost"),
                x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            ]
            usage = ExtendedKeyUsageOID.SERVER_AUTH
        else:
            sans, usage = [x509.DNSName(name)], ExtendedKeyUsageOID.CLIENT_AUTH
        cert = (
            builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        pem = Pem(self.folder / f"{name}.crt", self.folder / f"{name}.key")
        pem.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        pem.key.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return pem


def make_pki(folder: Path) -> dict[str, Any]:
    """A CA with a server and two clients, and a rogue CA's client with a name the first CA issued."""
    ca = Authority(folder / "pki", "test-ca")
    rogue = Authority(folder / "rogue", "rogue-ca")
    return {
        "ca": ca,
        "server": ca.issue("server", server=True),
        "client": ca.issue("good-client", server=False),
        "other": ca.issue("other-client", server=False),
        "rogue": rogue.issue("good-client", server=False),  # the right name, the wrong CA
    }


def install(source: Pem, target: Pem) -> None:
    """Put `source`'s files at `target`'s paths as cert-manager does: new files renamed into place."""
    for new, path in ((source.cert, target.cert), (source.key, target.key)):
        staged = path.with_suffix(".new")
        staged.write_bytes(new.read_bytes())
        staged.replace(path)


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )
