"""What every public gRPC listener enforces on its connections, in one place (the service's and
the sidecar's listeners both build their servers with `connection_options`).

- Streams: at most `grpc_max_concurrent_streams` open at once per connection (HTTP/2
  SETTINGS_MAX_CONCURRENT_STREAMS). With gRPC core's overload protection a stream counts until
  the server has let go of it, not only until the client reset it, so a rapid-reset run (streams
  opened and cancelled at once) fills its own connection's quota and further streams of that
  connection are refused (REFUSED_STREAM) instead of becoming calls that every connection's calls
  queue behind.
- Slow and idle connections: a connection must finish its HTTP/2 preface and SETTINGS within
  `grpc_handshake_timeout_s`; one without calls for `grpc_max_connection_idle_s` is sent GOAWAY
  and closed; every connection is asked to go away after `grpc_max_connection_age_s` (clients
  reconnect; calls in flight get `grpc_max_connection_age_grace_s` to finish). The server pings
  a connection quiet for a minute and closes it when the ping is not answered (a vanished peer).
- Keepalive enforcement: a client may ping at most once per 10 s when it sends no data (also
  with no call open); a client that pings more often is sent GOAWAY (too_many_pings) after
  two strikes.
- Metadata: a call's headers may total `MAX_METADATA_BYTES` (64 KiB, gRPC's soft and hard limit
  both, so nothing under it is refused at random as between gRPC's default 8 KiB soft and 16 KiB
  hard limits): an oversized value of ours (`x-model-version`) reaches the handlers, which answer
  INVALID_ARGUMENT with `x-error-reason`. Past it gRPC itself answers RESOURCE_EXHAUSTED without
  a reason ("received metadata size exceeds hard limit"). 64 KiB is what the HTTP edge admits
  too (Envoy 60 KiB, the gateway 64 KiB), so a header that got through the edge is ours to answer.
"""

from __future__ import annotations

from typing import Annotated, Protocol

from msgspec import Meta

INT_MAX = 2**31 - 1  # gRPC's "unlimited" for its int-valued durations

# Client pings are allowed this often while no data flows (gRPC's default is 5 minutes; clients
# that keep connections alive through proxies commonly ping every 10-30 s).
MIN_CLIENT_PING_INTERVAL_MS = 10_000
MAX_PING_STRIKES = 2
# The server's own keepalive: a connection quiet this long is pinged; unanswered, it is closed.
SERVER_KEEPALIVE_TIME_MS = 60_000
SERVER_KEEPALIVE_TIMEOUT_MS = 20_000
# A call's metadata (header list, HPACK-decoded) that reaches the handlers; past it gRPC refuses
# the call itself. Soft = hard: gRPC refuses calls between the two at random.
MAX_METADATA_BYTES = 64 * 1024

# The settings every gRPC listener's process declares (`grpc_max_concurrent_streams: MaxStreams = 256`).
MaxStreams = Annotated[
    int, Meta(ge=1, description="streams (calls) one gRPC connection may have open at once")
]
ConnectionIdle = Annotated[
    float, Meta(ge=0, description="seconds a gRPC connection without calls stays open; 0: no limit")
]
ConnectionAge = Annotated[
    float,
    Meta(
        ge=0,
        description="seconds after which a gRPC connection is asked to go away (the client reconnects); "
        "0: no limit",
    ),
]
ConnectionAgeGrace = Annotated[
    float, Meta(ge=0, description="seconds the calls of a connection past its age get to finish")
]
HandshakeTimeout = Annotated[
    float,
    Meta(ge=0, description="seconds a new connection has to complete its TLS handshake and HTTP/2 preface"),
]


class ConnectionSettings(Protocol):
    """The fields a process's Settings carries for its gRPC listener (see HELP)."""

    @property
    def grpc_max_concurrent_streams(self) -> int: ...
    @property
    def grpc_max_connection_idle_s(self) -> float: ...
    @property
    def grpc_max_connection_age_s(self) -> float: ...
    @property
    def grpc_max_connection_age_grace_s(self) -> float: ...
    @property
    def grpc_handshake_timeout_s(self) -> float: ...


def _ms(seconds: float) -> int:
    """Seconds as gRPC's int milliseconds; 0 (or less) means no limit."""
    return INT_MAX if seconds <= 0 else max(1, min(INT_MAX, round(seconds * 1000)))


def connection_options(settings: ConnectionSettings) -> list[tuple[str, int]]:
    """The channel arguments of a public gRPC server (names from grpc/impl/channel_arg_names.h
    and chttp2's transport: grpcio 1.85)."""
    if settings.grpc_max_concurrent_streams < 1:
        raise ValueError("grpc_max_concurrent_streams must be at least 1")
    return [
        ("grpc.max_concurrent_streams", settings.grpc_max_concurrent_streams),
        # A stream counts against the limit until the server has deallocated it (on by default
        # in grpcio; explicit, as the rapid-reset defence depends on it).
        ("grpc.http.overload_protection", 1),
        ("grpc.max_connection_idle_ms", _ms(settings.grpc_max_connection_idle_s)),
        ("grpc.max_connection_age_ms", _ms(settings.grpc_max_connection_age_s)),
        ("grpc.max_connection_age_grace_ms", _ms(settings.grpc_max_connection_age_grace_s)),
        ("grpc.server_handshake_timeout_ms", _ms(settings.grpc_handshake_timeout_s)),
        ("grpc.keepalive_time_ms", SERVER_KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", SERVER_KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_CLIENT_PING_INTERVAL_MS),
        ("grpc.http2.max_ping_strikes", MAX_PING_STRIKES),
        ("grpc.max_metadata_size", MAX_METADATA_BYTES),  # soft limit (GRPC_ARG_MAX_METADATA_SIZE)
        ("grpc.absolute_max_metadata_size", MAX_METADATA_BYTES),  # hard (..._ABSOLUTE_MAX_METADATA_SIZE)
    ]
