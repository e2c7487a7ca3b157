"""Log-probabilities of tokens, as OpenAI's `logprobs` and `echo` report them: the model's
log-softmax over its vocabulary (the raw logits, before temperature, penalties and bias), and the
most likely alternatives at each position. Computed only for the sequences that ask for them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

MAX_TOP_LOGPROBS = 20  # OpenAI's bound for top_logprobs


@dataclass(frozen=True, slots=True)
class Logprob:
    token_id: int
    token: str  # its text alone (special tokens as written)
    logprob: float | None  # None: a prompt's first token (nothing precedes it)
    top: tuple[Logprob, ...] = ()  # the most likely tokens at its position, most likely first


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Over the last axis, in float64 (a long vocabulary's sum loses nothing)."""
    row = logits.astype(np.float64)
    shifted = row - row.max(axis=-1, keepdims=True)
    return np.asarray(shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True)))


def token_logprob(logits: np.ndarray, token: int, top: int, text: Callable[[int], str]) -> Logprob:
    """`token`'s log-probability under one row of logits ([vocab]), with the `top` most likely."""
    scores = log_softmax(logits)
    return Logprob(token, text(token), float(scores[token]), _top(scores, top, text))


def prompt_logprobs(
    logits: np.ndarray, prompt: Sequence[int], top: int, text: Callable[[int], str]
) -> tuple[Logprob, ...]:
    """Each prompt token's log-probability given the ones before it (logits [prompt, vocab], each
    position's row predicting the next token); the first has none."""
    out = [Logprob(prompt[0], text(prompt[0]), None)]
    for i in range(1, len(prompt)):
        out.append(token_logprob(logits[i - 1], prompt[i], top, text))
    return tuple(out)


def _top(scores: np.ndarray, n: int, text: Callable[[int], str]) -> tuple[Logprob, ...]:
    if n <= 0:
        return ()
    n = min(n, scores.size)
    best = np.argpartition(-scores, n - 1)[:n]
    best = best[np.argsort(-scores[best], kind="stable")]
    return tuple(Logprob(int(t), text(int(t)), float(scores[t])) for t in best)
