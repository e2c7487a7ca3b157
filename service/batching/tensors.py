"""Pure helpers for batching tensors: which requests may share a run, concatenation, splitting."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import numpy as np

from modelyard.service.errors import ModelRunError

Feeds = Mapping[str, np.ndarray]


def batch_key(feeds: Feeds) -> Hashable:
    """Requests with equal keys can be concatenated along the batch dimension: the same input
    names, element types and shapes apart from the first (batch) dimension."""
    if len(feeds) == 1:  # most models, on every batched request: nothing to sort
        for name, array in feeds.items():
            return ((name, array.dtype, array.shape[1:]),)
    return tuple(sorted([(name, array.dtype, array.shape[1:]) for name, array in feeds.items()]))


def rows_and_key(feeds: Feeds) -> tuple[int, Hashable]:
    """batch_rows and batch_key in one call (the batcher asks both of every request)."""
    if len(feeds) == 1:  # most models
        for name, array in feeds.items():
            shape = array.shape
            return shape[0], ((name, array.dtype, shape[1:]),)
    return batch_rows(feeds), batch_key(feeds)


def batch_rows(feeds: Feeds) -> int:
    """The size of the batch dimension (inputs agree on it: the signature checked them)."""
    return next(iter(feeds.values())).shape[0] if feeds else 0


def concat(parts: Sequence[Feeds]) -> dict[str, np.ndarray]:
    """The inputs of several requests as one batch, in order; a single request is not copied."""
    if len(parts) == 1:
        return dict(parts[0])
    return {name: np.concatenate([part[name] for part in parts], axis=0) for name in parts[0]}


def split(
    outputs: Mapping[str, np.ndarray],
    rows: Sequence[int],
    names: Sequence[Sequence[str]] | None = None,
) -> list[dict[str, np.ndarray]]:
    """One batch's outputs cut back into each request's rows (views, not copies); with `names`
    (one sequence per request), each request gets only the outputs it asked for."""
    total = sum(rows)
    for name, array in outputs.items():
        if array.ndim == 0 or array.shape[0] != total:
            raise ModelRunError(
                f"output {name!r} has shape {list(array.shape)}, whose first dimension is not the "
                f"batch of {total} rows: its rows cannot be given back to the requests of the batch"
            )
    pieces: list[dict[str, np.ndarray]] = []
    start = 0
    if len(outputs) == 1:  # most models: one output, asked for by every request (no comprehension)
        ((only, array),) = outputs.items()
        if names is None or all(len(wanted) == 1 for wanted in names):
            for count in rows:
                end = start + count
                pieces.append({only: array[start:end]})
                start = end
            return pieces
    for index, count in enumerate(rows):
        end = start + count
        wanted = outputs if names is None else names[index]
        pieces.append({name: outputs[name][start:end] for name in wanted})
        start = end
    return pieces
