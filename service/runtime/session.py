"""One ONNX Runtime session for one model version: build, check against config, warm up, run."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np
import onnxruntime as ort
from onnxruntime.capi.onnxruntime_pybind11_state import (
    DeviceReset,
    EPFail,
    Fail,
    InvalidArgument,
    RuntimeException,
)

from modelyard.process.cores import usable_cores
from modelyard.service.datatypes import NAME_BY_ORT
from modelyard.service.errors import (
    DeviceFault,
    InvalidInput,
    ModelLoadError,
    ModelRejected,
    ModelRunError,
    RunMemoryExceeded,
    ServiceError,
    Unsupported,
)
from modelyard.service.repository.model_config import ModelConfig, TensorConfig
from modelyard.service.runtime import bf16
from modelyard.service.runtime.cost import value_driven
from modelyard.service.runtime.device_errors import names_a_device_failure, names_out_of_device_memory
from modelyard.service.runtime.internal import split_signature
from modelyard.service.runtime.iobinding import DeviceBinding, binding_for
from modelyard.service.runtime.providers import CPU, CUDA, ProviderChoice
from modelyard.service.runtime.runs import RunControl
from modelyard.service.runtime.signature import Signature, TensorSpec
from modelyard.service.runtime.strings import feeds_for_ort, outputs_from_ort
from modelyard.service.runtime.warmup import sample_feeds, synthetic

log = logging.getLogger(__name__)

# A run this cheap costs less than the hop to an executor thread and back (the limit is about what
# that hop costs on a small machine), so it runs inline on the event loop; anything slower goes to
# the executor.
INLINE_RUN_LIMIT_S = 50e-6
# With one usable core per process (pinned, or as many workers as cores) an executor thread adds
# no parallelism, only the hop: runs up to this long go inline, which bounds how long one run holds
# the event loop (and so the latency it adds to other requests).
ONE_CORE_INLINE_RUN_LIMIT_S = 500e-6
WARMUP_RUNS = 5
# A fresh session's first runs take several times what its warm runs do (over its first ten runs
# or so, in CPU time as well as wall), so the fastest of WARMUP_RUNS alone may judge it cold:
# under load, a model whose warm runs belong inline would start on the executor almost always. A
# model whose fastest run is over the inline limit but within WARMUP_SETTLE_FACTOR of it runs up
# to WARMUP_SETTLE_RUNS more, until one is under: its place follows what a warm run costs.
WARMUP_SETTLE_FACTOR = 4.0
WARMUP_SETTLE_RUNS = 45
# A run this long has likely grown ONNX Runtime's arena (which keeps what it grew, for the life of
# the session: one large request would hold gigabytes for good), so it is followed by a warm-up
# sized run with arena shrinkage, which frees the arena's unused chunks. Cheap beside such a run.
SHRINK_AFTER_S = 0.1
# How an arena refuses an allocation past its max_mem (BFCArena: "Available memory of N is smaller
# than requested bytes of M"; "Failed to allocate memory for requested buffer of size N"), and
# the system's own refusal (std::bad_alloc).
_MEMORY_MESSAGE = re.compile(
    r"Available memory of \d+ is smaller than requested|Failed to allocate memory|bad_alloc", re.IGNORECASE
)
# How a kernel refuses shapes (a computed shape that is negative, overflows or does not fit, as a
# Reshape to a constant [1, 4] of a [2, 4] input): ONNX Runtime raises these as Fail or
# RuntimeException. The request passed the declared checks, so the graph refused it: the graph's
# fault or the values' (model_rejected), not told apart here. Other kernel checks
# (GatherElements' "Out of range value in index tensor") stay model_failed: ONNX Runtime does not
# say whose they are, and a model that fails so on real traffic is what a breaker is for.
_REQUEST_MESSAGE = re.compile(
    r"shape|dimension|\bdims?\b|broadcast|overflow|too many elements", re.IGNORECASE
)
# How a kernel's own failure starts ("Non-zero status code returned while running Reshape node"):
# an InvalidArgument without it is ONNX Runtime's check of the feeds against the graph's declared
# inputs (name, type, rank, fixed dimensions), which our checks make first: a net under them.
_KERNEL_FAILURE = "while running"
# ONNX Runtime's messages quote where they were thrown: "[ONNXRuntimeError] : 1 : FAIL : ...",
# then a source path, a line and the C++ function ("/onnxruntime_src/.../reshape_helper.h:91
# onnxruntime::ReshapeHelper::ReshapeHelper(...) "), none of which a client should see.
_ORT_PREFIX = re.compile(r"\[ONNXRuntimeError\] : \d+ : \w+ : ")
_THROW_SITE = re.compile(r"(?:[\w.+-]*/)+[\w.+-]+:\d+(?: [^()]*\([^()]*\)(?: const)?)?\s*")
_MESSAGE_CHARS = 300
# An inline run that takes longer than this (the warm-up said microseconds: a slow machine, a
# graph the inspection misjudged) moves its model off the event loop for good.
INLINE_WATCHDOG_S = 0.02


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
    warmup_run_s: float  # fastest warm-up run, on inputs with every dynamic dimension = 1
    kind: GraphKind | None = None  # what a layer above recognised in the graph (a decoder: Generate)
    inline_limit_s: float = INLINE_RUN_LIMIT_S  # runs shorter than this go inline (inline_run_limit_s)
    sample_feeds: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)  # the warm-up's
    shrink_options: ort.RunOptions | None = None  # arena shrinkage of the session's devices
    device: str = "cpu"  # where the session runs: "cpu" or "cuda:<device_id>" (logs, metrics)
    # Why a run's cost may follow its inputs' values (cost.py); "" when it cannot. Only then may
    # the model run inline, however fast its warm-up was.
    value_driven: str = "not inspected"
    peak_run_s: float = 0.0  # a warm-up run at max_batch_size rows (0: no batch dimension)
    # Why this version serves on the CPU where CUDA was expected (a host with a driver, or a CUDA
    # session that fell back); "" when it runs where it should. Its status says "degraded: ...".
    degraded: str = ""
    # How runs on a device bind their tensors (iobinding.py); None: session.run (the CPU).
    binding: DeviceBinding | None = None
    # What its status says beside READY (why it loaded without a warm-up run); "" for nothing.
    load_note: str = ""
    # Graph inputs the service feeds itself, not in the signature (runtime/internal.py): a
    # stateful model's controls and state, a repeat model's index. Runs of such a model are fed
    # them by the layer that runs it (service/sequences/, service/decoupled/).
    internal_inputs: tuple[TensorSpec, ...] = ()

    @property
    def runs_inline(self) -> bool:
        return not self.value_driven and max(self.warmup_run_s, self.peak_run_s) < self.inline_limit_s

    @functools.cached_property
    def _session_run(self) -> Callable[..., list[np.ndarray]]:
        return direct_run(self.session)

    def run(
        self,
        feeds: Mapping[str, np.ndarray],
        output_names: Sequence[str],
        options: ort.RunOptions | None = None,
    ) -> list[np.ndarray]:
        strings = self.signature.string_inputs
        # ONNX Runtime takes a dict and keeps none of it: the decoders' dicts go as they are.
        ort_feeds = (
            feeds_for_ort(feeds, strings) if strings else feeds if type(feeds) is dict else dict(feeds)
        )
        arrays: list[np.ndarray]
        start = time.perf_counter()
        try:
            if self.signature.has_bf16:
                arrays = bf16.run(self.session, ort_feeds, output_names, options)
            elif self.binding is not None:
                arrays = self.binding.run(self.session, ort_feeds, output_names, options)
            else:
                arrays = self._session_run(output_names, ort_feeds, options)  # any sequence of str
        except UnicodeDecodeError:  # the binding decodes string outputs as UTF-8, strictly
            message = (
                "a BYTES output holds bytes that are not UTF-8, which ONNX Runtime's Python binding "
                "cannot return"
            )
            if any(a.dtype.kind == "S" for a in ort_feeds.values()):
                # The request's own bytes that are not UTF-8 reached an output (an echo): a limit
                # of this server with these values, not a fault of the model.
                raise Unsupported(f"{message} (the request's BYTES that are not UTF-8 reached it)") from None
            raise ModelRunError(message) from None
        except Exception:
            # A failed run may have grown the arena (up to its bound) before it failed. (Its own
            # failure is the answer, not one of the shrinking run.)
            with contextlib.suppress(Exception):
                self.give_back_memory()
            raise
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

    def run(
        self,
        feeds: Mapping[str, np.ndarray],
        output_names: Sequence[str],
        options: ort.RunOptions | None = None,
    ) -> list[np.ndarray]: ...


def run_checked(
    runner: Runnable,
    feeds: Mapping[str, np.ndarray],
    output_names: Sequence[str],
    label: str,
    control: RunControl | None = None,
) -> list[np.ndarray]:
    """Run once, here (on whatever thread calls it); a failure becomes the ServiceError that
    run_error gives, and a run stopped through `control` fails with the reason it was stopped."""
    try:
        if control is None:
            return runner.run(feeds, output_names)
        if control.why is not None:  # stopped before it started (it waited for a thread)
            raise control.why
        if not control.timed:
            return runner.run(feeds, output_names, control.options)
        control.started_ns = started = time.perf_counter_ns()
        arrays = runner.run(feeds, output_names, control.options)
        control.run_ns = time.perf_counter_ns() - started
        return arrays
    except Exception as exc:
        if control is not None and control.why is not None:
            raise control.why from None
        raise run_error(exc, label) from None


def run_error(exc: BaseException, label: str) -> ServiceError:
    """The answer for a failed run of the model `label` names ("model m version 3"), whose
    request passed the version's declared checks: the run's memory bound (RESOURCE_EXHAUSTED);
    ONNX Runtime's own check of the feeds against the graph's inputs (INVALID_ARGUMENT, the
    request's fault); a kernel refusing the shapes or values it computed (FAILED_PRECONDITION
    model_rejected: the graph's fault or the values', which another version's answer tells);
    else a fault of the device or the model (INTERNAL, counted against the version by a
    sidecar's breaker)."""
    if isinstance(exc, ServiceError):
        return exc
    message = str(exc)
    if _MEMORY_MESSAGE.search(message) or names_out_of_device_memory(message):
        return RunMemoryExceeded(
            f"{label}: the run needed more memory than its bound allows (the service's "
            f"--max-run-memory-mb, or the model's execution.gpu_mem_limit_mb); its inputs' values "
            f"ask for too large a tensor: {client_message(exc)}"
        )
    if isinstance(exc, InvalidArgument):
        if _KERNEL_FAILURE not in message:
            return InvalidInput(f"the inputs do not fit the model's graph: {client_message(exc)}")
        return ModelRejected(f"{label} rejected the inputs inside its graph: {client_message(exc)}")
    if is_device_fault(exc):
        return DeviceFault(f"{label} failed on its device: {client_message(exc)}")
    if isinstance(exc, Fail | RuntimeException) and _REQUEST_MESSAGE.search(message):
        # The inputs fit the signature and the warm-up ran: a shape the graph computed from
        # this request's shapes or values does not fit.
        return ModelRejected(f"{label} rejected the inputs inside its graph: {client_message(exc)}")
    return ModelRunError(f"{label} failed: {client_message(exc)}")


def client_message(exc: BaseException) -> str:
    """ONNX Runtime's message for a client: without its prefix, source paths and C++ function
    names, on one line, capped."""
    text = _ORT_PREFIX.sub("", str(exc))
    text = _THROW_SITE.sub("", text)
    text = " ".join(text.split()) or type(exc).__name__
    return text if len(text) <= _MESSAGE_CHARS else text[:_MESSAGE_CHARS] + "..."


def is_device_fault(exc: BaseException) -> bool:
    """True when the device or ONNX Runtime's provider failed, not the request: an execution
    provider failure or device reset, or a CUDA library error. A kernel refusing the request's
    values (Fail from an operator's check) is not one: it would fail on any instance."""
    if isinstance(exc, EPFail | DeviceReset):
        return True
    return isinstance(exc, Fail | RuntimeException) and names_a_device_failure(str(exc))


def direct_run(session: ort.InferenceSession) -> Callable[..., list[np.ndarray]]:
    """`session.run`, or for a CPU-only session the binding's own run: the Python wrapper's checks
    (every input given, no foreign OrtValues) are made by our callers before each run (the
    signature, a decoder's layout), and its EP fallback has no other provider to go to: those
    checks, in Python, once per request and once per decode step, are what this saves."""
    inner: Any = getattr(session, "_sess", None)
    if session.get_providers() == [CPU] and inner is not None and hasattr(inner, "run"):
        return cast(Callable[..., list[np.ndarray]], inner.run)
    return cast(Callable[..., list[np.ndarray]], session.run)


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
    degraded = _degraded(config, providers, provider, session.get_providers()[0], model_file)
    signature, internal = _signature(session, config, model_file)
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
        # Set before the warm-up, so that the warm-up runs as requests will. A graph a layer
        # above runs (a decoder) binds its own tensors (its cache stays on the device).
        binding=binding_for(
            session.get_providers()[0], config.execution.device_id, signature, config.execution.io_binding
        )
        if kind is None and not any(spec.datatype == "BYTES" for spec in internal)
        else None,
        internal_inputs=internal,
    )
    limit = inline_limit_s if kind is None else 0.0
    note = ""
    # Triton's model_warmup: the config's samples, each run as many times as it says (a failure
    # fails the load, as Triton's); the first one also times the inline decision. Without them,
    # synthetic inputs: a model whose kernel refuses their values (a string model casting "" to a
    # number) loads without a warm-up, and says so, rather than fail for want of real inputs; one
    # that refuses their shapes, or fails otherwise, fails the load (the graph is at fault).
    samples = _configured_samples(config, signature, model_file) if kind is None else []
    # The inputs the service feeds itself (a sequence's controls and state) are no sample's.
    internal_feeds = {spec.name: _internal_sample(spec) for spec in internal}
    if samples:
        for name, sample_feed, runs in samples[1:]:
            _run_sample(runner, {**sample_feed, **internal_feeds}, runs, model_file, name)
        name, feeds, runs = samples[0]
        feeds = {**feeds, **internal_feeds}
        warmup_run_s = _warm_up(runner, feeds, model_file, limit, sample=name, runs=runs)
    else:
        feeds = (
            kind.warmup_feeds()
            if kind is not None
            else {**{s.name: synthetic(s) for s in signature.inputs}, **internal_feeds}
        )
        try:
            warmup_run_s = _warm_up(runner, feeds, model_file, limit, synthetic=kind is None)
        except _SyntheticRefused as exc:
            note = (
                f"warm-up skipped: the graph refused a synthetic input (zeros, empty strings): {exc.why}; "
                "model_warmup in config.yaml gives it real ones"
            )
            log.warning("%s: %s", model_file, note)
            warmup_run_s, feeds = math.inf, {}
    driven = "a layer above runs it" if kind is not None else "the warm-up is too slow to run inline"
    if note:
        driven = "no warm-up ran, so its cost is not known"
    peak_run_s = 0.0
    if kind is None and warmup_run_s < inline_limit_s:
        # Fast enough to run inline: but only if no request's values can make it slow.
        driven = value_driven(model_file, signature)
        if not driven and signature.max_batch_size > 1:
            largest = _largest(signature, feeds if samples else None)
            largest.update({spec.name: _internal_sample(spec, signature.max_batch_size) for spec in internal})
            peak_run_s = _warm_up(runner, largest, model_file, inline_limit_s)
    return dataclasses.replace(
        runner,
        warmup_run_s=warmup_run_s,
        load_note=note,
        sample_feeds=feeds,
        shrink_options=_shrink_options(runner.provider, config),
        device=f"cuda:{config.execution.device_id}" if runner.provider == CUDA else "cpu",
        value_driven=driven,
        peak_run_s=peak_run_s,
        degraded=degraded,
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


def _degraded(config: ModelConfig, providers: ProviderChoice, wanted: str, got: str, model_file: Path) -> str:
    """Why the version serves on the CPU instead of CUDA ("" when it does not): the process found
    CUDA unusable on a host with a driver, or this version's CUDA session fell back (a device id
    that does not exist, a device out of memory). `execution.provider: cuda` refuses either."""
    if wanted == CUDA and got != CUDA:
        if config.execution.provider == "cuda":
            raise ModelLoadError(
                f"{model_file}: execution.provider is cuda but its session fell back to {got} "
                f"(device {config.execution.device_id})",
                "provider",
            )
        return f"on the CPU: its CUDA session on device {config.execution.device_id} fell back to {got}"
    if wanted == CPU and config.execution.provider == "auto" and providers.fallback:
        return f"on the CPU: {providers.reason}"
    return ""


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
    if _run_memory_bytes:
        # Runs draw CPU memory from the process's bounded arena (bound_run_memory); the weights
        # stay outside it, so that the bound is what runs hold, not how many models are loaded.
        options.add_session_config_entry("session.use_env_allocators", "1")
        options.add_session_config_entry("session.use_device_allocator_for_initializers", "1")
    return options


# The bound of the process's shared CPU arena, once set (0: each session has its own, unbounded).
_run_memory_bytes = 0


def bound_run_memory(max_bytes: int) -> int:
    """Bound the CPU memory that the runs of every session loaded from now on hold at once:
    one arena for the process, with ONNX Runtime's OrtArenaCfg max_mem (its CPU provider takes no
    arena settings per session). A run that would pass it fails with RunMemoryExceeded; the
    arena's unused chunks are freed after it (ModelRunner.give_back_memory). Once per process:
    ONNX Runtime keeps the first arena registered; returns the bound in force."""
    global _run_memory_bytes
    if max_bytes <= 0:
        return _run_memory_bytes
    if _run_memory_bytes:
        if max_bytes != _run_memory_bytes:
            log.warning(
                "the run memory bound is already %d MiB in this process; %d MiB is not applied",
                _run_memory_bytes >> 20,
                max_bytes >> 20,
            )
        return _run_memory_bytes
    info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
    # kSameAsRequested: the arena grows by what a run asks, so that the bound is not eaten by
    # power-of-two rounding.
    ort.create_and_register_allocator(
        info, ort.OrtArenaCfg({"max_mem": max_bytes, "arena_extend_strategy": 1})
    )
    _run_memory_bytes = max_bytes
    return max_bytes


def _signature(
    session: ort.InferenceSession, config: ModelConfig, model_file: Path
) -> tuple[Signature, tuple[TensorSpec, ...]]:
    """The signature clients see, and the internal inputs (runtime/internal.py)."""
    inputs = tuple(_spec(arg, model_file) for arg in session.get_inputs())
    outputs = tuple(_spec(arg, model_file) for arg in session.get_outputs())
    inputs, outputs, internal = split_signature(inputs, outputs, config, model_file)
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
    return Signature(inputs, outputs, config.max_batch_size), internal


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


class _SyntheticRefused(ModelLoadError):
    """A kernel of the graph refused the synthetic warm-up inputs' values (_refused_values)."""

    def __init__(self, message: str, why: str) -> None:
        super().__init__(message, "warmup")
        self.why = why


def _warm_up(
    runner: ModelRunner,
    feeds: Mapping[str, np.ndarray],
    model_file: Path,
    inline_limit_s: float = 0.0,
    clock: Callable[[], float] = time.perf_counter,
    *,
    synthetic: bool = False,  # the inputs are made up: a kernel's refusal is _SyntheticRefused
    sample: str = "",  # the config's sample these feeds are (for the message)
    runs: int = 0,  # at least this many runs (a sample's count)
) -> float:
    """The fastest of WARMUP_RUNS runs (other work on the machine only ever slows a run down, so the
    median of a start under load could send a cheap model to the executor for good); while that
    is over `inline_limit_s` but near it (WARMUP_SETTLE_FACTOR), up to WARMUP_SETTLE_RUNS more."""
    fastest = float("inf")
    done = 0
    try:
        while done < max(WARMUP_RUNS, runs) or (
            done < WARMUP_RUNS + WARMUP_SETTLE_RUNS
            and inline_limit_s <= fastest < WARMUP_SETTLE_FACTOR * inline_limit_s
        ):
            start = clock()
            runner.run(feeds, runner.signature.output_names)
            fastest = min(fastest, clock() - start)
            done += 1
    except Exception as exc:
        named = f" (model_warmup sample {sample!r})" if sample else ""
        message = f"{model_file}: warm-up run{named} failed: {_first_line(exc)}"
        if synthetic and _refused_values(exc):
            raise _SyntheticRefused(message, client_message(exc)) from None
        raise ModelLoadError(message, "warmup") from None
    return fastest


def _refused_values(exc: BaseException) -> bool:
    """Whether a warm-up run failed on its inputs' values: a kernel refused them (a Cast of "" to
    a number), not their shapes (a Reshape that fits no input of that size is the graph's fault,
    and fails the load) nor anything else (memory, a non-UTF-8 output)."""
    text = str(exc)
    return _KERNEL_FAILURE in text and not _REQUEST_MESSAGE.search(text)


def _configured_samples(
    config: ModelConfig, signature: Signature, model_file: Path
) -> list[tuple[str, dict[str, np.ndarray], int]]:
    """The config's warm-up samples (those of batch_size 0 are skipped, as Triton's) as (name,
    feeds, runs). The model folder is <root>/<model>/<version>/model.onnx's grandparent."""
    model_dir = model_file.parent.parent
    root = model_dir.parent
    return [
        (sample.name, sample_feeds(sample, signature, model_dir, root), sample.runs)
        for sample in config.model_warmup
        if sample.batch_size
    ]


def _run_sample(
    runner: ModelRunner, feeds: Mapping[str, np.ndarray], runs: int, model_file: Path, name: str
) -> None:
    try:
        for _ in range(runs):
            runner.run(feeds, runner.signature.output_names)
    except Exception as exc:
        raise ModelLoadError(
            f"{model_file}: warm-up run (model_warmup sample {name!r}) failed: {_first_line(exc)}", "warmup"
        ) from None


def _largest(signature: Signature, sample: Mapping[str, np.ndarray] | None) -> dict[str, np.ndarray]:
    """Inputs of max_batch_size rows: the sample's first row repeated (real data), or synthetic."""
    rows = signature.max_batch_size
    if sample is None:
        return {spec.name: synthetic(spec, rows) for spec in signature.inputs}
    return {name: np.repeat(array[:1], rows, axis=0) for name, array in sample.items()}


def _internal_sample(spec: TensorSpec, rows: int = 1) -> np.ndarray:
    """An input the service feeds itself (runtime/internal.py), as it feeds a row without a
    request: zeros, and a string correlation id "0" (as ONNX Runtime takes strings: str)."""
    sample = synthetic(spec, rows)
    if spec.datatype == "BYTES":
        return np.full(sample.shape, "0", dtype=object)
    return sample


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:500]
