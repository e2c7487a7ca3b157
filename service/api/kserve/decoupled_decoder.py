"""A decoder language model on KServe's ModelStreamInfer, as Triton's LLM backends serve one: a
decoupled model whose request is a text and whose responses are the text it generates.

The tensors and parameters are the vLLM backend's (triton-inference-server/vllm_backend,
src/model.py and src/utils/request.py): input `text_input` (BYTES, one element), optional
`stream` and `exclude_input_in_output` (BOOL) and `sampling_parameters` (BYTES: a JSON object);
output `text_output` (BYTES [1]). The sampling fields (`max_tokens`, `temperature`, `top_p`,
`top_k`, `seed`, `stop`, `frequency_penalty`, `presence_penalty`) come from an input tensor of
that name (TensorRT-LLM's way), else `sampling_parameters`, else the request's parameters
(vLLM's: tritonclient sends a float as a string, "0.1", which is read as the number). A field
this server has no counterpart for (`n`, `ignore_eos`, ...) is refused by name, never ignored.
Unset fields keep Generate's defaults (greedy, the model's default max_tokens), not vLLM's.

`stream: true`: one response per event of the generation (one token, or the tokens that piled up
while the client read slowly), each its new text. `stream: false` (vLLM's default): one response,
the whole text, led by the prompt unless `exclude_input_in_output` (vLLM's rule; streaming with
`exclude_input_in_output: false` is refused, as vLLM refuses it). Every response carries
`triton_final_response`, true on the last one: the flag comes with the last text, as vLLM's and
TensorRT-LLM's do, so no empty final response follows even when the client asks for one.

The request goes through the generation plane as Generate's does (batching across streams,
context checks, stop sequences, preemption); its errors, before or during the generation, are
its last response, in-band. A client that leaves ends the sequence and frees its slot. Unary
ModelInfer is refused, as Triton refuses a decoupled model.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncGenerator, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import numpy as np

from modelyard.kserve.v2 import grpc_service_pb2 as pb
from modelyard.kserve.v2 import model_config_pb2 as config_pb
from modelyard.service.api.errors import Context, deadline_passed, end_stalled, serving
from modelyard.service.api.kserve.decoupled import FINAL_RESPONSE, InBand
from modelyard.service.api.kserve.tensors import decode_inputs, parameter_value
from modelyard.service.api.names import quoted
from modelyard.service.api.scheduling import kserve_scheduling
from modelyard.service.api.tensor_headers import kserve_headers
from modelyard.service.dataplane import Call
from modelyard.service.decoupled.runner import UNARY_REFUSED
from modelyard.service.errors import InvalidInput, ServiceError, Unsupported
from modelyard.service.generation.model import DecoderModel
from modelyard.service.generation.params import (
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    GenerateParams,
    prompt_chars,
)
from modelyard.service.generation.plane import GenerationPlane
from modelyard.service.runtime.served import ServedVersion
from modelyard.service.runtime.signature import TensorSpec
from modelyard.service.shm.registry import Regions
from modelyard.tensors import TensorError

TEXT_INPUT, TEXT_OUTPUT = "text_input", "text_output"
STREAM, EXCLUDE_INPUT, SAMPLING_PARAMETERS = "stream", "exclude_input_in_output", "sampling_parameters"
# Request parameters that KServe's path reads itself (scheduling, sequences, the final flag).
KSERVE_PARAMETERS = frozenset(
    {
        "priority",
        "timeout",
        "sequence_id",
        "sequence_start",
        "sequence_end",
        "binary_data_output",
        "triton_enable_empty_final_response",
    }
)
MAX_SAMPLING_JSON_BYTES = 64 * 1024
_UINT64_MAX = 2**64 - 1
_INTEGERS = frozenset({"INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64"})


@dataclass(frozen=True)
class _Field:
    """One request field: its tensor's datatype as ModelMetadata shows it, and its kind."""

    name: str
    datatype: str
    kind: str  # "int", "float", "bool" or "text" (stop: a string, or a list of them)


_FIELDS = (
    _Field("max_tokens", "INT32", "int"),
    _Field("temperature", "FP32", "float"),
    _Field("top_p", "FP32", "float"),
    _Field("top_k", "INT32", "int"),
    _Field("seed", "UINT64", "int"),
    _Field("stop", "BYTES", "text"),
    _Field("frequency_penalty", "FP32", "float"),
    _Field("presence_penalty", "FP32", "float"),
    _Field(STREAM, "BOOL", "bool"),
    _Field(EXCLUDE_INPUT, "BOOL", "bool"),
)
_BY_NAME = {field.name: field for field in _FIELDS}
_DATATYPES = {
    "int": _INTEGERS,
    "float": _INTEGERS | {"FP16", "FP32", "FP64"},
    "bool": frozenset({"BOOL"}),
    "text": frozenset({"BYTES"}),
}
INPUTS = (
    TensorSpec(TEXT_INPUT, "BYTES", (1,)),
    TensorSpec(SAMPLING_PARAMETERS, "BYTES", (1,)),
    *(TensorSpec(f.name, f.datatype, (-1,) if f.kind == "text" else (1,)) for f in _FIELDS),
)
OUTPUTS = (TensorSpec(TEXT_OUTPUT, "BYTES", (1,)),)
_INPUT_NAMES = frozenset(spec.name for spec in INPUTS)
_KNOWN = ", ".join(spec.name for spec in INPUTS)
_SAMPLING_KNOWN = ", ".join(f.name for f in _FIELDS)


def text_decoder(served: ServedVersion) -> DecoderModel | None:
    """The version's decoder when the generation plane can serve it text (a decoder with its
    tokenizer): such a version answers KServe as this module says."""
    kind = served.runner.kind
    return kind if isinstance(kind, DecoderModel) and kind.codec is not None else None


def tensors(served: ServedVersion) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]] | None:
    """ModelMetadata's inputs and outputs of a text decoder; None for any other model."""
    return (INPUTS, OUTPUTS) if text_decoder(served) is not None else None


def describe(config: config_pb.ModelConfig) -> None:
    """A text decoder's ModelConfig as Triton's vLLM backend completes it: decoupled, no batch
    dimension (the generation plane batches), these tensors, all optional but text_input."""
    config.max_batch_size = 0
    del config.input[:]
    del config.output[:]
    for spec in INPUTS:
        config.input.add(
            name=spec.name,
            data_type=_triton_type(spec.datatype),
            dims=spec.shape,
            optional=spec.name != TEXT_INPUT,
        )
    for spec in OUTPUTS:
        config.output.add(name=spec.name, data_type=_triton_type(spec.datatype), dims=spec.shape)
    config.model_transaction_policy.decoupled = True


def _triton_type(datatype: str) -> config_pb.DataType.ValueType:
    return config_pb.DataType.Value("TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}")


@dataclass(frozen=True)
class Asked:
    """What a request asks: the generation, whether it streams, and whether its one response
    (stream false) begins with the prompt."""

    params: GenerateParams
    stream: bool
    echo: bool


class DecoderResponses:
    """The responses of one request to a text decoder, on `held`: its own lease of the request's
    version (Call.detached), released once the last response is out (or `release`, should the
    stream never start)."""

    def __init__(
        self,
        plane: GenerationPlane | None,
        held: Call,
        decoder: DecoderModel,
        request: pb.ModelInferRequest,
        context: Context,
        request_id: str,
        priority: int,
        regions: Regions,
    ) -> None:
        self._plane = plane
        self._held = held
        self._served = held.served
        self._decoder = decoder
        self._request = request
        self._context = context
        self._request_id = request_id
        self._priority = priority
        self._regions = regions

    @classmethod
    def open(
        cls,
        plane: GenerationPlane | None,
        call: Call,
        request: pb.ModelInferRequest,
        context: Context,
        request_id: str,
        priority: int,
        regions: Regions,
        streamed: bool,
    ) -> DecoderResponses:
        """The responses to a request for a text decoder (`text_decoder(call.served)`), on a lease
        of their own of the call's version; on a unary call, Triton's refusal."""
        served = call.served
        decoder = text_decoder(served)
        assert decoder is not None
        if not streamed:
            raise Unsupported(f"{UNARY_REFUSED} (model '{served.model}': call ModelStreamInfer)")
        return cls(plane, call.detached(), decoder, request, context, request_id, priority, regions)

    def release(self) -> None:
        """Give back the version's lease (once: a lease's release; `stream` does when it ends)."""
        self._held.release()

    async def stream(
        self, final_flag: bool, call: serving, first: bool, in_band: InBand
    ) -> AsyncGenerator[pb.ModelStreamInferResponse]:
        """The stream's messages for this request (`final_flag` changes nothing: the last text
        carries the flag). `first`: no response of the stream has been sent yet."""
        served, context = self._served, self._context
        try:
            try:
                if self._plane is None:
                    raise Unsupported(
                        f"model '{served.model}' is a decoder, and this server does not generate"
                    )
                asked = parse(self._request, self._decoder, self._regions)
                scheduling = self._held.levelled(
                    kserve_scheduling(context, self._request.parameters, self._priority)
                )
                events = self._plane.generate(
                    served.model,
                    served.version_name,
                    asked.params,
                    scheduling,
                    deadline_passed=lambda: deadline_passed(context),
                    on_stalled=lambda error: end_stalled(context, error),
                    served=served,
                )
                async with aclosing(events):
                    if asked.stream:
                        async for event in events:
                            response = self._response(event.version, event.text, event.finish is not None)
                            first = await _answered(call, response, first)
                            yield pb.ModelStreamInferResponse(infer_response=response)
                    else:
                        texts = [asked.params.prompt] if asked.echo else []
                        version = served.version
                        async for event in events:
                            texts.append(event.text)
                            version = event.version
                        response = self._response(version, "".join(texts), True)
                        await _answered(call, response, first)
                        yield pb.ModelStreamInferResponse(infer_response=response)
            except (ServiceError, TensorError) as exc:
                failed = in_band(self._request, exc, call)
                failed.infer_response.parameters[FINAL_RESPONSE].bool_param = True
                yield failed
        finally:
            self.release()
        call.version = call.version or served.version_name

    def _response(self, version: int, text: str, final: bool) -> pb.ModelInferResponse:
        response = pb.ModelInferResponse()
        response.model_name, response.model_version = self._served.model, str(version)
        if self._request_id:
            response.id = self._request_id
        data = text.encode()
        response.outputs.add(name=TEXT_OUTPUT, datatype="BYTES", shape=[1])
        response.raw_output_contents.append(len(data).to_bytes(4, "little") + data)
        response.parameters[FINAL_RESPONSE].bool_param = final
        return response


async def _answered(call: serving, response: pb.ModelInferResponse, first: bool) -> bool:
    """Say which version answers: x-served-version before the stream's first response."""
    if first:
        await call.stream_answered(response.model_version)
    else:
        call.version = response.model_version
    return False


# -- the request ------------------------------------------------------------------------------


def parse(request: pb.ModelInferRequest, decoder: DecoderModel, regions: Regions | None = None) -> Asked:
    """The request's generation; InvalidInput naming the input, parameter or field at fault."""
    for output in request.outputs:
        if output.name != TEXT_OUTPUT:
            raise InvalidInput(
                f"output {quoted(output.name)} is not an output of a decoder model ({TEXT_OUTPUT})"
            )
        if output.parameters:
            raise InvalidInput(
                f"output {TEXT_OUTPUT!r}: parameters (shared memory, classification) are not supported "
                "for a decoder model's text"
            )
    _check_headers(request, decoder)
    arrays = decode_inputs(request, regions)
    if TEXT_INPUT not in arrays:
        raise InvalidInput(f"input {TEXT_INPUT!r} is required: the text to continue")
    text = _text(arrays.pop(TEXT_INPUT), TEXT_INPUT)[0]
    if not text:
        raise InvalidInput(f"input {TEXT_INPUT!r} is empty: give the text to continue")
    limit = prompt_chars(decoder)
    if len(text) > limit:
        raise InvalidInput(
            f"input {TEXT_INPUT!r}: {len(text)} characters cannot fit the model's context of "
            f"{decoder.context_length} tokens"
        )
    from_json = _sampling_json(arrays.pop(SAMPLING_PARAMETERS)) if SAMPLING_PARAMETERS in arrays else {}
    from_parameters = _request_parameters(request.parameters)
    values: dict[str, Any] = {}
    for field in _FIELDS:
        if field.name in arrays:
            values[field.name] = _from_tensor(field, arrays[field.name])
        elif field.name in from_json:
            values[field.name] = _from_value(field, from_json[field.name], SAMPLING_PARAMETERS)
        elif field.name in from_parameters:
            values[field.name] = _from_value(field, from_parameters[field.name], "request parameter")
    stream = bool(values.get(STREAM, False))
    exclude = values.get(EXCLUDE_INPUT)
    # vLLM's rule: the prompt leads the text unless excluded; a stream never repeats it.
    echo = (not exclude) if exclude is not None else not stream
    if echo and stream:
        raise InvalidInput("When streaming, `exclude_input_in_output` = False is not allowed.")
    max_tokens = values.get("max_tokens")
    if max_tokens is not None and max_tokens < 1:
        raise InvalidInput(f"max_tokens: must be at least 1, got {max_tokens}")
    top_k = values.get("top_k", 0)
    seed = values.get("seed")
    if seed is not None and not 0 <= seed <= _UINT64_MAX:
        raise InvalidInput(f"seed: must be in [0, 2**64 - 1], got {seed}")
    params = GenerateParams(
        prompt=text,
        max_tokens=max_tokens or 0,
        temperature=values.get("temperature", 0.0),
        top_k=0 if top_k == -1 else top_k,  # vLLM's -1: no top-k cut
        top_p=values.get("top_p", 0.0),
        seed=seed,
        stop=values.get("stop", ()),
        frequency_penalty=values.get("frequency_penalty", 0.0),
        presence_penalty=values.get("presence_penalty", 0.0),
        # A max_tokens asked for that the prompt leaves no room for is refused, as Triton's LLM
        # backends refuse it (the gateway's generate route does the same); without one the text
        # ends at the context.
        strict_context=max_tokens is not None,
    )
    return Asked(params, stream, echo)


def _check_headers(request: pb.ModelInferRequest, decoder: DecoderModel) -> None:
    """Each input's name, datatype, element count and size, before anything is decoded."""
    if len(request.inputs) > len(INPUTS):
        raise InvalidInput(
            f"the request names {len(request.inputs)} inputs; a decoder model has {len(INPUTS)}"
        )
    text_bytes = 4 * prompt_chars(decoder) + 16  # UTF-8: at most 4 bytes a character
    for header in kserve_headers(request):
        name = header.name
        if name not in _INPUT_NAMES:
            raise InvalidInput(f"input {quoted(name)} is not an input of a decoder model ({_KNOWN})")
        field = _BY_NAME.get(name)
        allowed = _DATATYPES[field.kind] if field is not None else _DATATYPES["text"]
        if header.datatype not in allowed:
            expected = "BYTES" if field is None else field.datatype
            raise InvalidInput(
                f"input {quoted(name)}: datatype {quoted(header.datatype)}, expected {expected}"
            )
        count = math.prod(header.shape) if all(d >= 0 for d in header.shape) else -1
        most = MAX_STOP_SEQUENCES if field is not None and field.kind == "text" else 1
        if not (count == 1 or (most > 1 and 0 <= count <= most)):
            raise InvalidInput(
                f"input {quoted(name)}: shape {list(header.shape)}; it takes "
                + (f"at most {most} elements" if most > 1 else "one element")
            )
        limit = {
            TEXT_INPUT: text_bytes,
            SAMPLING_PARAMETERS: MAX_SAMPLING_JSON_BYTES,
        }.get(name, MAX_STOP_SEQUENCES * (4 * MAX_STOP_CHARS + 8))
        if header.nbytes > limit:
            raise InvalidInput(
                f"input {quoted(name)}: {header.nbytes} bytes, more than it can hold ({limit})"
            )


def _text(array: np.ndarray, name: str) -> list[str]:
    out = []
    for item in array.reshape(-1):
        try:
            out.append(item.decode("utf-8") if isinstance(item, bytes) else str(item))
        except UnicodeDecodeError:
            raise InvalidInput(f"input {quoted(name)}: not valid UTF-8") from None
    return out


def _sampling_json(array: np.ndarray) -> dict[str, Any]:
    (text,) = _text(array, SAMPLING_PARAMETERS)
    try:
        document = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: arrays nested thousands deep
        raise InvalidInput(f"input {SAMPLING_PARAMETERS!r}: not JSON") from None
    if not isinstance(document, dict):
        raise InvalidInput(
            f"input {SAMPLING_PARAMETERS!r}: a JSON object of sampling fields, got {quoted(document)}"
        )
    for key in document:
        if key not in _BY_NAME:
            raise InvalidInput(
                f"input {SAMPLING_PARAMETERS!r}: field {quoted(key)} is not supported by this server "
                f"(supported: {_SAMPLING_KNOWN})"
            )
    return document


def _request_parameters(parameters: Mapping[str, pb.InferParameter]) -> dict[str, Any]:
    values = {}
    for key, parameter in parameters.items():
        if key in KSERVE_PARAMETERS:
            continue
        if key not in _BY_NAME:
            raise InvalidInput(
                f"request parameter {quoted(key)} is not supported by a decoder model (supported: "
                f"{_SAMPLING_KNOWN}, and KServe's own)"
            )
        values[key] = parameter_value(parameter)
    return values


def _from_tensor(field: _Field, array: np.ndarray) -> Any:
    if field.kind == "text":
        return tuple(_text(array, field.name))
    value = array.reshape(-1)[0]
    if field.kind == "bool":
        return bool(value)
    if field.kind == "int":
        return int(value)
    number = float(value)
    if not math.isfinite(number):
        raise InvalidInput(f"input {quoted(field.name)}: must be a finite number, got {number}")
    return number


def _from_value(field: _Field, value: Any, where: str) -> Any:
    """A JSON or request parameter's value as the field's kind; strings as vLLM reads them."""
    wrong = InvalidInput(f"{where} {field.name!r}: expected {_KIND_TEXT[field.kind]}, got {quoted(value)}")
    if field.kind == "text":
        if isinstance(value, str):
            return (value,)
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise wrong
    if field.kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise wrong
    if isinstance(value, bool):
        raise wrong
    if field.kind == "int":
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str) and value.strip().lstrip("+-").isdigit() and len(value) <= 32:
            return int(value)
        raise wrong
    if isinstance(value, int | float):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            raise wrong from None
    else:
        raise wrong
    if not math.isfinite(number):
        raise wrong
    return number


_KIND_TEXT = {
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "text": "a string or a list of strings",
}
