"""The KV-cache decode loop's model side: prefill a prompt, and advance a batch of sequences one
token per run, keeping every sequence's cache between steps (a prompt is never recomputed).

Batch layout. Sequences of different lengths share one cache tensor per layer,
[rows, heads, width, head_size], right-aligned: a row shorter than the widest is padded on the
left, and the attention mask (1 = real, 0 = padding) hides the padding. Each row's position ids
count only its own tokens, so padding shifts nothing and a row computes what it would alone.

Where the cache lives. On the CPU provider, numpy arrays: ONNX Runtime reads numpy inputs in
place and returns its outputs as numpy views of its own buffers, so a step copies no cache. On
another device (CUDA), OrtValues on that device with IO binding: past_key_values.* bound from the
previous step's present.*, present.* bound to the device, only the logits bound to the host; the
few index inputs go in as host arrays. A step then copies the new token's ids, mask and position
to the device and the logits back, nothing of the cache.

Rows join and leave between steps; the batch's cache is re-assembled where it lives
(cache_ops.py: numpy on the host, two tiny ONNX graphs on the device), never through host memory
on a device. Nothing here is thread-safe: one decode loop owns a batch and calls it from one
executor thread at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import onnxruntime as ort

from modelyard.service.generation.cache_ops import CacheOps, DeviceCacheOps, HostCacheOps, Tensor
from modelyard.service.generation.layout import DecoderLayout
from modelyard.service.runtime.session import direct_run

Member = TypeVar("Member")


@dataclass
class Cache:
    """One sequence's KV cache outside a batch: [1, heads, length, head_size] per past input, as
    numpy on the host or OrtValues on the device (wherever the batch's cache lives)."""

    past: list[Tensor]
    length: int


class StepRunner:
    """Runs the decoder graph with its cache where `device` is ("cpu", or "cuda" with `device_id`).

    `bind`: IO binding with OrtValues (default: on any device but the CPU, where plain `run` on
    numpy copies nothing either and costs less Python per step). Both paths give the same tokens.
    """

    def __init__(
        self,
        session: ort.InferenceSession,
        layout: DecoderLayout,
        device: str = "cpu",
        device_id: int = 0,
        bind: bool | None = None,
    ) -> None:
        self._session = session
        self._device = device or "cpu"
        self._device_id = device_id
        self.bound = self._device != "cpu" if bind is None else bind
        self.ops: CacheOps = (
            DeviceCacheOps(layout, session, self._device, device_id) if self.bound else HostCacheOps(layout)
        )
        # ONNX Runtime's Session.run checks the feed's names against the graph's in Python on
        # every call, so on every decode step; the layout checked them when the version loaded.
        self._run = direct_run(session)
        # Looked up once: the layout builds these names on each access.
        self._past_names = layout.past_names
        self._present_names = layout.present_names
        self._output_names = list(layout.output_names)
        self._logits = layout.output_names[0]

    def run(self, feeds: dict[str, np.ndarray], past: Sequence[Tensor]) -> tuple[np.ndarray, list[Tensor]]:
        """-> logits [rows, sequence, vocab] on the host, and the present tensors (where past was)."""
        if not self.bound:
            feeds = dict(feeds)
            feeds.update(zip(self._past_names, past, strict=True))
            outputs = self._run(self._output_names, feeds, None)
            return np.asarray(outputs[0], dtype=np.float32), list(outputs[1:])
        binding = self._session.io_binding()
        for name, array in feeds.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(array))
        for name, tensor in zip(self._past_names, past, strict=True):
            binding.bind_ortvalue_input(name, tensor)
        binding.bind_output(self._logits, "cpu")
        for name in self._present_names:
            binding.bind_output(name, self._device, self._device_id)
        self._session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        return np.asarray(outputs[0].numpy(), dtype=np.float32), outputs[1:]


def prefill(
    runner: StepRunner, layout: DecoderLayout, prompt: Sequence[int], all_positions: bool = False
) -> tuple[Cache, np.ndarray]:
    """Run a whole prompt (an empty cache in, its cache out) -> its cache and the last position's
    logits [vocab] (every position's, [prompt, vocab], with `all_positions`: a prompt's scores).
    Prompts are prefilled alone, never padded, so a sequence's cache is the same whether it then
    decodes alone or in a batch. The cache stays where the runner keeps it."""
    ids = np.asarray(prompt, dtype=np.int64)[None, :]
    feeds = layout.feeds(ids, np.ones_like(ids), np.arange(ids.shape[1], dtype=np.int64)[None, :])
    logits, present = runner.run(feeds, runner.ops.empty(1))
    return Cache(present, ids.shape[1]), logits[0] if all_positions else logits[0, -1]


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
        self._ones = np.ones((1, 256), dtype=np.int64)  # a lone row's masks are views of it

    def __len__(self) -> int:
        return len(self.members)

    @property
    def width(self) -> int:
        return self._width

    @property
    def past(self) -> list[Tensor]:
        """The batch's cache tensors, one per past input (where the runner keeps them)."""
        return self._past

    def add(self, joining: Sequence[tuple[Member, Cache, int]]) -> None:
        """Rows join: (member, its cache, its next input token). The batch's cache is written once
        more where it lives (old rows and new ones into one tensor per layer)."""
        if not joining:
            return
        parts = [(self._past, self._width)] if self.members else []
        # A preempted sequence's cache comes back from host memory (ops.offload) first.
        parts += [(self._runner.ops.place(cache.past), cache.length) for _, cache, _ in joining]
        width = max(part_width for _, part_width in parts)
        self._past = self._runner.ops.join(parts, width)
        self._width = width
        self._lengths = np.concatenate([self._lengths, [cache.length for _, cache, _ in joining]]).astype(
            np.int64
        )
        self._next = np.concatenate([self._next, [token for _, _, token in joining]]).astype(np.int64)
        self.members.extend(member for member, _, _ in joining)

    def remove(self, leaving: Sequence[Member], keep: Sequence[Member] = ()) -> dict[int, tuple[Cache, int]]:
        """Rows leave; the caches of those in `keep` are returned (with their next token), by
        member id, so that they can rejoin later; they stay where the batch's cache lives. The
        rest of the cache is freed."""
        gone = {id(m) for m in leaving}
        if not gone:
            return {}
        ops = self._runner.ops
        kept_caches: dict[int, tuple[Cache, int]] = {}
        keep_ids = {id(m) for m in keep}
        stay = []
        for row, member in enumerate(self.members):
            if id(member) not in gone:
                stay.append(row)
            elif id(member) in keep_ids:
                length = int(self._lengths[row])
                kept_caches[id(member)] = (
                    Cache(ops.select(self._past, [row], self._width - length), length),
                    int(self._next[row]),
                )
        if len(stay) == len(self.members):
            return kept_caches
        self.members = [self.members[row] for row in stay]
        self._lengths = self._lengths[stay]
        self._next = self._next[stay]
        # Columns that are padding in every remaining row are dropped.
        width = int(self._lengths.max()) if stay else 0
        self._past = ops.select(self._past, stay, self._width - width) if stay else []
        self._width = width
        return kept_caches

    def step(self) -> np.ndarray:
        """Feed every row its next token -> the logits of the following one, [rows, vocab]."""
        rows = len(self.members)
        width = self._width + 1
        if rows == 1:  # a lone row is as wide as the batch: no padding to mask
            if width > self._ones.shape[1]:
                self._ones = np.ones((1, 2 * width), dtype=np.int64)
            mask = self._ones[:, :width]  # contiguous: one row (no np.ones allocated a step)
        else:
            mask = (np.arange(width)[None, :] >= (width - 1 - self._lengths)[:, None]).astype(np.int64)
        feeds = self._layout.feeds(self._next[:, None], mask, self._lengths[:, None])
        logits, present = self._runner.run(feeds, self._past)
        assert logits.shape[0] == rows
        self._past = present
        self._width = width
        self._lengths = self._lengths + 1
        return logits[:, -1]

    def failing_rows(self) -> list[tuple[Member, Exception]]:
        """After a step failed: each row's step run alone, from its own cache (nothing is kept) ->
        the rows whose step fails, with their errors. A failed step changed nothing (its outputs
        were never taken), so the rows that pass continue from the same caches."""
        failed: list[tuple[Member, Exception]] = []
        ops = self._runner.ops
        for row, member in enumerate(self.members):
            length = int(self._lengths[row])
            past = ops.select(self._past, [row], self._width - length)
            mask = np.ones((1, length + 1), dtype=np.int64)
            feeds = self._layout.feeds(
                self._next[row : row + 1, None], mask, self._lengths[row : row + 1, None]
            )
            try:
                self._runner.run(feeds, past)
            except Exception as exc:
                failed.append((member, exc))
        return failed

    def set_next(self, tokens: Sequence[int]) -> None:
        self._next = np.asarray(tokens, dtype=np.int64)
