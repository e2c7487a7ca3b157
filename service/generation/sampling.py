"""Choosing the next token from a row of logits: greedy, or sampled with temperature, top-k, top-p,
after the request's logit bias and its frequency and presence penalties (OpenAI's: on the tokens
this generation has produced so far).

Each sequence owns its random generator, seeded from the request, so a seeded request draws the
same numbers whatever else shares its decode steps; and its own `Produced` counts, updated by the
one thread that chooses its tokens at a time (the executor: prefill, then its decode batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = no limit
    top_p: float = 1.0  # 1 = no limit
    seed: int | None = None  # None = fresh entropy
    frequency_penalty: float = 0.0  # per time a token was produced
    presence_penalty: float = 0.0  # once a token was produced
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids sorted

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def plain(self) -> bool:
        """Nothing changes the logits before the choice."""
        return not (self.frequency_penalty or self.presence_penalty or self.logit_bias)

    def generator(self) -> np.random.Generator:
        return np.random.default_rng(self.seed)


class Produced:
    """The tokens one generation has produced so far, for its penalties (counts by token id)."""

    def __init__(self, params: SamplingParams) -> None:
        self._params = params
        self._penalised = bool(params.frequency_penalty or params.presence_penalty)
        self._counts: dict[int, int] = {}
        if params.logit_bias:
            ids, biases = zip(*params.logit_bias, strict=True)
            self._bias_ids = np.asarray(ids, np.int64)
            self._biases = np.asarray(biases, np.float32)

    def adjust(self, logits: np.ndarray) -> np.ndarray:
        """A copy of the row with the bias and the penalties applied (the row itself is the
        model's output buffer: left as it is)."""
        params = self._params
        if params.plain:
            return logits
        row = logits.astype(np.float32, copy=True)
        if params.logit_bias:
            row[self._bias_ids] += self._biases
        if self._counts:
            ids = np.fromiter(self._counts, np.int64, len(self._counts))
            counts = np.fromiter(self._counts.values(), np.float32, len(self._counts))
            row[ids] -= counts * np.float32(params.frequency_penalty) + np.float32(params.presence_penalty)
        return row

    def add(self, token: int) -> None:
        if self._penalised:
            self._counts[token] = self._counts.get(token, 0) + 1


def choose(
    logits: np.ndarray, params: SamplingParams, rng: np.random.Generator, produced: Produced | None = None
) -> int:
    """The next token for one row of logits ([vocab]); `produced` is told of it."""
    if produced is not None:
        token = _choose(produced.adjust(logits), params, rng)
        produced.add(token)
        return token
    return _choose(logits, params, rng)


def _choose(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    if params.greedy:
        return int(np.argmax(logits))
    # float64: the cumulative sums below must not lose the tail of a long vocabulary.
    scaled = logits.astype(np.float64) / params.temperature
    if 0 < params.top_k < scaled.size:
        kth = np.partition(scaled, -params.top_k)[-params.top_k]
        scaled[scaled < kth] = -np.inf
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        sorted_probs = probs[order]
        # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it
        # is still short of top_p (so the most likely token always stays).
        keep = np.cumsum(sorted_probs) - sorted_probs < params.top_p
        probs = np.zeros_like(probs)
        probs[order[keep]] = sorted_probs[keep]
    cumulative = np.cumsum(probs)
    # Inverse-CDF draw: one uniform number per token, so the stream of draws depends only on the seed.
    index = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
    return min(index, int(probs.size) - 1)


def choose_rows(
    logits: np.ndarray,
    params: list[SamplingParams],
    rngs: list[np.random.Generator],
    produced: list[Produced] | None = None,
) -> list[int]:
    """The next token of every row of a decode step ([rows, vocab])."""
    if all(p.greedy and p.plain for p in params):  # nothing to count either: plain rows count nothing
        return [int(t) for t in np.argmax(logits, axis=-1)]
    if produced is None:
        return [choose(row, p, rng) for row, p, rng in zip(logits, params, rngs, strict=True)]
    return [choose(*row) for row in zip(logits, params, rngs, produced, strict=True)]
