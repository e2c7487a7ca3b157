"""Samplers: greedy, temperature, top-k, top-p, and seeds."""

from __future__ import annotations

import numpy as np
import pytest

from modelyard.service.generation.sampling import SamplingParams, choose, choose_rows

LOGITS = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))


def draws(params: SamplingParams, n: int = 4000) -> np.ndarray:
    rng = params.generator()
    return np.array([choose(LOGITS, params, rng) for _ in range(n)])


def test_greedy_takes_the_most_likely_token() -> None:
    assert choose(LOGITS, SamplingParams(), np.random.default_rng(0)) == 0
    assert choose_rows(np.stack([LOGITS, LOGITS[::-1]]), [SamplingParams()] * 2, [None, None]) == [0, 3]


def test_temperature_one_follows_the_distribution() -> None:
    counts = np.bincount(draws(SamplingParams(temperature=1.0, seed=1)), minlength=4) / 4000
    np.testing.assert_allclose(counts, [0.5, 0.3, 0.15, 0.05], atol=0.03)


def test_low_temperature_sharpens() -> None:
    counts = np.bincount(draws(SamplingParams(temperature=0.1, seed=2)), minlength=4) / 4000
    assert counts[0] > 0.99


def test_top_k_keeps_only_the_k_most_likely() -> None:
    assert set(draws(SamplingParams(temperature=1.0, top_k=2, seed=3))) == {0, 1}


@pytest.mark.parametrize(
    ("top_p", "kept"), [(0.5, {0}), (0.6, {0, 1}), (0.81, {0, 1, 2}), (1.0, {0, 1, 2, 3})]
)
def test_top_p_keeps_the_smallest_set_reaching_p(top_p: float, kept: set[int]) -> None:
    assert set(draws(SamplingParams(temperature=1.0, top_p=top_p, seed=4))) == kept


def test_the_same_seed_draws_the_same_tokens() -> None:
    params = SamplingParams(temperature=1.0, seed=42)
    assert list(draws(params, 50)) == list(draws(params, 50))
    assert list(draws(params, 50)) != list(draws(SamplingParams(temperature=1.0, seed=43), 50))
