"""Choosing the next token from a row of logits: greedy, or sampled with temperature, top-k, top-p.

Each sequence owns its random generator, seeded from the request, so a seeded request draws the
same numbers whatever else shares its decode steps.
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self) -> np.random.Generator:
        return np.random.default_rng(self.seed)


def choose(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """The next token for one row of logits ([vocab])."""
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
    logits: np.ndarray, params: list[SamplingParams], rngs: list[np.random.Generator]
) -> list[int]:
    """The next token of every row of a decode step ([rows, vocab])."""
    if all(p.greedy for p in params):
        return [int(t) for t in np.argmax(logits, axis=-1)]
    return [choose(row, p, rng) for row, p, rng in zip(logits, params, rngs, strict=True)]
