"""The gateway APIs' request models and their mounts, without a network."""

from __future__ import annotations

import pytest

from modelyard.gateway import errors
from modelyard.gateway.kserve import app as kserve_app
from modelyard.gateway.kserve import protocol as kserve
from modelyard.gateway.openai import app as openai_app
from modelyard.gateway.openai import protocol as openai
from modelyard.gateway.sse import app as sse_app
from modelyard.gateway.sse import protocol as sse

PATHS = [
    "/v1/models",
    "/v1/models/",
    "/v1/models//",
    "/v1/completions",
    "/v1/chat/completions/",
    "/v1/models/m/generate",
    "/v1/models/m/generate/",
    "/v1/models/m",
    "/v2",
    "/v2/",
    "/v2x",
    "/v2/models/m/infer",
    "/v1",
    "/healthz",
    "/metrics",
    "/",
]


@pytest.mark.parametrize("path", PATHS)
def test_a_path_belongs_to_one_api_at_most(path: str) -> None:
    owners = [
        name
        for name, owns in [("sse", sse_app.owns), ("openai", openai_app.owns), ("kserve", kserve_app.owns)]
        if owns(path)
    ]
    assert len(owners) <= 1, owners


def test_owners() -> None:
    assert openai_app.owns("/v1/models/") and not sse_app.owns("/v1/models/")
    assert sse_app.owns("/v1/models/m/anything")
    assert kserve_app.owns("/v2x")  # every /v2... path answers in KServe's error body
    assert not any(owns("/healthz") for owns in (sse_app.owns, openai_app.owns, kserve_app.owns))


def test_sse_generate_fields_become_the_generate_request() -> None:
    params = sse.parse_generate("m", {"prompt": "hi", "max_tokens": 3, "stop": "x", "seed": 7}, "r1")
    message = params.message()
    assert (message.model_name, message.prompt, message.max_tokens, list(message.stop)) == (
        "m",
        "hi",
        3,
        ["x"],
    )
    assert message.HasField("seed") and message.seed == 7 and message.request_id == "r1"
    assert not sse.parse_generate("m", {"prompt": "hi"}, "").message().HasField("seed")


def test_sse_fields_are_checked_in_order() -> None:
    with pytest.raises(errors.HttpError) as missing:
        sse.parse_generate("bad name", {}, "")
    assert missing.value.status == 422 and "prompt" in missing.value.message  # the prompt before the name
    with pytest.raises(errors.HttpError) as ranged:
        sse.parse_generate("m", {"prompt": "x", "max_tokens": 2**32}, "")
    assert ranged.value.status == 400 and "max_tokens" in ranged.value.message


def test_openai_forwarded_headers_are_checked_after_the_model_fields_before_sampling() -> None:
    bad_header = {"x-user-id": "\u00e9"}
    with pytest.raises(errors.HttpError) as before:
        openai.parse_completion({"prompt": "x", "n": 0, "model": "m"}, bad_header)
    assert "n:" in before.value.message
    with pytest.raises(errors.HttpError) as after:
        openai.parse_completion({"prompt": "x", "model": "m", "max_tokens": -1}, bad_header)
    assert "x-user-id" in after.value.message


def test_openai_chat_request() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5}
    completion = openai.parse_chat_completion(body, {"x-request-id": "r"})
    assert completion.kind == openai.CHAT_COMPLETION and not completion.stream
    assert completion.generate.max_tokens == 5 and completion.generate.request_id == "r"
    # The service renders the messages with the model's own template.
    assert [(m.role, m.content) for m in completion.generate.messages] == [("user", "hi")]
    assert not completion.generate.prompt
    user = openai.parse_completion({"model": "m", "prompt": "x", "user": "u1"}, {})
    assert ("x-user-id", "u1") in user.metadata
    assert user.generate.max_tokens == openai.DEFAULT_COMPLETION_MAX_TOKENS


def test_kserve_infer_request_and_binary_split() -> None:
    head = b'{"inputs":[{"name":"x","datatype":"FP32","shape":[2],"parameters":{"binary_data_size":8}}]}'
    body = head + b"\x00" * 8
    json_head, binary = kserve.split_body(body, str(len(head)))
    assert json_head == head and len(binary) == 8
    infer = kserve.parse_infer("m", "1", json_head, binary)
    assert infer.message.model_name == "m" and infer.message.model_version == "1"
    assert list(infer.message.raw_input_contents) == [b"\x00" * 8] and infer.binary_outputs == {}
    with pytest.raises(errors.HttpError) as too_long:
        kserve.split_body(body, str(len(body) + 1))
    assert too_long.value.status == 400
    assert kserve.parse_model_path({"model": "m"}) == kserve.ModelPath("m", "")


def test_kserve_sequence_parameters_go_upstream_as_triton_sends_them() -> None:
    def parameters(extra: str) -> dict[str, object]:
        head = (
            b'{"inputs":[{"name":"x","datatype":"INT32","shape":[1],"data":[1]}],"parameters":'
            + extra.encode()
        )
        message = kserve.parse_infer("m", "", head + b"}", b"").message
        return {
            k: (v.WhichOneof("parameter_choice"), getattr(v, v.WhichOneof("parameter_choice")))
            for k, v in message.parameters.items()
        }

    sent = parameters('{"sequence_id":1000,"sequence_start":true,"sequence_end":false}')
    assert sent == {
        "sequence_id": ("int64_param", 1000),
        "sequence_start": ("bool_param", True),
        "sequence_end": ("bool_param", False),
    }
    assert parameters('{"sequence_id":"a-uuid"}') == {"sequence_id": ("string_param", "a-uuid")}
    # Triton's ids are uint64: one above the int64 range is sent as uint64_param.
    assert parameters('{"sequence_id":18446744073709551615}') == {"sequence_id": ("uint64_param", 2**64 - 1)}
    with pytest.raises(errors.HttpError) as too_big:
        parameters('{"sequence_id":18446744073709551616}')
    assert too_big.value.status == 400
