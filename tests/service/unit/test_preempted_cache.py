"""A preempted sequence's cache (service/generation/engine.py's preemption): taken out of its batch,
moved to host memory (CacheOps.offload) while others use its slot, and put back where the batch's
cache lives (CacheOps.place) when it rejoins, on both cache paths (numpy; OrtValues with IO
binding, the CUDA path, run here on the CPU): it then computes exactly what it computes alone."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from modelyard.service.generation.cache_ops import HostCacheOps
from modelyard.service.generation.decoder import Cache, DecodeBatch, StepRunner, prefill
from tests import hf_decoder
from tests.service.unit.test_decoder import PROMPTS, VOCAB, alone, layout_of


@pytest.fixture(scope="module")
def session() -> ort.InferenceSession:
    model = hf_decoder.gpt2_like(VOCAB, layers=2, heads=2, head_size=8, seed=5)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def step(batch: DecodeBatch[str], got: dict[str, list[int]]) -> None:
    tokens = np.argmax(batch.step()[:, :VOCAB], axis=-1)
    for member, token in zip(batch.members, tokens, strict=True):
        got[member].append(int(token))
    batch.set_next([got[m][-1] for m in batch.members])


@pytest.mark.parametrize("bind", [False, True])  # True: OrtValues and IO binding, as on CUDA
def test_an_offloaded_cache_rejoins_and_the_row_computes_what_it_computes_alone(session, bind: bool) -> None:
    layout = layout_of(session)
    runner = StepRunner(session, layout, "cpu", 0, bind=bind)
    want = {name: alone(StepRunner(session, layout), layout, PROMPTS[name], 12) for name in ("a", "b")}
    batch: DecodeBatch[str] = DecodeBatch(runner, layout)
    got: dict[str, list[int]] = {}
    for name in ("a", "b"):
        cache, logits = prefill(runner, layout, PROMPTS[name])
        got[name] = [int(np.argmax(logits[:VOCAB]))]
        batch.add([(name, cache, got[name][0])])
    for _ in range(3):
        step(batch, got)
    # "a" pauses and is preempted: its cache leaves the batch and goes to host memory.
    cache, next_token = batch.remove(["a"], keep=["a"])[id("a")]
    offloaded = Cache(runner.ops.offload(cache.past), cache.length)
    assert all(isinstance(t, np.ndarray) for t in offloaded.past)
    del cache
    # "b" goes on alone meanwhile; the batch's cache is rebuilt without "a".
    for _ in range(4):
        step(batch, got)
    batch.add([("a", offloaded, next_token)])
    if bind:  # back on the runner's device (here the CPU's OrtValues), as the batch's cache is
        assert all(isinstance(t, ort.OrtValue) for t in batch.past)
    while min(len(t) for t in got.values()) < 12:
        step(batch, got)
    assert {name: tokens[:12] for name, tokens in got.items()} == want


def test_a_host_cache_is_neither_copied_nor_moved() -> None:
    """On the CPU path a paused row's cache is already its own numpy copy: offload and place
    hand the same arrays back (preemption costs no copy there)."""
    session = ort.InferenceSession(
        hf_decoder.gpt2_like(VOCAB, layers=1, heads=1, head_size=4, seed=1).SerializeToString(),
        providers=["CPUExecutionProvider"],
    )
    ops = HostCacheOps(layout_of(session))
    past = [np.zeros((1, 1, 3, 4), np.float32), np.ones((1, 1, 3, 4), np.float32)]
    assert all(a is b for a, b in zip(ops.offload(past), past, strict=True))
    assert all(a is b for a, b in zip(ops.place(past), past, strict=True))
