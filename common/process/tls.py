"""TLS for every listener of the project (gRPC and HTTP), from certificate and key files.

- `TlsFiles`: the server's certificate chain and key, and optionally a client CA: with it, clients
  must present a certificate that CA signed (mTLS).
- `grpc_server_credentials`: grpc's dynamic credentials; the files are looked at again on each new
  handshake and re-read when they changed (cert-manager renewals, Kubernetes secret swaps), without
  a restart. A broken new file keeps the previous certificate serving, with a warning.
- `HttpTls`: the same for an HTTP server (the metrics endpoint): each accepted connection gets
  a context built from the files again once they changed.
- `ClientTls`: the files a gRPC client (the gateway's or the sidecar's upstream channel) verifies
  its server with and, for mTLS, presents itself; grpc fixes a channel's credentials for its life,
  so a change of the files (compare `stamp()`) takes a new channel.
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
from typing import Annotated, Self, cast

import grpc
from msgspec import Meta

log = logging.getLogger(__name__)


# The settings that make a ClientTls (`upstream_ca: tls.UpstreamCa = ""`), for the processes that have them.
UpstreamTls = Annotated[
    bool,
    Meta(
        description="reach the upstream over TLS, verified with the system's roots unless upstream_ca is set"
    ),
]
UpstreamCa = Annotated[
    str, Meta(description="PEM CA bundle that signed the upstream's certificate (implies upstream_tls)")
]
UpstreamCert = Annotated[str, Meta(description="PEM client certificate presented to the upstream (mTLS)")]
UpstreamKey = Annotated[str, Meta(description="PEM private key for upstream_cert")]
UpstreamServerName = Annotated[
    str, Meta(description="name to check in the upstream's certificate instead of the address's host")
]


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
        return _stamp(self.cert, self.key, self.client_ca)

    def read(self) -> tuple[bytes, bytes, bytes | None]:
        ca = self.client_ca.read_bytes() if self.client_ca else None
        return self.cert.read_bytes(), self.key.read_bytes(), ca


@dataclass(frozen=True)
class ClientTls:
    """How a gRPC client reaches its server over TLS: a CA bundle to verify it (None: the system's
    roots), and optionally a client certificate and key for mTLS."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    server_name: str = ""  # the name checked in the server's certificate; "": the address's host

    @classmethod
    def from_settings(
        cls, enabled: bool, ca: str = "", cert: str = "", key: str = "", server_name: str = ""
    ) -> Self | None:
        """None for plaintext (not `enabled` and no file or name given); ValueError when only half
        of a client pair is given."""
        if bool(cert) != bool(key):
            raise ValueError("a client certificate for the upstream needs both its certificate and key")
        if not (enabled or ca or cert or server_name):
            return None
        return cls(_path(ca), _path(cert), _path(key), server_name)

    def stamp(self) -> tuple[object, ...]:
        """What changes when any of the files changes (path targets, inode, size, mtime)."""
        return _stamp(self.ca, self.cert, self.key)

    def credentials(self) -> grpc.ChannelCredentials:
        """The files as they are now; ValueError/OSError for a client key that is not its
        certificate's (mid-swap) or an unreadable file."""
        if self.cert is not None and self.key is not None:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(self.cert, self.key)  # SSLError: OSError
        root = self.ca.read_bytes() if self.ca else None
        key = self.key.read_bytes() if self.key else None
        cert = self.cert.read_bytes() if self.cert else None
        return grpc.ssl_channel_credentials(root, key, cert)

    def options(self) -> list[tuple[str, int | str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


class Renewals:
    """Follows a ClientTls's files for a client that keeps its channels: `renewed()` gives new
    channel credentials once the files changed and are usable, else None. A half-written swap
    (a key that is not its certificate's, an unreadable file) keeps the previous credentials, with
    a warning, and is tried again on the next change."""

    def __init__(self, tls: ClientTls) -> None:
        self._tls = tls
        self._stamp = tls.stamp()

    def renewed(self) -> grpc.ChannelCredentials | None:
        try:
            stamp = self._tls.stamp()
            if stamp == self._stamp:
                return None
            self._stamp = stamp
            return self._tls.credentials()
        except (OSError, ValueError) as exc:
            log.warning("upstream TLS files changed but cannot be used (%s); keeping the previous ones", exc)
            return None


def _path(value: str) -> Path | None:
    return Path(value) if value else None


def _stamp(*paths: Path | None) -> tuple[object, ...]:
    out: list[object] = []
    for path in paths:
        if path is not None:
            st = path.stat()
            out.append((os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


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
            "traffic (configure a certificate and key, see docs/security.md)",
            what,
            host or "all addresses",
        )
