"""Triton's model repository extension: the index of every model's versions and their states,
and load (with the request's `config` and `file:<path>` parameters) and unload over the model
control that ModelService shares (service/api/model_control.py)."""

from __future__ import annotations

from modelyard.kserve.v2 import grpc_service_pb2 as pb
from modelyard.service.api.kserve.triton_config import load_parameters
from modelyard.service.api.model_control import ModelControl
from modelyard.service.api.names import quoted
from modelyard.service.errors import InvalidInput, ModelLoadError, ServiceError
from modelyard.service.runtime.manager import ModelManager
from modelyard.service.runtime.status import VersionState

FAILED_TO_LOAD = "failed to load"

# Triton reports a model's state with these words in its repository index.
_INDEX_STATE = {
    VersionState.LOADING: "LOADING",
    VersionState.READY: "READY",
    VersionState.FAILED: "UNAVAILABLE",
    VersionState.DRAINING: "UNLOADING",
    VersionState.UNLOADED: "UNAVAILABLE",
}


def index(manager: ModelManager, request: pb.RepositoryIndexRequest) -> pb.RepositoryIndexResponse:
    response = pb.RepositoryIndexResponse()
    for status in manager.statuses():
        if not status.versions and not request.ready:
            response.models.add(name=status.name, state="UNAVAILABLE", reason=status.reason)
        for version in status.versions.values():
            if request.ready and version.state != VersionState.READY:
                continue
            response.models.add(
                name=status.name,
                version=str(version.version),
                state=_INDEX_STATE[version.state],
                reason=version.reason,
            )
    return response


async def load(
    control: ModelControl, request: pb.RepositoryModelLoadRequest
) -> pb.RepositoryModelLoadResponse:
    name = request.model_name
    try:
        status = await control.load(name, "model_name", lambda: load_parameters(name, request.parameters))
    except ServiceError as exc:
        # Every refused load starts as Triton's does ("failed to load '<name>'"), which Triton's
        # clients match; the error keeps its kind (and so its code and x-error-reason).
        if not str(exc).startswith(FAILED_TO_LOAD):
            exc.args = (f"{FAILED_TO_LOAD} {quoted(name)}: {exc}",)
        raise
    if status.default_version is None:
        reasons = [status.reason] + [v.reason for v in status.versions.values() if v.reason]
        raise ModelLoadError(f"{FAILED_TO_LOAD} {quoted(name)}: {'; '.join(r for r in reasons if r)}")
    return pb.RepositoryModelLoadResponse()


async def unload(
    control: ModelControl, request: pb.RepositoryModelUnloadRequest
) -> pb.RepositoryModelUnloadResponse:
    name = request.model_name
    dependents = []
    if "unload_dependents" in request.parameters:
        flag = request.parameters["unload_dependents"]
        if flag.WhichOneof("parameter_choice") != "bool_param":
            raise InvalidInput("unload parameter 'unload_dependents' must be a bool")
        if flag.bool_param:  # as Triton: the ensembles that run the model go with it
            dependents = _ensembles_running(control.manager, name)
    await control.unload(name, "model_name")
    for dependent in dependents:
        await control.unload(dependent, "model_name")
    return pb.RepositoryModelUnloadResponse()


def _ensembles_running(manager: ModelManager, name: str) -> list[str]:
    """The served ensembles with a step that runs `name`."""
    found = []
    for status in manager.statuses():
        served = manager.served(status.name)
        ensemble = served.config.ensemble if served is not None else None
        if ensemble is not None and name in ensemble.models:
            found.append(status.name)
    return found
