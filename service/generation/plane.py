"""The transport-agnostic Generate path: open a version (the data plane's lease), validate, stream its events.

A stream leases the version it resolved for its whole life, so a stream that started on v1
finishes on v1 even if v2 is swapped in meanwhile (the retiring v1 drains until it does). Each
served version gets its own decode loop (Engine), created on its first Generate.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import weakref
from collections.abc import AsyncGenerator, Awaitable, Callable
from concurrent.futures import Executor

from modelyard.service import tracing
from modelyard.service.dataplane import DataPlane
from modelyard.service.errors import NotGenerative
from modelyard.service.generation.decoder import StepRunner
from modelyard.service.generation.engine import Engine
from modelyard.service.generation.model import DecoderModel
from modelyard.service.generation.params import GenerateParams, build_request, check_fields, prompt_chars
from modelyard.service.generation.sequence import TokenEvent
from modelyard.service.generation.tokenizer import TextCodec
from modelyard.service.metrics import BatchingMetrics, GenerationMetrics, ServiceMetrics
from modelyard.service.runtime.providers import CUDA
from modelyard.service.runtime.served import ServedVersion
from modelyard.service.scheduling.queue import DEFAULT_SCHEDULING, Scheduling

# Generate's span attributes (OpenTelemetry's GenAI names for the token counts).
TTFT_ATTRIBUTE = "modelyard.generation.time_to_first_token_s"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
# Prompts up to this many characters are tokenized on the event loop (a short hold of the loop,
# less than the executor's round trip), longer ones in the executor.
INLINE_PROMPT_CHARS = 256


class GenerationPlane:
    def __init__(self, dataplane: DataPlane, executor: Executor, metrics: ServiceMetrics) -> None:
        self._dataplane = dataplane  # where a stream resolves and leases its version
        self._executor = executor
        self._metrics = metrics
        # Weak keys: an engine lives as long as its version is referenced (served or draining).
        self._engines: weakref.WeakKeyDictionary[ServedVersion, Engine] = weakref.WeakKeyDictionary()
        self._metrics_of: dict[Engine, tuple[GenerationMetrics, BatchingMetrics]] = {}

    async def generate(
        self,
        model: str,
        version: str,
        params: GenerateParams,
        scheduling: Scheduling = DEFAULT_SCHEDULING,
        deadline_passed: Callable[[], bool] | None = None,
        on_stalled: Callable[[BaseException], None] | None = None,
        accepted: Callable[[int], Awaitable[None]] | None = None,
        served: ServedVersion | None = None,
    ) -> AsyncGenerator[TokenEvent]:
        """Stream a generation's events, ending with the one that carries the finish reason.
        `scheduling` gives its priority and queue timeout for a decode slot, and the time left to
        its client's deadline, after which the work is dropped. Closing the generator early
        cancels the sequence; `deadline_passed` tells then whether that was the deadline (the
        transport's own clock is the one that fired) rather than the client. `on_stalled` is
        called if the sequence is dropped because its reader took nothing for too long (the
        reader is then blocked writing, so the transport must end the stream). `accepted` is
        awaited once with the version, as soon as the request passed every check and is queued for
        a slot: the transport sends the stream's headers then, while the prompt runs, rather than
        behind the first token (a failure after it ends the stream as one failing mid-way does).
        `served`: the version, when the caller resolved it already (KServe's stream, which tells a
        decoder from other models by it); the stream leases it as it would the one it resolves."""
        remaining = scheduling.time_remaining_s
        arrived = time.monotonic()
        deadline = None if remaining is None else arrived + remaining
        # The stream's lease (dataplane.Call), held until the stream ends or is closed.
        held = self._dataplane.hold(served) if served is not None else self._dataplane.open(model, version)
        with held:
            served = held.served
            decoder = served.runner.kind
            if not isinstance(decoder, DecoderModel):
                raise NotGenerative(
                    f"model {served.model!r} version {served.version} is not a decoder language model "
                    "(Generate needs input_ids, attention_mask and past_key_values.* inputs with logits and "
                    "present.* outputs); use Infer"
                )
            if decoder.codec is None:
                raise NotGenerative(
                    f"model {served.model!r} version {served.version} has no tokenizer.json beside its "
                    "model.onnx"
                )
            check_fields(params, decoder)
            codec = decoder.codec
            opening = ""
            if params.messages:
                prompt, opening = await self._render(served.model, served.version, decoder, params)
                if not params.stop and decoder.settings.chat_stop:
                    params = dataclasses.replace(params, stop=decoder.settings.chat_stop)
                # As transformers and vLLM: the template writes the special tokens (a BOS) itself.
                prompt_ids = await self._encode(codec, prompt, add_special_tokens=False)
            elif params.prompt_token_ids:
                prompt_ids = list(params.prompt_token_ids)
            else:
                prompt_ids = await self._encode(codec, params.prompt)
            request = build_request(params, prompt_ids, decoder, deadline, opening)
            engine = self._engine(served)
            sequence = engine.submit(request, scheduling)
            sequence.on_stalled = on_stalled
            finished = False
            index = generated = 0
            phases = tracing.steps("prefill")  # trace spans: up to the first token, then the stream
            try:
                if accepted is not None:
                    await accepted(served.version)
                while not finished:
                    event = merge(await sequence.take(), index)
                    finished = event.finish is not None
                    if index == 0:
                        phases.next("stream")
                        phases.note({TTFT_ATTRIBUTE: time.monotonic() - arrived})
                    index += 1
                    generated += len(event.token_ids)
                    yield event
            finally:
                phases.end()
                # The call's span: what it cost (tokens in and out), also for a stream cut short.
                phases.note({INPUT_TOKENS: len(prompt_ids), OUTPUT_TOKENS: generated})
                if not finished:
                    late = deadline is not None and time.monotonic() >= deadline
                    late = late or (deadline_passed is not None and deadline_passed())
                    engine.release(sequence, "deadline" if late else "cancelled")

    async def _encode(self, codec: TextCodec, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) <= INLINE_PROMPT_CHARS:
            # A short prompt's tokenizing costs less than the executor's round trip, which is
            # on the first token's path (two thread hand-offs, and a wait behind decode steps
            # under load).
            return codec.encode(text, add_special_tokens)
        # A long prompt's tokenizing is CPU work: not on the event loop.
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, codec.encode, text, add_special_tokens
        )

    async def _render(
        self, model: str, version: int, decoder: DecoderModel, params: GenerateParams
    ) -> tuple[str, str]:
        """The chat's prompt, rendered by the model's template (in the executor: a template is
        code), and the reply's opening where the model's config asks for one: what the template
        writes for add_generation_prompt (codelm's opens the reply's function)."""
        chat = decoder.chat
        if chat is None:
            raise NotGenerative(
                f"model {model!r} version {version} has no chat template (chat_template in its "
                "tokenizer_config.json, or chat_template.jinja beside its tokenizer.json): send a prompt"
            )
        messages = [{"role": role, "content": content} for role, content in params.messages]
        limit = prompt_chars(decoder)

        def render() -> tuple[str, str]:
            prompt = chat.render(messages, limit)
            if not decoder.settings.chat_reply_opening:
                return prompt, ""
            bare = chat.render(messages, limit, add_generation_prompt=False)
            return prompt, prompt[len(bare) :] if prompt.startswith(bare) else ""

        return await asyncio.get_running_loop().run_in_executor(self._executor, render)

    async def close(self) -> None:
        """End every decode loop (on shutdown, after the server stopped taking calls)."""
        await asyncio.gather(*(engine.close() for engine in list(self._engines.values())))

    def _engine(self, served: ServedVersion) -> Engine:
        engine = self._engines.get(served)
        if engine is None:
            decoder = served.runner.kind
            assert isinstance(decoder, DecoderModel)
            device = "cuda" if served.runner.provider == CUDA else "cpu"
            runner = StepRunner(
                served.runner.session, decoder.layout, device, served.config.execution.device_id
            )
            model, version = served.model, str(served.version)
            metrics = self._metrics.generation(model, version)
            # The wait queue reports as a batcher's does: the same queue metrics, by model and version.
            queue_metrics = self._metrics.batching(model, version, decoder.settings.admission.priority_levels)
            engine = Engine(
                decoder,
                runner,
                served.version,
                self._executor,
                metrics,
                queue_metrics,
                f"model {model} version {version}",
            )
            self._engines[served] = engine
            self._metrics_of[engine] = (metrics, queue_metrics)
            served.on_retire(self._retire)
        return engine

    async def _retire(self, served: ServedVersion) -> None:
        """The version retired (and drained): end its decode loop and its metric series, and let go
        of the engine, whose step runner holds the version's session."""
        engine = self._engines.pop(served, None)
        if engine is None:
            return
        await engine.close()
        for metrics in self._metrics_of.pop(engine):
            metrics.close()


def merge(events: list[TokenEvent], index: int) -> TokenEvent:
    """Tokens that piled up while the reader was busy, as one event: fewer, larger messages for a
    reader that is behind, which is when per-message cost matters most."""
    last = events[-1]
    if len(events) == 1 and last.index == index:
        return last
    # Built directly: dataclasses.replace costs several times more, once per merged message.
    return TokenEvent(
        index,
        "".join(e.text for e in events),
        tuple(t for e in events for t in e.token_ids),
        last.version,
        last.finish,
        last.usage,
        last.time_to_first_token_s,
        tuple(p for e in events for p in e.logprobs),
        events[0].prompt_logprobs,
    )
