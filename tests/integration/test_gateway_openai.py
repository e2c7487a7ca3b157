"""The official `openai` client against the gateway's OpenAI-compatible endpoints (the real service
upstream, the committed demo model codelm)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai
import pytest
import pytest_asyncio

from models import demo_models
from modelyard.gateway.app import Gateway
from modelyard.gateway.config import Settings as GatewaySettings
from modelyard.gateway.openai import chat_template
from modelyard.service.config import Settings
from modelyard.service.server import build_service
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


async def sse_text(gateway: Gateway, prompt: str, max_tokens: int) -> str:
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
        response = await http.post(
            "/v1/models/codelm/generate", json={"prompt": prompt, "max_tokens": max_tokens}
        )
        return "".join(e.data["text"] for e in events_only([e async for e in read_events(response)])[:-1])


async def test_models_are_listed(client) -> None:
    models = [m.id async for m in client.models.list()]
    assert sorted(models) == ["classifier", "codelm"]


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


async def test_chat_completion_uses_the_documented_template(client, gateway) -> None:
    messages = [
        {"role": "system", "content": "short Python functions"},
        {"role": "user", "content": "add two numbers"},
    ]
    prompt = chat_template.render(messages)
    assert prompt == "# system: short Python functions\n# user: add two numbers\n"
    want = await sse_text(gateway, prompt, 10)
    whole = await client.chat.completions.create(
        model="codelm", messages=messages, max_tokens=10, temperature=0
    )
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content == want
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 10

    stream = await client.chat.completions.create(
        model="codelm", messages=messages, max_tokens=10, temperature=0, stream=True
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # include_usage not asked for


async def test_errors_come_as_openai_error_objects(client) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        await client.completions.create(model="nosuch", prompt="x", max_tokens=2)
    assert missing.value.status_code == 404 and missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        await client.completions.create(model="codelm", prompt="x", max_tokens=2, temperature=-1)
    assert bad.value.type == "invalid_request_error"
    with pytest.raises(openai.UnprocessableEntityError):
        await client.chat.completions.create(model="codelm", messages=[{"role": "wizard", "content": "x"}])
    with pytest.raises(openai.UnprocessableEntityError):
        await client.completions.create(model="codelm", prompt="x", n=2)
