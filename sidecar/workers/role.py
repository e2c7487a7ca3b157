"""A sidecar worker's place among the workers, from its supervisor's environment, and the private
folder (mode 0700) where each worker serves its admin endpoint on a unix socket."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

# Set by the supervisor only (operators set MODELYARD_SIDECAR_*, whose unknown names are warned of).
ENV_CONTROL = "MODELYARD_WORKER_SIDECAR_CONTROL"
ENV_INDEX = "MODELYARD_WORKER_SIDECAR_INDEX"
ENV_PARENT = "MODELYARD_WORKER_SIDECAR_PARENT"


def admin_socket(folder: Path, index: int) -> Path:
    return folder / f"admin-{index}.sock"


@dataclass(frozen=True)
class WorkerRole:
    index: int
    folder: Path
    parent: int | None = None  # the supervisor's pid: a worker with another parent is orphaned

    @property
    def admin_socket(self) -> Path:
        return admin_socket(self.folder, self.index)

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> WorkerRole | None:
        environ = os.environ if environ is None else environ
        if ENV_CONTROL not in environ:
            return None
        parent = environ.get(ENV_PARENT)
        return cls(int(environ[ENV_INDEX]), Path(environ[ENV_CONTROL]), int(parent) if parent else None)
