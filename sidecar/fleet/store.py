"""Where the controller's state lives and who leads: `FileStore` on one host, `MemoryStore` with
no state file (a restart forgets; it warns), kube.py's `KubeStore` in Kubernetes.

FileStore: the state file is JSON written whole the sidecar's way (sidecar/routes/state_file.py: a temporary
file beside it, fsynced, renamed over it, the folder fsynced), and checked whole when a replica
takes the lead (a file that is not the controller's state stops it: exit 2). The leader holds an
exclusive lock (flock) on `<file>.lock` for its life; a second replica on the host waits, trying
again every tick, and takes over (re-reading the file) when the leader's process ends, SIGKILL
included: the kernel drops the lock with the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
from pathlib import Path
from typing import Any, Protocol

from modelyard.common.names import InvalidName, check_name
from modelyard.sidecar.rollout.policy import Rollout
from modelyard.sidecar.routes.state_file import StateError, load_state, remove_stale, write_atomically


class Store(Protocol):
    where: str

    async def lead(self) -> bool:
        """Take or keep the lead: whether this replica leads now."""
        ...

    async def load(self) -> dict[str, Any]:
        """The saved rollouts (model -> the controller's doc of it); StateError."""
        ...

    async def save(self, rollouts: dict[str, Any]) -> None:
        """On disk (or in the API server) when it returns; OSError."""
        ...

    async def resign(self) -> None: ...


def check_saved(doc: Any, where: str) -> dict[str, Any]:
    """The rollouts of a saved state, each one checked as the policy reads it; StateError."""
    rollouts = doc.get("rollouts", {}) if isinstance(doc, dict) else None
    if not isinstance(rollouts, dict):
        raise StateError(f"{where}: not the rollout controller's state (no rollouts mapping)")
    for model, raw in rollouts.items():
        try:
            check_name(model, "model")
            Rollout.from_doc(model, raw)
        except (InvalidName, KeyError, TypeError, ValueError) as exc:
            raise StateError(f"{where}: rollout {model!r}: {exc}") from None
    return rollouts


class MemoryStore:
    where = "memory (no --state-file: a restart forgets the rollouts)"

    def __init__(self) -> None:
        self._saved: dict[str, Any] = {}

    async def lead(self) -> bool:
        return True

    async def load(self) -> dict[str, Any]:
        return dict(self._saved)

    async def save(self, rollouts: dict[str, Any]) -> None:
        self._saved = dict(rollouts)

    async def resign(self) -> None:
        pass


class FileStore:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.where = f"state file {path}"
        self._lock: int | None = None

    def read(self) -> dict[str, Any]:
        """The file's rollouts (a standby's GET reads them too); StateError."""
        return check_saved(load_state(self.path), f"state file {self.path}")

    async def lead(self) -> bool:
        if self._lock is not None:
            return True
        fd = os.open(f"{self.path}.lock", os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._lock = fd
        remove_stale(self.path)
        return True

    async def load(self) -> dict[str, Any]:
        return await asyncio.to_thread(self.read)

    async def save(self, rollouts: dict[str, Any]) -> None:
        await asyncio.to_thread(write_atomically, self.path, {"rollouts": rollouts})

    async def resign(self) -> None:
        if self._lock is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._lock, fcntl.LOCK_UN)
                os.close(self._lock)
            self._lock = None
