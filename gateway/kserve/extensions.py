"""Triton's HTTP extensions, each mapped onto the KServe gRPC call of the same extension (Triton's
server docs, docs/protocol/extension_*.md, give the JSON): model configuration
(`/v2/models/{m}[/versions/{v}]/config`), statistics (`/v2/models[/{m}[/versions/{v}]]/stats`),
the model repository (`POST /v2/repository/index`, `.../models/{m}/load|unload`), logging
(`GET|POST /v2/logging`), trace (`GET|POST /v2[/models/{m}]/trace/setting`, also without
`/setting`), system shared memory (`/v2/systemsharedmemory[/region/{r}]/status|register|
unregister`) and CUDA shared memory (`/v2/cudasharedmemory/...`, the same routes: the service
answers that none is registered, and refuses a register)."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from modelyard.common import names
from modelyard.gateway import errors, http
from modelyard.gateway.kserve import messages, protocol
from modelyard.gateway.upstream import Upstream
from modelyard.kserve.v2 import grpc_service_pb2 as kpb

# KServeEndpoints._call: one upstream call with the request's forwarded headers, errors as HttpError.
Call = Callable[[Any, Any, Request], Awaitable[Any]]


class ExtensionEndpoints:
    def __init__(self, call: Call, upstream: Upstream, max_body_bytes: int) -> None:
        self._call = call
        self._upstream = upstream
        self._limit = max_body_bytes

    @property
    def _stub(self) -> Any:
        return self._upstream.kserve  # read per call: a TLS renewal replaces the channel

    async def _body(self, request: Request) -> dict[str, Any]:
        """The JSON object of a body; an empty body is `{}` (tritonclient sends one for the index)."""
        raw = await protocol.read_body(request, self._limit)
        return http.parse_object(raw) if raw.strip() else {}

    async def config(self, request: Request) -> Response:
        model = protocol.parse_model_path(request.path_params)
        asked = kpb.ModelConfigRequest(name=model.name, version=model.version)
        answer = await self._call(self._stub.ModelConfig, asked, request)
        return JSONResponse(messages.to_json(answer.config))

    async def stats(self, request: Request) -> Response:
        if "model" in request.path_params:
            model = protocol.parse_model_path(request.path_params)
            asked = kpb.ModelStatisticsRequest(name=model.name, version=model.version)
        else:
            asked = kpb.ModelStatisticsRequest()
        answer = await self._call(self._stub.ModelStatistics, asked, request)
        return JSONResponse(messages.to_json(answer, every_message=True))

    async def index(self, request: Request) -> Response:
        body = await self._body(request)
        ready = body.get("ready", False)
        if not isinstance(ready, bool):
            raise http.invalid("ready", "must be a boolean")
        asked = kpb.RepositoryIndexRequest(ready=ready)
        answer = await self._call(self._stub.RepositoryIndex, asked, request)
        return JSONResponse([messages.to_json(m) for m in answer.models])

    async def load(self, request: Request) -> Response:
        name = http.model_name(request.path_params["model"], "model_name")
        parameters = http.get_dict(await self._body(request), "parameters")
        asked = kpb.RepositoryModelLoadRequest(model_name=name)
        for key, value in parameters.items():
            asked.parameters[key].CopyFrom(_repository_parameter(key, value))
        await self._call(self._stub.RepositoryModelLoad, asked, request)
        return Response(b"", media_type="application/json")

    async def unload(self, request: Request) -> Response:
        name = http.model_name(request.path_params["model"], "model_name")
        parameters = http.get_dict(await self._body(request), "parameters")
        asked = kpb.RepositoryModelUnloadRequest(model_name=name)
        for key, value in parameters.items():
            asked.parameters[key].CopyFrom(_repository_parameter(key, value))
        await self._call(self._stub.RepositoryModelUnload, asked, request)
        return Response(b"", media_type="application/json")

    async def logging(self, request: Request) -> Response:
        asked = kpb.LogSettingsRequest()
        if request.method == "POST":
            for key, value in (await self._body(request)).items():
                setting = asked.settings[key]
                label = names.echo(key, 64)
                if isinstance(value, bool):
                    setting.bool_param = value
                elif isinstance(value, int):
                    setting.uint32_param = http.ranged(value, label, http.UINT32)
                elif isinstance(value, str):
                    setting.string_param = value
                else:
                    raise http.invalid(label, "must be a boolean, an integer or a string")
        answer = await self._call(self._stub.LogSettings, asked, request)
        return JSONResponse({k: _log_value(v) for k, v in answer.settings.items()})

    async def trace(self, request: Request) -> Response:
        asked = kpb.TraceSettingRequest()
        if "model" in request.path_params:
            asked.model_name = http.model_name(request.path_params["model"], "model_name")
        if request.method == "POST":
            for key, value in (await self._body(request)).items():
                label = names.echo(key, 64)
                values = [] if value is None else value if isinstance(value, list) else [value]
                if not all(isinstance(v, str) for v in values):
                    raise http.invalid(label, "must be a string, a list of strings or null")
                asked.settings[key].value.extend(values)
        answer = await self._call(self._stub.TraceSetting, asked, request)
        # Triton: trace_level is a list, every other setting one string.
        return JSONResponse(
            {
                k: list(v.value) if k == "trace_level" else (v.value[0] if v.value else "")
                for k, v in answer.settings.items()
            }
        )

    async def shm_status(self, request: Request) -> Response:
        asked = kpb.SystemSharedMemoryStatusRequest(name=request.path_params.get("region", ""))
        answer = await self._call(self._stub.SystemSharedMemoryStatus, asked, request)
        return JSONResponse([messages.to_json(r) for r in answer.regions.values()])

    async def shm_register(self, request: Request) -> Response:
        body = await self._body(request)
        key = http.get_str(body, "key")
        if not key:
            raise http.invalid("key", "required")
        asked = kpb.SystemSharedMemoryRegisterRequest(
            name=request.path_params["region"],
            key=key,
            offset=http.get_int(body, "offset", http.UINT64),
            byte_size=http.get_int(body, "byte_size", http.UINT64),
        )
        await self._call(self._stub.SystemSharedMemoryRegister, asked, request)
        return Response(b"", media_type="application/json")

    async def shm_unregister(self, request: Request) -> Response:
        asked = kpb.SystemSharedMemoryUnregisterRequest(name=request.path_params.get("region", ""))
        await self._call(self._stub.SystemSharedMemoryUnregister, asked, request)
        return Response(b"", media_type="application/json")

    # CUDA shared memory: answered by the service as over gRPC (nothing is ever registered; a
    # register is refused, UNIMPLEMENTED: this server imports no CUDA IPC handle), in Triton's JSON.

    async def cuda_status(self, request: Request) -> Response:
        asked = kpb.CudaSharedMemoryStatusRequest(name=request.path_params.get("region", ""))
        answer = await self._call(self._stub.CudaSharedMemoryStatus, asked, request)
        return JSONResponse([messages.to_json(r) for r in answer.regions.values()])

    async def cuda_register(self, request: Request) -> Response:
        body = await self._body(request)
        handle = http.get_dict(body, "raw_handle")
        encoded = http.get_str(handle, "b64", "")
        try:
            raw = base64.b64decode(encoded or "", validate=True)
        except binascii.Error:
            raise errors.bad_request("raw_handle.b64: is not valid base64") from None
        asked = kpb.CudaSharedMemoryRegisterRequest(
            name=request.path_params["region"],
            raw_handle=raw,
            device_id=http.get_int(body, "device_id", http.INT64),
            byte_size=http.get_int(body, "byte_size", http.UINT64),
        )
        await self._call(self._stub.CudaSharedMemoryRegister, asked, request)
        return Response(b"", media_type="application/json")

    async def cuda_unregister(self, request: Request) -> Response:
        asked = kpb.CudaSharedMemoryUnregisterRequest(name=request.path_params.get("region", ""))
        await self._call(self._stub.CudaSharedMemoryUnregister, asked, request)
        return Response(b"", media_type="application/json")


def _repository_parameter(key: str, value: Any) -> kpb.ModelRepositoryParameter:
    label = f"parameters.{names.echo(key, 64)}"
    if key.startswith("file:"):  # a file's content, base64 over JSON (as tritonclient.http sends it)
        if not isinstance(value, str):
            raise http.invalid(label, "must be base64 text")
        try:
            return kpb.ModelRepositoryParameter(bytes_param=base64.b64decode(value, validate=True))
        except binascii.Error:
            raise errors.bad_request(f"{label}: is not valid base64") from None
    if isinstance(value, bool):
        return kpb.ModelRepositoryParameter(bool_param=value)
    if isinstance(value, int):
        return kpb.ModelRepositoryParameter(int64_param=http.ranged(value, label, http.INT64))
    if isinstance(value, str):
        return kpb.ModelRepositoryParameter(string_param=value)
    raise http.invalid(label, "must be a boolean, an integer or a string")


def _log_value(setting: Any) -> Any:
    kind = setting.WhichOneof("parameter_choice")
    return getattr(setting, kind) if kind else None
