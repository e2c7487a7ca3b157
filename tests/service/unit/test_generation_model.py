"""Generation settings in config.yaml, and the decoder layout read off a graph's signature."""

from __future__ import annotations

import pytest

from modelyard.service.generation.layout import NotADecoder, decoder_layout
from modelyard.service.repository.model_config import (
    DEFAULT_GENERATION_QUEUE_TIMEOUT_US,
    DEFAULT_MAX_WAITING,
    ConfigError,
    GenerationConfig,
    parse_config,
)
from modelyard.service.runtime.signature import Signature, TensorSpec
from modelyard.service.scheduling.queue import AdmissionPolicy, QueuePolicy


def test_generation_section_parses_with_defaults_for_the_rest() -> None:
    config = parse_config({"generation": {"max_concurrent_sequences": 4, "eos_token": "</s>"}})
    assert config.generation.max_concurrent_sequences == 4
    assert config.generation.eos_token == "</s>"
    assert config.generation.admission == GenerationConfig().admission
    assert parse_config({}).generation == GenerationConfig()


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        ({"max_concurrent": 4}, "unknown key(s) max_concurrent"),
        ({"max_concurrent_sequences": 0}, "generation.max_concurrent_sequences"),
        ({"max_waiting": -1}, "generation.max_waiting"),
        # 0 would be an unbounded queue (max_queue_size 0), not "no waiting" as it once meant.
        ({"max_waiting": 0}, "generation.max_waiting: expected an integer >= 1"),
        ({"priority_levels": 0}, "generation.priority_levels"),
        ({"priority_levels": 2, "default_priority_level": 3}, "generation.default_priority_level"),
        ({"priority_queue_policy": {2: {}}}, "generation.priority_queue_policy: key 2"),
        ({"default_queue_policy": {"max_queue_size": -1}}, "generation.default_queue_policy.max_queue_size"),
        ({"continuous_batching": "yes"}, "generation.continuous_batching"),
        ({"eos_token": 2}, "generation.eos_token"),
        ({"max_tokens": 8, "default_max_tokens": 16}, "exceeds generation.max_tokens"),
        ([], "generation: expected a mapping"),
    ],
)
def test_bad_generation_settings_are_errors(raw: object, words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        parse_config({"generation": raw})


def test_generation_admission_keys_parse_like_dynamic_batching() -> None:
    raw = {
        "priority_levels": 2,
        "default_queue_policy": {"default_timeout_us": 5000, "allow_timeout_override": True},
        "priority_queue_policy": {1: {"max_queue_size": 4}},
    }
    generation = parse_config({"generation": {**raw, "max_waiting": 8}}).generation.admission
    batching = parse_config({"max_batch_size": 4, "dynamic_batching": raw}).dynamic_batching
    assert batching is not None
    # The same rules, except that max_waiting sizes the generation queues that set no size.
    assert generation.default_priority_level == batching.admission.default_priority_level == 2
    assert generation.policy(2) == QueuePolicy(8, 5000, True)
    assert generation.policy(1) == batching.admission.policy(1) == QueuePolicy(4, 5000, True)
    assert batching.admission.policy(2) == QueuePolicy(0, 5000, True)


def test_max_waiting_is_the_default_queue_size_unless_the_policy_sets_one() -> None:
    def default(**generation: object) -> QueuePolicy:
        return parse_config({"generation": generation}).generation.admission.default_queue_policy

    wait = DEFAULT_GENERATION_QUEUE_TIMEOUT_US  # queued streams wait a bounded time by default
    assert default() == QueuePolicy(max_queue_size=DEFAULT_MAX_WAITING, default_timeout_us=wait)
    assert default(max_waiting=3) == QueuePolicy(max_queue_size=3, default_timeout_us=wait)
    assert default(max_waiting=3, default_queue_policy={"max_queue_size": 0}).max_queue_size == 0
    assert GenerationConfig().admission == AdmissionPolicy(
        1, 1, QueuePolicy(max_queue_size=DEFAULT_MAX_WAITING, default_timeout_us=wait)
    )


def spec(name: str, datatype: str, *shape: int) -> TensorSpec:
    return TensorSpec(name, datatype, shape)


def signature(layers: int = 3, heads: int = 4, head_size: int = 16, position_ids: bool = True) -> Signature:
    inputs = [spec("input_ids", "INT64", -1, -1), spec("attention_mask", "INT64", -1, -1)]
    if position_ids:
        inputs.append(spec("position_ids", "INT64", -1, -1))
    outputs = [spec("logits", "FP32", -1, -1, 1000)]
    for i in range(layers):
        for kind in ("key", "value"):
            inputs.append(spec(f"past_key_values.{i}.{kind}", "FP32", -1, heads, -1, head_size))
            outputs.append(spec(f"present.{i}.{kind}", "FP32", -1, heads, -1, head_size))
    return Signature(tuple(inputs), tuple(outputs), 0)


def test_layers_heads_and_head_size_come_from_the_past_inputs() -> None:
    layout = decoder_layout(signature(layers=3, heads=4, head_size=16, position_ids=False))
    assert (layout.layers, layout.heads, layout.head_size, layout.vocab) == (3, 4, 16, 1000)
    assert not layout.has_position_ids
    assert layout.past_names[:2] == ("past_key_values.0.key", "past_key_values.0.value")
    # The warm-up input is consistent: the mask covers past (1) + new (1) positions.
    feeds = layout.sample_feeds()
    assert feeds["attention_mask"].shape == (1, 2) and feeds["past_key_values.2.value"].shape == (1, 4, 1, 16)
    assert "position_ids" not in feeds


def test_graphs_that_are_not_decoders_say_why() -> None:
    plain = Signature((spec("INPUT0", "FP32", -1, 4),), (spec("OUTPUT0", "FP32", -1, 2),), 0)
    with pytest.raises(NotADecoder, match="input_ids"):
        decoder_layout(plain)
    full = signature()
    no_cache = Signature(full.inputs[:3], full.outputs[:1], 0)
    with pytest.raises(NotADecoder, match="no KV cache"):
        decoder_layout(no_cache)
    missing_present = Signature(full.inputs, full.outputs[:-1], 0)
    with pytest.raises(NotADecoder, match=r"present\.2\.value"):
        decoder_layout(missing_present)
    dynamic_heads = Signature(
        tuple(spec(t.name, t.datatype, -1, -1, -1, 16) if "past" in t.name else t for t in full.inputs),
        full.outputs,
        0,
    )
    with pytest.raises(NotADecoder, match="fixed heads"):
        decoder_layout(dynamic_heads)
