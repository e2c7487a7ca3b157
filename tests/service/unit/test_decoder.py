"""The KV-cache batch on its own (no server): padding, joins, leaves, pauses and IO binding give
what each sequence computes alone."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from tokenizers import Tokenizer

from models import demo_models
from modelyard.service.generation.cache_ops import DeviceCacheOps, HostCacheOps, to_host
from modelyard.service.generation.decoder import Cache, DecodeBatch, StepRunner, prefill
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
    return layout_of(session)


def layout_of(session: ort.InferenceSession) -> DecoderLayout:
    def specs(args: list[ort.NodeArg]) -> tuple[TensorSpec, ...]:
        names = {"tensor(float)": "FP32", "tensor(int64)": "INT64"}
        return tuple(
            TensorSpec(a.name, names[a.type], tuple(d if isinstance(d, int) else -1 for d in a.shape))
            for a in args
        )

    return decoder_layout(Signature(specs(session.get_inputs()), specs(session.get_outputs()), 0))


def alone(runner: StepRunner, layout: DecoderLayout, prompt: list[int], n: int) -> list[int]:
    vocab = layout.vocab if layout.vocab > 0 else VOCAB
    cache, logits = prefill(runner, layout, prompt)
    tokens = [int(np.argmax(logits[:vocab]))]
    batch: DecodeBatch[str] = DecodeBatch(runner, layout)
    batch.add([("x", cache, tokens[0])])
    while len(tokens) < n:
        tokens.append(int(np.argmax(batch.step()[0, :vocab])))
        batch.set_next(tokens[-1:])
    return tokens


PROMPTS = {"a": [5, 6, 7, 8, 9, 10, 11], "b": [42], "c": [100, 3, 17]}


@pytest.mark.parametrize("bind", [False, True])  # True: OrtValues and IO binding, as on CUDA
def test_rows_of_different_lengths_compute_what_they_compute_alone(session, layout, bind: bool) -> None:
    runner = StepRunner(session, layout, bind=bind)
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


@pytest.mark.parametrize("bind", [False, True])
def test_a_paused_row_resumes_where_it_left_off_and_leaving_rows_shrink_the_cache(
    session, layout, bind: bool
) -> None:
    runner = StepRunner(session, layout, bind=bind)
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


# --- the demo language model: the OrtValue path against the numpy path -------------------------

CODELM = demo_models.COMMITTED_ROOT / "codelm" / "1"
CODE_PROMPTS = {"a": "def __init__(self", "b": "import os\n", "c": "    for i in range("}


@pytest.fixture(scope="module")
def codelm() -> tuple[ort.InferenceSession, DecoderLayout, dict[str, list[int]]]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(CODELM / "model.onnx"), options, providers=["CPUExecutionProvider"])
    tokenizer = Tokenizer.from_file(str(CODELM / "tokenizer.json"))
    prompts = {name: list(tokenizer.encode(text).ids) for name, text in CODE_PROMPTS.items()}
    return session, layout_of(session), prompts


def on_device(tensors: list[Any], device: str) -> bool:
    """Every tensor is where the runner keeps the cache: OrtValues on `device`, or numpy ("")."""
    if not device:
        return all(isinstance(t, np.ndarray) for t in tensors)
    return all(isinstance(t, ort.OrtValue) and t.device_name() == device for t in tensors)


def scripted(
    runner: StepRunner, layout: DecoderLayout, prompts: dict[str, list[int]], n: int, device: str = ""
) -> dict[str, list[int]]:
    """a decodes alone, b and c join it mid-decode, a pauses and rejoins, b leaves early, c
    stays: each row's greedy tokens, checking at every change that the cache never left `device`
    (OrtValues there; "": numpy on the host)."""
    vocab = layout.vocab
    tokens: dict[str, list[int]] = {}
    batch: DecodeBatch[str] = DecodeBatch(runner, layout)

    def join(name: str, cache: Cache | None = None, token: int = 0) -> None:
        if cache is None:
            cache, logits = prefill(runner, layout, prompts[name])
            assert on_device(cache.past, device)
            token = int(np.argmax(logits[:vocab]))
            tokens[name] = [token]
        batch.add([(name, cache, token)])
        assert on_device(batch.past, device)

    def steps(count: int) -> None:
        for _ in range(count):
            step = np.argmax(batch.step()[:, :vocab], axis=-1)
            for member, token in zip(batch.members, step, strict=True):
                tokens[member].append(int(token))
            batch.set_next([tokens[m][-1] for m in batch.members])
            assert on_device(batch.past, device)

    join("a")
    steps(3)
    join("b")
    join("c")
    steps(2)
    kept = batch.remove(["a"], keep=["a"])
    cache, next_token = kept[id("a")]
    assert on_device(cache.past, device) and on_device(batch.past, device)
    steps(2)
    batch.remove(["b"])
    join("a", cache, next_token)
    while min(len(tokens[m]) for m in batch.members) < n:
        steps(1)
    return {name: got[:n] if name != "b" else got for name, got in tokens.items()}


def test_the_ortvalue_path_gives_the_numpy_paths_tokens_through_joins_pauses_and_leaves(codelm) -> None:
    session, layout, prompts = codelm
    numpy_path = scripted(StepRunner(session, layout), layout, prompts, 16)
    ortvalue_path = scripted(StepRunner(session, layout, "cpu", 0, bind=True), layout, prompts, 16, "cpu")
    assert ortvalue_path == numpy_path
    # And each row is what it would be alone (b as far as it got before it left).
    for name, got in numpy_path.items():
        assert got == alone(StepRunner(session, layout), layout, prompts[name], len(got))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_the_device_graphs_join_and_select_as_numpy_does(session, dtype: type) -> None:
    """DeviceCacheOps (ONNX graphs, OrtValues) against HostCacheOps (numpy), on parts of different
    widths and rows: the same tensors, padded on the left with zeros."""
    layout = dataclasses.replace(layout_of(session), kv_dtype=np.dtype(dtype))
    rng = np.random.default_rng(0)
    host, device = HostCacheOps(layout), DeviceCacheOps(layout, session, "cpu", 0)
    shapes = [(2, 5), (1, 3), (1, 7)]  # (rows, width) of each part
    parts: list[list[np.ndarray]] = [
        [
            rng.standard_normal((rows, layout.heads, width, layout.head_size)).astype(dtype)
            for _ in layout.past_names
        ]
        for rows, width in shapes
    ]
    width = max(w for _, w in shapes)
    want = host.join([(p, w) for p, (_, w) in zip(parts, shapes, strict=True)], width)
    as_values = [[ort.OrtValue.ortvalue_from_numpy(a) for a in p] for p in parts]
    got = device.join([(p, w) for p, (_, w) in zip(as_values, shapes, strict=True)], width)
    assert [to_host(t).dtype for t in got] == [np.dtype(dtype)] * len(want)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(to_host(a), b)
    assert not np.any(want[0][2, :, : width - 3])  # the narrow part's padding is zeros
    for rows, start in (([0, 3], 2), ([2], 4), ([1, 2, 3], 0)):
        for a, b in zip(device.select(got, rows, start), host.select(want, rows, start), strict=True):
            np.testing.assert_array_equal(to_host(a), b)


def test_a_prompts_empty_past_comes_from_host_memory_on_any_device(
    session: ort.InferenceSession, layout: DecoderLayout
) -> None:
    """The zero-width past of a prefill holds no bytes: DeviceCacheOps keeps it in host memory for
    every device (a CUDA decoder's bound run takes it as any host input), so making the ops for
    "cuda" allocates nothing on a device (here, without one, that would raise)."""
    ops = DeviceCacheOps(layout, session, "cuda", 0)
    for rows in (1, 3):
        empty = ops.empty(rows)
        assert len(empty) == len(layout.past_names)
        for tensor in empty:
            assert tensor.device_name() == "cpu"
            assert tensor.shape() == [rows, layout.heads, 0, layout.head_size]
