"""Samplers: greedy, temperature, top-k, top-p, and seeds."""

from __future__ import annotations

import numpy as np
import pytest

from modelyard.service.generation.sampling import Produced, SamplingParams, choose, choose_rows

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


def test_penalties_count_what_the_sequence_produced() -> None:
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.0)
    produced = Produced(params)
    rng = params.generator()
    logits = np.array([1.0, 0.9, 0.0], np.float32)
    assert choose(logits, params, rng, produced) == 0  # nothing produced yet: plain greedy
    assert choose(logits, params, rng, produced) == 1  # token 0 now at 1.0 - 0.5 < 0.9
    assert choose(logits, params, rng, produced) == 0  # each produced once: 0.5 against 0.4
    assert logits.tolist() == pytest.approx([1.0, 0.9, 0.0])  # the model's row is left as it was


def test_presence_is_once_and_the_bias_is_every_step() -> None:
    params = SamplingParams(presence_penalty=0.2, logit_bias=((2, 5.0),))
    produced = Produced(params)
    row = produced.adjust(np.array([1.0, 0.9, 0.0], np.float32))
    assert row.tolist() == pytest.approx([1.0, 0.9, 5.0])
    produced.add(2)
    produced.add(2)
    assert produced.adjust(np.zeros(3, np.float32)).tolist() == pytest.approx([0.0, 0.0, 4.8])


def test_rows_with_penalties_are_chosen_with_them_and_plain_rows_alone() -> None:
    penalised = SamplingParams(frequency_penalty=2.0)
    plain = SamplingParams()
    produced = [Produced(penalised), Produced(plain)]
    logits = np.array([[1.0, 0.5], [1.0, 0.5]], np.float32)
    rngs = [penalised.generator(), plain.generator()]
    assert choose_rows(logits, [penalised, plain], rngs, produced) == [0, 0]
    assert choose_rows(logits, [penalised, plain], rngs, produced) == [1, 0]
