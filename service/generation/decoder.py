"""The KV-cache decode loop's model side: prefill a prompt, and advance a batch of sequences one
token per run, keeping every sequence's cache between steps (a prompt is never recomputed).

Batch layout. Sequences of different lengths share one cache tensor per layer,
[rows, heads, width, head_size], right-aligned: a row shorter than the widest is padded on the
left, and the attention mask (1 = real, 0 = padding) hides the padding. Each row's position ids
count only its own tokens, so padding shifts nothing and a row computes what it would alone.

Rows join and leave between steps. A join or a leave rebuilds the cache tensors on the host
(one copy); a step in between feeds the model's `present.*` outputs straight back as the next
`past_key_values.*`, so in steady state the cache stays where the model put it (on the GPU, with
IO binding). Nothing here is thread-safe: one decode loop owns a batch and calls it from one
executor thread at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeAlias, TypeVar

import numpy as np
import onnxruntime as ort

from modelyard.service.generation.layout import DecoderLayout

# A cache tensor: a numpy array on the host, or an onnxruntime OrtValue (on the device; untyped).
Tensor: TypeAlias = Any
Member = TypeVar("Member")


@dataclass
class Cache:
    """One sequence's KV cache outside a batch: [1, heads, length, head_size] per past input."""

    past: list[np.ndarray]
    length: int


class StepRunner:
    """Runs the decoder graph with a cache that may live on the device.

    With `device` set (CUDA), inputs are bound with IO binding: the cache tensors stay on the device
    as OrtValues between steps and only the logits come back to the host. Without it, a plain
    `run` on numpy arrays (which ONNX Runtime reads in place on the CPU).
    """

    def __init__(
        self, session: ort.InferenceSession, layout: DecoderLayout, device: str = "", device_id: int = 0
    ) -> None:
        self._session = session
        self._layout = layout
        self._device = device
        self._device_id = device_id

    def run(self, feeds: dict[str, np.ndarray], past: Sequence[Tensor]) -> tuple[np.ndarray, list[Tensor]]:
        """-> logits [rows, sequence, vocab] as float32 on the host, and the present tensors."""
        layout = self._layout
        if not self._device:
            arrays = [self.to_host(t) for t in past]
            outputs = self._session.run(
                list(layout.output_names), {**feeds, **dict(zip(layout.past_names, arrays, strict=True))}
            )
            return np.asarray(outputs[0], dtype=np.float32), list(outputs[1:])
        binding = self._session.io_binding()
        for name, array in feeds.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(array))
        for name, tensor in zip(layout.past_names, past, strict=True):
            if isinstance(tensor, np.ndarray):
                tensor = ort.OrtValue.ortvalue_from_numpy(
                    np.ascontiguousarray(tensor), self._device, self._device_id
                )
            binding.bind_ortvalue_input(name, tensor)
        binding.bind_output(layout.output_names[0], "cpu")
        for name in layout.present_names:
            binding.bind_output(name, self._device, self._device_id)
        self._session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        return np.asarray(outputs[0].numpy(), dtype=np.float32), list(outputs[1:])

    @staticmethod
    def to_host(tensor: Tensor) -> np.ndarray:
        return tensor if isinstance(tensor, np.ndarray) else np.asarray(tensor.numpy())


def prefill(runner: StepRunner, layout: DecoderLayout, prompt: Sequence[int]) -> tuple[Cache, np.ndarray]:
    """Run a whole prompt (an empty cache in, its cache out) -> its cache and the last position's
    logits [vocab]. Prompts are prefilled alone, never padded, so a sequence's cache is the same
    whether it then decodes alone or in a batch."""
    ids = np.asarray(prompt, dtype=np.int64)[None, :]
    feeds = layout.feeds(ids, np.ones_like(ids), np.arange(ids.shape[1], dtype=np.int64)[None, :])
    empty = layout.empty_past(1)
    logits, present = runner.run(feeds, [empty] * len(layout.past_names))
    return Cache([runner.to_host(t) for t in present], ids.shape[1]), logits[0, -1]


class DecodeBatch(Generic[Member]):
    """Sequences that advance together, one token per `step`."""

    def __init__(self, runner: StepRunner, layout: DecoderLayout) -> None:
        self._runner = runner
        self._layout = layout
        self.members: list[Member] = []
        self._past: list[Tensor] = []
        self._width = 0  # cache positions per row (the longest row's length)
        self._lengths = np.zeros(0, dtype=np.int64)  # real cache positions per row
        self._next = np.zeros(0, dtype=np.int64)  # each row's next input token

    def __len__(self) -> int:
        return len(self.members)

    @property
    def width(self) -> int:
        return self._width

    def add(self, joining: Sequence[tuple[Member, Cache, int]]) -> None:
        """Rows join: (member, its cache, its next input token). One host copy of the batch."""
        if not joining:
            return
        old = [self._runner.to_host(t) for t in self._past] if self.members else []
        rows = len(self.members) + len(joining)
        width = max([self._width, *(cache.length for _, cache, _ in joining)])
        past = []
        for i in range(len(self._layout.past_names)):
            merged = self._layout.empty_past(rows, width)
            if old:
                merged[: len(self.members), :, width - self._width :] = old[i]
            for j, (_, cache, _) in enumerate(joining):
                merged[len(self.members) + j, :, width - cache.length :] = cache.past[i][0]
            past.append(merged)
        self._past = list(past)
        self._width = width
        self._lengths = np.concatenate([self._lengths, [cache.length for _, cache, _ in joining]]).astype(
            np.int64
        )
        self._next = np.concatenate([self._next, [token for _, _, token in joining]]).astype(np.int64)
        self.members.extend(member for member, _, _ in joining)

    def remove(self, leaving: Sequence[Member], keep: Sequence[Member] = ()) -> dict[int, tuple[Cache, int]]:
        """Rows leave; the caches of those in `keep` are returned (with their next token), by
        member id, so that they can rejoin later. The rest of the cache is freed."""
        gone = {id(m) for m in leaving}
        if not gone:
            return {}
        kept_caches: dict[int, tuple[Cache, int]] = {}
        host = [self._runner.to_host(t) for t in self._past]
        keep_ids = {id(m) for m in keep}
        stay = []
        for row, member in enumerate(self.members):
            if id(member) not in gone:
                stay.append(row)
            elif id(member) in keep_ids:
                length = int(self._lengths[row])
                start = self._width - length
                kept_caches[id(member)] = (
                    Cache([array[row : row + 1, :, start:].copy() for array in host], length),
                    int(self._next[row]),
                )
        self.members = [self.members[row] for row in stay]
        self._lengths = self._lengths[stay]
        self._next = self._next[stay]
        # Columns that are padding in every remaining row are dropped.
        width = int(self._lengths.max()) if stay else 0
        self._past = [np.ascontiguousarray(array[stay, :, self._width - width :]) for array in host]
        self._width = width
        return kept_caches

    def step(self) -> np.ndarray:
        """Feed every row its next token -> the logits of the following one, [rows, vocab]."""
        rows = len(self.members)
        width = self._width + 1
        mask = (np.arange(width)[None, :] >= (width - 1 - self._lengths)[:, None]).astype(np.int64)
        feeds = self._layout.feeds(self._next[:, None], mask, self._lengths[:, None])
        logits, present = self._runner.run(feeds, self._past)
        assert logits.shape[0] == rows
        self._past = present
        self._width = width
        self._lengths = self._lengths + 1
        return logits[:, -1]

    def set_next(self, tokens: Sequence[int]) -> None:
        self._next = np.asarray(tokens, dtype=np.int64)
