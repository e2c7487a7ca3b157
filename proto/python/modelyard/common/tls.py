"""TLS for every listener of the project (gRPC and HTTP), from certificate and key files.

- `TlsFiles`: the server's certificate chain and key, and optionally a client CA: with it, clients
  must present a certificate that CA signed (mTLS).
- `grpc_server_credentials`: grpc's dynamic credentials; the files are looked at again on each new
  handshake and re-read when they changed (cert-manager renewals, Kubernetes secret swaps), without
  a restart. A broken new file keeps the previous certificate serving, with a warning.
- `HttpTls`: the same for an HTTP server (the metrics endpoint): each accepted connection gets
  a context built from the files again once they changed.
- `warn_if_plaintext`: a listener on a non-loopback address without TLS says so at start.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TlsFiles:
    cert: Path  # PEM certificate chain, the server's first
    key: Path  # PEM private key
    client_ca: Path | None = None  # PEM CA bundle: clients must present a certificate it signed

    @classmethod
    def from_settings(cls, cert: str, key: str, client_ca: str = "") -> TlsFiles | None:
        """None when no certificate is configured; ValueError when only half of a pair is."""
        if not cert and not key:
            if client_ca:
                raise ValueError("a client CA (mTLS) needs a server certificate and key too")
            return None
        if not cert or not key:
            raise ValueError("TLS needs both a certificate file and a key file")
        return cls(Path(cert), Path(key), Path(client_ca) if client_ca else None)

    def stamp(self) -> tuple[object, ...]:
        """What changes when any of the files changes (path targets, inode, size, mtime)."""
        out: list[object] = []
        for path in (self.cert, self.key, self.client_ca):
            if path is None:
                continue
            st = path.stat()
            out.append((os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns))
        return tuple(out)

    def read(self) -> tuple[bytes, bytes, bytes | None]:
        ca = self.client_ca.read_bytes() if self.client_ca else None
        return self.cert.read_bytes(), self.key.read_bytes(), ca


class _Watched:
    """The files' contents, re-read when their stamp changes; thread-safe (handshakes run on
    gRPC's and the HTTP server's threads)."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self._lock = threading.Lock()
        self._stamp = files.stamp()
        self.version = 0

    def changed(self) -> bool:
        """True once per change of the files (a missing file mid-swap counts as no change)."""
        try:
            stamp = self.files.stamp()
        except OSError:
            return False
        with self._lock:
            if stamp == self._stamp:
                return False
            self._stamp = stamp
            self.version += 1
            return True


def grpc_server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    cert, key, ca = files.read()
    watched = _Watched(files)

    def config(cert: bytes, key: bytes, ca: bytes | None) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        if not watched.changed():
            return None
        try:
            _context(files)  # a key that does not match its certificate (mid-swap) fails here
            fresh = config(*files.read())
        except Exception as exc:  # a half-written file: keep serving the previous certificate
            log.warning("TLS files changed but cannot be used (%s); keeping the previous ones", exc)
            return None
        log.info("TLS certificate reloaded from %s", files.cert)
        return fresh

    # The fetcher may return None ("no change"), which grpc-stubs' signature leaves out.
    fetcher = cast(Callable[[], grpc.ServerCertificateConfiguration], fetch)
    return grpc.dynamic_ssl_server_credentials(
        config(cert, key, ca), fetcher, require_client_authentication=files.client_ca is not None
    )


class HttpTls:
    """Server contexts for an HTTP listener: `current()` (called per accepted connection) gives a
    context built from the files again once they changed. Per connection rather than per SNI
    callback: scrapers that connect by IP address send no server name."""

    def __init__(self, files: TlsFiles) -> None:
        self._watched = _Watched(files)
        self._context = _context(files)

    def current(self) -> ssl.SSLContext:
        if self._watched.changed():
            try:
                self._context = _context(self._watched.files)
                log.info("TLS certificate reloaded from %s", self._watched.files.cert)
            except (OSError, ssl.SSLError, ValueError) as exc:
                log.warning("TLS files changed but cannot be used (%s); keeping the previous ones", exc)
        return self._context


def _context(files: TlsFiles) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(files.cert, files.key)
    if files.client_ca is not None:
        context.load_verify_locations(cafile=files.client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def is_loopback(host: str) -> bool:
    if host in ("localhost", "localhost6"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name (or "" / 0.0.0.0 / [::]): assume it is reachable from elsewhere


def warn_if_plaintext(host: str, what: str, tls: TlsFiles | None) -> None:
    if tls is None and not is_loopback(host):
        log.warning(
            "%s listens on %s without TLS: anything that reaches this address can read and change its "
            "traffic (configure a certificate and key, see README Security)",
            what,
            host or "all addresses",
        )
