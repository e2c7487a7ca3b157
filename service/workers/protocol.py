"""What the supervisor and its workers say to each other, over gRPC on unix sockets in a private
folder (mode 0700): names of the sockets, of the internal health services and methods, and the
framing of several answers in one message."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from modelyard.common import headers

# Environment of a worker process (set by the supervisor only; operators set MODELYARD_SERVICE_*).
ENV_CONTROL = "MODELYARD_WORKER_CONTROL"  # the private folder
ENV_INDEX = "MODELYARD_WORKER_INDEX"
ENV_COUNT = "MODELYARD_WORKER_COUNT"
ENV_PARENT = "MODELYARD_WORKER_PARENT"  # the supervisor's pid: a worker with another parent is orphaned

# Health services. A worker's own readiness (its repository loaded), read by the supervisor:
LOCAL = "modelyard.internal.worker"


# On the supervisor: SERVING once worker N may take traffic (it caught up with explicit control).
def admitted(index: int) -> str:
    return f"modelyard.internal.admitted.{index}"


# The supervisor's "" (whole service) status is SERVING only while every worker is admitted and
# serving; each worker reports that as its own "" status, so any worker answers for all.

# Methods that are not in any public API (generic handlers, bytes in and out).
BROADCAST = "/modelyard.internal.Coordinator/Broadcast"  # on the supervisor
WATCH = "/modelyard.internal.Coordinator/WatchModels"  # on the supervisor: the merged watch
METRICS = "/modelyard.internal.Worker/Metrics"  # on a worker's unix socket: its scrape, text

# Metadata of a Broadcast call.
METHOD_KEY = "x-modelyard-method"  # the public method to call on every worker
CHANGE_KEY = "x-modelyard-change"  # set on model control: the model it changes (kept for replay)


@dataclass(frozen=True)
class ControlFolder:
    path: Path

    @property
    def coordinator(self) -> str:
        return f"unix:{self.path / 'coordinator.sock'}"

    def worker(self, index: int) -> str:
        return f"unix:{self.path / f'worker-{index}.sock'}"

    @property
    def regions(self) -> Path:
        return self.path / "shm-regions.json"


def pack(messages: Sequence[bytes]) -> bytes:
    return b"".join(struct.pack(">I", len(m)) + m for m in messages)


def unpack(data: bytes) -> list[bytes]:
    out: list[bytes] = []
    at = 0
    while at < len(data):
        (size,) = struct.unpack_from(">I", data, at)
        out.append(data[at + 4 : at + 4 + size])
        at += 4 + size
    return out


def error_reason(exc: grpc.aio.AioRpcError) -> tuple[tuple[str, str], ...]:
    """The x-error-reason of a failed call, to pass on with its status."""
    metadata: Any = exc.trailing_metadata() or ()
    return tuple((str(k), str(v)) for k, v in metadata if k == headers.ERROR_REASON)
