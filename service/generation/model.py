"""What a model version needs to generate, found when the version loads: its decoder layout, its
tokenizer, its context length, its end tokens and its generation settings.

The context length is the export's own, read in this order (the first that states one wins):
config.json beside model.onnx (`max_position_embeddings`, `n_positions`, ...: what optimum and
transformers write), the ONNX model metadata (`context_length`, `n_positions`, ...), the size
of the graph's position table (a Gather from a fixed [N, d] initializer fed by position ids:
GPT-2 style exports, which fail past it), else config.yaml's generation.context_length, else
DEFAULT_CONTEXT with a warning. config.yaml may lower the export's context, never raise it: past
it are positions the model never saw (or a position table that ends)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from modelyard.service.errors import ModelLoadError
from modelyard.service.generation.chat import ChatTemplate, load_chat_template
from modelyard.service.generation.export import (
    CONFIG_JSON,
    GenerationDefaults,
    context_from_config,
    generation_defaults,
    position_table_size,
    read_json,
)
from modelyard.service.generation.export import CONTEXT_KEYS as EXPORT_CONTEXT_KEYS
from modelyard.service.generation.layout import DecoderLayout, NotADecoder, decoder_layout
from modelyard.service.generation.tokenizer import TextCodec, TokenizerError, find_tokenizer
from modelyard.service.repository.model_config import GenerationConfig, ModelConfig
from modelyard.service.runtime.signature import Signature

log = logging.getLogger(__name__)

# Model metadata keys that state the context length, in the spellings exporters use.
CONTEXT_KEYS = ("context_length", "max_position_embeddings", "n_positions", "n_ctx", "max_seq_len")
DEFAULT_CONTEXT = 2048
# Where a context length came from (DecoderModel.context_source).
FROM_CONFIG_JSON, FROM_METADATA, FROM_TABLE, FROM_CONFIG_YAML, FROM_DEFAULT = (
    "config.json",
    "model metadata",
    "position table",
    "config.yaml",
    "default",
)


@dataclass(frozen=True)
class DecoderModel:
    layout: DecoderLayout
    codec: TextCodec | None  # None: no tokenizer.json, so Generate cannot take or give text
    context_length: int
    settings: GenerationConfig
    context_source: str = FROM_DEFAULT  # where context_length was read (FROM_*)
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)  # generation_config.json
    chat: ChatTemplate | None = None  # the model's chat template (GenerateRequest.messages)

    def warmup_feeds(self) -> dict[str, np.ndarray]:
        """The runtime's warm-up input (service.runtime.session.GraphKind)."""
        return self.layout.sample_feeds()

    @property
    def vocab(self) -> int:
        """Tokens that can be sampled: the logits' width, capped by the tokenizer's vocabulary
        (exports often pad the embedding matrix to a multiple of 64)."""
        sizes = [n for n in (self.layout.vocab, self.codec.vocab_size if self.codec else -1) if n > 0]
        return min(sizes) if sizes else -1


def recognize_decoder(
    signature: Signature, metadata: Mapping[str, str], config: ModelConfig, model_file: Path
) -> DecoderModel | None:
    """The generation layer's recognizer for the runtime's loader (service.runtime.session). A
    decoder serves from one session: its decode loop holds every sequence's cache on that session's
    device, so a config asking for more instances is refused rather than half obeyed."""
    decoder = load_decoder(signature, dict(metadata), config.generation, model_file)
    if decoder is not None and config.execution.sessions > 1:
        execution = config.execution
        raise ModelLoadError(
            f"{model_file}: a decoder language model serves Generate from one session, but execution "
            f"asks for {execution.sessions} (instances: {execution.instances} on devices "
            f"{list(execution.devices)}); set instances: 1 and one device",
            "config",
        )
    return decoder


def load_decoder(
    signature: Signature, metadata: dict[str, str], settings: GenerationConfig, model_file: Path
) -> DecoderModel | None:
    """The version's decoder description, or None when the graph is not a decoder (it then serves
    Infer only). A decoder with a broken tokenizer.json fails the load, like a broken model file."""
    try:
        layout = decoder_layout(signature)
    except NotADecoder as exc:
        log.debug("%s is not a decoder: %s", model_file, exc)
        return None
    export_config = read_json(model_file, CONFIG_JSON)
    defaults = generation_defaults(model_file) or GenerationDefaults()
    # The end tokens: generation_config.json's, else config.json's (as transformers falls back).
    eos_ids = defaults.eos_token_ids or _ids(export_config.get("eos_token_id") if export_config else None)
    chat = None
    try:
        path = find_tokenizer(model_file)
        codec = TextCodec.from_file(path, settings.eos_token, eos_ids=eos_ids) if path else None
        if path is not None:
            chat = load_chat_template(path, model_file.parent.parent.parent)
    except TokenizerError as exc:
        raise ModelLoadError(str(exc)) from None
    if codec is None:
        log.warning("%s is a decoder but has no tokenizer.json: Generate will refuse it", model_file)
    context, source = context_length(settings, metadata, model_file, export_config)
    log.info("%s: context of %d tokens (from its %s)", model_file, context, source)
    return DecoderModel(layout, codec, context, settings, source, defaults, chat)


def context_length(
    settings: GenerationConfig,
    metadata: dict[str, str],
    model_file: Path,
    export_config: dict[str, Any] | None = None,
) -> tuple[int, str]:
    """The context and where it came from (the module's docstring gives the order)."""
    found = _exported_context(metadata, model_file, export_config)
    configured = settings.context_length
    if found is None:
        if configured:
            return configured, FROM_CONFIG_YAML
        log.warning(
            "%s states no context length (config.json %s, model metadata %s, a position table, or "
            "config.yaml generation.context_length); assuming %d",
            model_file,
            "/".join(EXPORT_CONTEXT_KEYS[:2]),
            "/".join(CONTEXT_KEYS),
            DEFAULT_CONTEXT,
        )
        return DEFAULT_CONTEXT, FROM_DEFAULT
    context, source = found
    if configured and configured < context:
        return configured, FROM_CONFIG_YAML
    if configured > context:
        log.warning(
            "%s: config.yaml's generation.context_length %d is beyond the export's %d (its %s): serving %d",
            model_file,
            configured,
            context,
            source,
            context,
        )
    return context, source


def _exported_context(
    metadata: dict[str, str], model_file: Path, export_config: dict[str, Any] | None
) -> tuple[int, str] | None:
    stated = context_from_config(export_config)
    if stated is not None:
        return stated[0], FROM_CONFIG_JSON
    for key in CONTEXT_KEYS:
        value = metadata.get(key, "")
        if value.isascii() and value.isdigit() and int(value) > 0:
            return int(value), FROM_METADATA
    table = position_table_size(model_file)
    return (table, FROM_TABLE) if table else None


def _ids(value: Any) -> tuple[int, ...]:
    values = [value] if isinstance(value, int) else value if isinstance(value, list) else []
    return tuple(v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0)
