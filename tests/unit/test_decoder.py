"""The KV-cache batch on its own (no server): padding, joins, leaves, pauses and IO binding give
what each sequence computes alone."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from modelyard.service.generation.decoder import DecodeBatch, StepRunner, prefill
from modelyard.service.generation.layout import DecoderLayout, decoder_layout
from modelyard.service.runtime.signature import Signature, TensorSpec
from tests import hf_decoder

VOCAB = 300


@pytest.fixture(scope="module")
def session() -> ort.InferenceSession:
    model = hf_decoder.gpt2_like(VOCAB, layers=2, heads=2, head_size=8, seed=3)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def layout(session: ort.InferenceSession) -> DecoderLayout:
    def specs(args: list[ort.NodeArg]) -> tuple[TensorSpec, ...]:
        names = {"tensor(float)": "FP32", "tensor(int64)": "INT64"}
        return tuple(
            TensorSpec(a.name, names[a.type], tuple(d if isinstance(d, int) else -1 for d in a.shape))
            for a in args
        )

    return decoder_layout(Signature(specs(session.get_inputs()), specs(session.get_outputs()), 0))


def alone(runner: StepRunner, layout: DecoderLayout, prompt: list[int], n: int) -> list[int]:
    cache, logits = prefill(runner, layout, prompt)
    tokens = [int(np.argmax(logits[:VOCAB]))]
    batch: DecodeBatch[str] = DecodeBatch(runner, layout)
    batch.add([("x", cache, tokens[0])])
    while len(tokens) < n:
        tokens.append(int(np.argmax(batch.step()[0, :VOCAB])))
        batch.set_next(tokens[-1:])
    return tokens


PROMPTS = {"a": [5, 6, 7, 8, 9, 10, 11], "b": [42], "c": [100, 3, 17]}


@pytest.mark.parametrize("device", ["", "cpu"])  # "cpu": the IO-binding path, as on CUDA
def test_rows_of_different_lengths_compute_what_they_compute_alone(session, layout, device: str) -> None:
    runner = StepRunner(session, layout, device)
    want = {name: alone(StepRunner(session, layout), layout, p, 10) for name, p in PROMPTS.items()}
    batch: DecodeBatch[str] = DecodeBatch(runner, layout)
    got: dict[str, list[int]] = {}
    for name, prompt in PROMPTS.items():
        cache, logits = prefill(runner, layout, prompt)
        got[name] = [int(np.argmax(logits[:VOCAB]))]
        batch.add([(name, cache, got[name][0])])
        # One step between joins, so that the rows have different lengths and positions.
        step = np.argmax(batch.step()[:, :VOCAB], axis=-1)
        for member, token in zip(batch.members, step, strict=True):
            got[member].append(int(token))
        batch.set_next([got[m][-1] for m in batch.members])
    while min(len(t) for t in got.values()) < 10:
        step = np.argmax(batch.step()[:, :VOCAB], axis=-1)
        for member, token in zip(batch.members, step, strict=True):
            got[member].append(int(token))
        batch.set_next([got[m][-1] for m in batch.members])
    assert {name: tokens[:10] for name, tokens in got.items()} == want


def test_a_paused_row_resumes_where_it_left_off_and_leaving_rows_shrink_the_cache(session, layout) -> None:
    runner = StepRunner(session, layout)
    want = alone(runner, layout, PROMPTS["a"], 8)
    batch: DecodeBatch[str] = DecodeBatch(runner, layout)
    cache_a, logits_a = prefill(runner, layout, PROMPTS["a"])
    cache_b, logits_b = prefill(runner, layout, PROMPTS["b"])
    tokens = [int(np.argmax(logits_a[:VOCAB]))]
    batch.add([("a", cache_a, tokens[0]), ("b", cache_b, int(np.argmax(logits_b[:VOCAB])))])
    assert batch.width == len(PROMPTS["a"])
    for _ in range(3):
        step = batch.step()
        tokens.append(int(np.argmax(step[0, :VOCAB])))
        batch.set_next([tokens[-1], int(np.argmax(step[1, :VOCAB]))])
    kept = batch.remove(["a"], keep=["a"])
    assert batch.members == ["b"] and batch.width == len(PROMPTS["b"]) + 3  # a's padding is gone
    cache, next_token = kept[id("a")]
    assert cache.length == len(PROMPTS["a"]) + 3 and next_token == tokens[-1]
    batch.remove(["b"])
    assert len(batch) == 0 and batch.width == 0
    batch.add([("a", cache, next_token)])
    while len(tokens) < 8:
        tokens.append(int(np.argmax(batch.step()[0, :VOCAB])))
        batch.set_next(tokens[-1:])
    assert tokens == want
