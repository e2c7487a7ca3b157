"""Generate against the real service on loopback: the committed demo language model, and a GPT-2
style model built here with random weights (served from its layout alone, no model-specific code).

One service for the whole module (loading the models is the slow part); each test uses its own
prompts, and the metrics it reads are per model, so tests do not see each other's streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
import yaml
from prometheus_client import generate_latest
from tokenizers import Tokenizer

from models import demo_models
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.service.generation.plane import INLINE_PROMPT_CHARS
from modelyard.service.generation.tokenizer import TextCodec
from modelyard.service.server import Service, build_service
from modelyard.service.settings import Settings
from tests import hf_decoder
from tests.support import eventually, metric

pytestmark = pytest.mark.asyncio(loop_scope="module")

CODELM = demo_models.COMMITTED_ROOT / "codelm"
# A paused stream keeps its slot here (max_preempted 0: no preemption), so that a stream nobody
# reads holds the one slot while the tests look at the queue behind it (preemption has its tests
# in tests/gateway/security/test_abandoned_streams.py).
TIGHT = """generation:
  max_concurrent_sequences: 1
  max_waiting: 1
  max_tokens: 256
  stream_buffer: 2
  max_preempted: 0
"""
# One slot and two priority levels (requests that name none wait at 2, the lowest), whose queues
# let a request shorten its wait with timeout_us.
RANKED = """generation:
  max_concurrent_sequences: 1
  max_tokens: 256
  stream_buffer: 2
  max_preempted: 0
  priority_levels: 2
  default_queue_policy: {max_queue_size: 4, allow_timeout_override: true}
"""
EOS_PROMPT, EOS_AT = "the quick brown", 3
EOS_AT_FOUND = -1
PROMPTS = [
    "def __init__(self",
    "import os\n",
    "    for i in range(",
    "class Parser:\n    def parse(self, text):\n",
]


@pytest.fixture(scope="module")
def gen_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("generation") / "models"
    demo_models.write_model(root, "classifier", 1, demo_models.dense_classifier(4, 4, 2, seed=0))
    assert demo_models.copy_trained_models(demo_models.COMMITTED_ROOT, root) == ["codelm"]
    # The same model under a tight config: one slot, one queue place, a 2-token stream buffer.
    shutil.copytree(CODELM / "1", root / "tight" / "1")
    (root / "tight" / "config.yaml").write_text(TIGHT)
    shutil.copytree(CODELM / "1", root / "ranked" / "1")
    (root / "ranked" / "config.yaml").write_text(RANKED)
    shutil.copytree(CODELM / "1", root / "swapped" / "1")
    tokenizer = hf_decoder.tiny_tokenizer()
    vocab = tokenizer.get_vocab_size()
    hf_decoder.write_decoder(root, "gpt2ish", hf_decoder.gpt2_like(vocab), tokenizer)
    hf_decoder.write_decoder(
        root, "gpt2ish-nopos", hf_decoder.gpt2_like(vocab, position_ids=False), tokenizer
    )
    # The same model with an end-of-text token that its greedy output for EOS_PROMPT reaches at
    # EOS_AT: the stream must end there, with finish reason EOS.
    want = reference(root, "gpt2ish", EOS_PROMPT)
    eos = next(t for i, t in enumerate(want) if i >= EOS_AT and t not in want[:i])
    global EOS_AT_FOUND
    EOS_AT_FOUND = want.index(eos)
    config = yaml.safe_dump({"generation": {"eos_token": tokenizer.id_to_token(eos)}})
    hf_decoder.write_decoder(root, "gpt2ish-eos", hf_decoder.gpt2_like(vocab), tokenizer, config)
    return root


def reference(root: Path, model: str, prompt: str, n: int = 12) -> list[int]:
    """Greedy tokens by full recomputation, up to and including the end-of-text token."""
    tokenizer = hf_decoder.tiny_tokenizer()
    tokens = hf_decoder.reference_greedy(
        root / model / "1" / "model.onnx", tokenizer.encode(prompt).ids, n, tokenizer.get_vocab_size()
    )
    eos = tokenizer.token_to_id(hf_decoder.EOS)
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gen_service(gen_repository: Path) -> AsyncIterator[Service]:
    running = build_service(Settings(repository=gen_repository, listen="127.0.0.1:0", metrics_listen=""))
    await running.start()
    try:
        yield running
    finally:
        await running.stop(grace_s=1.0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stub(gen_service: Service) -> AsyncIterator[pb_grpc.InferenceServiceStub]:
    async with grpc.aio.insecure_channel(gen_service.address) as channel:
        yield pb_grpc.InferenceServiceStub(channel)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def slow_stub(gen_service: Service) -> AsyncIterator[pb_grpc.InferenceServiceStub]:
    """A client with the smallest fixed HTTP/2 window gRPC allows: when it stops reading, what gRPC
    itself buffers is small, so the sequence's own pause shows (and a stream that is not read does
    not run to its end inside gRPC's buffers)."""
    options = [("grpc.http2.lookahead_bytes", 1), ("grpc.http2.bdp_probe", 0)]
    async with grpc.aio.insecure_channel(gen_service.address, options=options) as channel:
        yield pb_grpc.InferenceServiceStub(channel)


async def generate(stub: Any, **fields: Any) -> list[pb.GenerateResponse]:
    fields.setdefault("model_name", "codelm")
    return [r async for r in stub.Generate(pb.GenerateRequest(**fields))]


async def rest(call: Any) -> list[pb.GenerateResponse]:
    """The remaining responses of a call already read with read() (gRPC forbids mixing in async for)."""
    out = []
    while (response := await call.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
        out.append(response)
    return out


def ids(responses: list[pb.GenerateResponse]) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def text(responses: list[pb.GenerateResponse]) -> str:
    return "".join(r.text for r in responses)


def gauge(service: Service, name: str, model: str, version: str = "1", **labels: str) -> float | None:
    """A series of the model version; None while it does not exist (before its first event)."""
    return metric(service.metrics.registry, name, model=model, version=version, **labels)


def paused(service: Service, model: str) -> int:
    """Sequences of the model paused for their reader (out of the decode steps, slot kept)."""
    assert service.generation is not None
    return sum(e.paused for v, e in list(service.generation._engines.items()) if v.model == model)


# --- streaming -----------------------------------------------------------------------------------


async def test_tokens_arrive_one_message_at_a_time_and_a_slow_reader_pauses(slow_stub, gen_service) -> None:
    before = gauge(gen_service, "modelyard_generation_tokens_total", "tight") or 0.0
    call = slow_stub.Generate(pb.GenerateRequest(model_name="tight", prompt=PROMPTS[0], max_tokens=200))
    first = await call.read()
    assert first.sequence_number == 0 and len(first.token_ids) == 1 and first.model_version == "1"
    # The reader stops: the window fills, the 2-token stream buffer fills, the sequence pauses
    # (keeping its slot, out of the decode steps) instead of running ahead to 200 tokens.
    await eventually(lambda: paused(gen_service, "tight") == 1, "the sequence to pause for its reader")
    assert gauge(gen_service, "modelyard_generation_tokens_total", "tight") - before < 50
    # The decode steps run ahead of the loop's deliveries, but never past the buffer's bound.
    assert gen_service.generation is not None
    engines = [e for v, e in list(gen_service.generation._engines.items()) if v.model == "tight"]
    assert [s.buffered for e in engines for s in e._slots] == [2]
    assert gauge(gen_service, "modelyard_generation_active_sequences", "tight") == 1
    responses = [first, *await rest(call)]
    # Tokens that piled up while the reader slept come in fewer, larger messages; none is lost.
    assert [r.sequence_number for r in responses] == list(range(len(responses)))
    assert len(ids(responses)) == 200 and len(responses) > 1
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert all(r.finish_reason == pb.FINISH_REASON_UNSPECIFIED for r in responses[:-1])
    assert not any(r.HasField("usage") for r in responses[:-1])
    await eventually(lambda: gauge(gen_service, "modelyard_generation_active_sequences", "tight") == 0)


async def test_output_is_code_shaped(stub) -> None:
    """The demo model was trained on Python source: greedy output from a def looks like Python."""
    out = text(await generate(stub, prompt="    def __init__(self, ", max_tokens=60))
    assert "self" in out and ("\n" in out or ":" in out), out


async def test_usage_counts_and_time_to_first_token(stub) -> None:
    tokenizer = Tokenizer.from_file(str(CODELM / "1" / "tokenizer.json"))
    responses = await generate(stub, prompt=PROMPTS[1], max_tokens=12, request_id="req-7")
    last = responses[-1]
    assert last.usage.prompt_tokens == len(tokenizer.encode(PROMPTS[1]).ids)
    assert last.usage.completion_tokens == 12 == len(ids(responses))
    assert last.time_to_first_token.ToNanoseconds() > 0
    assert all(r.request_id == "req-7" for r in responses)
    # The text is the decoding of the tokens, whole.
    assert text(responses) == tokenizer.decode(ids(responses))


async def test_prompt_token_ids_are_used_instead_of_text(stub) -> None:
    tokenizer = Tokenizer.from_file(str(CODELM / "1" / "tokenizer.json"))
    by_text = await generate(stub, prompt=PROMPTS[2], max_tokens=8)
    by_ids = await generate(stub, prompt_token_ids=tokenizer.encode(PROMPTS[2]).ids, max_tokens=8)
    assert ids(by_text) == ids(by_ids)


async def test_a_short_prompt_is_tokenized_on_the_event_loop_and_a_long_one_in_the_executor(
    stub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The executor's round trip is on the first token's path: a short prompt skips it."""
    on_loop: list[tuple[int, bool]] = []
    loop_thread = threading.current_thread()  # the test runs on the service's event loop
    real = TextCodec.encode

    def encode(codec: TextCodec, prompt: str, add_special_tokens: bool = True) -> list[int]:
        on_loop.append((len(prompt), threading.current_thread() is loop_thread))
        return real(codec, prompt, add_special_tokens)

    monkeypatch.setattr(TextCodec, "encode", encode)
    short, long = PROMPTS[0], PROMPTS[3] * (INLINE_PROMPT_CHARS // len(PROMPTS[3]) + 1)
    assert len(short) <= INLINE_PROMPT_CHARS < len(long)
    for prompt in (short, long):
        assert len(ids(await generate(stub, prompt=prompt, max_tokens=2))) == 2
    assert on_loop == [(len(short), True), (len(long), False)]


# --- sampling --------------------------------------------------------------------------------------


async def test_a_seed_reproduces_and_another_seed_differs(stub) -> None:
    ask = {"prompt": PROMPTS[3], "max_tokens": 24, "temperature": 1.0, "top_k": 50, "top_p": 0.95}
    a = await generate(stub, seed=7, **ask)
    b = await generate(stub, seed=7, **ask)
    c = await generate(stub, seed=8, **ask)
    assert ids(a) == ids(b)
    assert ids(a) != ids(c)


async def test_stop_sequence_spanning_tokens_ends_the_text_before_it(stub) -> None:
    tokenizer = Tokenizer.from_file(str(CODELM / "1" / "tokenizer.json"))
    free = await generate(stub, prompt=PROMPTS[3], max_tokens=40)
    full = text(free)
    pieces = [tokenizer.decode([t]) for t in ids(free)]
    # A stop sequence made of the end of one token's text and the start of the next one's.
    i = next(i for i in range(3, len(pieces) - 1) if len(pieces[i]) >= 2 and pieces[i + 1].strip())
    stop = pieces[i][-2:] + pieces[i + 1][:1]
    stopped = await generate(stub, prompt=PROMPTS[3], max_tokens=40, stop=[stop, "never-produced"])
    assert stopped[-1].finish_reason == pb.FINISH_REASON_STOP
    assert text(stopped) == full[: full.index(stop)]
    assert stop not in text(stopped)
    assert len(ids(stopped)) < 40


# --- batching ---------------------------------------------------------------------------------------


async def test_greedy_tokens_are_the_same_alone_and_batched(stub, gen_service) -> None:
    alone = [ids(await generate(stub, prompt=p, max_tokens=24)) for p in PROMPTS]
    rows_before = gen_service.metrics.registry.get_sample_value(
        "modelyard_generation_decode_batch_rows_sum", {"model": "codelm", "version": "1"}
    )
    steps_before = gen_service.metrics.registry.get_sample_value(
        "modelyard_generation_decode_batch_rows_count", {"model": "codelm", "version": "1"}
    )
    # The same prompts together, with sampled streams of other lengths joining and leaving.
    noise = [
        generate(stub, prompt="x" * (i + 1), max_tokens=5 + 7 * i, temperature=1.0, seed=i) for i in range(4)
    ]
    together = await asyncio.gather(*(generate(stub, prompt=p, max_tokens=24) for p in PROMPTS), *noise)
    assert [ids(r) for r in together[: len(PROMPTS)]] == alone
    rows = gen_service.metrics.registry.get_sample_value(
        "modelyard_generation_decode_batch_rows_sum", {"model": "codelm", "version": "1"}
    )
    steps = gen_service.metrics.registry.get_sample_value(
        "modelyard_generation_decode_batch_rows_count", {"model": "codelm", "version": "1"}
    )
    assert (rows - rows_before) / (steps - steps_before) > 2, "the streams did not share decode steps"


async def test_a_stream_keeps_its_version_across_a_swap(stub, gen_service, gen_repository) -> None:
    def series(version: str) -> bool:
        body = generate_latest(gen_service.metrics.registry).decode()
        return f'modelyard_generation_tokens_total{{model="swapped",version="{version}"}}' in body

    call = stub.Generate(pb.GenerateRequest(model_name="swapped", prompt=PROMPTS[0], max_tokens=30))
    first = await call.read()
    assert first.model_version == "1"
    assert series("1")
    shutil.copytree(gen_repository / "swapped" / "1", gen_repository / "swapped" / "2")
    await gen_service.manager.load("swapped")  # v2 now serves new requests
    assert (await generate(stub, model_name="swapped", prompt="x", max_tokens=1))[0].model_version == "2"
    assert {r.model_version for r in await rest(call)} == {"1"}
    # v1 drained and retired: its decode loop ended and its metric series left with it.
    await eventually(lambda: not series("1"))
    assert series("2")


# --- cancellation, deadlines, load ----------------------------------------------------------------


async def test_cancel_frees_the_slot(stub, slow_stub, gen_service) -> None:
    cancelled_before = (
        gauge(gen_service, "modelyard_generation_cancellations_total", "tight", cause="cancelled") or 0.0
    )
    call = slow_stub.Generate(pb.GenerateRequest(model_name="tight", prompt=PROMPTS[1], max_tokens=200))
    await call.read()
    await call.read()
    assert gauge(gen_service, "modelyard_generation_active_sequences", "tight") == 1
    call.cancel()
    await eventually(lambda: gauge(gen_service, "modelyard_generation_active_sequences", "tight") == 0)
    assert (
        gauge(gen_service, "modelyard_generation_cancellations_total", "tight", cause="cancelled")
        == cancelled_before + 1
    )
    # The slot is free: the next stream runs (the tight model has exactly one).
    assert len(ids(await generate(stub, model_name="tight", prompt="y", max_tokens=3))) == 3


async def test_deadline_ends_the_stream_and_frees_the_slot(slow_stub, gen_service) -> None:
    def deadlines() -> float | None:
        return gauge(gen_service, "modelyard_generation_cancellations_total", "tight", cause="deadline")

    before = deadlines() or 0.0
    call = slow_stub.Generate(
        pb.GenerateRequest(model_name="tight", prompt=PROMPTS[2], max_tokens=200), timeout=0.5
    )
    await call.read()  # then read nothing: the sequence pauses and the deadline passes
    # The service sees the deadline pass: the stream is released as a deadline cancellation.
    await eventually(
        lambda: (
            (gauge(gen_service, "modelyard_generation_cancellations_total", "tight", cause="deadline") or 0)
            > before
        ),
        "the deadline to end the sequence",
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await rest(call)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await eventually(lambda: gauge(gen_service, "modelyard_generation_active_sequences", "tight") == 0)
    assert (
        gauge(gen_service, "modelyard_generation_cancellations_total", "tight", cause="deadline")
        == before + 1
    )


async def test_a_full_queue_answers_resource_exhausted(stub, slow_stub, gen_service) -> None:
    running = slow_stub.Generate(pb.GenerateRequest(model_name="tight", prompt=PROMPTS[0], max_tokens=200))
    await running.read()  # holds the one slot (paused: nobody reads)
    queued = stub.Generate(pb.GenerateRequest(model_name="tight", prompt=PROMPTS[1], max_tokens=5))
    await eventually(lambda: gauge(gen_service, "modelyard_generation_waiting_sequences", "tight") == 1)
    full_before = gauge(gen_service, QUEUE_REJECTIONS, "tight", priority="1", reason="queue_full") or 0.0
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await generate(stub, model_name="tight", prompt=PROMPTS[2], max_tokens=5)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert gauge(gen_service, QUEUE_REJECTIONS, "tight", priority="1", reason="queue_full") == full_before + 1
    running.cancel()
    assert len(ids(await rest(queued))) == 5  # the queued one gets the slot when it frees


# --- waiting for a slot: the admission queue the batcher uses --------------------------------------

QUEUE_DEPTH = "modelyard_queue_depth"
QUEUE_REJECTIONS = "modelyard_queue_rejections_total"
FIRST_TOKENS = "modelyard_generation_time_to_first_token_seconds_count"


@contextlib.asynccontextmanager
async def slot_held(slow_stub: Any, service: Service, model: str) -> AsyncIterator[Any]:
    """The model's one slot, held by a stream that nobody reads after its first token (it pauses
    and keeps the slot), until the block cancels it or ends."""
    call = slow_stub.Generate(pb.GenerateRequest(model_name=model, prompt=PROMPTS[0], max_tokens=250))
    await call.read()
    try:
        yield call
    finally:
        call.cancel()
        await eventually(lambda: gauge(service, "modelyard_generation_active_sequences", model) == 0)


def queued(service: Service, model: str, level: str, depth: int) -> Callable[[], bool]:
    return lambda: gauge(service, QUEUE_DEPTH, model, priority=level) == depth


async def test_a_higher_priority_generation_gets_the_next_slot_first(stub, slow_stub, gen_service) -> None:
    order: list[str] = []

    async def wait_then_read(name: str, priority: int) -> list[pb.GenerateResponse]:
        call = stub.Generate(
            pb.GenerateRequest(model_name="ranked", prompt=PROMPTS[1], max_tokens=3, priority=priority)
        )
        first = await call.read()
        order.append(name)  # first tokens arrive in the order the streams got the slot
        return [first, *await rest(call)]

    async with slot_held(slow_stub, gen_service, "ranked") as holder:
        streams = []
        # Two at the default (lowest) level, named and unnamed, then one at the highest.
        for name, priority, level, depth in [("low-1", 2, "2", 1), ("low-2", 0, "2", 2), ("high", 1, "1", 1)]:
            streams.append(asyncio.create_task(wait_then_read(name, priority)))
            await eventually(queued(gen_service, "ranked", level, depth))
        holder.cancel()  # the slot frees: the highest priority first, then the oldest of the rest
        answers = await asyncio.gather(*streams)
    assert order == ["high", "low-1", "low-2"]
    assert all(len(ids(answer)) == 3 for answer in answers)
    assert gauge(gen_service, QUEUE_DEPTH, "ranked", priority="1") == 0
    assert gauge(gen_service, QUEUE_DEPTH, "ranked", priority="2") == 0


async def test_a_generation_whose_wait_runs_out_is_deadline_exceeded_and_never_runs(
    stub, slow_stub, gen_service
) -> None:
    async with slot_held(slow_stub, gen_service, "ranked"):
        first_tokens = gauge(gen_service, FIRST_TOKENS, "ranked")
        expired = gauge(gen_service, QUEUE_REJECTIONS, "ranked", priority="2", reason="deadline") or 0.0
        # The queue's timeout, shortened by the request, ends it; the far gRPC deadline only keeps
        # a broken engine from hanging the test (its details would then differ).
        call = stub.Generate(
            pb.GenerateRequest(model_name="ranked", prompt=PROMPTS[3], max_tokens=3, timeout_us=100_000),
            timeout=60,
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await rest(call)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "waited for a slot" in caught.value.details()
        assert gauge(gen_service, QUEUE_REJECTIONS, "ranked", priority="2", reason="deadline") == expired + 1
        assert gauge(gen_service, FIRST_TOKENS, "ranked") == first_tokens  # its prompt never ran
        assert gauge(gen_service, QUEUE_DEPTH, "ranked", priority="2") == 0


async def test_a_cancelled_waiting_generation_leaves_the_queue(stub, slow_stub, gen_service) -> None:
    async with slot_held(slow_stub, gen_service, "ranked"):
        first_tokens = gauge(gen_service, FIRST_TOKENS, "ranked")
        cancelled = gauge(gen_service, QUEUE_REJECTIONS, "ranked", priority="1", reason="cancelled") or 0.0
        waiting = stub.Generate(pb.GenerateRequest(model_name="ranked", prompt=PROMPTS[2], priority=1))
        await eventually(queued(gen_service, "ranked", "1", 1))
        assert gauge(gen_service, "modelyard_generation_waiting_sequences", "ranked") == 1
        waiting.cancel()
        await eventually(queued(gen_service, "ranked", "1", 0))
        assert gauge(gen_service, "modelyard_generation_waiting_sequences", "ranked") == 0
        assert (
            gauge(gen_service, QUEUE_REJECTIONS, "ranked", priority="1", reason="cancelled") == cancelled + 1
        )
        assert gauge(gen_service, FIRST_TOKENS, "ranked") == first_tokens  # its prompt never ran


async def test_a_priority_the_model_lacks_is_invalid_argument(stub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await generate(stub, model_name="ranked", prompt="x", priority=3)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("priority 3 is not a priority level of model ranked version 1")


# --- bad input ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": "def f(x):\n    return x\n" * 60}, "prompt"),
        ({"prompt": "x", "max_tokens": 257}, "max_tokens"),
        ({"prompt": "x", "temperature": -0.5}, "temperature"),
        ({"prompt": "x", "top_p": 1.5}, "top_p"),
        ({"prompt": "x", "top_p": -0.1}, "top_p"),
        ({"prompt_token_ids": [5, 999999]}, "prompt_token_ids"),
        ({"prompt": "x", "stop": [""]}, "stop"),
        ({"prompt": "x", "frequency_penalty": 2.5}, "frequency_penalty"),
        ({"prompt": "x", "presence_penalty": float("nan")}, "presence_penalty"),
        ({"prompt": "x", "logit_bias": {999999: 1.0}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {5: -100.5}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {i: 1.0 for i in range(301)}}, "logit_bias"),
        ({"prompt": "x", "max_tokens": 256, "strict_context": True}, "max_tokens"),
    ],
)
async def test_bad_input_is_invalid_argument_naming_the_field(
    stub, fields: dict[str, object], named: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await generate(stub, **fields)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith(named + ":"), caught.value.details()


def token_ids(responses: list[pb.GenerateResponse]) -> list[int]:
    return [t for r in responses for t in r.token_ids]


async def test_logit_bias_forces_and_bans_tokens(stub) -> None:
    request = {"prompt": PROMPTS[2], "max_tokens": 8}
    plain = token_ids(await generate(stub, **request))
    # +100 outweighs any logit: greedy picks the forced token at every step.
    assert token_ids(await generate(stub, **request, logit_bias={7: 100.0})) == [7] * 8
    # -100 bans greedy's own first choice: the first token differs, and never is the banned one.
    banned = token_ids(await generate(stub, **request, logit_bias={plain[0]: -100.0}))
    assert banned[0] != plain[0] and plain[0] not in banned


async def test_penalties_keep_greedy_from_repeating(stub) -> None:
    request = {"prompt": "    for i in range(", "max_tokens": 32}
    plain = token_ids(await generate(stub, **request))
    assert len(set(plain)) < len(plain), "the demo model repeats itself when greedy (the premise)"
    penalised = token_ids(await generate(stub, **request, presence_penalty=2.0, frequency_penalty=2.0))
    assert penalised != plain
    # A token it has produced loses 2 per time plus 2: repeats become rarer.
    assert len(penalised) - len(set(penalised)) < len(plain) - len(set(plain))


async def test_strict_context_refuses_with_the_numbers_and_the_default_ends_early(stub) -> None:
    prompt_ids = [5] * 250
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await generate(stub, prompt_token_ids=prompt_ids, max_tokens=10, strict_context=True)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (
        "context is 256 tokens" in caught.value.details()
        and "250 in the prompt and 10" in caught.value.details()
    )
    ended = await generate(stub, prompt_token_ids=prompt_ids, max_tokens=10)
    assert ended[-1].finish_reason == pb.FINISH_REASON_LENGTH and len(token_ids(ended)) == 6


async def test_a_model_that_is_not_a_decoder_is_failed_precondition(stub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await generate(stub, model_name="classifier", prompt="hello")
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "not a decoder" in caught.value.details()


async def test_unknown_model_is_not_found(stub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await generate(stub, model_name="nope", prompt="hello")
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


# --- any model in the Hugging Face layout -----------------------------------------------------------


@pytest.mark.parametrize("model", ["gpt2ish", "gpt2ish-nopos"])
async def test_a_hugging_face_layout_model_is_served_from_its_layout(
    stub, gen_repository, model: str
) -> None:
    prompts = ["the quick brown", "to be or not", "a"]
    want = [reference(gen_repository, model, p) for p in prompts]
    # KV-cache decoding (alone, then batched) gives what full recomputation gives.
    alone = [ids(await generate(stub, model_name=model, prompt=p, max_tokens=12)) for p in prompts]
    together = await asyncio.gather(
        *(generate(stub, model_name=model, prompt=p, max_tokens=12) for p in prompts)
    )
    assert alone == want
    assert [ids(r) for r in together] == want


async def test_the_end_of_text_token_ends_the_stream(stub, gen_repository) -> None:
    responses = await generate(stub, model_name="gpt2ish-eos", prompt=EOS_PROMPT, max_tokens=12)
    tokens = reference(gen_repository, "gpt2ish", EOS_PROMPT)[: EOS_AT_FOUND + 1]
    assert ids(responses) == tokens
    assert responses[-1].finish_reason == pb.FINISH_REASON_EOS
    assert responses[-1].usage.completion_tokens == len(tokens)
    # The end-of-text token is counted and returned as a token id, but it is not text.
    assert text(responses) == hf_decoder.tiny_tokenizer().decode(tokens[:-1])
