"""One ONNX Runtime session for one model version: build, check against config, warm up, run."""

from __future__ import annotations

import dataclasses
import logging
import re
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import onnxruntime as ort
from modelyard.tensors import NUMPY_BY_NAME
from onnxruntime.capi.onnxruntime_pybind11_state import (
    DeviceReset,
    EPFail,
    Fail,
    InvalidArgument,
    RuntimeException,
)

from service.cores import usable_cores
from service.datatypes import NAME_BY_ORT
from service.errors import DeviceFault, InvalidInput, ModelLoadError, ModelRunError, ServiceError
from service.repository.config import ModelConfig, TensorConfig
from service.runtime import bf16
from service.runtime.providers import CPU, CUDA, ProviderChoice
from service.runtime.signature import Signature, TensorSpec
from service.runtime.strings import feeds_for_ort, outputs_from_ort

log = logging.getLogger(__name__)

# A run this cheap costs less than the hop to an executor thread and back (measured: ~40-60 us on
# this 2-core machine), so it runs inline on the event loop; anything slower goes to the executor.
INLINE_RUN_LIMIT_S = 50e-6
# With one usable core per process (pinned, or as many workers as cores) an executor thread adds
# no parallelism, only the hop: runs up to this long go inline, which bounds how long one run holds
# the event loop (and so the latency it adds to other requests).
ONE_CORE_INLINE_RUN_LIMIT_S = 500e-6
WARMUP_RUNS = 5
# A run this long has likely grown ONNX Runtime's arena (which keeps what it grew, for the life of
# the session: one large request would hold gigabytes for good), so it is followed by a warm-up
# sized run with arena shrinkage, which frees the arena's unused chunks. Cheap beside such a run.
SHRINK_AFTER_S = 0.1
# How ONNX Runtime reports a failing device when it has no exception type for it: its CUDA provider's
# CUDA_CALL / CUBLAS_CALL / CUDNN_CALL checks throw "CUDA failure 700: an illegal memory access..."
# (or "CUBLAS failure", "CUDNN failure", "CUDA error cudaError..."), surfacing as Fail.
_DEVICE_MESSAGE = re.compile(r"\b(CUDA|CUBLAS|CUDNN|NCCL) (failure|error)\b|\bcudaError", re.IGNORECASE)


class GraphKind(Protocol):
    """What a layer above recognised in a graph as it loaded (generation: a decoder language
    model), kept with the runner for that layer. The runtime only asks it for warm-up inputs: such
    a graph takes inputs the signature alone cannot fill (a cache whose lengths must agree)."""

    def warmup_feeds(self) -> dict[str, np.ndarray]: ...


# Recognises its kind of graph as a version loads (None: not that kind); a ModelLoadError fails
# the load. The composition root passes the layers' recognisers; the runtime knows none of them.
Recognizer = Callable[[Signature, Mapping[str, str], ModelConfig, Path], GraphKind | None]


@dataclass(frozen=True)
class ModelRunner:
    """A loaded, validated, warmed-up session. `run` is thread-safe (ORT sessions are)."""

    session: ort.InferenceSession
    signature: Signature
    provider: str
    warmup_run_s: float  # median warm-up run time, on inputs with every dynamic dimension = 1
    kind: GraphKind | None = None  # what a layer above recognised in the graph (a decoder: Generate)
    inline_limit_s: float = INLINE_RUN_LIMIT_S  # runs shorter than this go inline (inline_run_limit_s)
    sample_feeds: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)  # the warm-up's
    shrink_options: ort.RunOptions | None = None  # arena shrinkage of the session's devices
    device: str = "cpu"  # where the session runs: "cpu" or "cuda:<device_id>" (logs, metrics)

    @property
    def runs_inline(self) -> bool:
        return self.warmup_run_s < self.inline_limit_s

    def run(self, feeds: Mapping[str, np.ndarray], output_names: Sequence[str]) -> list[np.ndarray]:
        strings = self.signature.string_inputs
        ort_feeds = feeds_for_ort(feeds, strings) if strings else dict(feeds)
        arrays: list[np.ndarray]
        start = time.perf_counter()
        try:
            if self.signature.has_bf16:
                arrays = bf16.run(self.session, ort_feeds, output_names)
            else:
                arrays = self.session.run(list(output_names), ort_feeds)
        except UnicodeDecodeError:  # the binding decodes string outputs as UTF-8, strictly
            raise ModelRunError(
                "a BYTES output holds bytes that are not UTF-8, which ONNX Runtime's Python binding "
                "cannot return"
            ) from None
        if time.perf_counter() - start > SHRINK_AFTER_S:
            self.give_back_memory()
        return outputs_from_ort(arrays) if self.signature.string_outputs else arrays

    def give_back_memory(self) -> None:
        """Free the arena's unused chunks (those a large run grew) with a warm-up sized run."""
        if self.shrink_options is None or not self.sample_feeds or self.signature.has_bf16:
            return
        strings = self.signature.string_inputs
        feeds = feeds_for_ort(self.sample_feeds, strings) if strings else dict(self.sample_feeds)
        self.session.run(list(self.signature.output_names), feeds, self.shrink_options)


def inline_run_limit_s(processes: int = 1) -> float:
    """How long a run may be and still run on the event loop, for this machine: the cores this
    process may use (its CPU affinity), shared by `processes` service processes. Per model, the
    warm-up run time is held against it (ModelRunner.runs_inline)."""
    return ONE_CORE_INLINE_RUN_LIMIT_S if usable_cores() <= processes else INLINE_RUN_LIMIT_S


class Runnable(Protocol):
    """What running a model needs of its runner (ModelRunner, or a test's stand-in)."""

    @property
    def runs_inline(self) -> bool: ...

    def run(self, feeds: Mapping[str, np.ndarray], output_names: Sequence[str]) -> list[np.ndarray]: ...


def run_checked(
    runner: Runnable, feeds: Mapping[str, np.ndarray], output_names: Sequence[str], label: str
) -> list[np.ndarray]:
    """Run once, here (on whatever thread calls it); a failure becomes the ServiceError that
    run_error gives."""
    try:
        return runner.run(feeds, output_names)
    except Exception as exc:
        raise run_error(exc, label) from None


def run_error(exc: BaseException, label: str) -> ServiceError:
    """The answer for a failed run of the model `label` names ("model m version 3")."""
    if isinstance(exc, ServiceError):
        return exc
    if isinstance(exc, InvalidArgument):
        # Shapes the schema allows (-1) but the graph's operators reject.
        return InvalidInput(f"the model rejected the inputs: {_first_line(exc)}")
    if is_device_fault(exc):
        return DeviceFault(f"{label} failed on its device: {_first_line(exc)}")
    return ModelRunError(f"{label} failed: {_first_line(exc)}")


def is_device_fault(exc: BaseException) -> bool:
    """True when the device or ONNX Runtime's provider failed, not the request: an execution
    provider failure or device reset, or a CUDA library error. A kernel refusing the request's
    values (Fail from an operator's check) is not one: it would fail on any instance."""
    if isinstance(exc, EPFail | DeviceReset):
        return True
    return isinstance(exc, Fail | RuntimeException) and _DEVICE_MESSAGE.search(str(exc)) is not None


def load_runner(
    model_file: Path,
    config: ModelConfig,
    providers: ProviderChoice,
    recognizers: Sequence[Recognizer] = (),
    inline_limit_s: float = INLINE_RUN_LIMIT_S,
) -> ModelRunner:
    """Build and validate a session; raise ModelLoadError naming the file and the reason. The
    first recognizer that knows the graph gives its kind."""
    provider = _provider_for(config, providers, model_file)
    try:
        session = ort.InferenceSession(
            str(model_file), sess_options=_session_options(config), providers=_providers(config, provider)
        )
    except Exception as exc:  # ORT raises a variety of types for a bad file
        raise ModelLoadError(f"{model_file}: onnxruntime cannot load it: {_first_line(exc)}") from None
    signature = _signature(session, config, model_file)
    metadata = dict(session.get_modelmeta().custom_metadata_map)
    kind: GraphKind | None = None
    for recognize in recognizers:
        kind = recognize(signature, metadata, config, model_file)
        if kind is not None:
            break
    runner = ModelRunner(
        session,
        signature,
        session.get_providers()[0],
        warmup_run_s=0.0,
        kind=kind,
        inline_limit_s=inline_limit_s,
    )
    if kind is not None:
        feeds = kind.warmup_feeds()
    else:
        feeds = {spec.name: _sample(spec) for spec in signature.inputs}
    return dataclasses.replace(
        runner,
        warmup_run_s=_warm_up(runner, feeds, model_file),
        sample_feeds=feeds,
        shrink_options=_shrink_options(runner.provider, config),
        device=f"cuda:{config.execution.device_id}" if runner.provider == CUDA else "cpu",
    )


def _shrink_options(provider: str, config: ModelConfig) -> ort.RunOptions:
    options = ort.RunOptions()
    devices = "cpu:0" + (f";gpu:{config.execution.device_id}" if provider == CUDA else "")
    options.add_run_config_entry("memory.enable_memory_arena_shrinkage", devices)
    return options


def _provider_for(config: ModelConfig, providers: ProviderChoice, model_file: Path) -> str:
    wanted = config.execution.provider
    if wanted == "cuda" and not providers.cuda_usable:
        raise ModelLoadError(f"{model_file}: execution.provider is cuda but {providers.reason}", "provider")
    if wanted == "cpu":
        return CPU
    return providers.default


def _providers(config: ModelConfig, provider: str) -> list[Any]:
    if provider != CUDA:
        return [CPU]
    options: dict[str, Any] = {"device_id": config.execution.device_id}
    if config.execution.gpu_mem_limit_mb:
        options["gpu_mem_limit"] = config.execution.gpu_mem_limit_mb * 1024 * 1024
        # Grow the arena by what is asked for, so the limit is not eaten by power-of-two rounding.
        options["arena_extend_strategy"] = "kSameAsRequested"
    return [(CUDA, options), CPU]


def _session_options(config: ModelConfig) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.intra_op_num_threads = config.execution.intra_op_threads
    options.inter_op_num_threads = config.execution.inter_op_threads
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return options


def _signature(session: ort.InferenceSession, config: ModelConfig, model_file: Path) -> Signature:
    inputs = tuple(_spec(arg, model_file) for arg in session.get_inputs())
    outputs = tuple(_spec(arg, model_file) for arg in session.get_outputs())
    if config.inputs:
        inputs = _apply_config(inputs, config.inputs, "input", model_file)
    if config.outputs:
        outputs = _apply_config(outputs, config.outputs, "output", model_file)
    if config.max_batch_size:
        for spec in inputs + outputs:
            if not spec.shape or spec.shape[0] not in (-1, config.max_batch_size):
                raise ModelLoadError(
                    f"{model_file}: max_batch_size is {config.max_batch_size} but {spec.name!r} has shape "
                    f"{list(spec.shape)}, whose first dimension is not a dynamic batch dimension",
                    "schema",
                )
    return Signature(inputs, outputs, config.max_batch_size)


def _spec(arg: Any, model_file: Path) -> TensorSpec:
    datatype = NAME_BY_ORT.get(arg.type)
    if datatype is None:
        raise ModelLoadError(f"{model_file}: tensor {arg.name!r} has unsupported type {arg.type}", "schema")
    # Symbolic ("batch") and unknown (None) dimensions both accept any size.
    shape = tuple(d if isinstance(d, int) and d >= 0 else -1 for d in (arg.shape or []))
    return TensorSpec(arg.name, datatype, shape)


def _apply_config(
    graph: tuple[TensorSpec, ...], configured: tuple[TensorConfig, ...], kind: str, model_file: Path
) -> tuple[TensorSpec, ...]:
    """The graph's tensors, narrowed by the config; any disagreement is a load error."""
    by_name = {t.name: t for t in graph}
    if set(by_name) != {t.name for t in configured}:
        raise ModelLoadError(
            f"{model_file}: config {kind}s {sorted(t.name for t in configured)} do not match the graph's "
            f"{sorted(by_name)}",
            "schema",
        )
    specs = []
    for want in configured:
        have = by_name[want.name]
        compatible = len(want.shape) == len(have.shape) and all(
            h in (-1, w) for w, h in zip(want.shape, have.shape, strict=True)
        )
        if want.datatype != have.datatype or not compatible:
            raise ModelLoadError(
                f"{model_file}: config {kind} {want.name!r} is {want.datatype}{list(want.shape)} but the "
                f"graph has {have.describe()}",
                "schema",
            )
        specs.append(TensorSpec(want.name, want.datatype, want.shape))
    return tuple(specs)


def _warm_up(runner: ModelRunner, feeds: Mapping[str, np.ndarray], model_file: Path) -> float:
    timings = []
    try:
        for _ in range(WARMUP_RUNS):
            start = time.perf_counter()
            runner.run(feeds, runner.signature.output_names)
            timings.append(time.perf_counter() - start)
    except Exception as exc:
        raise ModelLoadError(f"{model_file}: warm-up run failed: {_first_line(exc)}", "warmup") from None
    return statistics.median(timings)


def _sample(spec: TensorSpec) -> np.ndarray:
    shape = tuple(1 if d < 0 else d for d in spec.shape)
    if spec.datatype == "BYTES":
        return np.full(shape, b"", dtype=object)
    return np.zeros(shape, dtype=NUMPY_BY_NAME[spec.datatype])


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:500]
