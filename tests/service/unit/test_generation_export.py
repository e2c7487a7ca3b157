"""What an export states beside its model.onnx (service/generation/export.py), and how the model's
generation defaults meet a request's fields (params.build_request)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from modelyard.service.errors import ModelLoadError
from modelyard.service.generation.export import (
    GenerationDefaults,
    context_from_config,
    generation_defaults,
    position_table_size,
)
from modelyard.service.generation.layout import decoder_layout
from modelyard.service.generation.model import DecoderModel, context_length
from modelyard.service.generation.params import GenerateParams, build_request
from modelyard.service.repository.model_config import GenerationConfig
from modelyard.service.runtime.signature import Signature, TensorSpec
from tests import hf_decoder


def test_config_json_states_the_context_under_each_familys_key() -> None:
    assert context_from_config({"n_positions": 1024, "n_ctx": 2048}) == (1024, "n_positions")
    assert context_from_config({"max_position_embeddings": 32768}) == (32768, "max_position_embeddings")
    assert context_from_config({"n_positions": True, "seq_length": 0}) is None
    assert context_from_config(None) is None


def test_the_position_table_is_found_by_position_ids_or_a_range(tmp_path: Path) -> None:
    tokenizer = hf_decoder.tiny_tokenizer()
    vocab = tokenizer.get_vocab_size()
    fed = hf_decoder.write_decoder(tmp_path, "fed", hf_decoder.gpt2_like(vocab, positions=40), tokenizer)
    assert position_table_size(fed) == 40
    inside = hf_decoder.gpt2_like(vocab, positions=24, position_ids=False)
    assert position_table_size(hf_decoder.write_decoder(tmp_path, "inside", inside, tokenizer)) == 24
    (tmp_path / "broken.onnx").write_bytes(b"not onnx")
    assert position_table_size(tmp_path / "broken.onnx") is None


def test_config_yaml_lowers_the_exports_context_and_never_raises_it(tmp_path: Path) -> None:
    model_file = tmp_path / "m" / "1" / "model.onnx"
    exported = {"n_positions": 64}
    assert context_length(GenerationConfig(), {}, model_file, exported) == (64, "config.json")
    assert context_length(GenerationConfig(context_length=32), {}, model_file, exported) == (
        32,
        "config.yaml",
    )
    assert context_length(GenerationConfig(context_length=99), {}, model_file, exported) == (
        64,
        "config.json",
    )
    assert context_length(GenerationConfig(), {"n_positions": "48"}, model_file, None) == (
        48,
        "model metadata",
    )
    assert context_length(GenerationConfig(context_length=99), {}, model_file, None) == (99, "config.yaml")


def test_generation_config_json_gives_end_tokens_and_sampling(tmp_path: Path) -> None:
    version = tmp_path / "m" / "1"
    version.mkdir(parents=True)
    model_file = version / "model.onnx"
    assert generation_defaults(model_file) is None
    raw = {"eos_token_id": [2, 7, "x"], "pad_token_id": 0, "do_sample": True, "temperature": 0.6, "top_p": 2}
    (version / "generation_config.json").write_text(json.dumps(raw))
    found = generation_defaults(model_file)
    assert found == GenerationDefaults(
        present=True, eos_token_ids=(2, 7), pad_token_id=0, do_sample=True, temperature=0.6, top_p=None
    )
    (version / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert generation_defaults(model_file) == GenerationDefaults(present=True, eos_token_ids=(5,))
    (version / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match="expected a JSON object"):
        generation_defaults(model_file)


def decoder(defaults: GenerationDefaults) -> DecoderModel:
    spec = TensorSpec
    inputs = [spec("input_ids", "INT64", (-1, -1)), spec("attention_mask", "INT64", (-1, -1))]
    inputs += [spec(f"past_key_values.0.{k}", "FP32", (-1, 2, -1, 4)) for k in ("key", "value")]
    outputs = [spec("logits", "FP32", (-1, -1, 50))]
    outputs += [spec(f"present.0.{k}", "FP32", (-1, 2, -1, 4)) for k in ("key", "value")]
    layout = decoder_layout(Signature(tuple(inputs), tuple(outputs), 0))
    return DecoderModel(layout, None, 100, GenerationConfig(), defaults=defaults)


@pytest.mark.parametrize(
    ("defaults", "asked", "want"),
    [
        # No generation_config.json: the request's values, model_defaults or not.
        (GenerationDefaults(), ("temperature", "top_p"), (1.0, 0, 1.0)),
        # Stated values for the fields left to the model; the others stay the request's.
        (
            GenerationDefaults(True, do_sample=True, temperature=0.6, top_p=0.9),
            ("temperature",),
            (0.6, 0, 1.0),
        ),
        (
            GenerationDefaults(True, do_sample=True, temperature=0.6, top_k=5),
            ("temperature", "top_k"),
            (0.6, 5, 1.0),
        ),
        # A value the file does not state keeps the request's (vLLM's rule).
        (GenerationDefaults(True, eos_token_ids=(1,)), ("temperature", "top_p"), (1.0, 0, 1.0)),
        # do_sample: false stated: greedy.
        (GenerationDefaults(True, do_sample=False, temperature=0.6), ("temperature",), (0.0, 0, 1.0)),
        # A field the request sets itself is its own.
        (GenerationDefaults(True, do_sample=True, temperature=0.6), (), (1.0, 0, 1.0)),
    ],
)
def test_model_defaults_take_the_stated_values(
    defaults: GenerationDefaults, asked: tuple[str, ...], want: tuple[float, int, float]
) -> None:
    params = GenerateParams(prompt="x", temperature=1.0, top_p=1.0, model_defaults=asked)
    sampling = build_request(params, [1], decoder(defaults), None).sampling
    assert (sampling.temperature, sampling.top_k, sampling.top_p) == want
