"""What a model version needs to generate, found when the version loads: its decoder layout, its
tokenizer, its context length and its generation settings."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from modelyard.service.errors import ModelLoadError
from modelyard.service.generation.layout import DecoderLayout, NotADecoder, decoder_layout
from modelyard.service.generation.tokenizer import TextCodec, TokenizerError, find_tokenizer
from modelyard.service.repository.config import GenerationConfig, ModelConfig
from modelyard.service.runtime.signature import Signature

log = logging.getLogger(__name__)

# Model metadata keys that state the context length, in the spellings exporters use.
CONTEXT_KEYS = ("context_length", "max_position_embeddings", "n_positions", "n_ctx", "max_seq_len")
DEFAULT_CONTEXT = 2048


@dataclass(frozen=True)
class DecoderModel:
    layout: DecoderLayout
    codec: TextCodec | None  # None: no tokenizer.json, so Generate cannot take or give text
    context_length: int
    settings: GenerationConfig

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
    try:
        path = find_tokenizer(model_file)
        codec = TextCodec.from_file(path, settings.eos_token) if path else None
    except TokenizerError as exc:
        raise ModelLoadError(str(exc)) from None
    if codec is None:
        log.warning("%s is a decoder but has no tokenizer.json: Generate will refuse it", model_file)
    return DecoderModel(layout, codec, _context_length(settings, metadata, model_file), settings)


def _context_length(settings: GenerationConfig, metadata: dict[str, str], model_file: Path) -> int:
    if settings.context_length:
        return settings.context_length
    for key in CONTEXT_KEYS:
        value = metadata.get(key, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    log.warning(
        "%s states no context length (config generation.context_length or model metadata %s); assuming %d",
        model_file,
        "/".join(CONTEXT_KEYS),
        DEFAULT_CONTEXT,
    )
    return DEFAULT_CONTEXT
