"""Which calls manage the server rather than use it: one list that the service's guards, the
gateway's cross-site rule and Envoy's public edge all read, so that a method or route added to the
management surface is refused everywhere it should be.

Management: loading and unloading models (our ModelService and KServe's repository extension,
uploads included), Triton's shared-memory, log and trace extensions. Everything else (inference,
generation, metadata, statistics, health, reflection) is the public surface."""

from __future__ import annotations

import re

_KSERVE = "/inference.GRPCInferenceService/"

MANAGEMENT_METHODS = frozenset(
    {
        "/modelyard.inference.v1.ModelService/LoadModel",
        "/modelyard.inference.v1.ModelService/UnloadModel",
        _KSERVE + "RepositoryIndex",
        _KSERVE + "RepositoryModelLoad",
        _KSERVE + "RepositoryModelUnload",
        # Registering shared memory makes the server map a region by its key: not for anyone.
        _KSERVE + "SystemSharedMemoryStatus",
        _KSERVE + "SystemSharedMemoryRegister",
        _KSERVE + "SystemSharedMemoryUnregister",
        _KSERVE + "CudaSharedMemoryStatus",
        _KSERVE + "CudaSharedMemoryRegister",
        _KSERVE + "CudaSharedMemoryUnregister",
        _KSERVE + "LogSettings",
        _KSERVE + "TraceSetting",
    }
)

# The HTTP routes of the same extensions (Triton's HTTP/REST form), as path prefixes (each matched
# whole or followed by `/`), and a model's trace settings, which sit under its model path.
MANAGEMENT_PATH_PREFIXES = (
    "/v2/repository",
    "/v2/systemsharedmemory",
    "/v2/cudasharedmemory",
    "/v2/logging",
    "/v2/trace",
)
MODEL_TRACE_PATH = r"/v2/models/[^/]+(/versions/[^/]+)?/trace(/setting)?"
_MODEL_TRACE = re.compile(MODEL_TRACE_PATH)


def is_management_method(method: str) -> bool:
    return method in MANAGEMENT_METHODS


def is_management_path(path: str) -> bool:
    """Whether an HTTP path is a management route (no normalisation: give the path as routed)."""
    for prefix in MANAGEMENT_PATH_PREFIXES:
        if path == prefix or path.startswith(prefix + "/"):
            return True
    return _MODEL_TRACE.fullmatch(path) is not None
