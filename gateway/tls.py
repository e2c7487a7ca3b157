"""TLS of the gateway: its HTTP listener (TLS, mTLS with a client CA) and its channel to the upstream.

uvicorn hands one SSLContext to asyncio when the server starts, and asyncio keeps it for every
connection; a renewed certificate must still be served without a restart. So the listening context
has a server-name callback, which OpenSSL runs on every handshake (with `None` when the client sends
no name, as when it connects by IP address): it swaps in `HttpTls.current()`, the context built
again from the files once they changed (a broken new file keeps the previous one).
"""

from __future__ import annotations

import ssl

from modelyard.gateway.settings import Settings
from modelyard.process.tls import ClientTls, HttpTls, TlsFiles


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


class UpstreamTls(ClientTls):
    """The gateway's channel to its upstream (modelyard.process.tls.ClientTls), from its settings."""

    @classmethod
    def of(cls, settings: Settings) -> UpstreamTls | None:
        return cls.from_settings(
            settings.upstream_tls,
            settings.upstream_ca,
            settings.upstream_cert,
            settings.upstream_key,
            settings.upstream_server_name,
        )
