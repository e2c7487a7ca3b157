"""A Generate request as the client sent it, and its validation against the model.

Every error is InvalidInput and names the field, so a client can tell which value to fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from modelyard.service.errors import InvalidInput
from modelyard.service.generation.logprobs import MAX_TOP_LOGPROBS
from modelyard.service.generation.model import DecoderModel
from modelyard.service.generation.sampling import SamplingParams
from modelyard.service.generation.sequence import GenerationRequest

MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 256
# Prompt text longer than this many characters per context token cannot fit; refusing it before
# tokenizing keeps a huge prompt from costing the tokenizer's time.
MAX_CHARS_PER_TOKEN = 64
MAX_PENALTY = 2.0  # |frequency_penalty|, |presence_penalty| (OpenAI's range)
MAX_BIAS = 100.0  # |logit_bias| values (OpenAI's range)
MAX_BIASED_TOKENS = 300  # entries of logit_bias (OpenAI's limit)
MAX_MESSAGES = 1024  # messages of one conversation
# The sampling fields a request may leave to the model's generation_config.json.
MODEL_DEFAULT_FIELDS = ("temperature", "top_k", "top_p")


@dataclass(frozen=True)
class GenerateParams:
    """Transport-agnostic request fields; zero values mean "the default", as in the proto."""

    prompt: str = ""
    prompt_token_ids: tuple[int, ...] = ()
    max_tokens: int = 0
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 0.0  # 0 = 1 (no nucleus cut), because 0 is what an unset proto3 float reads as
    seed: int | None = None
    stop: tuple[str, ...] = ()
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    strict_context: bool = False  # refuse prompt + max_tokens over the context (else end early)
    messages: tuple[tuple[str, str], ...] = ()  # (role, content): rendered by the chat template
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: bool = False
    prompt_only: bool = False  # generate nothing: the prompt's scores only
    model_defaults: tuple[str, ...] = ()  # sampling fields taken from generation_config.json


def check_fields(params: GenerateParams, model: DecoderModel) -> None:
    """Everything that can be checked before tokenizing the prompt."""
    if params.messages:
        if params.prompt or params.prompt_token_ids:
            raise InvalidInput("messages: give messages, or prompt / prompt_token_ids, not both")
        if len(params.messages) > MAX_MESSAGES:
            raise InvalidInput(f"messages: at most {MAX_MESSAGES}, got {len(params.messages)}")
        characters = sum(len(role) + len(content) for role, content in params.messages)
        if characters > prompt_chars(model):
            raise InvalidInput(
                f"messages: {characters} characters cannot fit the model's context of "
                f"{model.context_length} tokens"
            )
        for i, (role, _) in enumerate(params.messages):
            if not role:
                raise InvalidInput(f"messages[{i}].role: empty")
    elif not params.prompt and not params.prompt_token_ids:
        raise InvalidInput("prompt: empty; give prompt text, prompt_token_ids or messages")
    if params.prompt and len(params.prompt) > prompt_chars(model):
        raise InvalidInput(
            f"prompt: {len(params.prompt)} characters cannot fit the model's context of "
            f"{model.context_length} tokens"
        )
    if not 0 <= params.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidInput(f"top_logprobs: must be in [0, {MAX_TOP_LOGPROBS}], got {params.top_logprobs}")
    for name in params.model_defaults:
        if name not in MODEL_DEFAULT_FIELDS:
            raise InvalidInput(f"model_defaults: {name!r} is not one of {', '.join(MODEL_DEFAULT_FIELDS)}")
    limit = model.settings.max_tokens
    if params.max_tokens > limit:
        raise InvalidInput(f"max_tokens: {params.max_tokens} exceeds this model's limit of {limit}")
    if not math.isfinite(params.temperature) or params.temperature < 0:
        raise InvalidInput(f"temperature: must be >= 0 (0 = greedy), got {params.temperature}")
    if not math.isfinite(params.top_p) or not 0 <= params.top_p <= 1:
        raise InvalidInput(f"top_p: must be in (0, 1] (0 = unset = 1), got {params.top_p}")
    if params.top_k < 0:
        raise InvalidInput(f"top_k: must be >= 0 (0 = no limit), got {params.top_k}")
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(params, name)
        if not math.isfinite(value) or abs(value) > MAX_PENALTY:
            raise InvalidInput(f"{name}: must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
    if len(params.logit_bias) > MAX_BIASED_TOKENS:
        raise InvalidInput(f"logit_bias: at most {MAX_BIASED_TOKENS} tokens, got {len(params.logit_bias)}")
    for token, bias in params.logit_bias:
        if not 0 <= token < model.vocab:
            raise InvalidInput(f"logit_bias: {token} is not a token id of this model (0..{model.vocab - 1})")
        if not math.isfinite(bias) or abs(bias) > MAX_BIAS:
            raise InvalidInput(f"logit_bias: the bias of token {token} must be in [-100, 100], got {bias}")
    if len(params.stop) > MAX_STOP_SEQUENCES:
        raise InvalidInput(f"stop: at most {MAX_STOP_SEQUENCES} sequences, got {len(params.stop)}")
    for stop in params.stop:
        if not stop or len(stop) > MAX_STOP_CHARS:
            raise InvalidInput(
                f"stop: each sequence must have 1 to {MAX_STOP_CHARS} characters, got {stop!r}"
            )


def prompt_chars(model: DecoderModel) -> int:
    """The most characters a prompt (or a rendered chat) may have for the model's context."""
    return model.context_length * MAX_CHARS_PER_TOKEN


def build_request(
    params: GenerateParams,
    prompt_ids: list[int],
    model: DecoderModel,
    deadline: float | None,
    opening: str = "",
) -> GenerationRequest:
    """The validated request, given the prompt's token ids."""
    field = "prompt_token_ids" if params.prompt_token_ids else "messages" if params.messages else "prompt"
    if not prompt_ids:
        raise InvalidInput(f"{field}: the prompt has no tokens")
    vocab = model.vocab
    bad = [t for t in prompt_ids if not 0 <= t < vocab]
    if bad:
        raise InvalidInput(f"prompt_token_ids: {bad[0]} is not a token id of this model (0..{vocab - 1})")
    if len(prompt_ids) >= model.context_length:
        raise InvalidInput(
            f"{field}: {len(prompt_ids)} tokens leave no room in the model's context of "
            f"{model.context_length} tokens"
        )
    max_tokens = params.max_tokens or model.settings.default_max_tokens
    if (
        params.strict_context
        and not params.prompt_only
        and len(prompt_ids) + max_tokens > model.context_length
    ):
        raise InvalidInput(
            f"max_tokens: the model's context is {model.context_length} tokens, but {len(prompt_ids)} "
            f"in the prompt and {max_tokens} to generate make {len(prompt_ids) + max_tokens}; shorten "
            "the prompt or lower max_tokens"
        )
    temperature, top_k, top_p = _sampling(params, model)
    return GenerationRequest(
        prompt_ids=tuple(prompt_ids),
        max_tokens=max_tokens,
        sampling=SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p or 1.0,
            seed=params.seed,
            frequency_penalty=params.frequency_penalty,
            presence_penalty=params.presence_penalty,
            logit_bias=tuple(sorted(params.logit_bias)),
        ),
        stop=params.stop,
        deadline=deadline,
        logprobs=params.logprobs,
        top_logprobs=params.top_logprobs,
        prompt_logprobs=params.prompt_logprobs,
        prompt_only=params.prompt_only,
        opening=opening,
    )


def _sampling(params: GenerateParams, model: DecoderModel) -> tuple[float, int, float]:
    """temperature, top_k and top_p: the request's, or for the fields it leaves to the model
    (model_defaults) the values generation_config.json states (vLLM's rule: a value it does not
    state keeps the request's); `do_sample: false` stated there is greedy."""
    temperature, top_k, top_p = params.temperature, params.top_k, params.top_p
    defaults = model.defaults
    wanted = set(params.model_defaults)
    if defaults.do_sample is False:
        return (0.0 if "temperature" in wanted else temperature), top_k, top_p
    if "temperature" in wanted and defaults.temperature is not None:
        temperature = defaults.temperature
    if "top_k" in wanted and defaults.top_k is not None:
        top_k = defaults.top_k
    if "top_p" in wanted and defaults.top_p is not None:
        top_p = defaults.top_p
    return temperature, top_k, top_p
