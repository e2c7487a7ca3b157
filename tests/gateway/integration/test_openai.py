"""The official `openai` client against the gateway's OpenAI-compatible endpoints (the real service
upstream, the committed demo model codelm)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio

from models import demo_models
from modelyard.gateway.app import Gateway
from modelyard.gateway.settings import Settings as GatewaySettings
from modelyard.service.server import build_service
from modelyard.service.settings import Settings
from tests.sse_client import events_only, read_events

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def openai_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("openai") / "models"
    demo_models.write_model(root, "classifier", 1, demo_models.dense_classifier(4, 4, 2, seed=0))
    assert demo_models.copy_trained_models(demo_models.COMMITTED_ROOT, root) == ["codelm"]
    return root


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(openai_repository: Path) -> AsyncIterator[Gateway]:
    service = build_service(Settings(repository=openai_repository, listen="127.0.0.1:0", metrics_listen=""))
    await service.start()
    running = Gateway(GatewaySettings(listen="127.0.0.1:0", upstream=service.address))
    await running.start()
    try:
        yield running
    finally:
        await running.stop()
        await service.stop(grace_s=1.0)


@pytest_asyncio.fixture(loop_scope="module")
async def client(gateway: Gateway) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


async def sse_text(gateway: Gateway, prompt: str, max_tokens: int, stop: tuple[str, ...] = ()) -> str:
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
        response = await http.post(
            "/v1/models/codelm/generate",
            json={"prompt": prompt, "max_tokens": max_tokens, "stop": list(stop)},
        )
        return "".join(e.data["text"] for e in events_only([e async for e in read_events(response)])[:-1])


async def test_models_are_listed(client) -> None:
    models = [m.id async for m in client.models.list()]
    assert sorted(models) == ["classifier", "codelm"]


async def test_one_model_is_retrieved_and_an_unknown_one_is_not_found(client, gateway) -> None:
    model = await client.models.retrieve("codelm")
    assert model.id == "codelm" and model.object == "model"
    with pytest.raises(openai.NotFoundError) as missing:
        await client.models.retrieve("nosuch")
    assert missing.value.code == "model_not_found" and missing.value.type == "invalid_request_error"
    # Below a model is still the SSE API's (its own error body, not OpenAI's).
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        answer = await http.get("/v1/models/nosuch/generate", params={"prompt": "x"})
    assert answer.status_code == 404 and "error" in answer.json() and "type" not in answer.json()["error"]


async def test_completion_whole_and_streamed_agree_with_the_sse_endpoint(client, gateway) -> None:
    want = await sse_text(gateway, "def add(a, b):", 12)
    whole = await client.completions.create(
        model="codelm", prompt="def add(a, b):", max_tokens=12, temperature=0
    )
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    assert whole.choices[0].text == want and whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12

    stream = await client.completions.create(
        model="codelm",
        prompt="def add(a, b):",
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert len([c for c in chunks if c.choices]) > 2  # token by token, not one piece
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


# codelm's own template (models/demo/codelm/1/chat_template.jinja) and its config's chat keys.
CODELM_STOP = ["\ndef ", "\nclass ", "\n@", "\n\n\n"]


async def test_chat_completion_uses_the_models_own_template(client, gateway) -> None:
    messages = [
        {"role": "system", "content": "short Python functions"},
        {"role": "user", "content": "Add two numbers!"},
    ]
    opening = "def add_two_numbers("
    prompt = f"# system: short Python functions\n# user: Add two numbers!\n{opening}"
    want = opening + await sse_text(gateway, prompt, 24, tuple(CODELM_STOP))
    whole = await client.chat.completions.create(
        model="codelm", messages=messages, max_tokens=24, temperature=0
    )
    assert whole.object == "chat.completion"
    answer = whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant" and answer == want
    # An answer a person reads as code: the function the template opened, with arguments and a body.
    assert answer.startswith(opening) and "):\n    " in answer, answer
    assert whole.usage.completion_tokens <= 24

    stream = await client.chat.completions.create(
        model="codelm", messages=messages, max_tokens=24, temperature=0, stream=True
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content.startswith(opening)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)  # include_usage not asked for


async def test_errors_come_as_openai_error_objects(client) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        await client.completions.create(model="nosuch", prompt="x", max_tokens=2)
    assert missing.value.status_code == 404 and missing.value.code == "model_not_found"
    assert missing.value.type == "invalid_request_error"  # OpenAI's type for a 404 too
    with pytest.raises(openai.BadRequestError) as bad:
        await client.completions.create(model="codelm", prompt="x", max_tokens=2, temperature=-1)
    assert bad.value.type == "invalid_request_error" and bad.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as over:
        await client.completions.create(model="codelm", prompt="x", max_tokens=257)
    assert over.value.param == "max_tokens" and "256" in over.value.message
    # A missing or mistyped field is 400 as in OpenAI's API (not 422), naming the field.
    with pytest.raises(openai.BadRequestError) as role:
        await client.chat.completions.create(model="codelm", messages=[{"role": "wizard", "content": "x"}])
    assert role.value.status_code == 400 and role.value.param == "messages[0].role"
    with pytest.raises(openai.BadRequestError) as typed:
        await client.completions.create(model="codelm", prompt="x", extra_body={"max_tokens": "many"})
    assert typed.value.param == "max_tokens" and typed.value.code == "invalid_argument"


UNIMPLEMENTED = [
    ("top_logprobs", {"top_logprobs": 2}),  # without logprobs: true
    ("echo", {"extra_body": {"echo": True}}),  # completions' only
    ("tools", {"tools": [{"type": "function", "function": {"name": "f"}}]}),
    ("response_format", {"response_format": {"type": "json_object"}}),
    ("stream_options", {"stream_options": {"include_usage": True}}),  # without stream
]


@pytest.mark.parametrize(("param", "fields"), UNIMPLEMENTED, ids=[p for p, _ in UNIMPLEMENTED])
async def test_parameters_the_server_does_not_implement_are_refused_by_name(client, param, fields) -> None:
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model="codelm", messages=messages, max_tokens=1, **fields)
    assert refused.value.status_code == 400 and refused.value.param == param, refused.value.body
    assert refused.value.type == "invalid_request_error"


async def test_logit_bias_and_penalties_reach_the_model(client) -> None:
    async def text(**fields: Any) -> str:
        fields = {"prompt": "def add(a, b):", "max_tokens": 6, **fields}
        answer = await client.completions.create(model="codelm", temperature=0, **fields)
        return str(answer.choices[0].text)

    plain = await text()
    # Token 50 forced at every step (greedy: +100 outweighs any logit): one token, repeated.
    forced = await text(logit_bias={"50": 100})
    assert forced and forced != plain and len(set(forced)) <= 2, forced
    # Penalties change greedy text once it would repeat itself (test_generation shows how much).
    loop = {"prompt": "    for i in range(", "max_tokens": 32}
    assert await text(**loop, frequency_penalty=2.0, presence_penalty=2.0) != await text(**loop)
    for fields, param in (
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -3}, "presence_penalty"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"logit_bias": {"50": 101}}, "logit_bias"),
        ({"logit_bias": {"fifty": 1}}, "logit_bias"),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            await text(**fields)
        assert refused.value.param == param, refused.value.body


async def test_a_prompt_and_max_tokens_over_the_context_are_refused_with_the_numbers(client) -> None:
    with pytest.raises(openai.BadRequestError) as over:
        await client.completions.create(model="codelm", prompt="def add(a, b):", max_tokens=256)
    assert over.value.param == "max_tokens"
    assert "256 tokens" in over.value.message and "in the prompt and 256 to generate" in over.value.message
    # Without max_tokens the completion ends where the context does (OpenAI's default too).
    answer = await client.chat.completions.create(model="codelm", messages=[{"role": "user", "content": "x"}])
    assert answer.choices[0].finish_reason in ("length", "stop")


async def test_parameters_at_their_neutral_values_are_accepted(client) -> None:
    # What clients send by default when they use none of these features.
    answer = await client.chat.completions.create(
        model="codelm",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=1,
        n=1,
        frequency_penalty=0,
        presence_penalty=0.0,
        logit_bias={},
        logprobs=False,
    )
    assert answer.choices[0].finish_reason in ("length", "stop")
    completion = await client.completions.create(
        model="codelm", prompt="x", max_tokens=1, best_of=1, echo=False
    )
    assert completion.usage is not None and completion.usage.completion_tokens == 1


async def test_unknown_paths_under_v1_answer_in_the_error_object(gateway) -> None:
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        for method, path in [("GET", "/v1/nosuch"), ("POST", "/v1/embeddings"), ("GET", "/v1")]:
            answer = await http.request(method, path)
            assert answer.status_code == 404, (path, answer.text)
            error = answer.json()["error"]
            assert error["type"] == "invalid_request_error" and path in error["message"]
            assert answer.headers["x-error-reason"] == "unsupported"
        wrong = await http.get("/v1/completions")
        assert wrong.status_code == 405 and wrong.json()["error"]["type"] == "invalid_request_error"
