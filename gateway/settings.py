"""Settings of one gateway process. Every value has a flag and a MODELYARD_GATEWAY_* variable,
declared once below: type, default, help and allowed values (see modelyard.process.settings)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated

from msgspec import Meta

from modelyard.process import logs, tls
from modelyard.process.settings import LISTEN, LISTEN_OR_EMPTY
from modelyard.process.settings import parse_settings as parse

ENV_PREFIX = "MODELYARD_GATEWAY_"


@dataclass(frozen=True)
class Settings:
    listen: Annotated[str, LISTEN, Meta(description="HTTP address HOST:PORT (port 0 picks a free port)")] = (
        "127.0.0.1:8000"
    )
    # Off the public port (Envoy's routes reach only the APIs and the page): off by default, so
    # that gateways started side by side (tests, several per host) never compete for a port.
    metrics_listen: Annotated[
        str,
        LISTEN_OR_EMPTY,
        Meta(description="Prometheus /metrics (and /healthz) address HOST:PORT; empty disables it"),
    ] = ""
    # The sidecar forwards the service's API unchanged.
    upstream: Annotated[str, Meta(description="gRPC address HOST:PORT of the sidecar (or a service)")] = (
        "127.0.0.1:50051"
    )
    grace_s: Annotated[
        float, Meta(ge=0, description="seconds in-flight requests get to finish on shutdown")
    ] = 10.0
    max_body_bytes: Annotated[int, Meta(ge=0, description="largest request body in bytes (larger: 413)")] = (
        1024 * 1024
    )
    # A failure in the first moments (load shed, unknown model) is an HTTP status; a stream whose
    # first token takes longer (queued for a slot) opens anyway and heartbeats while it waits.
    first_event_wait_s: Annotated[
        float, Meta(ge=0, description="seconds to wait for the first token before the stream opens anyway")
    ] = 1.0
    heartbeat_s: Annotated[
        float, Meta(gt=0, description="seconds of silence after which an SSE stream gets a comment heartbeat")
    ] = 15.0
    retry_ms: Annotated[
        int, Meta(ge=0, description="reconnect delay hinted to EventSource clients (SSE retry:)")
    ] = 3000
    # Resume: a stream whose client went away stops being read at once, so the service pauses its
    # sequence within a few tokens (with the small upstream lookahead below); if nobody resumes it
    # within resume_window_s it is cancelled upstream (the slot is freed). Shorter than the
    # service's generation.stall_timeout_ms (30 s), so the gateway's cancel is what ends it. A
    # finished stream is kept as long so a late reconnect is answered, not restarted. 0 = no
    # resume: a disconnect cancels the upstream call at once.
    resume_window_s: Annotated[
        float,
        Meta(
            ge=0,
            description="seconds a stream whose client left is kept, paused, for resume; 0: none",
        ),
    ] = 20.0
    resume_buffer_events: Annotated[
        int, Meta(ge=1, description="most events a stream buffers for resume (generation pauses when full)")
    ] = 512
    # Open streams: upstream call running, attached or not.
    max_streams: Annotated[
        int,
        Meta(
            ge=0,
            description=(
                "most SSE streams open at once (generating, attached or kept for resume); at it a new "
                "stream cancels the oldest one kept for resume, or is refused (429) if none is"
            ),
        ),
    ] = 1024
    # A client (its credential, else its x-tenant-id, else its peer address) that leaves streams
    # unread holds upstream slots with them: past this many its oldest is cancelled. And at
    # max_streams a new stream cancels the oldest detached one instead of being refused.
    max_detached_per_client: Annotated[
        int,
        Meta(
            ge=0,
            description=(
                "most open streams one client (credential, else x-tenant-id, else peer address) may "
                "leave unread for resume; past it its oldest is cancelled"
            ),
        ),
    ] = 8
    # Finished streams kept for resume hold only their buffers (encoded events).
    resume_buffer_bytes: Annotated[
        int,
        Meta(
            ge=0,
            description="bytes the finished streams kept for resume may buffer together (oldest dropped)",
        ),
    ] = 64 * 1024 * 1024
    # gRPC's own flow-control window buffers many small token messages (64 KiB and up: thousands of
    # tokens) before a stopped reader is felt upstream. A one-byte lookahead (BDP probing off)
    # makes a stream that is not read pause the service's sequence within a few tokens; a large
    # message still gets the window it needs when it is read (one round trip more). That round trip
    # is paid by every message, the first included: about 0.3 ms of time to first token at best
    # (bench.edge_trace, initmd -> msg1). 64 bytes removed it, but a closed tab's stream then ran on
    # far past a few tokens in 2 of 6 runs of the browser test (147 and 186 tokens, bound 96).
    upstream_lookahead_bytes: Annotated[
        int, Meta(ge=0, description="HTTP/2 lookahead window to the upstream (bytes); 0 = gRPC's default")
    ] = 1
    # Streams may be long.
    upstream_timeout_s: Annotated[
        float, Meta(ge=0, description="deadline of each upstream gRPC call in seconds; 0 = none")
    ] = 0.0
    # The HTTP listener's connection guard (gateway/listener.py); 0 turns a timeout off.
    idle_timeout_s: Annotated[
        float,
        Meta(ge=0, description="seconds a connection may stay without a request in progress; 0 = no limit"),
    ] = 60.0
    header_timeout_s: Annotated[
        float,
        Meta(
            ge=0,
            description="seconds from a request's first byte to the end of its headers (408); 0 = no limit",
        ),
    ] = 10.0
    body_timeout_s: Annotated[
        float,
        Meta(
            ge=0, description="seconds from the end of the headers to the end of the body (408); 0 = no limit"
        ),
    ] = 30.0
    max_header_bytes: Annotated[
        int, Meta(ge=1, description="largest request line plus headers in bytes (larger: 431)")
    ] = 64 * 1024
    write_stall_timeout_s: Annotated[
        float,
        Meta(ge=0, description="seconds a client may read nothing of a full write buffer; 0 = no limit"),
    ] = 60.0
    max_connections: Annotated[
        int, Meta(ge=1, description="most connections and requests in progress at once (more: 503)")
    ] = 4096
    # TLS of the HTTP listener, as the service's.
    tls_cert: Annotated[
        str, Meta(description="PEM certificate chain of the HTTP listener; empty: plain HTTP")
    ] = ""
    tls_key: Annotated[str, Meta(description="PEM private key for tls_cert")] = ""
    tls_client_ca: Annotated[
        str,
        Meta(description="PEM CA bundle; when set, HTTP clients must present a certificate it signed (mTLS)"),
    ] = ""
    # TLS to the upstream: on with upstream_tls or any of the files below.
    upstream_tls: tls.UpstreamTls = False
    upstream_ca: tls.UpstreamCa = ""
    upstream_cert: tls.UpstreamCert = ""
    upstream_key: tls.UpstreamKey = ""
    upstream_server_name: tls.UpstreamServerName = ""
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
        prog="modelyard gateway",
        description="HTTP gateway: SSE and OpenAI-compatible endpoints over the sidecar's gRPC API.",
    )
