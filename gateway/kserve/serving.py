"""KServe V2 / Open Inference Protocol over REST, mapped onto the sidecar's KServe gRPC service:
`/v2/health/live|ready`, `/v2`, `/v2/models/{m}[/versions/{v}]`, `.../ready`, `.../infer`.

Tensors travel as JSON (`data`: flattened row-major, or nested lists) or with the binary tensor
data extension (`Inference-Header-Content-Length`: a JSON header, then each tensor's raw bytes,
sized by its `binary_data_size` parameter), which is what `tritonclient.http` sends by default.
Element bytes are little-endian, as the gRPC API's raw contents; the `struct` module converts
them (the gateway does not need numpy). BYTES elements are 4-byte-length-prefixed, as Triton's.
"""

from __future__ import annotations

import asyncio
import json
import struct
from typing import Any

import grpc
from modelyard.common import names
from modelyard.kserve.v2 import grpc_service_pb2 as kpb
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway import errors, http
from gateway.config import Settings
from gateway.upstream import Upstream, forward, returned

HEADER_LENGTH = "inference-header-content-length"
# Datatype -> struct format character (little-endian '<' prefix added when packing).
FORMATS = {
    "BOOL": "?",
    "INT8": "b",
    "UINT8": "B",
    "INT16": "h",
    "UINT16": "H",
    "INT32": "i",
    "UINT32": "I",
    "INT64": "q",
    "UINT64": "Q",
    "FP16": "e",
    "FP32": "f",
    "FP64": "d",
}


def _shape_text(shape: list[int]) -> str:
    """The shape as a message shows it: its first 16 dims (int64s, so bounded)."""
    return str(shape) if len(shape) <= 16 else str(shape[:16])[:-1] + ", ...]"


def _count(shape: list[int], cap: int) -> int:
    """The element count of `shape`, or cap + 1 once it is known to be over `cap` (a long shape
    of huge dims would otherwise make an enormous integer, slowly)."""
    if 0 in shape:
        return 0
    n = 1
    for d in shape:
        n *= d
        if n > cap:
            return cap + 1
    return n


def _flatten(data: Any) -> list[Any]:
    if isinstance(data, list):
        return [x for item in data for x in _flatten(item)]
    return [data]


def encode(datatype: str, shape: list[int], data: Any, name: str) -> bytes:
    """JSON elements -> the raw little-endian bytes of the gRPC API."""
    values = _flatten(data)
    if len(values) != _count(shape, len(values)):
        raise http.invalid(name, f"{len(values)} elements for shape {_shape_text(shape)}")
    if datatype == "BYTES":
        out = bytearray()
        for value in values:
            # Strings only: bytes(<int>) would allocate that many zero bytes.
            if not isinstance(value, str):
                raise http.invalid(name, f"BYTES elements must be strings, got {type(value).__name__}")
            raw = value.encode()
            out += struct.pack("<I", len(raw)) + raw
        return bytes(out)
    fmt = FORMATS.get(datatype)
    if fmt is None:
        raise http.invalid(name, f"datatype {names.echo(datatype)} cannot be sent as JSON")
    if datatype == "BOOL" and not all(isinstance(v, bool) for v in values):
        raise http.invalid(name, "BOOL elements must be true or false")
    try:
        return struct.pack(f"<{len(values)}{fmt}", *values)
    except (struct.error, OverflowError) as exc:
        raise http.invalid(name, f"data does not fit {names.echo(datatype)}: {exc}") from None


def decode(datatype: str, raw: bytes) -> list[Any]:
    if datatype == "BYTES":
        out: list[Any] = []
        offset = 0
        while offset < len(raw):
            (length,) = struct.unpack_from("<I", raw, offset)
            item = raw[offset + 4 : offset + 4 + length]
            offset += 4 + length
            try:
                out.append(item.decode())
            except UnicodeDecodeError:
                out.append(list(item))
        return out
    fmt = FORMATS[datatype]
    return list(struct.unpack(f"<{len(raw) // struct.calcsize(fmt)}{fmt}", raw))


def _param(value: Any, name: str) -> kpb.InferParameter:
    if isinstance(value, bool):
        return kpb.InferParameter(bool_param=value)
    if isinstance(value, int):
        return kpb.InferParameter(int64_param=http.ranged(value, name, http.INT64))
    if isinstance(value, float):
        return kpb.InferParameter(double_param=value)
    if isinstance(value, str):
        return kpb.InferParameter(string_param=value)
    raise http.invalid(name, "must be a boolean, a number or a string")


def _param_value(param: kpb.InferParameter) -> Any:
    kind = param.WhichOneof("parameter_choice")
    return getattr(param, kind) if kind else None


class KServeEndpoints:
    def __init__(self, upstream: Upstream, settings: Settings) -> None:
        self.upstream = upstream
        self.settings = settings

    async def _call(self, method: Any, message: Any, request: Request) -> Any:
        try:
            return await method(message, metadata=forward(request.headers), timeout=self.upstream.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise errors.from_rpc_error(exc) from None

    async def live(self, request: Request) -> Response:
        answer = await self._call(self.upstream.kserve.ServerLive, kpb.ServerLiveRequest(), request)
        return JSONResponse({"live": answer.live}, status_code=200 if answer.live else 503)

    async def ready(self, request: Request) -> Response:
        answer = await self._call(self.upstream.kserve.ServerReady, kpb.ServerReadyRequest(), request)
        return JSONResponse({"ready": answer.ready}, status_code=200 if answer.ready else 503)

    async def server_metadata(self, request: Request) -> Response:
        answer = await self._call(self.upstream.kserve.ServerMetadata, kpb.ServerMetadataRequest(), request)
        return JSONResponse(
            {"name": answer.name, "version": answer.version, "extensions": list(answer.extensions)}
        )

    async def model_metadata(self, request: Request) -> Response:
        name, version = _model(request)
        answer = await self._call(
            self.upstream.kserve.ModelMetadata, kpb.ModelMetadataRequest(name=name, version=version), request
        )

        def tensors(items: Any) -> list[dict[str, Any]]:
            return [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in items]

        return JSONResponse(
            {
                "name": answer.name,
                "versions": list(answer.versions),
                "platform": answer.platform,
                "inputs": tensors(answer.inputs),
                "outputs": tensors(answer.outputs),
            }
        )

    async def model_ready(self, request: Request) -> Response:
        name, version = _model(request)
        answer = await self._call(
            self.upstream.kserve.ModelReady, kpb.ModelReadyRequest(name=name, version=version), request
        )
        return JSONResponse({"name": name, "ready": answer.ready}, status_code=200 if answer.ready else 503)

    async def infer(self, request: Request) -> Response:
        name, version = _model(request)
        metadata = forward(request.headers)
        body = await http.read_body(request, self.settings.max_body_bytes)
        header_length = request.headers.get(HEADER_LENGTH)
        if header_length is not None:
            if not header_length.isdigit() or len(header_length) > 19 or int(header_length) > len(body):
                raise errors.bad_request(
                    f"{HEADER_LENGTH} {names.echo(header_length, 40)} does not fit the body"
                )
            head, binary = body[: int(header_length)], body[int(header_length) :]
        else:
            head, binary = body, b""
        if len(head) > http.OFF_LOOP_BYTES:  # parse and encode large JSON tensors off the loop
            grpc_request, binary_out = await asyncio.to_thread(_parse_infer, name, version, head, binary)
        else:
            grpc_request, binary_out = _parse_infer(name, version, head, binary)
        call = self.upstream.kserve.ModelInfer(
            grpc_request, metadata=metadata, timeout=self.upstream.timeout_s
        )
        try:
            answer = await call
            served = returned(await call.initial_metadata())
        except grpc.aio.AioRpcError as exc:
            raise errors.from_rpc_error(exc) from None
        return _infer_response(answer, binary_out, served)


def _model(request: Request) -> tuple[str, str]:
    """The path's model name and version (names rule: 400 naming the field)."""
    name = http.model_name(request.path_params["model"], "model_name")
    return name, http.model_version(request.path_params.get("version", ""), "model_version")


def _parse_infer(
    name: str, version: str, head: bytes, binary: bytes
) -> tuple[kpb.ModelInferRequest, dict[str, bool]]:
    return _infer_request(name, version, http.parse_object(head), binary)


def _infer_request(
    name: str, version: str, document: dict[str, Any], binary: bytes
) -> tuple[kpb.ModelInferRequest, dict[str, bool]]:
    inputs = document.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise http.invalid("inputs", "must be a non-empty list")
    request_id = document.get("id", "")
    if not isinstance(request_id, str):
        raise http.invalid("id", "must be a string")
    request = kpb.ModelInferRequest(model_name=name, model_version=version, id=request_id)
    offset = 0
    for i, tensor in enumerate(inputs):
        label = f"inputs[{i}]"
        if not isinstance(tensor, dict):
            raise http.invalid(label, "must be an object")
        tname, datatype, shape = tensor.get("name"), tensor.get("datatype"), tensor.get("shape")
        if not isinstance(tname, str) or not isinstance(datatype, str):
            raise http.invalid(label, "needs a name and a datatype")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise http.invalid(f"{label}.shape", "must be a list of non-negative integers")
        shape = http.int_list(shape, f"{label}.shape", http.INT64)
        parameters = http.get_dict(tensor, "parameters")
        size = parameters.get("binary_data_size")
        if size is not None:
            size = http.as_int(size, f"{label}.parameters.binary_data_size", http.INT64, 0)
            if offset + size > len(binary):
                raise http.invalid(f"{label}.parameters.binary_data_size", "does not fit the binary data")
            raw = binary[offset : offset + size]
            offset += size
        elif "data" in tensor:
            raw = encode(datatype, shape, tensor["data"], f"{label}.data")
        else:
            raise http.invalid(label, "needs data or parameters.binary_data_size")
        request.inputs.append(
            kpb.ModelInferRequest.InferInputTensor(name=tname, datatype=datatype, shape=shape)
        )
        request.raw_input_contents.append(raw)
    parameters = http.get_dict(document, "parameters")
    binary_all = bool(parameters.get("binary_data_output", False))
    binary_out: dict[str, bool] = {}
    outputs = document.get("outputs") or []
    if not isinstance(outputs, list):
        raise http.invalid("outputs", "must be a list")
    for output in outputs:
        if not isinstance(output, dict) or not isinstance(output.get("name"), str):
            raise http.invalid("outputs", "each output must be an object with a name")
        binary_out[output["name"]] = bool(http.get_dict(output, "parameters").get("binary_data", binary_all))
        request.outputs.append(kpb.ModelInferRequest.InferRequestedOutputTensor(name=output["name"]))
    if not binary_out and binary_all:
        binary_out[""] = True  # every output binary
    for key, value in parameters.items():
        if key != "binary_data_output":
            request.parameters[key].CopyFrom(_param(value, f"parameters.{names.echo(key, 64)}"))
    return request, binary_out


def _infer_response(
    answer: kpb.ModelInferResponse, binary_out: dict[str, bool], served: dict[str, str]
) -> Response:
    outputs: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    for tensor, raw in zip(answer.outputs, answer.raw_output_contents, strict=False):
        entry: dict[str, Any] = {
            "name": tensor.name,
            "datatype": tensor.datatype,
            "shape": list(tensor.shape),
        }
        if binary_out.get(tensor.name, binary_out.get("", False)):
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            if tensor.datatype not in FORMATS and tensor.datatype != "BYTES":
                raise errors.bad_request(f"output {tensor.name!r} ({tensor.datatype}) needs binary_data")
            entry["data"] = decode(tensor.datatype, raw)
        outputs.append(entry)
    document: dict[str, Any] = {"model_name": answer.model_name, "model_version": answer.model_version}
    if answer.id:
        document["id"] = answer.id
    if answer.parameters:
        document["parameters"] = {k: _param_value(v) for k, v in answer.parameters.items()}
    document["outputs"] = outputs
    head = json.dumps(document, separators=(",", ":")).encode()
    if not chunks:
        return Response(head, media_type="application/json", headers=served)
    headers = {**served, HEADER_LENGTH: str(len(head))}
    return Response(head + b"".join(chunks), media_type="application/octet-stream", headers=headers)
