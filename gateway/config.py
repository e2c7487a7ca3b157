"""Settings of one gateway process. Every value has a flag and a MODELYARD_GATEWAY_* variable."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from modelyard.common import logs, tls
from modelyard.common.settings import parse_settings as parse

ENV_PREFIX = "MODELYARD_GATEWAY_"


@dataclass(frozen=True)
class Settings:
    listen: str = "127.0.0.1:8000"
    upstream: str = "127.0.0.1:50051"  # the sidecar (it forwards the service's API unchanged)
    grace_s: float = 10.0
    max_body_bytes: int = 1024 * 1024  # larger request bodies get 413
    # A failure in the first moments (load shed, unknown model) is an HTTP status; a stream whose
    # first token takes longer (queued for a slot) opens anyway and heartbeats while it waits.
    first_event_wait_s: float = 1.0
    heartbeat_s: float = 15.0  # an SSE comment line after this long without an event
    retry_ms: int = 3000  # the `retry:` hint sent to EventSource clients
    # Resume: a stream whose client went away keeps generating into its buffer (up to
    # resume_buffer_events not yet read) for resume_window_s; then it is cancelled upstream. A
    # finished stream is kept as long so a late reconnect is answered, not restarted. 0 = no resume:
    # a disconnect cancels the upstream call at once.
    resume_window_s: float = 30.0
    resume_buffer_events: int = 512
    max_streams: int = 1024  # open streams (upstream call running, attached or not); more get 429
    # Finished streams kept for resume hold only their buffers: all of them together stay under
    # this many bytes (encoded events), the oldest forgotten first.
    resume_buffer_bytes: int = 64 * 1024 * 1024
    # gRPC's own flow-control window buffers many small token messages (64 KiB and up: thousands of
    # tokens) before a stopped reader is felt upstream. A small lookahead (bytes; 0 = gRPC's adaptive
    # default) makes a stalled stream pause the service's sequence after a few tokens.
    upstream_lookahead_bytes: int = 0
    upstream_timeout_s: float = 0.0  # deadline of each upstream call; 0 = none (streams may be long)
    # The HTTP listener's connection guard (gateway/listener.py); 0 turns a timeout off.
    idle_timeout_s: float = 60.0  # a connection with no request in progress (new or kept alive)
    header_timeout_s: float = 10.0  # from a request's first byte to the end of its headers (then 408)
    body_timeout_s: float = 30.0  # from the end of the headers to the end of the body (then 408)
    max_header_bytes: int = 64 * 1024  # request line and headers together (more: 431)
    write_stall_timeout_s: float = 60.0  # a client that reads nothing while its buffer is full
    max_connections: int = 4096  # connections (and requests in progress) at once; more get 503
    # TLS of the HTTP listener, as the service's: certificate and key, optional client CA (mTLS).
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    # TLS to the upstream: on with upstream_tls or any of the files below.
    upstream_tls: bool = False
    upstream_ca: str = ""
    upstream_cert: str = ""
    upstream_key: str = ""
    upstream_server_name: str = ""
    log_level: str = "INFO"
    log_format: str = "text"


_HELP = {
    "listen": "HTTP address HOST:PORT (port 0 picks a free port)",
    "upstream": "gRPC address HOST:PORT of the sidecar (or a service)",
    "grace_s": "seconds in-flight requests get to finish on shutdown",
    "max_body_bytes": "largest request body in bytes (larger: 413)",
    "first_event_wait_s": "seconds to wait for the first token before the stream opens anyway",
    "heartbeat_s": "seconds of silence after which an SSE stream gets a comment heartbeat",
    "retry_ms": "reconnect delay hinted to EventSource clients (SSE retry:)",
    "resume_window_s": "seconds a stream is kept for Last-Event-ID resume after its client left; 0: none",
    "resume_buffer_events": "most events a stream buffers for resume (generation pauses when full)",
    "max_streams": "most SSE streams open at once (generating, attached or kept for resume); more: 429",
    "resume_buffer_bytes": "bytes the finished streams kept for resume may buffer together (oldest dropped)",
    "upstream_lookahead_bytes": "HTTP/2 lookahead window to the upstream (bytes); 0 = gRPC's default",
    "upstream_timeout_s": "deadline of each upstream gRPC call in seconds; 0 = none",
    "idle_timeout_s": "seconds a connection may stay without a request in progress; 0 = no limit",
    "header_timeout_s": "seconds from a request's first byte to the end of its headers (408); 0 = no limit",
    "body_timeout_s": "seconds from the end of the headers to the end of the body (408); 0 = no limit",
    "max_header_bytes": "largest request line plus headers in bytes (larger: 431)",
    "write_stall_timeout_s": "seconds a client may read nothing of a full write buffer; 0 = no limit",
    "max_connections": "most connections and requests in progress at once (more: 503)",
    "tls_cert": "PEM certificate chain of the HTTP listener; empty: plain HTTP",
    "tls_key": "PEM private key for tls_cert",
    "tls_client_ca": "PEM CA bundle; when set, HTTP clients must present a certificate it signed (mTLS)",
    **tls.UPSTREAM_HELP,
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
        prog="modelyard gateway",
        description="HTTP gateway: SSE and OpenAI-compatible endpoints over the sidecar's gRPC API.",
        help=_HELP,
        choices=_CHOICES,
    )
