"""Settings of one service process. Every value has a flag and a MODELYARD_SERVICE_* variable."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from modelyard.common import grpc_server, logs
from modelyard.common.settings import parse_settings as parse

from service.cores import usable_cores

ENV_PREFIX = "MODELYARD_SERVICE_"


@dataclass(frozen=True)
class Settings:
    repository: Path = Path("models/demo")
    listen: str = "127.0.0.1:50052"
    metrics_listen: str = "127.0.0.1:9102"  # empty: no metrics endpoint
    grace_s: float = 10.0  # on SIGTERM: how long in-flight requests may take to finish
    drain_timeout_s: float = 30.0  # how long a retired model version waits for its requests
    max_message_bytes: int = 64 * 1024 * 1024  # larger requests: RESOURCE_EXHAUSTED, too_large
    # Connections of the gRPC listener (modelyard/common/grpc_server.py): open streams each, idle
    # and age limits (0: none), and the time a new connection has for its handshake.
    grpc_max_concurrent_streams: int = 256
    grpc_max_connection_idle_s: float = 300.0
    grpc_max_connection_age_s: float = 3600.0
    grpc_max_connection_age_grace_s: float = 60.0
    grpc_handshake_timeout_s: float = 10.0
    # Model files sent with KServe loads, all uploads on disk together (one per model name at most).
    max_upload_bytes: int = 4 * 1024 * 1024 * 1024
    inference_threads: int = 0  # executor threads for model runs; 0 = one per core
    # CPU memory the runs of all models may hold at once (ONNX Runtime's arena max_mem); a run
    # past it: RESOURCE_EXHAUSTED, too_large. 0 = half of the memory the service may use, shared
    # among its worker processes. Per process.
    max_run_memory_mb: int = 0
    # The longest one model run may take, whatever the caller's deadline (or none): a run past it
    # is stopped (DEADLINE_EXCEEDED, deadline) and its thread and slot come back. 0: no bound.
    max_run_s: float = 120.0
    workers: str = "1"  # service processes sharing the port: a number, or auto (one per core)
    control_mode: str = "watch"  # watch: follow the repository on disk; explicit: only Load/Unload calls
    watch_method: str = "events"  # events (inotify) or poll (file systems without change events)
    watch_quiet_s: float = 0.25  # a model folder must be this quiet before a change is loaded
    resync_s: float = 30.0  # full repository reconcile, for changes the OS did not report
    # TLS on the gRPC and metrics listeners (both files, or neither); with a client CA, clients
    # must present a certificate it signed (mTLS). Files are re-read when they change.
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    # Authorization: bearer tokens (one per line) and/or allowed mTLS client identities (CN/SAN).
    # When either is set, LoadModel/UnloadModel and the KServe repository extension need one.
    auth_tokens_file: str = ""
    auth_client_names: tuple[str, ...] = ()
    auth_inference: bool = False  # inference and metadata calls need a credential too
    # System shared memory (KServe extension): regions registered at once, and bytes they span.
    shm_max_regions: int = 256
    shm_max_bytes: int = 8 * 1024 * 1024 * 1024
    log_level: str = "INFO"
    log_format: str = "text"  # text, or json: one object per line for log collectors


_HELP = {
    "repository": "model repository folder (<name>/<version>/model.onnx)",
    "listen": "gRPC address HOST:PORT (port 0 picks a free port)",
    "metrics_listen": "Prometheus /metrics address HOST:PORT; empty disables it",
    "grace_s": "seconds in-flight requests get to finish on shutdown",
    "drain_timeout_s": "seconds a retired model version waits for its in-flight requests",
    "max_message_bytes": "largest request or response message, in bytes",
    "max_upload_bytes": "bytes that model files uploaded with loads may take on disk together; 0: no limit",
    "inference_threads": "threads that run models; 0 = one per CPU core",
    "max_run_memory_mb": "MiB of CPU memory that the model runs of one service process may hold at once "
    "(a run past it is refused RESOURCE_EXHAUSTED); 0 = half of the memory available, shared among "
    "the workers",
    "max_run_s": "seconds one model run may take whatever the caller's deadline (then it is stopped: "
    "DEADLINE_EXCEEDED); 0: no bound",
    "workers": "service processes sharing the gRPC port (each with its own sessions): N, or auto "
    "for one per CPU core",
    "tls_cert": "PEM certificate chain of the gRPC and metrics listeners; empty: no TLS",
    "tls_key": "PEM private key for tls_cert",
    "tls_client_ca": "PEM CA bundle; when set, clients must present a certificate it signed (mTLS)",
    "auth_tokens_file": "file of bearer tokens, one per line; management calls then need one",
    "auth_client_names": "an mTLS client identity (certificate CN or SAN) allowed to call (repeatable)",
    "auth_inference": "require a credential for inference and metadata calls too",
    "shm_max_regions": "system shared memory regions that may be registered at once",
    "shm_max_bytes": "bytes that registered system shared memory regions may span together",
    **grpc_server.HELP,
    **logs.HELP,
    "control_mode": "watch (load changes on disk) or explicit (only LoadModel/UnloadModel)",
    "watch_method": "events (inotify) or poll",
    "watch_quiet_s": "seconds a model folder must be quiet before a change is loaded",
    "resync_s": "seconds between full repository reconciles in watch mode",
}
_CHOICES = {
    "control_mode": ["watch", "explicit"],
    "watch_method": ["events", "poll"],
    **logs.CHOICES,
}


def worker_count(text: str) -> int:
    """`--workers`: a positive number, or auto (one per core this process may use: its affinity
    and its container's CPU limit). ValueError names what is wrong."""
    if text.strip().lower() == "auto":
        return usable_cores()
    if not (text.strip().isascii() and text.strip().isdigit()) or int(text) < 1:
        raise ValueError(f"--workers must be a positive number or auto, got {text!r}")
    return int(text)


def parse_settings(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """Flags override environment variables, which override the defaults."""
    return parse(
        Settings,
        ENV_PREFIX,
        argv,
        environ,
        prog="modelyard serve",
        description="Serve an ONNX model repository over gRPC.",
        help=_HELP,
        choices=_CHOICES,
    )
