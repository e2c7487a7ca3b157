"""The gateway's input, strictly read (issue 33's smaller holes): OpenAI's `logit_bias` keys and
values, numbers in query parameters and headers read by JSON's grammar (not int()/float()),
numbers past a double's range (`1e999`), gzip/deflate bodies that are not one whole stream, and
OpenAI's `param` naming the field at fault. Each is a 4xx with its reason, never a 5xx, and what
is refused never reaches the upstream.

As test_gateway_input.py: the ASGI app in this process over a real gRPC channel to a fake
upstream on loopback (which here records what reached it); the keep-alive case runs the real
listener (uvicorn) on a loopback port.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import struct
import zlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modelyard.gateway.app import Gateway, build_app
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.gateway.settings import Settings
from modelyard.gateway.streams import Registry
from modelyard.gateway.upstream import Upstream
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.kserve.v2 import grpc_service_pb2 as kpb
from tests.gateway.security.test_input import (
    GENERATE,
    INFER,
    Harness,
    _handlers,
    assert_client_answer,
    assert_refused,
    generate,
)

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
OPENAI_BASE = {"model": "m", "prompt": "x"}
CHAT_BASE = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
LIMIT = 256 * 1024


class Seen(grpc.GenericRpcHandler):  # type: ignore[type-arg]
    """Records every Generate and ModelInfer request that reached the upstream, then lets the
    shared fake (test_gateway_input's) answer it."""

    def __init__(self) -> None:
        self.generate: list[pb.GenerateRequest] = []
        self.infer: list[kpb.ModelInferRequest] = []

    def service(self, details: grpc.HandlerCallDetails) -> Any:
        if details.method == "/modelyard.inference.v1.InferenceService/Generate":

            async def recorded(
                request: pb.GenerateRequest, context: Any
            ) -> AsyncIterator[pb.GenerateResponse]:
                self.generate.append(request)
                async for response in generate(request, context):
                    yield response

            return grpc.unary_stream_rpc_method_handler(
                recorded,
                request_deserializer=pb.GenerateRequest.FromString,
                response_serializer=pb.GenerateResponse.SerializeToString,
            )
        if details.method == "/inference.GRPCInferenceService/ModelInfer":

            async def echoed(request: kpb.ModelInferRequest, context: Any) -> kpb.ModelInferResponse:
                self.infer.append(request)
                answer = kpb.ModelInferResponse(model_name=request.model_name, model_version="1")
                for tensor, raw in zip(request.inputs, request.raw_input_contents, strict=False):
                    answer.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
                    answer.raw_output_contents.append(raw)
                return answer

            return grpc.unary_unary_rpc_method_handler(
                echoed,
                request_deserializer=kpb.ModelInferRequest.FromString,
                response_serializer=kpb.ModelInferResponse.SerializeToString,
            )
        return None


@pytest.fixture(scope="module")
def seen() -> Seen:
    return Seen()


@pytest.fixture(scope="module")
def harness(seen: Seen) -> Iterator[Harness]:
    loop = asyncio.new_event_loop()

    async def start() -> tuple[grpc.aio.Server, Upstream, httpx.AsyncClient]:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([seen, *_handlers()])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        config = Settings(upstream=f"127.0.0.1:{port}", max_body_bytes=LIMIT, resume_window_s=0)
        metrics = GatewayMetrics()
        upstream = Upstream(config.upstream, 0.0)
        registry = Registry(config.resume_window_s, config.resume_buffer_events, config.max_streams, metrics)
        app = build_app(config, upstream, registry, metrics)
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")
        return server, upstream, client

    server, upstream, client = loop.run_until_complete(start())
    try:
        yield Harness(loop, server, upstream, client)
    finally:
        loop.run_until_complete(client.aclose())
        loop.run_until_complete(upstream.close())
        loop.run_until_complete(server.stop(None))
        loop.close()


def openai_error(
    response: httpx.Response, param: str | None, reason: str = "invalid_argument"
) -> dict[str, Any]:
    """A 400 with `reason` in OpenAI's error object, naming `param`."""
    assert response.status_code == 400, response.text
    assert response.headers["x-error-reason"] == reason
    error: dict[str, Any] = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", reason, param)
    assert error["message"]
    return error


def refused_before_upstream(harness: Harness, seen: Seen, path: str, **kwargs: Any) -> httpx.Response:
    """The answer to a request that must not reach the upstream (and did not)."""
    before = len(seen.generate), len(seen.infer)
    response = harness.request("POST", path, **kwargs)
    assert (len(seen.generate), len(seen.infer)) == before, "a refused request reached the upstream"
    return response


# --- logit_bias ----------------------------------------------------------------------------------

HUGE = 10**400  # 401 digits: past a float's range


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize(
    "bias",
    [
        {"5": HUGE},
        {"5": -HUGE},
        {"5": 101},
        {"5": -100.5},
        {"5": 2**64},
        {"5": "1"},
        {"5": True},
        {"5": None},
        {"5": [1]},
        {" 5 ": 1},
        {"5_0": 1},
        {"+5": 1},
        {"05": 1},
        {"\u0665": 1},  # ARABIC-INDIC DIGIT FIVE: int() reads it as 5
        {"\uff15": 1},  # FULLWIDTH DIGIT FIVE
        {"5\n": 1},
        {"-1": 1},
        {"": 1},
        {"5.0": 1},
        {"1e3": 1},
        {"0x5": 1},
        {str(2**63): 1},
        {"9" * 400: 1},
        {"9" * 5000: 1},
        {str(i): 1 for i in range(301)},
    ],
)
def test_logit_bias_is_read_strictly(harness: Harness, seen: Seen, path: str, bias: dict[str, Any]) -> None:
    base = OPENAI_BASE if path == COMPLETIONS else CHAT_BASE
    response = refused_before_upstream(harness, seen, path, json={**base, "logit_bias": bias})
    error = openai_error(response, "logit_bias")
    assert error["message"].startswith("logit_bias: ") and len(error["message"]) < 300  # no 5000 digits


def test_logit_bias_of_canonical_ids_reaches_the_model(harness: Harness, seen: Seen) -> None:
    bias = {"0": -100, "5": 100, "7": 0.5, "9223372036854775807": -1e-3}
    response = harness.request("POST", COMPLETIONS, json={**OPENAI_BASE, "logit_bias": bias})
    assert response.status_code == 200, response.text
    assert dict(seen.generate[-1].logit_bias) == pytest.approx(
        {0: -100.0, 5: 100.0, 7: 0.5, 2**63 - 1: -1e-3}
    )


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    bias=st.dictionaries(
        st.text(max_size=8) | st.integers().map(str),
        st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from([HUGE, -HUGE]),
        max_size=4,
    )
)
def test_no_logit_bias_gets_a_5xx(harness: Harness, bias: dict[str, Any]) -> None:
    response = harness.request("POST", COMPLETIONS, json={**OPENAI_BASE, "logit_bias": bias})
    assert_client_answer(response)
    if response.status_code == 400:
        assert response.json()["error"]["param"] == "logit_bias"


async def _upstream_server() -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(_handlers())
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def _answer(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One HTTP/1.1 response (Content-Length framed): its head and body."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return head, await reader.readexactly(length)


async def test_a_huge_bias_is_a_400_on_a_connection_that_stays_usable() -> None:
    """Through the real listener: the answer is OpenAI's JSON error (not a plain-text 500), and the
    keep-alive connection serves the next request."""
    server, port = await _upstream_server()
    running = Gateway(Settings(listen="127.0.0.1:0", upstream=f"127.0.0.1:{port}", resume_window_s=0))
    await running.start()
    try:
        host, gateway_port = running.address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(gateway_port))
        try:
            body = json.dumps({**OPENAI_BASE, "logit_bias": {"5": HUGE}}).encode()
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body)
            )
            async with asyncio.timeout(10):
                head, answer = await _answer(reader)
                assert head.startswith(b"HTTP/1.1 400") and b"x-error-reason: invalid_argument" in head
                assert json.loads(answer)["error"]["param"] == "logit_bias"
                writer.write(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")  # the same connection
                head, _ = await _answer(reader)
            assert head.startswith(b"HTTP/1.1 200")
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
    finally:
        await running.stop()
        await server.stop(None)


# --- numbers in text: query parameters and headers -----------------------------------------------


@pytest.mark.parametrize(
    ("field", "text"),
    [
        ("max_tokens", " 5 "),
        ("max_tokens", "5_0"),
        ("max_tokens", "+5"),
        ("max_tokens", "05"),
        ("max_tokens", "\u0665"),
        ("max_tokens", "5.0"),
        ("max_tokens", "1e3"),
        ("top_k", "0x10"),
        ("seed", "\uff11"),
        ("priority", "1\n"),
        ("temperature", "1_0"),
        ("temperature", " 1"),
        ("temperature", "inf"),
        ("temperature", "nan"),
        ("temperature", "Infinity"),
        ("temperature", ".5"),
        ("top_p", "1."),
        ("top_p", "+1"),
    ],
)
def test_query_numbers_follow_json_grammar(harness: Harness, seen: Seen, field: str, text: str) -> None:
    before = len(seen.generate)
    response = harness.request("GET", GENERATE, params={"prompt": "x", field: text})
    assert field in assert_refused(response, 422)
    assert len(seen.generate) == before


@pytest.mark.parametrize("text", ["1e999", "-1e999", "1" + "0" * 400 + ".0", "1" + "0" * 400])
def test_query_numbers_past_a_float_are_400(harness: Harness, text: str) -> None:
    response = harness.request("GET", GENERATE, params={"prompt": "x", "temperature": text})
    assert "temperature" in assert_refused(response, 400)


def test_query_numbers_in_json_grammar_pass(harness: Harness, seen: Seen) -> None:
    params = {
        "prompt": "x",
        "max_tokens": "5",
        "temperature": "0.5",
        "top_p": "1e-1",
        "seed": "0",
        "top_k": "7",
    }
    response = harness.request("GET", GENERATE, params=params)
    assert response.status_code == 200, response.text
    sent = seen.generate[-1]
    assert (sent.max_tokens, sent.top_k, sent.seed) == (5, 7, 0)
    assert (sent.temperature, sent.top_p) == pytest.approx((0.5, 0.1))


@pytest.mark.parametrize("value", [b"\xb2", b"\xb9", b" 5", b"5_0", b"+5"])
def test_a_header_length_that_is_not_ascii_digits_is_400(harness: Harness, seen: Seen, value: bytes) -> None:
    """Inference-Header-Content-Length: latin-1 '²' passes str.isdigit() but not int()."""
    head = json.dumps({"inputs": [{"name": "x", "datatype": "INT64", "shape": [1], "data": [1]}]}).encode()
    headers = {"inference-header-content-length": value}
    response = refused_before_upstream(harness, seen, INFER, content=head, headers=headers)
    assert "inference-header-content-length" in assert_refused(response)


# --- numbers past a double: 1e999 ----------------------------------------------------------------

BIG_NUMBERS = [b"1e999", b"-1e999", b"1" + b"0" * 400 + b".5", b"1.5e400", b"-2E+309"]
FLOAT_FIELDS = [
    (GENERATE, b'{"prompt": "x", "temperature": %s}'),
    (GENERATE, b'{"prompt": "x", "top_p": %s}'),
    (COMPLETIONS, b'{"model": "m", "prompt": "x", "temperature": %s}'),
    (COMPLETIONS, b'{"model": "m", "prompt": "x", "top_p": %s}'),
    (COMPLETIONS, b'{"model": "m", "prompt": "x", "frequency_penalty": %s}'),
    (CHAT, b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "presence_penalty": %s}'),
    (COMPLETIONS, b'{"model": "m", "prompt": "x", "logit_bias": {"5": %s}}'),
    (COMPLETIONS, b'{"model": "m", "prompt": "x", "unknown_field": %s}'),
    ("/v2/models/m/generate", b'{"text_input": "x", "parameters": {"temperature": %s}}'),
    (INFER, b'{"inputs": [{"name": "x", "datatype": "FP64", "shape": [1], "data": [%s]}]}'),
    (INFER, b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [%s]}]}'),
    (
        INFER,
        b'{"inputs": [{"name": "x", "datatype": "FP64", "shape": [1], "data": [1]}], "parameters": {"p": %s}}',  # noqa: E501
    ),
]


@pytest.mark.parametrize("number", BIG_NUMBERS)
@pytest.mark.parametrize(("path", "template"), FLOAT_FIELDS)
def test_a_number_past_a_double_is_400_everywhere(
    harness: Harness, seen: Seen, path: str, template: bytes, number: bytes
) -> None:
    response = refused_before_upstream(harness, seen, path, content=template % number)
    assert response.status_code == 400, response.text
    assert response.headers["x-error-reason"] == "invalid_argument"
    assert "out of range" in response.text


def test_large_finite_numbers_still_pass(harness: Harness, seen: Seen) -> None:
    body = b'{"inputs": [{"name": "x", "datatype": "FP64", "shape": [2], "data": [1.5e308, -4.9e-324]}]}'
    response = harness.request("POST", INFER, content=body)
    assert response.status_code == 200, response.text
    assert struct.unpack("<2d", seen.infer[-1].raw_input_contents[0]) == (1.5e308, -5e-324)


# --- compressed bodies ---------------------------------------------------------------------------

TENSOR = json.dumps(
    {"inputs": [{"name": "x", "datatype": "INT64", "shape": [3], "data": [1, 2, 3]}]}
).encode()
GZIPPED = gzip.compress(TENSOR)
ZLIBBED = zlib.compress(TENSOR)


def _raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return packer.compress(data) + packer.flush()


RAW = _raw_deflate(TENSOR)
# An infer body, and a management body (the repository index reads its body the same way).
INTACT = [("gzip", GZIPPED), ("deflate", ZLIBBED), ("deflate", RAW)]
BROKEN = [
    ("gzip", GZIPPED[:-8], "truncated"),  # no CRC-32/ISIZE trailer
    ("gzip", GZIPPED[:-4], "truncated"),  # no ISIZE
    ("gzip", GZIPPED[:-1], "truncated"),
    ("gzip", GZIPPED[: len(GZIPPED) // 2], "truncated"),
    ("gzip", GZIPPED[:10], "truncated"),  # the header alone
    ("gzip", GZIPPED[:-8] + struct.pack("<I", zlib.crc32(TENSOR) ^ 1) + GZIPPED[-4:], "decompressed"),
    ("gzip", GZIPPED[:-4] + struct.pack("<I", len(TENSOR) + 1), "decompressed"),
    ("gzip", GZIPPED + b"garbage", "after the end"),
    ("gzip", GZIPPED + b"\0", "after the end"),
    ("gzip", GZIPPED + GZIPPED, "after the end"),  # a second member
    ("deflate", ZLIBBED[:-4], "truncated"),  # no Adler-32
    ("deflate", ZLIBBED[:-1], "truncated"),
    ("deflate", ZLIBBED[:-4] + struct.pack(">I", zlib.adler32(TENSOR) ^ 1), "decompressed"),
    ("deflate", ZLIBBED + b"x", "after the end"),
    ("deflate", RAW[:-2], "truncated"),
    ("deflate", RAW + b"garbage", "after the end"),
]


@pytest.mark.parametrize(("encoding", "body"), INTACT)
def test_an_intact_compressed_body_is_served(
    harness: Harness, seen: Seen, encoding: str, body: bytes
) -> None:
    response = harness.request("POST", INFER, content=body, headers={"content-encoding": encoding})
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["data"] == [1, 2, 3]


@pytest.mark.parametrize(("encoding", "body", "says"), BROKEN)
def test_a_compressed_body_that_is_not_one_whole_stream_is_400(
    harness: Harness, seen: Seen, encoding: str, body: bytes, says: str
) -> None:
    response = refused_before_upstream(
        harness, seen, INFER, content=body, headers={"content-encoding": encoding}
    )
    assert says in assert_refused(response)


def test_a_truncated_management_body_is_400_too(harness: Harness) -> None:
    """The extensions (repository, logging, shared memory) read bodies the same way."""
    body = gzip.compress(b'{"log_verbose_level": 1}')[:-8]
    response = harness.request("POST", "/v2/logging", content=body, headers={"content-encoding": "gzip"})
    assert "truncated" in assert_refused(response)


def test_a_decompression_bomb_is_still_413(harness: Harness, seen: Seen) -> None:
    bomb = gzip.compress(b"{" + b" " * (4 * LIMIT) + b"}")
    assert len(bomb) < LIMIT
    response = refused_before_upstream(
        harness, seen, INFER, content=bomb, headers={"content-encoding": "gzip"}
    )
    assert_refused(response, 413, "too_large")


# --- OpenAI's param ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"model": "../x"}, "model"),
        ({"model": "a" * 200}, "model"),
        ({"model": "a b"}, "model"),
        ({"model": ""}, "model"),
        ({"model": 5}, "model"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_completion_tokens": 2**40}, "max_completion_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 10**400}, "top_p"),
        ({"seed": -1}, "seed"),
        ({"n": 0}, "n"),
        ({"n": 65}, "n"),  # more choices than a request may start upstream streams
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"user": "caf\u00e9"}, "user"),
        ({"stop": 5}, "stop"),
    ],
)
def test_openai_errors_name_their_param(
    harness: Harness, seen: Seen, path: str, extra: dict[str, Any], param: str
) -> None:
    base = OPENAI_BASE if path == COMPLETIONS else CHAT_BASE
    if param == "max_completion_tokens" and path == COMPLETIONS:
        pytest.skip("max_completion_tokens is the chat API's")
    response = refused_before_upstream(harness, seen, path, json={**base, **extra})
    # completions' top_logprobs is the chat API's parameter (completions take logprobs: N)
    unsupported = param == "top_logprobs" and path == COMPLETIONS
    openai_error(response, param, "unsupported" if unsupported else "invalid_argument")


def test_an_invalid_model_in_the_path_names_model(harness: Harness) -> None:
    openai_error(harness.request("GET", "/v1/models/" + "a" * 200), "model")


@pytest.mark.parametrize(
    ("headers", "body"),
    [
        ({"x-request-id": "caf\u00e9".encode()}, OPENAI_BASE),
        ({"x-model-version": "../1"}, OPENAI_BASE),
        ({}, b"[1, 2"),
        ({}, b'{"model": "m", "prompt": "x", "t": 1e999}'),
    ],
)
def test_errors_of_no_body_field_have_a_null_param(
    harness: Harness, headers: dict[str, Any], body: dict[str, Any] | bytes
) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = harness.request("POST", COMPLETIONS, content=content, headers=headers)
    openai_error(response, None)
