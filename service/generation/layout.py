"""The Hugging Face decoder layout, read off a graph's signature.

A model is a decoder when its graph takes `input_ids`, `attention_mask` and one
`past_key_values.<i>.key` / `past_key_values.<i>.value` pair per layer, and returns `logits` and the
matching `present.<i>.key` / `present.<i>.value`. `position_ids` is optional. Layers, heads and head
size come from the past tensors' shapes ([batch, heads, past_sequence, head_size]), so any export in
this layout (GPT-2 style ones included) is served without model-specific code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from modelyard.service.runtime.signature import Signature, TensorSpec
from modelyard.tensors import NUMPY_BY_NAME

INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"
LOGITS = "logits"
_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
_INDEX_TYPES = ("INT64", "INT32")


class NotADecoder(Exception):
    """The graph is not in the decoder layout; the message says what is missing."""


@dataclass(frozen=True)
class DecoderLayout:
    layers: int
    heads: int  # key/value heads (fewer than the query heads in grouped-query attention)
    head_size: int
    kv_dtype: np.dtype
    index_dtype: np.dtype  # of input_ids, attention_mask, position_ids
    has_position_ids: bool
    vocab: int  # the logits' last dimension; -1 when the graph leaves it dynamic

    @property
    def past_names(self) -> tuple[str, ...]:
        return tuple(f"past_key_values.{i}.{kind}" for i in range(self.layers) for kind in ("key", "value"))

    @property
    def present_names(self) -> tuple[str, ...]:
        return tuple(f"present.{i}.{kind}" for i in range(self.layers) for kind in ("key", "value"))

    @property
    def output_names(self) -> tuple[str, ...]:
        return (LOGITS, *self.present_names)

    def empty_past(self, batch: int, length: int = 0) -> np.ndarray:
        return np.zeros((batch, self.heads, length, self.head_size), dtype=self.kv_dtype)

    def feeds(
        self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray
    ) -> dict[str, np.ndarray]:
        """The non-cache inputs, in the graph's index type."""
        feeds = {
            INPUT_IDS: input_ids.astype(self.index_dtype, copy=False),
            ATTENTION_MASK: attention_mask.astype(self.index_dtype, copy=False),
        }
        if self.has_position_ids:
            feeds[POSITION_IDS] = position_ids.astype(self.index_dtype, copy=False)
        return feeds

    def sample_feeds(self) -> dict[str, np.ndarray]:
        """A consistent warm-up input: one new token after one cached one (past length 1, so the
        attention mask covers 2 positions). Setting every dynamic dimension to 1 would give a mask
        shorter than past + new, which many exports reject."""
        feeds = self.feeds(np.zeros((1, 1)), np.ones((1, 2)), np.ones((1, 1)))
        for name in self.past_names:
            feeds[name] = self.empty_past(1, 1)
        return feeds


def decoder_layout(signature: Signature) -> DecoderLayout:
    """The graph's decoder layout, or NotADecoder saying why it is not one."""
    inputs = {t.name: t for t in signature.inputs}
    outputs = {t.name: t for t in signature.outputs}
    for name in (INPUT_IDS, ATTENTION_MASK):
        if name not in inputs:
            raise NotADecoder(f"it has no {name!r} input")
    if LOGITS not in outputs:
        raise NotADecoder(f"it has no {LOGITS!r} output")
    past = {name: spec for name, spec in inputs.items() if _PAST.match(name)}
    if not past:
        raise NotADecoder("it has no past_key_values.<i>.key/value inputs (no KV cache)")
    layers = len(past) // 2
    shapes = set()
    for i in range(layers):
        for kind in ("key", "value"):
            spec = past.get(f"past_key_values.{i}.{kind}")
            if spec is None:
                raise NotADecoder(f"past_key_values.{i}.{kind} is missing (layers must be numbered from 0)")
            present = outputs.get(f"present.{i}.{kind}")
            if present is None:
                raise NotADecoder(f"it has no present.{i}.{kind} output for past_key_values.{i}.{kind}")
            shapes.add(_kv_shape(spec, present))
    if len(past) != 2 * layers or len(shapes) != 1:
        raise NotADecoder(f"its past_key_values inputs do not form {layers} layers of one shape")
    ((heads, head_size, datatype),) = shapes
    index_types = {inputs[n].datatype for n in (INPUT_IDS, ATTENTION_MASK, POSITION_IDS) if n in inputs}
    if len(index_types) != 1 or not index_types <= set(_INDEX_TYPES):
        raise NotADecoder(
            f"input_ids/attention_mask/position_ids must share INT64 or INT32, got {index_types}"
        )
    extra = set(inputs) - set(past) - {INPUT_IDS, ATTENTION_MASK, POSITION_IDS}
    if extra:
        raise NotADecoder(f"it has inputs the decoder layout does not know: {sorted(extra)}")
    logits = outputs[LOGITS]
    if len(logits.shape) != 3:
        raise NotADecoder(f"logits must be [batch, sequence, vocab], got {list(logits.shape)}")
    return DecoderLayout(
        layers=layers,
        heads=heads,
        head_size=head_size,
        kv_dtype=np.dtype(NUMPY_BY_NAME[datatype]),
        index_dtype=np.dtype(NUMPY_BY_NAME[index_types.pop()]),
        has_position_ids=POSITION_IDS in inputs,
        vocab=logits.shape[2],
    )


def _kv_shape(past: TensorSpec, present: TensorSpec) -> tuple[int, int, str]:
    shape = past.shape
    if len(shape) != 4 or shape[1] < 1 or shape[3] < 1:
        raise NotADecoder(
            f"{past.name} must be [batch, heads, past_sequence, head_size] with fixed heads and head size, "
            f"got {list(shape)}"
        )
    if past.datatype not in ("FP32", "FP16") or present.datatype != past.datatype:
        raise NotADecoder(f"{past.name} and its present output must both be FP32 or FP16")
    return shape[1], shape[3], past.datatype
