"""Models as Hugging Face's exporters write them (built here with the onnx helper, tests/hf_decoder.py):
model.onnx without context metadata, with config.json, generation_config.json and a tokenizer with
its chat template beside it, served by copying the folder into the repository and nothing else.

Checked against the real service and gateway on loopback: the context read from the export (and
shown), enforced on gRPC and every HTTP API; a row whose step fails in a decode batch failing
alone while the others finish exactly as alone; end tokens from generation_config.json; the chat
template rendered in the service; logprobs and echo against numpy's log-softmax of the same graph;
and the openai client with logprobs, echo and n.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import openai
import pytest
import pytest_asyncio

from modelyard.gateway.app import Gateway
from modelyard.gateway.settings import Settings as GatewaySettings
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.inference.v1 import model_service_pb2 as model_pb
from modelyard.inference.v1 import model_service_pb2_grpc as model_grpc
from modelyard.service.server import Service, build_service
from modelyard.service.settings import Settings
from tests import hf_decoder

pytestmark = pytest.mark.asyncio(loop_scope="module")

TOKENIZER = hf_decoder.tiny_tokenizer()
VOCAB = TOKENIZER.get_vocab_size()
EOS_ID = TOKENIZER.token_to_id(hf_decoder.EOS)
# A ChatML template as Qwen2's tokenizer_config.json carries it, with the tokenizer's specials.
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# What transformers' apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
# renders with CHATML (tests/service/unit/test_chat_templates.py checks the renderer on many templates).
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick brown"}]
RENDERED = (
    "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nthe quick brown<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def tokenizer_config() -> dict[str, Any]:
    return {"chat_template": CHATML, "eos_token": hf_decoder.EOS, "bos_token": {"content": hf_decoder.EOS}}


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("exports") / "models"
    bare = {"metadata": False}
    # optimum's layout: the context only in config.json (128), the position table larger (192).
    hf_decoder.write_export(
        root,
        "exported",
        hf_decoder.gpt2_like(VOCAB, positions=192, **bare),
        TOKENIZER,
        {
            "config.json": {"model_type": "gpt2", "n_positions": 128},
            "tokenizer_config.json": tokenizer_config(),
        },
    )
    # No config.json, no metadata: the context is the position table's size, with position_ids
    # fed in or computed inside the graph (a Range).
    hf_decoder.write_export(root, "table", hf_decoder.gpt2_like(VOCAB, positions=40, **bare), TOKENIZER)
    nopos = hf_decoder.gpt2_like(VOCAB, positions=40, position_ids=False, **bare)
    hf_decoder.write_export(root, "table-nopos", nopos, TOKENIZER)
    # config.yaml may lower the export's context, never raise it.
    lowered = hf_decoder.gpt2_like(VOCAB, positions=64, **bare)
    hf_decoder.write_export(
        root,
        "lowered",
        lowered,
        TOKENIZER,
        {"config.json": {"n_positions": 64}},
        "generation:\n  context_length: 32\n",
    )
    # An export whose config.json states more context (256) than its position table has (128):
    # a stream that reaches position 128 fails inside the graph, mid-batch.
    hf_decoder.write_export(
        root,
        "short-table",
        hf_decoder.gpt2_like(VOCAB, positions=128, **bare),
        TOKENIZER,
        {"config.json": {"n_positions": 256}},
    )
    return root


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def service(repository: Path) -> AsyncIterator[Service]:
    running = build_service(Settings(repository=repository, listen="127.0.0.1:0", metrics_listen=""))
    await running.start()
    try:
        yield running
    finally:
        await running.stop(grace_s=1.0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stub(service: Service) -> AsyncIterator[pb_grpc.InferenceServiceStub]:
    async with grpc.aio.insecure_channel(service.address) as channel:
        yield pb_grpc.InferenceServiceStub(channel)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def models(service: Service) -> AsyncIterator[model_grpc.ModelServiceStub]:
    async with grpc.aio.insecure_channel(service.address) as channel:
        yield model_grpc.ModelServiceStub(channel)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(service: Service) -> AsyncIterator[Gateway]:
    running = Gateway(GatewaySettings(listen="127.0.0.1:0", upstream=service.address))
    await running.start()
    try:
        yield running
    finally:
        await running.stop()


@pytest_asyncio.fixture(loop_scope="module")
async def client(gateway: Gateway) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


async def generate(stub: Any, **fields: Any) -> list[pb.GenerateResponse]:
    return [r async for r in stub.Generate(pb.GenerateRequest(**fields))]


def ids(responses: list[pb.GenerateResponse]) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def model_file(root: Path, name: str) -> Path:
    return root / name / "1" / "model.onnx"


def log_softmax(logits: np.ndarray) -> np.ndarray:
    row = logits[..., :VOCAB].astype(np.float64)
    shifted = row - row.max(axis=-1, keepdims=True)
    return np.asarray(shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True)))


# --- the context -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "context", "source"),
    [
        ("exported", 128, "config.json"),
        ("table", 40, "position table"),
        ("table-nopos", 40, "position table"),
        ("lowered", 32, "config.yaml"),
    ],
)
async def test_the_context_is_the_exports_own_and_shown(models, name: str, context: int, source: str) -> None:
    model = (await models.GetModel(model_pb.GetModelRequest(name=name))).model
    assert (model.generation.context_length, model.generation.context_source) == (context, source)
    assert model.versions[0].generation.context_length == context
    listed = {m.name: m for m in (await models.ListModels(model_pb.ListModelsRequest())).models}
    assert listed[name].generation.context_length == context


async def test_grpc_ends_exactly_at_the_context_or_refuses_with_strict_context(stub) -> None:
    prompt = [5] * 30
    # The default (the proto's contract): FINISH_REASON_LENGTH when prompt + tokens fill the context.
    ended = await generate(stub, model_name="table", prompt_token_ids=prompt, max_tokens=100)
    assert ended[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert len(prompt) + len(ids(ended)) == 40
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await generate(stub, model_name="table", prompt_token_ids=prompt, max_tokens=11, strict_context=True)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (
        "context is 40 tokens" in refused.value.details()
        and "30 in the prompt and 11" in refused.value.details()
    )
    fits = await generate(
        stub, model_name="table", prompt_token_ids=prompt, max_tokens=10, strict_context=True
    )
    assert len(ids(fits)) == 10
    with pytest.raises(grpc.aio.AioRpcError) as full:
        await generate(stub, model_name="table", prompt_token_ids=[5] * 40, max_tokens=1)
    assert full.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "leave no room" in full.value.details()


async def test_every_http_api_refuses_an_asked_for_max_tokens_beyond_the_context(gateway, client) -> None:
    ids_prompt = [5] * 30
    with pytest.raises(openai.BadRequestError) as over:
        await client.completions.create(model="table", prompt=ids_prompt, max_tokens=11)
    assert over.value.param == "max_tokens" and "context is 40 tokens" in over.value.message
    with pytest.raises(openai.BadRequestError) as chat:
        await client.chat.completions.create(model="exported", messages=MESSAGES, max_tokens=48)
    assert chat.value.param == "max_tokens" and "context is 128 tokens" in chat.value.message
    # Without max_tokens the completion ends where the context does.
    ended = await client.completions.create(model="table", prompt=ids_prompt, extra_body={"max_tokens": None})
    assert ended.choices[0].finish_reason == "length" and ended.usage.total_tokens <= 40
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
        # The SSE API keeps Generate's contract: the stream ends at the context (finish_reason length).
        sse = await http.post(
            "/v1/models/table/generate", json={"prompt_token_ids": ids_prompt, "max_tokens": 11}
        )
        assert sse.status_code == 200
        assert '"finish_reason":"length","usage":{"prompt_tokens":30,"completion_tokens":10,' in sse.text
        kserve = await http.post(
            "/v2/models/table/generate", json={"text_input": "to be " * 15, "max_tokens": 39}
        )
        assert kserve.status_code == 400 and "context is 40 tokens" in kserve.text
    listed = await client.models.list()
    lengths = {m.id: getattr(m, "max_model_len", None) async for m in listed}
    assert lengths["exported"] == 128 and lengths["table"] == 40


# --- one row's failure -------------------------------------------------------------------------------


async def test_a_row_that_fails_in_a_batch_fails_alone(
    stub, service, caplog: pytest.LogCaptureFixture
) -> None:
    """short-table states 256 positions but its table has 128: a stream past position 127 fails
    inside the graph. Started while healthy streams decode, it fails on its own; they go on with
    exactly the tokens they have alone."""
    prompts = ["the quick brown", "to be or not", "a stitch"]
    alone = [ids(await generate(stub, model_name="short-table", prompt=p, max_tokens=60)) for p in prompts]
    healthy = [
        stub.Generate(pb.GenerateRequest(model_name="short-table", prompt=p, max_tokens=60)) for p in prompts
    ]
    firsts = [await call.read() for call in healthy]  # decoding, in one batch
    caplog.set_level(logging.WARNING, logger="modelyard.service.generation.engine")
    failing = stub.Generate(
        pb.GenerateRequest(model_name="short-table", prompt_token_ids=[7] * 118, max_tokens=40)
    )
    got: list[int] = []
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        async for response in failing:
            got.extend(response.token_ids)
    assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert trailing(failed.value)["x-error-reason"] == "model_rejected"
    # The prompt's run gave the first token, steps at positions 118..127 ten more; 128 failed.
    assert len(got) == 11
    rest = [[r async for r in _rest(call)] for call in healthy]
    together = [[*first.token_ids, *ids(more)] for first, more in zip(firsts, rest, strict=True)]
    assert together == alone
    assert any("failed for one sequence" in r.getMessage() for r in caplog.records)
    # The model still serves.
    assert len(ids(await generate(stub, model_name="short-table", prompt="a", max_tokens=3))) == 3


def trailing(error: Any) -> dict[str, Any]:
    return {key: value for key, value in error.trailing_metadata() or ()}


async def _rest(call: Any) -> AsyncIterator[pb.GenerateResponse]:
    while (response := await call.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
        yield response


# --- end tokens, chat, logprobs ------------------------------------------------------------------------


async def test_end_tokens_come_from_generation_config(stub, models, repository: Path) -> None:
    want = hf_decoder.reference_greedy(
        model_file(repository, "table"), TOKENIZER.encode("to be or").ids, 12, VOCAB
    )
    first_new = next(t for i, t in enumerate(want) if i >= 3 and t not in want[:i])
    ends = [first_new, EOS_ID]
    exported = repository / "eos"
    hf_decoder.write_export(
        repository,
        "eos",
        hf_decoder.gpt2_like(VOCAB, positions=40, metadata=False),
        TOKENIZER,
        {"generation_config.json": {"eos_token_id": ends, "pad_token_id": EOS_ID, "do_sample": False}},
    )
    assert exported.is_dir()
    await _load(models, "eos")
    model = (await models.GetModel(model_pb.GetModelRequest(name="eos"))).model
    assert sorted(model.generation.eos_token_ids) == sorted(ends)
    responses = await generate(stub, model_name="eos", prompt="to be or", max_tokens=12)
    assert ids(responses) == want[: want.index(ends[0]) + 1]
    assert responses[-1].finish_reason == pb.FINISH_REASON_EOS


async def _load(models: Any, name: str) -> None:
    for _ in range(3):
        try:
            await models.LoadModel(model_pb.LoadModelRequest(name=name))
            return
        except grpc.aio.AioRpcError as exc:  # management may be closed: the watcher loads it then
            if exc.code() != grpc.StatusCode.PERMISSION_DENIED:
                raise
            await asyncio.sleep(0.5)
    for _ in range(100):
        model = (await models.GetModel(model_pb.GetModelRequest(name=name))).model
        if model.default_version:
            return
        await asyncio.sleep(0.1)


async def test_chat_messages_render_with_the_models_template(stub, client, repository: Path) -> None:
    prompt = TOKENIZER.encode(RENDERED, add_special_tokens=False).ids
    want = hf_decoder.reference_greedy(model_file(repository, "exported"), prompt, 6, VOCAB)
    messages = [pb.ChatMessage(role=m["role"], content=m["content"]) for m in MESSAGES]
    responses = await generate(stub, model_name="exported", messages=messages, max_tokens=6)
    assert responses[-1].usage.prompt_tokens == len(prompt) and ids(responses) == want
    answer = await client.chat.completions.create(
        model="exported", messages=MESSAGES, max_tokens=6, temperature=0
    )
    assert answer.choices[0].message.content == TOKENIZER.decode(want)
    # A model without a template refuses chat, naming what it lacks.
    with pytest.raises(grpc.aio.AioRpcError) as none:
        await generate(stub, model_name="table", messages=messages, max_tokens=2)
    assert (
        none.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        and "no chat template" in none.value.details()
    )
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model="table", messages=MESSAGES, max_tokens=2)
    assert "no chat template" in refused.value.message


async def test_logprobs_and_prompt_scores_equal_numpy_log_softmax(stub, repository: Path) -> None:
    prompt = TOKENIZER.encode("all that glitters").ids
    responses = await generate(
        stub,
        model_name="table",
        prompt_token_ids=prompt,
        max_tokens=6,
        logprobs=True,
        top_logprobs=3,
        prompt_logprobs=True,
    )
    tokens = ids(responses)
    scores = log_softmax(hf_decoder.reference_logits(model_file(repository, "table"), prompt + tokens))
    entries = [e for r in responses for e in r.logprobs]
    assert [e.token_id for e in entries] == tokens
    for position, entry in enumerate(entries, start=len(prompt) - 1):
        assert entry.logprob == pytest.approx(scores[position, entry.token_id], abs=1e-3)
        best = np.argsort(-scores[position])[:3]
        assert [t.token_id for t in entry.top_logprobs] == best.tolist()
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(scores[position, best], abs=1e-3)
    scored = list(responses[0].prompt_logprobs)
    assert [e.token_id for e in scored] == prompt and not scored[0].HasField("logprob")
    for i, entry in enumerate(scored[1:], start=1):
        assert entry.logprob == pytest.approx(scores[i - 1, prompt[i]], abs=1e-3)
    assert scored[1].token == TOKENIZER.decode([prompt[1]])
    only = await generate(
        stub, model_name="table", prompt_token_ids=prompt, prompt_only=True, prompt_logprobs=True
    )
    assert len(only) == 1 and not only[0].token_ids and only[0].finish_reason == pb.FINISH_REASON_LENGTH
    assert only[0].usage.completion_tokens == 0 and [
        (e.token_id, e.logprob) for e in only[0].prompt_logprobs
    ] == [(e.token_id, e.logprob) for e in scored]


async def test_the_openai_client_gets_logprobs_echo_and_n(client, repository: Path) -> None:
    prompt = TOKENIZER.encode("to be or not").ids
    # lm-evaluation-harness's log-likelihood request: echo, max_tokens 0, logprobs 1.
    scored = await client.completions.create(
        model="table", prompt=[prompt], echo=True, max_tokens=0, logprobs=1, temperature=0, seed=1234
    )
    logprobs = scored.choices[0].logprobs
    scores = log_softmax(hf_decoder.reference_logits(model_file(repository, "table"), prompt))
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1:] == pytest.approx(
        [scores[i - 1, prompt[i]] for i in range(1, len(prompt))], abs=1e-3
    )
    assert logprobs.tokens == [TOKENIZER.decode([t]) for t in prompt]
    assert scored.choices[0].text == TOKENIZER.decode(prompt) and scored.usage.completion_tokens == 0
    greedy = int(np.argmax(scores[0]))
    assert max(logprobs.top_logprobs[1], key=logprobs.top_logprobs[1].get) == TOKENIZER.decode([greedy])
    # Completion logprobs, streamed and whole alike.
    whole = await client.completions.create(
        model="table", prompt="to be", max_tokens=5, logprobs=2, temperature=0
    )
    assert len(whole.choices[0].logprobs.tokens) == 5 and all(
        len(t) <= 3 for t in whole.choices[0].logprobs.top_logprobs
    )
    stream = await client.completions.create(
        model="table", prompt="to be", max_tokens=5, logprobs=2, temperature=0, stream=True
    )
    streamed = [
        t
        async for c in stream
        for t in (c.choices[0].logprobs.token_logprobs if c.choices and c.choices[0].logprobs else [])
    ]
    assert streamed == pytest.approx(whole.choices[0].logprobs.token_logprobs, abs=1e-6)
    # Chat: logprobs true, top_logprobs N.
    chat = await client.chat.completions.create(
        model="exported", messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert content[0].top_logprobs[0].logprob >= content[0].logprob - 1e-6  # greedy: the top one
    # n > 1: independent choices, reproducible with a seed.
    ask = {"model": "table", "prompt": "a stitch", "max_tokens": 8, "temperature": 1.5, "n": 3}
    first = await client.completions.create(seed=7, **ask)
    again = await client.completions.create(seed=7, **ask)
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2] and texts == [c.text for c in again.choices]
    assert len(set(texts)) > 1, texts
    assert (
        first.usage.completion_tokens == sum(c.usage.completion_tokens for c in [first])
        and first.usage.completion_tokens <= 24
    )
    stream = await client.completions.create(seed=7, stream=True, **ask)
    pieces = {0: "", 1: "", 2: ""}
    async for chunk in stream:
        for c in chunk.choices:
            pieces[c.index] += c.text
    assert list(pieces.values()) == texts
    # Several prompts: choices in OpenAI's order (prompt by prompt, n each).
    many = await client.completions.create(
        model="table", prompt=["to be", "a stitch"], max_tokens=3, temperature=0, n=2
    )
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text != many.choices[2].text == many.choices[3].text
