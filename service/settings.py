"""Settings of one service process. Every value has a flag and a MODELYARD_SERVICE_* variable,
declared once below: type, default, help and allowed values (see modelyard.process.settings)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from msgspec import Meta

from modelyard.common.names import echo, is_valid_name
from modelyard.process import grpc_server, logs
from modelyard.process.settings import LISTEN, LISTEN_OR_EMPTY
from modelyard.process.settings import parse_settings as parse
from modelyard.process.workers import worker_count as worker_count  # shared with the sidecar

ENV_PREFIX = "MODELYARD_SERVICE_"


def _model_names(values: tuple[str, ...]) -> None:
    for value in values:
        if value != "*" and not is_valid_name(value):
            raise ValueError(f"{echo(value)} is not a model name (or * for every model)")


def _seconds(text: str) -> Meta:
    return Meta(ge=0, description=text)


@dataclass(frozen=True)
class Settings:
    repository: Annotated[Path, Meta(description="model repository folder (<name>/<version>/model.onnx)")] = (
        Path("models/demo")
    )
    listen: Annotated[str, LISTEN, Meta(description="gRPC address HOST:PORT (port 0 picks a free port)")] = (
        "127.0.0.1:50052"
    )
    metrics_listen: Annotated[
        str, LISTEN_OR_EMPTY, Meta(description="Prometheus /metrics address HOST:PORT; empty disables it")
    ] = "127.0.0.1:9102"
    grace_s: Annotated[float, _seconds("seconds in-flight requests get to finish on shutdown")] = 10.0
    drain_timeout_s: Annotated[
        float, _seconds("seconds a retired model version waits for its in-flight requests")
    ] = 30.0
    # Larger requests: RESOURCE_EXHAUSTED, too_large.
    max_message_bytes: Annotated[
        int, Meta(ge=1, description="largest request or response message, in bytes")
    ] = 64 * 1024 * 1024
    # Connections of the gRPC listener (modelyard.process.grpc_server).
    grpc_max_concurrent_streams: grpc_server.MaxStreams = 256
    grpc_max_connection_idle_s: grpc_server.ConnectionIdle = 300.0
    grpc_max_connection_age_s: grpc_server.ConnectionAge = 3600.0
    grpc_max_connection_age_grace_s: grpc_server.ConnectionAgeGrace = 60.0
    grpc_handshake_timeout_s: grpc_server.HandshakeTimeout = 10.0
    # Model files sent with KServe loads, all uploads on disk together (one per model name at most).
    max_upload_bytes: Annotated[
        int,
        Meta(
            ge=0,
            description="bytes that model files uploaded with loads may take on disk together; 0: no limit",
        ),
    ] = 4 * 1024 * 1024 * 1024
    inference_threads: Annotated[
        int, Meta(ge=0, description="threads that run models; 0 = one per CPU core")
    ] = 0
    # CPU memory the runs of all models may hold at once (ONNX Runtime's arena max_mem). Per process.
    max_run_memory_mb: Annotated[
        int,
        Meta(
            ge=0,
            description="MiB of CPU memory that the model runs of one service process may hold at once "
            "(a run past it is refused RESOURCE_EXHAUSTED); 0 = half of the memory available, shared "
            "among the workers",
        ),
    ] = 0
    # A run past it is stopped (DEADLINE_EXCEEDED, deadline) and its thread and slot come back.
    max_run_s: Annotated[
        float,
        _seconds(
            "seconds one model run may take whatever the caller's deadline (then it is stopped: "
            "DEADLINE_EXCEEDED); 0: no bound"
        ),
    ] = 120.0
    # A number or auto: checked by worker_count (auto needs the CPUs this process may use).
    workers: Annotated[
        str,
        Meta(
            description="service processes sharing the gRPC port (each with its own sessions): N, or "
            "auto for one per CPU core"
        ),
    ] = "1"
    control_mode: Annotated[
        Literal["watch", "explicit"],
        Meta(
            description="watch (load changes on disk) or explicit (load only the --load-model models at "
            "start, then only LoadModel/UnloadModel)"
        ),
    ] = "watch"
    # As Triton's --load-model: explicit mode loads nothing at start but these (`*`: every model).
    load_model: Annotated[
        tuple[str, ...],
        Meta(
            description="explicit mode: a model to load at start (repeatable; * for every model)",
            extra={"check": _model_names},
        ),
    ] = ()
    watch_method: Annotated[
        Literal["events", "poll"],
        Meta(description="events (inotify) or poll (file systems without change events)"),
    ] = "events"
    watch_quiet_s: Annotated[
        float, _seconds("seconds a model folder must be quiet before a change is loaded")
    ] = 0.25
    # For changes the OS did not report.
    resync_s: Annotated[float, _seconds("seconds between full repository reconciles in watch mode")] = 30.0
    # TLS on the gRPC and metrics listeners (both files, or neither). Files are re-read when they change.
    tls_cert: Annotated[
        str, Meta(description="PEM certificate chain of the gRPC and metrics listeners; empty: no TLS")
    ] = ""
    tls_key: Annotated[str, Meta(description="PEM private key for tls_cert")] = ""
    tls_client_ca: Annotated[
        str, Meta(description="PEM CA bundle; when set, clients must present a certificate it signed (mTLS)")
    ] = ""
    # Management (modelyard.common.surfaces) needs a credential with the management scope; without
    # any configured it is off, unless management_open.
    auth_tokens_file: Annotated[
        str,
        Meta(description="bearer tokens, a line each (TOKEN [management] [inference]); management needs one"),
    ] = ""
    auth_client_names: Annotated[
        tuple[str, ...],
        Meta(description="an mTLS client identity (certificate CN or SAN) allowed to call (repeatable)"),
    ] = ()
    auth_inference: Annotated[
        bool, Meta(description="require a credential for inference and metadata calls too")
    ] = False
    management_open: Annotated[
        bool,
        Meta(
            description="let every client that reaches the port load/unload models and use shared memory, "
            "logging and trace settings without a credential (a trusted local host only)"
        ),
    ] = False
    # System shared memory (KServe extension).
    shm_max_regions: Annotated[
        int, Meta(ge=0, description="system shared memory regions that may be registered at once")
    ] = 256
    shm_max_bytes: Annotated[
        int, Meta(ge=0, description="bytes that registered system shared memory regions may span together")
    ] = 8 * 1024 * 1024 * 1024
    # ServerMetadata.name: Triton's example clients check for "triton".
    server_name: Annotated[
        str, Meta(min_length=1, max_length=64, description="the server name ServerMetadata answers")
    ] = "modelyard"
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
        prog="modelyard serve",
        description="Serve an ONNX model repository over gRPC.",
    )
