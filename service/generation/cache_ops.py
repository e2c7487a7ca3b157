"""Re-assembling a decode batch's KV cache when rows join or leave, where the cache lives.

Two implementations of the same three operations (an empty past, join, select):

- `HostCacheOps`: numpy arrays in host memory (the CPU provider, whose session reads numpy inputs
  in place and returns its outputs as numpy views of its own buffers: no copy in a step).
- `DeviceCacheOps`: OrtValues on the decoder's device. ONNX Runtime's Python API has no
  device-side concatenation or slicing, so two tiny graphs do it, run by a session of their own on
  the decoder's provider and device: `join` (Pad on the left to the batch width, then Concat along
  the batch) and `select` (Gather rows, then Slice off the columns that are padding in all of
  them). The cache never passes through host memory; what crosses is a few int64 scalars (pads,
  row indices, the first column).

A join writes the batch's cache once more on the device (old rows and the joining row into one new
tensor per layer); a leave writes the remaining rows once (and a pausing row's own slice). Steps
in between write nothing: each step's present.* is the next step's past_key_values.*.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeAlias

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from modelyard.service.generation.layout import DecoderLayout

# A cache tensor: a numpy array on the host, or an onnxruntime OrtValue (on the decoder's device).
Tensor: TypeAlias = Any
# One part of a join: a cache's tensors (one per past input, [rows, heads, width, head_size]) and
# their width (cache positions per row, right-aligned).
Part: TypeAlias = tuple[Sequence[Tensor], int]

_OPSET = 17
_IR_VERSION = 10  # what every supported ONNX Runtime loads (see models/demo_models.py)
_INT64_MAX = np.iinfo(np.int64).max
_ONNX_TYPES = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16}


class CacheOps(Protocol):
    def empty(self, rows: int) -> list[Tensor]:
        """The past of a prompt: zero cache positions per past input."""
        ...

    def join(self, parts: Sequence[Part], width: int) -> list[Tensor]:
        """The parts' rows, in order, in one batch cache of `width` columns (each part padded on
        the left). A single part already `width` wide is returned as it is."""
        ...

    def select(self, past: Sequence[Tensor], rows: Sequence[int], start: int) -> list[Tensor]:
        """`rows` of the cache, from column `start` on (a copy: the batch cache is freed after)."""
        ...

    def offload(self, past: Sequence[Tensor]) -> list[Tensor]:
        """One sequence's cache in host memory (a preempted sequence's, off the device)."""
        ...

    def place(self, past: Sequence[Tensor]) -> list[Tensor]:
        """A cache back where the batch's lives (an offloaded one onto the device)."""
        ...


class HostCacheOps:
    def __init__(self, layout: DecoderLayout) -> None:
        self._layout = layout

    def empty(self, rows: int) -> list[Tensor]:
        return [self._layout.empty_past(rows)] * len(self._layout.past_names)

    def join(self, parts: Sequence[Part], width: int) -> list[Tensor]:
        if len(parts) == 1 and parts[0][1] == width:
            return list(parts[0][0])
        rows = sum(_rows(tensors[0]) for tensors, _ in parts)
        joined = []
        for i in range(len(self._layout.past_names)):
            merged = self._layout.empty_past(rows, width)
            row = 0
            for tensors, part_width in parts:
                array = np.asarray(tensors[i])
                merged[row : row + array.shape[0], :, width - part_width :] = array
                row += array.shape[0]
            joined.append(merged)
        return joined

    def select(self, past: Sequence[Tensor], rows: Sequence[int], start: int) -> list[Tensor]:
        index = np.asarray(rows, dtype=np.int64)
        return [np.ascontiguousarray(np.asarray(array)[index, :, start:]) for array in past]

    def offload(self, past: Sequence[Tensor]) -> list[Tensor]:
        return list(past)  # already in host memory

    def place(self, past: Sequence[Tensor]) -> list[Tensor]:
        return list(past)


class DeviceCacheOps:
    """The join and select graphs on the decoder session's provider, device and provider options
    (so a CUDA decoder's cache is re-assembled on its own device)."""

    def __init__(
        self, layout: DecoderLayout, decoder: ort.InferenceSession, device: str, device_id: int
    ) -> None:
        self._layout = layout
        self._device = device
        self._device_id = device_id
        self._decoder = decoder
        # Made at the first join of two parts or the first leave: a lone stream never needs them,
        # and the first Generate of a version should not wait for two more sessions.
        self._sessions: tuple[ort.InferenceSession, ort.InferenceSession] | None = None
        # A prompt's empty past holds no bytes, so it stays in host memory: the bound run takes it
        # as it takes any host input (the path of a plain run with an empty past), rather than
        # through a zero-size allocation on the device, which nothing else here makes.
        self._empty = ort.OrtValue.ortvalue_from_numpy(layout.empty_past(1))
        self._run_options = ort.RunOptions()
        if device == "cuda":
            # Batch caches come and go in this session's device arena: give free chunks back after
            # each run, so its peak does not stay held beside the decoder's.
            self._run_options.add_run_config_entry("memory.enable_memory_arena_shrinkage", f"gpu:{device_id}")

    def _graphs(self) -> tuple[ort.InferenceSession, ort.InferenceSession]:
        """The join and select sessions, on the decoder's providers with its provider options."""
        if self._sessions is None:
            n = len(self._layout.past_names)
            elem = _ONNX_TYPES[np.dtype(self._layout.kv_dtype)]
            options = ort.SessionOptions()
            options.intra_op_num_threads = 1  # memory copies of a few tensors: threads would only spin
            options.inter_op_num_threads = 1
            providers = self._decoder.get_providers()
            provider_options = [self._decoder.get_provider_options().get(p, {}) for p in providers]
            self._sessions = (
                ort.InferenceSession(_join_graph(n, elem), options, providers, provider_options),
                ort.InferenceSession(_select_graph(n, elem), options, providers, provider_options),
            )
        return self._sessions

    def empty(self, rows: int) -> list[Tensor]:
        empty = self._empty if rows == 1 else ort.OrtValue.ortvalue_from_numpy(self._layout.empty_past(rows))
        return [empty] * len(self._layout.past_names)

    def join(self, parts: Sequence[Part], width: int) -> list[Tensor]:
        joined, joined_width = list(parts[0][0]), parts[0][1]
        for tensors, part_width in parts[1:]:
            session = self._graphs()[0]
            binding = session.io_binding()
            for i, (a, b) in enumerate(zip(joined, tensors, strict=True)):
                binding.bind_ortvalue_input(f"a{i}", a)
                binding.bind_ortvalue_input(f"b{i}", b)
            binding.bind_cpu_input("pads_a", _left_pad(width - joined_width))
            binding.bind_cpu_input("pads_b", _left_pad(width - part_width))
            for i in range(len(joined)):
                binding.bind_output(f"out{i}", self._device, self._device_id)
            session.run_with_iobinding(binding, self._run_options)
            joined, joined_width = binding.get_outputs(), width
        assert joined_width == width, "a lone part is already the batch's width"
        return joined

    def select(self, past: Sequence[Tensor], rows: Sequence[int], start: int) -> list[Tensor]:
        session = self._graphs()[1]
        binding = session.io_binding()
        for i, tensor in enumerate(past):
            binding.bind_ortvalue_input(f"x{i}", tensor)
        binding.bind_cpu_input("rows", np.asarray(rows, dtype=np.int64))
        binding.bind_cpu_input("start", np.asarray([start], dtype=np.int64))
        for i in range(len(past)):
            binding.bind_output(f"out{i}", self._device, self._device_id)
        session.run_with_iobinding(binding, self._run_options)
        return list(binding.get_outputs())

    def offload(self, past: Sequence[Tensor]) -> list[Tensor]:
        # Copied, not dropped and recomputed: a prefill of prompt and tokens computes the cache
        # with other kernels than the steps did, so the rejoined sequence could choose otherwise
        # at a near tie; the copy makes what it emits exactly what it would have uninterrupted.
        return [to_host(tensor) for tensor in past]

    def place(self, past: Sequence[Tensor]) -> list[Tensor]:
        return [
            ort.OrtValue.ortvalue_from_numpy(t, self._device, self._device_id)
            if isinstance(t, np.ndarray)
            else t
            for t in past
        ]


def to_host(tensor: Tensor) -> np.ndarray:
    """A cache tensor as numpy (a copy from the device; on the CPU a view)."""
    return tensor if isinstance(tensor, np.ndarray) else np.asarray(tensor.numpy())


def _rows(tensor: Tensor) -> int:
    return int(tensor.shape[0] if isinstance(tensor, np.ndarray) else tensor.shape()[0])


def _left_pad(columns: int) -> np.ndarray:
    """ONNX Pad's pads for [rows, heads, width, head_size]: `columns` before the width axis."""
    return np.asarray([0, 0, columns, 0, 0, 0, 0, 0], dtype=np.int64)


def _kv(name: str, elem: int) -> Any:
    return helper.make_tensor_value_info(name, elem, [f"{name}_rows", "heads", f"{name}_width", "head_size"])


def _model(nodes: list[Any], inputs: list[Any], outputs: list[Any], initializers: list[Any]) -> bytes:
    graph = helper.make_graph(nodes, "kv_cache_ops", inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", _OPSET)])
    model.ir_version = _IR_VERSION
    return bytes(model.SerializeToString())


def _join_graph(n: int, elem: int) -> bytes:
    nodes = []
    for i in range(n):
        nodes += [
            helper.make_node("Pad", [f"a{i}", "pads_a"], [f"pa{i}"]),
            helper.make_node("Pad", [f"b{i}", "pads_b"], [f"pb{i}"]),
            helper.make_node("Concat", [f"pa{i}", f"pb{i}"], [f"out{i}"], axis=0),
        ]
    pads = [helper.make_tensor_value_info(name, TensorProto.INT64, [8]) for name in ("pads_a", "pads_b")]
    inputs = [_kv(f"{side}{i}", elem) for i in range(n) for side in ("a", "b")] + pads
    return _model(nodes, inputs, [_kv(f"out{i}", elem) for i in range(n)], [])


def _select_graph(n: int, elem: int) -> bytes:
    nodes = []
    for i in range(n):
        nodes += [
            helper.make_node("Gather", [f"x{i}", "rows"], [f"g{i}"], axis=0),
            helper.make_node("Slice", [f"g{i}", "start", "end", "axes"], [f"out{i}"]),
        ]
    inputs = [_kv(f"x{i}", elem) for i in range(n)] + [
        helper.make_tensor_value_info("rows", TensorProto.INT64, ["selected"]),
        helper.make_tensor_value_info("start", TensorProto.INT64, [1]),
    ]
    constants = [
        helper.make_tensor("end", TensorProto.INT64, [1], [_INT64_MAX]),
        helper.make_tensor("axes", TensorProto.INT64, [1], [2]),
    ]
    return _model(nodes, inputs, [_kv(f"out{i}", elem) for i in range(n)], constants)
