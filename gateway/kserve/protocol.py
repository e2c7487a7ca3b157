"""The KServe V2 REST API's request and response models (the Open Inference Protocol over REST,
mapped onto the sidecar's KServe gRPC service).

Requests: a model path (`/v2/models/{m}[/versions/{v}]`: the names rule, 400 naming the field);
an infer body, JSON (`data`: flattened row-major, or nested lists) or with the binary tensor data
extension (`Inference-Header-Content-Length`: a JSON header, then each tensor's raw bytes, sized
by its `binary_data_size` parameter), which is what `tritonclient.http` sends by default; both
checked by the shared intake (gateway/http.py). Responses: the metadata documents and the infer
answer (JSON data, or binary data after the JSON header for the outputs asked for as binary).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from modelyard.common import names
from modelyard.common.reasons import ErrorReason
from modelyard.gateway import errors, http
from modelyard.gateway.kserve import tensors
from modelyard.kserve.v2 import grpc_service_pb2 as kpb

HEADER_LENGTH = "inference-header-content-length"
SHM_REGION = "shared_memory_region"
SEQUENCE_ID = "sequence_id"  # Triton's sequence parameter (a uint64 or a string)
# Content-Encoding -> zlib's wbits: what tritonclient sends with request_compression_algorithm.
_ENCODINGS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS, "identity": 0}


async def read_body(request: Request, limit: int) -> bytes:
    """The body, decompressed when its Content-Encoding is gzip or deflate (as Triton accepts);
    `limit` bounds the bytes sent and the bytes they inflate to (413 past it), so a small
    compressed body cannot expand into a large one. The compressed stream must be one whole
    stream (one gzip member), checksum checked, with nothing after it (else 400)."""
    raw = await http.read_body(request, limit)
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    wbits = _ENCODINGS.get(encoding)
    if wbits is None:
        message = f"content-encoding {names.echo(encoding, 40)} is not supported (gzip, deflate)"
        raise errors.HttpError(415, "INVALID_ARGUMENT", ErrorReason.UNSUPPORTED, message)
    if not wbits:
        return raw
    zlib_header = len(raw) >= 2 and raw[0] & 0x0F == 8 and (raw[0] << 8 | raw[1]) % 31 == 0
    if encoding == "deflate" and not zlib_header:
        wbits = -zlib.MAX_WBITS  # raw deflate, without the zlib header some clients leave out
    inflater = zlib.decompressobj(wbits)
    try:
        body = inflater.decompress(raw, limit + 1)
    except zlib.error as exc:  # also a bad CRC-32 / ISIZE (gzip) or Adler-32 (zlib) check
        raise errors.bad_request(f"the {encoding} body cannot be decompressed: {exc}") from None
    if len(body) > limit or inflater.unconsumed_tail:
        raise http.too_large(limit)
    # Whole and alone: a stream cut before its end (a gzip without its CRC-32/ISIZE trailer, a
    # deflate without its last block) or followed by more bytes (garbage, or a second gzip
    # member) is refused, not read as far as it goes. An empty body is no stream at all.
    if raw and not inflater.eof:
        raise errors.bad_request(f"the {encoding} body is truncated: its stream does not end")
    if inflater.unused_data:
        raise errors.bad_request(
            f"the {encoding} body has {len(inflater.unused_data)} bytes after the end of its stream"
        )
    return body


@dataclass(frozen=True, slots=True)
class ModelPath:
    name: str
    version: str  # "" = none asked for


def parse_model_path(path_params: Mapping[str, Any]) -> ModelPath:
    """The path's model name and version (names rule: 400 naming the field)."""
    name = http.model_name(path_params["model"], "model_name")
    return ModelPath(name, http.model_version(path_params.get("version", ""), "model_version"))


def split_body(body: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    """The JSON header and the binary tensor data of a body (all JSON without the header)."""
    if header_length is None:
        return body, b""
    # ASCII digits only: str.isdigit() also takes '²' (which int() refuses) and U+0665 (which it reads as 5).
    if (
        not (header_length.isascii() and header_length.isdigit())
        or len(header_length) > 19
        or int(header_length) > len(body)
    ):
        raise errors.bad_request(f"{HEADER_LENGTH} {names.echo(header_length, 40)} does not fit the body")
    return body[: int(header_length)], body[int(header_length) :]


@dataclass(frozen=True, slots=True)
class InferRequest:
    message: kpb.ModelInferRequest
    # Output name -> sent as binary data; "" -> every output (binary_data_output without outputs).
    binary_outputs: dict[str, bool]
    # Output name -> its shared-memory parameters: written into the region, answered without data.
    shm_outputs: dict[str, dict[str, Any]]


def parse_infer(name: str, version: str, head: bytes, binary: bytes) -> InferRequest:
    """The request from its JSON header (`head`) and the binary tensor data after it."""
    return InferRequest(*_infer_request(name, version, http.parse_object(head), binary))


def _infer_request(
    name: str, version: str, document: dict[str, Any], binary: bytes
) -> tuple[kpb.ModelInferRequest, dict[str, bool], dict[str, dict[str, Any]]]:
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
        message = kpb.ModelInferRequest.InferInputTensor(name=tname, datatype=datatype, shape=shape)
        # The rest (shared_memory_region/_offset/_byte_size: the data is in a registered region)
        # goes upstream as the tensor's parameters.
        for key, value in parameters.items():
            if key != "binary_data_size":
                message.parameters[key].CopyFrom(_param(value, f"{label}.parameters.{names.echo(key, 64)}"))
        request.inputs.append(message)
        if SHM_REGION in parameters:
            continue  # no raw entry: raw contents are for the inputs outside shared memory
        size = parameters.get("binary_data_size")
        if size is not None:
            size = http.as_int(size, f"{label}.parameters.binary_data_size", http.INT64, 0)
            if offset + size > len(binary):
                raise http.invalid(f"{label}.parameters.binary_data_size", "does not fit the binary data")
            raw = binary[offset : offset + size]
            offset += size
        elif "data" in tensor:
            raw = tensors.encode(datatype, shape, tensor["data"], f"{label}.data")
        else:
            raise http.invalid(
                label, "needs data, parameters.binary_data_size or parameters.shared_memory_region"
            )
        request.raw_input_contents.append(raw)
    parameters = http.get_dict(document, "parameters")
    binary_all = bool(parameters.get("binary_data_output", False))
    binary_out: dict[str, bool] = {}
    shm_out: dict[str, dict[str, Any]] = {}
    outputs = document.get("outputs") or []
    if not isinstance(outputs, list):
        raise http.invalid("outputs", "must be a list")
    for output in outputs:
        if not isinstance(output, dict) or not isinstance(output.get("name"), str):
            raise http.invalid("outputs", "each output must be an object with a name")
        output_parameters = http.get_dict(output, "parameters")
        binary_out[output["name"]] = bool(output_parameters.get("binary_data", binary_all))
        if SHM_REGION in output_parameters:
            shm_out[output["name"]] = {
                k: v for k, v in output_parameters.items() if k.startswith("shared_memory")
            }
        requested = kpb.ModelInferRequest.InferRequestedOutputTensor(name=output["name"])
        # The rest (`classification`: top-k, as tritonclient's class_count sends it) goes upstream.
        for key, value in output_parameters.items():
            if key != "binary_data":
                label = f"outputs.{names.echo(output['name'], 64)}.parameters.{names.echo(key, 64)}"
                requested.parameters[key].CopyFrom(_param(value, label))
        request.outputs.append(requested)
    if not binary_out and binary_all:
        binary_out[""] = True  # every output binary
    for key, value in parameters.items():
        if key == SEQUENCE_ID and type(value) is int and value > http.INT64[2]:
            # Triton's sequence ids are uint64: one above the int64 range goes as uint64_param.
            request.parameters[key].uint64_param = http.ranged(value, "parameters.sequence_id", http.UINT64)
        elif key != "binary_data_output":
            request.parameters[key].CopyFrom(_param(value, f"parameters.{names.echo(key, 64)}"))
    return request, binary_out, shm_out


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


def model_metadata(answer: kpb.ModelMetadataResponse) -> dict[str, Any]:
    def described(items: Any) -> list[dict[str, Any]]:
        return [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in items]

    return {
        "name": answer.name,
        "versions": list(answer.versions),
        "platform": answer.platform,
        "inputs": described(answer.inputs),
        "outputs": described(answer.outputs),
    }


def infer_response(
    answer: kpb.ModelInferResponse,
    binary_out: dict[str, bool],
    served: dict[str, str],
    shm_out: dict[str, dict[str, Any]] | None = None,
) -> Response:
    """The answer as JSON, with the outputs asked for as binary after it (the extension's layout)."""
    outputs: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    for tensor, raw in zip(answer.outputs, answer.raw_output_contents, strict=False):
        entry: dict[str, Any] = {
            "name": tensor.name,
            "datatype": tensor.datatype,
            "shape": list(tensor.shape),
        }
        if tensor.name in (shm_out or {}):
            entry["parameters"] = (shm_out or {})[tensor.name]  # the data is in the region, as Triton's
        elif binary_out.get(tensor.name, binary_out.get("", False)):
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            if tensor.datatype not in tensors.FORMATS and tensor.datatype != "BYTES":
                raise errors.bad_request(f"output {tensor.name!r} ({tensor.datatype}) needs binary_data")
            entry["data"] = tensors.decode(tensor.datatype, raw)
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
