"""Settings of one sidecar process. Every value has a flag and a MODELYARD_SIDECAR_* variable."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from modelyard.common import grpc_server, logs, tls
from modelyard.common.settings import parse_settings as parse

ENV_PREFIX = "MODELYARD_SIDECAR_"


@dataclass(frozen=True)
class Settings:
    listen: str = "127.0.0.1:50051"
    upstream: tuple[str, ...] = ("127.0.0.1:50052",)
    admin_listen: str = "127.0.0.1:9101"  # /metrics, /breakers, /canary; empty disables it
    config: str = ""  # the route file (YAML); empty: defaults and admin changes only
    config_poll_s: float = 1.0
    grace_s: float = 10.0
    max_message_bytes: int = 64 * 1024 * 1024
    # Connections of the gRPC listener (modelyard/common/grpc_server.py): open streams each, idle
    # and age limits (0: none), and the time a new connection has for its handshake.
    grpc_max_concurrent_streams: int = 256
    grpc_max_connection_idle_s: float = 300.0
    grpc_max_connection_age_s: float = 3600.0
    grpc_max_connection_age_grace_s: float = 60.0
    grpc_handshake_timeout_s: float = 10.0
    # TLS of the gRPC listener and the admin endpoint, as the service's: certificate and key,
    # optional client CA (mTLS).
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    # TLS to the upstreams, as the gateway's: on with upstream_tls or any of the files below.
    upstream_tls: bool = False
    upstream_ca: str = ""
    upstream_cert: str = ""
    upstream_key: str = ""
    upstream_server_name: str = ""
    # The admin endpoint's credential: bearer tokens (one per line, the service's format) for any
    # change (PUT /canary); with admin_auth_reads, for every request.
    admin_tokens_file: str = ""
    admin_auth_reads: bool = False
    # What one admin connection may cost (sidecar/admin.py).
    admin_header_timeout_s: float = 10.0
    admin_body_timeout_s: float = 10.0
    admin_idle_timeout_s: float = 30.0
    admin_max_body_bytes: int = 64 * 1024
    admin_max_connections: int = 64
    log_level: str = "INFO"
    log_format: str = "text"


_HELP = {
    "listen": "gRPC address HOST:PORT the clients call (port 0 picks a free port)",
    "upstream": "a service HOST:PORT, optionally @VERSION[+VERSION] it alone serves; repeat for several",
    "admin_listen": "admin HTTP address HOST:PORT (/metrics, /breakers, /canary); empty disables it",
    "config": "route file (YAML): canary weights, versions, breaker thresholds, tenant limits",
    "config_poll_s": "seconds between checks of the route file for changes",
    "grace_s": "seconds in-flight calls get to finish on shutdown",
    "max_message_bytes": "largest request or response message, in bytes",
    "tls_cert": "PEM certificate chain of the gRPC and admin listeners; empty: no TLS",
    "tls_key": "PEM private key for tls_cert",
    "tls_client_ca": "PEM CA bundle; when set, clients must present a certificate it signed (mTLS)",
    **tls.UPSTREAM_HELP,
    "admin_tokens_file": "file of bearer tokens, one per line; admin changes (PUT /canary) then need one",
    "admin_auth_reads": "require a token for the admin endpoint's reads too (/metrics, /breakers, /canary)",
    "admin_header_timeout_s": "seconds an admin request's TLS handshake and head may take (then 408/closed)",
    "admin_body_timeout_s": "seconds an admin request's body may take to arrive (then 408)",
    "admin_idle_timeout_s": "seconds an idle admin keep-alive connection stays open",
    "admin_max_body_bytes": "largest admin request body, in bytes (larger: 413)",
    "admin_max_connections": "admin connections open at once (more: 503 and closed)",
    **grpc_server.HELP,
    **logs.HELP,
}
_CHOICES = logs.CHOICES


def parse_settings(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """Flags override environment variables, which override the defaults."""
    return parse(
        Settings,
        ENV_PREFIX,
        argv,
        environ,
        prog="modelyard sidecar",
        description="Route, dye and guard calls to Modelyard services.",
        help=_HELP,
        choices=_CHOICES,
    )
