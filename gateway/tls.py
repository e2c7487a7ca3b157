"""TLS of the gateway: its HTTP listener (TLS, mTLS with a client CA) and its channel to the upstream.

uvicorn hands one SSLContext to asyncio when the server starts, and asyncio keeps it for every
connection; a renewed certificate must still be served without a restart. So the listening context
has a server-name callback, which OpenSSL runs on every handshake (with `None` when the client sends
no name, as when it connects by IP address): it swaps in `HttpTls.current()`, the context built
again from the files once they changed (a broken new file keeps the previous one).
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc
from modelyard.common.tls import HttpTls, TlsFiles

from gateway.config import Settings


def listener_context(files: TlsFiles) -> ssl.SSLContext:
    contexts = HttpTls(files)

    def swap(connection: ssl.SSLObject, server_name: str | None, listening: ssl.SSLContext) -> None:
        # The connection keeps the verify mode it started with (CERT_REQUIRED under mTLS: every
        # context of these files has it) and takes the new context's certificate and CA store.
        connection.context = contexts.current()

    # The first context serves until the files change; it is the one the callback swaps to meanwhile.
    listening = contexts.current()
    listening.sni_callback = swap
    return listening


@dataclass(frozen=True)
class UpstreamTls:
    """How the gateway reaches its upstream over TLS: a CA bundle to verify it (None: the system's
    roots), and optionally a client certificate and key for mTLS."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    server_name: str = ""  # the name checked in the upstream's certificate; "": the address's host

    @classmethod
    def from_settings(cls, settings: Settings) -> UpstreamTls | None:
        """None for a plaintext upstream; ValueError when only half of a client pair is given."""
        ca, cert, key = settings.upstream_ca, settings.upstream_cert, settings.upstream_key
        if bool(cert) != bool(key):
            raise ValueError("the upstream client certificate needs both upstream_cert and upstream_key")
        if not (settings.upstream_tls or ca or cert or settings.upstream_server_name):
            return None
        return cls(_path(ca), _path(cert), _path(key), settings.upstream_server_name)

    def stamp(self) -> tuple[object, ...]:
        """What changes when any of the files changes (path targets, inode, size, mtime)."""
        out: list[object] = []
        for path in (self.ca, self.cert, self.key):
            if path is not None:
                st = path.stat()
                out.append((os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns))
        return tuple(out)

    def credentials(self) -> grpc.ChannelCredentials:
        """The files as they are now; ValueError/OSError for a client key that is not its
        certificate's (mid-swap) or an unreadable file. grpc fixes a channel's credentials for its
        life: a change of the files takes a new channel."""
        if self.cert is not None and self.key is not None:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(self.cert, self.key)  # SSLError: OSError
        root = self.ca.read_bytes() if self.ca else None
        key = self.key.read_bytes() if self.key else None
        cert = self.cert.read_bytes() if self.cert else None
        return grpc.ssl_channel_credentials(root, key, cert)

    def options(self) -> list[tuple[str, int | str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def _path(value: str) -> Path | None:
    return Path(value) if value else None
