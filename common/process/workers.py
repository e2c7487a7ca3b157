"""What every supervisor of worker processes (the service's, the sidecar's) does the same way:
the count behind `--workers N|auto`, the shared port held by the parent, the restart backoff, and
settings handed to a worker as its environment."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from modelyard.process.cores import usable_cores
from modelyard.process.settings import split_address

BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0
STEADY_S = 30.0  # a worker that ran this long before dying restarts after the first backoff again


def worker_count(text: str) -> int:
    """`--workers`: a positive number, or auto (one per core this process may use: its affinity
    and its container's CPU limit). ValueError names what is wrong."""
    if text.strip().lower() == "auto":
        return usable_cores()
    if not (text.strip().isascii() and text.strip().isdigit()) or int(text) < 1:
        raise ValueError(f"--workers must be a positive number or auto, got {text!r}")
    return int(text)


def reserve_port(listen: str) -> socket.socket:
    """Bind (not listen on) the gRPC address with SO_REUSEPORT: a port another program holds fails
    here, loudly, and while this socket is open only processes of this user that also ask for
    SO_REUSEPORT (our workers) can bind it. Port 0 picks the port the workers then share."""
    host, port = split_address(listen)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host or "0.0.0.0", port))
    except OSError:
        sock.close()
        raise
    return sock


def env_text(value: object) -> str:
    """A setting as its environment variable spells it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)


@dataclass
class Backoff:
    """The delay before a dead worker's restart: BACKOFF_FIRST_S, doubling to BACKOFF_MAX_S, back
    to the first after STEADY_S of steady running."""

    delay: float = BACKOFF_FIRST_S

    def next(self, ran_s: float) -> float:
        if ran_s > STEADY_S:
            self.delay = BACKOFF_FIRST_S
        delay = self.delay
        self.delay = min(self.delay * 2, BACKOFF_MAX_S)
        return delay
