"""Settings of one sidecar process. Every value has a flag and a MODELYARD_SIDECAR_* variable,
declared once below: type, default, help and allowed values (see modelyard.process.settings)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated

from msgspec import Meta

from modelyard.common.names import echo, is_valid_name
from modelyard.process import grpc_server, logs, tls
from modelyard.process.settings import LISTEN, LISTEN_OR_EMPTY
from modelyard.process.settings import parse_settings as parse

ENV_PREFIX = "MODELYARD_SIDECAR_"


def check_upstream(text: str) -> tuple[str, tuple[str, ...]]:
    """`HOST:PORT[@VERSION[+VERSION...]]` as (address, versions); ValueError saying what is wrong."""
    address, at, label = text.partition("@")
    host, _, port = address.rpartition(":")
    if not host.strip("[]") or not (port.isascii() and port.isdigit()) or not 0 < int(port) <= 65535:
        raise ValueError(f"upstream {echo(text)} is not HOST:PORT[@VERSION[+VERSION...]] (port 1-65535)")
    versions = tuple(label.split("+")) if at else ()
    for version in versions:
        if not is_valid_name(version):
            raise ValueError(f"upstream {echo(text)}: version label {echo(version)} is not a version")
    return address, versions


def _upstreams(values: tuple[str, ...]) -> None:
    if not values:
        raise ValueError("no upstream: give at least one HOST:PORT")
    for value in values:
        check_upstream(value)


UPSTREAMS = Meta(extra={"check": _upstreams})


@dataclass(frozen=True)
class Settings:
    listen: Annotated[
        str, LISTEN, Meta(description="gRPC address HOST:PORT the clients call (port 0 picks a free port)")
    ] = "127.0.0.1:50051"
    upstream: Annotated[
        tuple[str, ...],
        UPSTREAMS,
        Meta(
            description="a service HOST:PORT, optionally @VERSION[+VERSION] it alone serves; "
            "repeat for several"
        ),
    ] = ("127.0.0.1:50052",)
    admin_listen: Annotated[
        str,
        LISTEN_OR_EMPTY,
        Meta(description="admin HTTP address HOST:PORT (/metrics, /breakers, /canary); empty disables it"),
    ] = "127.0.0.1:9101"
    # Empty: defaults and admin changes only.
    config: Annotated[
        str,
        Meta(description="route file (YAML): canary weights, versions, breaker thresholds, tenant limits"),
    ] = ""
    config_poll_s: Annotated[
        float, Meta(gt=0, description="seconds between checks of the route file for changes")
    ] = 1.0
    # Empty: admin changes and rollouts last until a restart (sidecar/routes/state_file.py).
    state_file: Annotated[
        str,
        Meta(
            description="JSON file keeping admin weight changes and rollouts across restarts "
            "(written atomically; a change is answered once it is on disk); empty: kept in memory only"
        ),
    ] = ""
    rollout_tick_s: Annotated[
        float, Meta(gt=0, description="seconds between evaluations of the rollouts' gates")
    ] = 1.0
    grace_s: Annotated[float, Meta(ge=0, description="seconds in-flight calls get to finish on shutdown")] = (
        10.0
    )
    max_message_bytes: Annotated[
        int, Meta(ge=1, description="largest request or response message, in bytes")
    ] = 64 * 1024 * 1024
    # Connections of the gRPC listener (modelyard.process.grpc_server).
    grpc_max_concurrent_streams: grpc_server.MaxStreams = 256
    grpc_max_connection_idle_s: grpc_server.ConnectionIdle = 300.0
    grpc_max_connection_age_s: grpc_server.ConnectionAge = 3600.0
    grpc_max_connection_age_grace_s: grpc_server.ConnectionAgeGrace = 60.0
    grpc_handshake_timeout_s: grpc_server.HandshakeTimeout = 10.0
    # TLS of the gRPC listener and the admin endpoint, as the service's.
    tls_cert: Annotated[
        str, Meta(description="PEM certificate chain of the gRPC and admin listeners; empty: no TLS")
    ] = ""
    tls_key: Annotated[str, Meta(description="PEM private key for tls_cert")] = ""
    tls_client_ca: Annotated[
        str, Meta(description="PEM CA bundle; when set, clients must present a certificate it signed (mTLS)")
    ] = ""
    # TLS to the upstreams, as the gateway's: on with upstream_tls or any of the files below.
    upstream_tls: tls.UpstreamTls = False
    upstream_ca: tls.UpstreamCa = ""
    upstream_cert: tls.UpstreamCert = ""
    upstream_key: tls.UpstreamKey = ""
    upstream_server_name: tls.UpstreamServerName = ""
    # The admin endpoint's credential (the service's token file format). Without one, changes are
    # refused unless admin_open (sidecar/admin.py).
    admin_tokens_file: Annotated[
        str,
        Meta(
            description="bearer tokens, a line each (TOKEN [management] [inference]); admin changes "
            "(PUT /canary, the rollouts' POSTs) need one with the management scope"
        ),
    ] = ""
    admin_open: Annotated[
        bool,
        Meta(
            description="let every client that reaches the admin endpoint change weights and rollouts "
            "without a credential (a trusted local host only)"
        ),
    ] = False
    admin_auth_reads: Annotated[
        bool,
        Meta(description="require a token for the admin endpoint's reads too (/metrics, /breakers, /canary)"),
    ] = False
    # What one admin connection may cost (sidecar/admin.py).
    admin_header_timeout_s: Annotated[
        float,
        Meta(
            gt=0, description="seconds an admin request's TLS handshake and head may take (then 408/closed)"
        ),
    ] = 10.0
    admin_body_timeout_s: Annotated[
        float, Meta(gt=0, description="seconds an admin request's body may take to arrive (then 408)")
    ] = 10.0
    admin_idle_timeout_s: Annotated[
        float, Meta(gt=0, description="seconds an idle admin keep-alive connection stays open")
    ] = 30.0
    admin_max_body_bytes: Annotated[
        int, Meta(ge=0, description="largest admin request body, in bytes (larger: 413)")
    ] = 64 * 1024
    admin_max_connections: Annotated[
        int, Meta(ge=1, description="admin connections open at once (more: 503 and closed)")
    ] = 64
    # A number or auto: checked by modelyard.process.workers.worker_count.
    workers: Annotated[
        str,
        Meta(
            description="sidecar processes sharing the gRPC port behind one admin endpoint: N, or auto "
            "for one per usable CPU core"
        ),
    ] = "1"
    log_level: logs.Level = "INFO"
    log_format: logs.Format = "text"
    # Off by default: a line per call costs a JSON encode and a write at every call's rate.
    access_log: logs.AccessLog = False


def parse_settings(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """Flags override environment variables, which override the defaults."""
    return parse(
        Settings,
        ENV_PREFIX,
        argv,
        environ,
        prog="modelyard sidecar",
        description="Route, dye and guard calls to Modelyard services.",
    )
