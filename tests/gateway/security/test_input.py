"""Hostile HTTP input at the gateway: every endpoint's body, query parameters, path parts and
forwarded headers. Each answer is a 2xx or a 4xx with the usual error body and reason, never a 5xx
or an exception, and comes back in bounded time.

The gateway's ASGI app runs in this process (httpx's ASGITransport: an exception inside the app
reaches the test instead of hiding in a 500), over a real gRPC channel to a fake upstream on
loopback that answers as the sidecar does; the upstream deserializes each message, so whatever the
gateway sent really crossed protobuf and gRPC.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modelyard.gateway.app import build_app
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.gateway.settings import Settings
from modelyard.gateway.streams import Registry
from modelyard.gateway.upstream import Upstream
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import model_service_pb2 as model_pb
from modelyard.kserve.v2 import grpc_service_pb2 as kpb

ANSWER_WITHIN_S = 5.0  # each request, hostile or not (most take milliseconds)
EXAMPLES = 120


# --- a fake sidecar ------------------------------------------------------------------------------


async def generate(request: pb.GenerateRequest, context: Any) -> AsyncIterator[pb.GenerateResponse]:
    await context.send_initial_metadata((("x-served-version", "1"),))
    yield pb.GenerateResponse(sequence_number=0, model_version="1", text="hi", token_ids=[7])
    yield pb.GenerateResponse(sequence_number=1, model_version="1", finish_reason=pb.FINISH_REASON_LENGTH)


async def model_infer(request: kpb.ModelInferRequest, context: Any) -> kpb.ModelInferResponse:
    """Echoes each input as an output of the same name, datatype and shape."""
    answer = kpb.ModelInferResponse(model_name=request.model_name, model_version="1", id=request.id)
    for tensor, raw in zip(request.inputs, request.raw_input_contents, strict=False):
        answer.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
        answer.raw_output_contents.append(raw)
    return answer


def _unary(method: Any, request_type: Any, response_type: Any) -> grpc.RpcMethodHandler[Any, Any]:
    return grpc.unary_unary_rpc_method_handler(
        method,
        request_deserializer=request_type.FromString,
        response_serializer=response_type.SerializeToString,
    )


def _handlers() -> list[grpc.GenericRpcHandler[Any, Any]]:
    async def ready(request: Any, context: Any) -> kpb.ModelReadyResponse:
        return kpb.ModelReadyResponse(ready=True)

    async def metadata(request: kpb.ModelMetadataRequest, context: Any) -> kpb.ModelMetadataResponse:
        return kpb.ModelMetadataResponse(name=request.name, versions=["1"], platform="onnx")

    async def live(request: Any, context: Any) -> kpb.ServerLiveResponse:
        return kpb.ServerLiveResponse(live=True)

    async def models(request: Any, context: Any) -> model_pb.ListModelsResponse:
        return model_pb.ListModelsResponse()

    inference = grpc.method_handlers_generic_handler(
        "modelyard.inference.v1.InferenceService",
        {
            "Generate": grpc.unary_stream_rpc_method_handler(
                generate,
                request_deserializer=pb.GenerateRequest.FromString,
                response_serializer=pb.GenerateResponse.SerializeToString,
            )
        },
    )
    kserve = grpc.method_handlers_generic_handler(
        "inference.GRPCInferenceService",
        {
            "ModelInfer": _unary(model_infer, kpb.ModelInferRequest, kpb.ModelInferResponse),
            "ModelReady": _unary(ready, kpb.ModelReadyRequest, kpb.ModelReadyResponse),
            "ModelMetadata": _unary(metadata, kpb.ModelMetadataRequest, kpb.ModelMetadataResponse),
            "ServerLive": _unary(live, kpb.ServerLiveRequest, kpb.ServerLiveResponse),
        },
    )
    listing = grpc.method_handlers_generic_handler(
        "modelyard.inference.v1.ModelService",
        {"ListModels": _unary(models, model_pb.ListModelsRequest, model_pb.ListModelsResponse)},
    )
    return [inference, kserve, listing]


@dataclass
class Harness:
    """The app and its fake upstream on one event loop of their own: hypothesis drives sync tests."""

    loop: asyncio.AbstractEventLoop
    server: grpc.aio.Server
    upstream: Upstream
    client: httpx.AsyncClient

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        started = time.monotonic()
        response = self.loop.run_until_complete(
            asyncio.wait_for(self.client.request(method, path, **kwargs), ANSWER_WITHIN_S)
        )
        assert time.monotonic() - started < ANSWER_WITHIN_S
        return response


async def _start() -> tuple[grpc.aio.Server, Upstream, httpx.AsyncClient]:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(_handlers())
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    # Small body bound, so size cases stay fast.
    settings = Settings(upstream=f"127.0.0.1:{port}", max_body_bytes=256 * 1024, resume_window_s=0)
    metrics = GatewayMetrics()
    upstream = Upstream(settings.upstream, 0.0)
    registry = Registry(
        settings.resume_window_s, settings.resume_buffer_events, settings.max_streams, metrics
    )
    app = build_app(settings, upstream, registry, metrics)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")
    return server, upstream, client


@pytest.fixture(scope="module")
def harness() -> Iterator[Harness]:
    loop = asyncio.new_event_loop()
    server, upstream, client = loop.run_until_complete(_start())
    try:
        yield Harness(loop, server, upstream, client)
    finally:
        loop.run_until_complete(client.aclose())
        loop.run_until_complete(upstream.close())
        loop.run_until_complete(server.stop(None))
        loop.close()


def assert_client_answer(response: httpx.Response) -> None:
    """2xx, or a 4xx with the gateway's error body and an x-error-reason."""
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert response.headers.get("x-error-reason"), response.text
        error = response.json()["error"]
        assert error["message"] if isinstance(error, dict) else error


def assert_refused(response: httpx.Response, status: int = 400, reason: str = "invalid_argument") -> str:
    assert response.status_code == status, response.text
    assert response.headers["x-error-reason"] == reason
    error = response.json()["error"]
    message = error["message"] if isinstance(error, dict) else error
    assert message
    return str(message)


GENERATE = "/v1/models/m/generate"
INFER = "/v2/models/m/infer"


# --- each class of the issue, on every endpoint it can reach -------------------------------------

DEEP = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
SURROGATE = b'{"prompt": "a\\ud800b", "model": "m", "messages": [{"role": "user", "content": "\\udfff"}]}'


@pytest.mark.parametrize("path", [GENERATE, "/v1/completions", "/v1/chat/completions", INFER])
@pytest.mark.parametrize(
    ("body", "says"),
    [
        (DEEP, "nested deeper"),
        (b"[" * 5000, "not valid JSON"),
        (SURROGATE, "surrogate"),
        (b'{"\\udc00": 1}', "surrogate"),
        (b'{"prompt": "\xed\xa0\x80"}', "UTF-8"),
        (b'{"prompt": NaN}', "NaN"),
        (b'{"prompt": ' + b"9" * 5000 + b"}", "not valid JSON"),
    ],
)
def test_malformed_json_is_400_on_every_endpoint(harness: Harness, path: str, body: bytes, says: str) -> None:
    message = assert_refused(harness.request("POST", path, content=body))
    assert says in message


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompt": "x", "prompt_token_ids": [1, 2**70]}, "prompt_token_ids[1]"),
        ({"prompt": "x", "max_tokens": 10**18}, "max_tokens"),
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "x", "top_k": 2**32}, "top_k"),
        ({"prompt": "x", "seed": 2**64}, "seed"),
        ({"prompt": "x", "seed": -1}, "seed"),
        ({"prompt": "x", "priority": 2**33}, "priority"),
        ({"prompt": "x", "temperature": 10**400}, "temperature"),
        ({"prompt": "x", "top_p": 1e300}, "top_p"),
        ({"prompt": "x", "model_version": "../1"}, "model_version"),
    ],
)
def test_sse_fields_out_of_their_protobuf_range_are_400_naming_the_field(
    harness: Harness, body: dict[str, Any], field: str
) -> None:
    assert field in assert_refused(harness.request("POST", GENERATE, json=body))


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"prompt": "x", "max_tokens": str(10**18)}, "max_tokens"),
        ({"prompt": "x", "seed": str(2**64)}, "seed"),
        ({"prompt": "x", "priority": str(2**33)}, "priority"),
        ({"prompt": "x", "top_k": "9" * 5000}, "top_k"),
        ({"prompt": "x", "temperature": "1e400"}, "temperature"),
    ],
)
def test_query_parameters_take_the_same_checks(harness: Harness, params: dict[str, str], field: str) -> None:
    response = harness.request("GET", GENERATE, params=params)
    assert response.status_code in (400, 422)
    assert field in assert_refused(response, response.status_code)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"max_tokens": 10**18}, "max_tokens"),
        ({"seed": 2**64}, "seed"),
        ({"n": 2**70}, "n"),
        ({"model": "../../etc"}, "model"),
        ({"model": "m" * 5000}, "model"),
        ({"user": "caf\u00e9"}, "user"),
    ],
)
def test_openai_fields_are_checked_too(
    harness: Harness, path: str, extra: dict[str, Any], field: str
) -> None:
    body = {"model": "m", "prompt": "x", "messages": [{"role": "user", "content": "x"}], **extra}
    message = assert_refused(harness.request("POST", path, json=body))
    assert field in message and len(message) < 400  # a 5000-character name is not echoed whole


def test_openai_token_prompt_is_ranged(harness: Harness) -> None:
    body = {"model": "m", "prompt": [1, 2**70]}
    assert "prompt[1]" in assert_refused(harness.request("POST", "/v1/completions", json=body))


def _tensor(**fields: Any) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "datatype": "INT64", "shape": [1], "data": [1], **fields}]}


@pytest.mark.parametrize(
    ("document", "field"),
    [
        (_tensor(shape=[2**70]), "shape"),
        (_tensor(data=[2**64]), "inputs[0].data"),
        (_tensor(datatype="BYTES", data=[10**12]), "inputs[0].data"),
        (_tensor(datatype="FP64", data=[10**400]), "inputs[0].data"),
        (_tensor(parameters=[1]), "parameters"),
        (_tensor(parameters={"binary_data_size": -4}), "binary_data_size"),
        ({**_tensor(), "parameters": {"p": 2**70}}, "parameters.'p'"),
        ({**_tensor(), "parameters": {"p": {"nested": 1}}}, "parameters.'p'"),
        ({**_tensor(), "parameters": "all"}, "parameters"),
        ({**_tensor(), "outputs": {"name": "y"}}, "outputs"),
        ({**_tensor(), "id": {"x": 1}}, "id"),
    ],
)
def test_kserve_documents_are_checked(harness: Harness, document: dict[str, Any], field: str) -> None:
    response = harness.request("POST", INFER, json=document)
    assert response.status_code in (400, 422)
    assert field in assert_refused(response, response.status_code)


@pytest.mark.parametrize(
    ("method", "path", "field"),
    [
        ("POST", "/v1/models/a..b/generate", "model"),
        ("GET", "/v1/models/" + "m" * 200 + "/generate?prompt=x", "model"),
        ("POST", "/v2/models/.hidden/infer", "model_name"),
        ("GET", "/v2/models/m/versions/1..2", "model_version"),
        ("GET", "/v2/models/%00/ready", "model_name"),
    ],
)
def test_names_in_paths_follow_the_names_rule(harness: Harness, method: str, path: str, field: str) -> None:
    message = assert_refused(harness.request(method, path, json={"prompt": "x", **_tensor()}))
    assert field in message and len(message) < 400


@pytest.mark.parametrize(
    "header", ["x-request-id", "x-user-id", "x-tenant-id", "authorization", "traceparent"]
)
@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", GENERATE, {"prompt": "x"}),
        ("POST", "/v1/completions", {"model": "m", "prompt": "x"}),
        ("POST", INFER, _tensor()),
        ("GET", "/v2/models/m", None),
        ("GET", "/v1/models", None),
    ],
)
def test_a_forwarded_header_that_grpc_cannot_carry_is_400(
    harness: Harness, header: str, method: str, path: str, body: Any
) -> None:
    for value in (b"caf\xe9", b"a\x01b"):
        response = harness.request(method, path, json=body, headers={header: value})
        message = assert_refused(response)
        assert header in message and "caf" not in message  # named, not quoted (it may be a credential)


@pytest.mark.parametrize(
    ("method", "path", "kwargs"),
    [
        ("POST", INFER, {"json": {**_tensor(), "parameters": {"k" * 100_000: 2**70}}}),
        ("POST", INFER, {"json": _tensor(datatype="X" * 100_000)}),
        ("POST", INFER, {"json": _tensor(shape=[3] * 20_000)}),
        ("GET", GENERATE, {"headers": {"last-event-id": "s" * 30_000 + ":1"}}),
        ("POST", "/v1/completions", {"json": {"model": "m" * 100_000, "prompt": "x"}}),
    ],
)
def test_answers_quote_client_values_capped(harness: Harness, method: str, path: str, kwargs: Any) -> None:
    response = harness.request(method, path, **kwargs)
    assert 400 <= response.status_code < 500 and len(response.content) < 1000, response.text[:300]


def test_unknown_routes_and_methods_get_the_error_body(harness: Harness) -> None:
    assert_refused(harness.request("GET", "/v1/models/..%2F..%2Fetc/generate"), 404, "unsupported")
    assert_refused(harness.request("DELETE", GENERATE), 405, "unsupported")


def test_a_pinned_version_header_follows_the_names_rule(harness: Harness) -> None:
    for path, body in ((GENERATE, {"prompt": "x"}), (INFER, _tensor())):
        response = harness.request("POST", path, json=body, headers={"x-model-version": "../2"})
        assert "x-model-version" in assert_refused(response)


def test_bodies_over_the_bound_are_413(harness: Harness) -> None:
    big = {"prompt": "x" * (300 * 1024)}
    for path in (GENERATE, "/v1/completions", INFER):
        assert_refused(harness.request("POST", path, json=big), 413, "too_large")


def test_good_requests_still_pass(harness: Harness) -> None:
    """The checks refuse only what cannot be served: the same endpoints answer valid requests."""
    sse = harness.request("POST", GENERATE, json={"prompt": "x", "seed": 2**64 - 1, "priority": 2**32 - 1})
    assert sse.status_code == 200 and "event: done" in sse.text
    query = harness.request("GET", GENERATE, params={"prompt": "x", "max_tokens": str(2**32 - 1)})
    assert query.status_code == 200
    chat = {"model": "m.v-1_a", "messages": [{"role": "user", "content": [{"text": "hi"}, {"text": 3}]}]}
    assert harness.request("POST", "/v1/chat/completions", json=chat).status_code == 200
    deep_but_fine = {"inputs": [{"name": "x", "datatype": "INT64", "shape": [1] * 6, "data": [[[[[[1]]]]]]}]}
    infer = harness.request("POST", INFER, json=deep_but_fine, headers={"x-request-id": "req-1"})
    assert infer.status_code == 200 and infer.json()["outputs"][0]["data"] == [1]


# --- property-based: anything in the fields, anything as the body ---------------------------------

# Strings with every code point, lone surrogates included (json.dumps escapes them as \udxxx).
TEXT = st.text(st.characters(exclude_categories=()), max_size=20)
EDGE_INTS = st.sampled_from([-(2**63) - 1, -1, 0, 2**31, 2**32, 2**33, 2**63, 2**64, 2**70, 10**18, 10**30])
SCALARS = st.none() | st.booleans() | st.integers() | EDGE_INTS | st.floats() | TEXT
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)
GENERATE_FIELDS = ("prompt", "prompt_token_ids", "max_tokens", "temperature", "top_k", "top_p", "seed")
OPENAI_FIELDS: tuple[str, ...] = (
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "stream",
    "user",
)
OPENAI_FIELDS += ("stream_options", "stop", "seed", "temperature", "logprobs")
KSERVE_FIELDS = ("inputs", "outputs", "parameters", "id")


HOSTILE = EDGE_INTS | TEXT | VALUES  # edge integers and odd strings more often than in VALUES alone


def _bodies(fields: tuple[str, ...], base: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """A valid body with a few fields replaced (or added) by hostile values."""
    chosen = st.dictionaries(st.sampled_from((*fields, "priority", "model_version")), HOSTILE, max_size=3)
    return chosen.map(lambda extra: {**base, **extra})


TENSOR = st.fixed_dictionaries(
    {
        "name": st.just("x") | TEXT,
        "datatype": st.sampled_from(
            ["INT64", "INT32", "UINT8", "FP32", "FP16", "FP64", "BOOL", "BYTES", "X"]
        ),
        "shape": st.lists(st.integers(-2, 3) | EDGE_INTS, max_size=3),
        "data": HOSTILE,
    },
    optional={"parameters": st.dictionaries(st.sampled_from(["binary_data_size", "x"]), HOSTILE, max_size=2)},
)
OPENAI_BASE = {"model": "m", "prompt": "x", "messages": [{"role": "user", "content": "x"}]}


def _dumps(value: Any) -> bytes:
    return json.dumps(value).encode()  # NaN/Infinity and \udxxx escapes included, as a client may send


CASES = st.one_of(
    st.tuples(st.just(GENERATE), _bodies(GENERATE_FIELDS, {"prompt": "x"}).map(_dumps)),
    st.tuples(st.just("/v1/completions"), _bodies(OPENAI_FIELDS, OPENAI_BASE).map(_dumps)),
    st.tuples(st.just("/v1/chat/completions"), _bodies(OPENAI_FIELDS, OPENAI_BASE).map(_dumps)),
    st.tuples(
        st.just(INFER),
        st.fixed_dictionaries(
            {"inputs": st.lists(TENSOR, min_size=1, max_size=2)},
            optional={"parameters": st.dictionaries(TEXT, HOSTILE, max_size=2) | HOSTILE, "outputs": HOSTILE},
        ).map(_dumps),
    ),
    st.tuples(st.sampled_from([GENERATE, "/v1/completions", INFER]), st.binary(max_size=64)),
    st.tuples(st.sampled_from([GENERATE, INFER]), _bodies(KSERVE_FIELDS, {}).map(_dumps)),
)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=CASES)
def test_no_body_gets_a_5xx(harness: Harness, case: tuple[str, bytes]) -> None:
    path, body = case
    assert_client_answer(harness.request("POST", path, content=body))


QUERY = st.dictionaries(
    st.sampled_from(
        ["prompt", "max_tokens", "temperature", "top_k", "top_p", "seed", "priority", "stop", "x"]
    ),
    TEXT | st.integers().map(str) | EDGE_INTS.map(str),
    max_size=5,
)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(params=QUERY, model=st.sampled_from(["m", "..", "a" * 129, "m%2F..", "caf%C3%A9"]))
def test_no_query_gets_a_5xx(harness: Harness, params: dict[str, str], model: str) -> None:
    # Surrogates cannot be percent-encoded as UTF-8: send them as a client would, replaced.
    query = {k: v.encode("utf-8", "replace").decode() for k, v in params.items()}
    assert_client_answer(harness.request("GET", f"/v1/models/{model}/generate", params=query))


BINARY_TENSOR = st.fixed_dictionaries(
    {
        "name": st.just("x"),
        "datatype": st.sampled_from(["INT64", "FP32", "BYTES", "BOOL"]),
        "shape": st.lists(st.integers(0, 4) | EDGE_INTS, max_size=3),
        "parameters": st.fixed_dictionaries({"binary_data_size": st.integers(-3, 64) | EDGE_INTS | HOSTILE}),
    }
)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    tensors=st.lists(BINARY_TENSOR, min_size=1, max_size=3),
    binary=st.binary(max_size=128),
    length=st.none() | st.integers(-3, 400).map(str) | st.sampled_from(["", "x", "9" * 30, "1e3", "\u0663"]),
)
def test_no_binary_infer_gets_a_5xx(
    harness: Harness, tensors: list[dict[str, Any]], binary: bytes, length: str | None
) -> None:
    """The binary tensor extension: a JSON head of Inference-Header-Content-Length bytes, then raw
    tensor bytes sized by binary_data_size; any of the three may lie."""
    head = _dumps({"inputs": tensors, "outputs": [{"name": "x", "parameters": {"binary_data": True}}]})
    value = str(len(head)) if length is None else length
    headers = {"inference-header-content-length": value.encode("utf-8")}
    assert_client_answer(harness.request("POST", INFER, content=head + binary, headers=headers))
