"""Per-model configuration (`models/<name>/config.yaml`) as the service uses it: frozen dataclasses,
built from the file's typed declaration (service/repository/model_config_schema.py: keys, types, bounds;
unknown keys are errors, a typo in a serving config must fail loudly) and the checks that span keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import yaml
from msgspec import UNSET, UnsetType

from modelyard.process.documents import DocumentError, load
from modelyard.service.errors import ModelLoadError
from modelyard.service.repository.ensemble_config import EnsembleConfig, parse_ensemble
from modelyard.service.repository.files import read_inside, shown
from modelyard.service.repository.model_config_schema import (
    DEFAULT_MAX_QUEUED_RUNS,
    ConfigDoc,
    DecoupledDoc,
    ExecutionDoc,
    GenerationDoc,
    InputDoc,
    OutputDoc,
    QueuePolicyDoc,
    SequenceBatchingDoc,
    VersionPolicyDoc,
    _AdmissionDoc,
)
from modelyard.service.repository.model_config_schema import (
    DEFAULT_MAX_WAITING as DEFAULT_MAX_WAITING,
)
from modelyard.service.repository.warmup_config import WarmupSample, parse_warmup
from modelyard.service.scheduling.queue import AdmissionPolicy, QueuePolicy
from modelyard.tensors import NUMPY_BY_NAME, is_known

CONFIG_FILE = "config.yaml"


class ConfigError(ModelLoadError):
    """config.yaml is missing a value, has a wrong one, or has an unknown key."""

    def __init__(self, message: str) -> None:
        super().__init__(message, kind="config")


@dataclass(frozen=True)
class TensorConfig:
    name: str
    datatype: str
    shape: tuple[int, ...]  # includes the batch dimension (-1) when max_batch_size > 0; -1 = any
    # Outputs only: a file in the model's folder with one class label per line (Triton's
    # classification extension reads labels from it).
    label_filename: str = ""
    # Inputs only: Triton's image layout (FORMAT_NONE, FORMAT_NHWC, FORMAT_NCHW), told to clients.
    format: str = "FORMAT_NONE"


@dataclass(frozen=True)
class VersionPolicy:
    """Which versions on disk are served: the newest `latest`, a `specific` list, or `all`."""

    kind: Literal["latest", "specific", "all"] = "latest"
    latest: int = 1
    versions: tuple[int, ...] = ()

    def select(self, available: list[int]) -> list[int]:
        ordered = sorted(available)
        if self.kind == "all":
            return ordered
        if self.kind == "specific":
            return [v for v in ordered if v in self.versions]
        return ordered[-self.latest :]


# Sessions one version may hold (instances on each device, all devices together): each one is a
# whole copy of the model in memory and a warm-up at load.
MAX_SESSIONS = 16


@dataclass(frozen=True)
class ExecutionConfig:
    provider: Literal["auto", "cuda", "cpu"] = "auto"
    device_id: int = 0  # the first of device_ids when those are given
    gpu_mem_limit_mb: int = 0  # 0 = no limit, per session
    intra_op_threads: int = 0  # 0 = ONNX Runtime's default, per session
    inter_op_threads: int = 0
    instances: int = 1  # sessions on each device (service/runtime/instances.py picks among them)
    # Runs of each version on the service's run threads at once; 0 = a share of them
    # (service/runtime/capacity.py). Runs beyond it wait, at most max_queued_runs (0: no bound).
    max_concurrent_runs: int = 0
    max_queued_runs: int = DEFAULT_MAX_QUEUED_RUNS
    device_ids: tuple[int, ...] = ()  # CUDA devices to place instances on; () = (device_id,)
    # CUDA runs bind their inputs and outputs (runtime/iobinding.py); False: plain session.run.
    io_binding: bool = True

    @property
    def devices(self) -> tuple[int, ...]:
        return self.device_ids or (self.device_id,)

    @property
    def sessions(self) -> int:
        """Sessions a version of this model holds."""
        return self.instances * len(self.devices)


@dataclass(frozen=True)
class DynamicBatchingConfig:
    """How requests to a version are queued and batched (the YAML keys are flat; the priority and
    queue policy keys become `admission`)."""

    # How long a request may wait for others to share its run while a run slot is free; 0 = none:
    # batches still grow under load, from the requests that queue while every slot is busy.
    max_queue_delay_us: int = 0
    # A batch leaves as soon as it reaches the largest of these (or max_batch_size).
    preferred_batch_sizes: tuple[int, ...] = ()
    # Batches of this version that run at once; 0 = sized to the machine (service/batching/batcher.py).
    max_concurrent_batches: int = 0
    admission: AdmissionPolicy = field(default_factory=AdmissionPolicy)


@dataclass(frozen=True)
class ReloadConfig:
    """How new versions of this model replace served ones."""

    allow_schema_change: bool = False  # may a new version change inputs/outputs?
    memory_budget_mb: int = 0  # what all served versions together may take; 0 = no budget
    # When a new version does not fit beside the served one: "fail" keeps the old version serving;
    # "drain_first" releases the old one, then loads (requests in the gap get UNAVAILABLE).
    when_over_budget: Literal["fail", "drain_first"] = "fail"


# How long a stream may wait for a decode slot unless default_queue_policy says otherwise: a
# queue that slow readers keep full must not hold the streams behind them forever.
DEFAULT_GENERATION_QUEUE_TIMEOUT_US = 60_000_000


def _generation_admission() -> AdmissionPolicy:
    return AdmissionPolicy(
        default_queue_policy=QueuePolicy(
            max_queue_size=DEFAULT_MAX_WAITING, default_timeout_us=DEFAULT_GENERATION_QUEUE_TIMEOUT_US
        )
    )


@dataclass(frozen=True)
class GenerationConfig:
    """How a decoder language model serves Generate. Ignored for models that are not decoders.
    The YAML keys are flat; max_waiting and the priority and queue policy keys become `admission`,
    the rules of the wait queue for decode slots (the same rules as dynamic_batching's queue)."""

    max_concurrent_sequences: int = 16  # sequences decoding at once (the rows of a decode step)
    max_tokens: int = 512  # the largest max_tokens a request may ask for
    default_max_tokens: int = 64  # for requests that leave max_tokens at 0
    # 0 = the export's own (config.json, model metadata, its position table); else used when the
    # export states none, or to lower it (service/generation/model.py).
    context_length: int = 0
    eos_token: str = ""  # "" = the tokenizer's end-of-text special token, if it has a known one
    continuous_batching: bool = True  # False: every sequence decodes alone (a benchmark baseline)
    stream_buffer: int = 16  # tokens buffered per stream before its sequence pauses for the reader
    # How long a sequence may stay paused while its reader takes nothing (a stalled client): past
    # it the stream ends (ABORTED) and its decode slot is freed. 0 = no limit.
    stall_timeout_ms: int = 30_000
    # Paused sequences (reader behind) give up their decode slot to waiting ones and keep their
    # cache in host memory until their reader reads again; at most this many are kept (past it
    # the oldest is dropped, its stream ending ABORTED reader_stalled). 0 = no preemption: a
    # paused sequence holds its slot.
    max_preempted: int = 64
    # Chat (Generate's messages): stop sequences of a reply when the request sends none, and
    # whether the reply's text begins with what the template writes for add_generation_prompt
    # (codelm's template opens the reply's function there).
    chat_stop: tuple[str, ...] = ()
    chat_reply_opening: bool = False
    admission: AdmissionPolicy = field(default_factory=_generation_admission)


@dataclass(frozen=True)
class LimitsConfig:
    """What one request may ask of a model, checked from its tensors' headers before decoding.
    Beyond them a request gets RESOURCE_EXHAUSTED naming the limit."""

    max_elements: int = 1 << 24  # elements across all inputs of a request (16 Mi)
    max_request_bytes: int = 64 << 20  # bytes of a request's tensor payloads (64 MiB)


@dataclass(frozen=True)
class ControlInput:
    """A graph input the sequence batcher fills for each step (Triton's control_input)."""

    name: str
    kind: Literal["start", "end", "ready", "corrid"]
    datatype: str
    false_true: tuple[float, float] = (0.0, 1.0)  # start, end, ready: the values for false and true


@dataclass(frozen=True)
class StateConfig:
    """Implicit state: `output_name` of one step is `input_name` of the next step of its sequence."""

    input_name: str
    output_name: str
    datatype: str
    shape: tuple[int, ...]  # as the graph input's, with the batch dimension when max_batch_size > 0
    # The first step's value: its shape and raw little-endian bytes (initial_state: zero_data or a
    # file under initial_state/, read with config.yaml); None: zeros, each -1 dimension 1.
    initial_shape: tuple[int, ...] | None = None
    initial_data: bytes | None = None  # None with initial_shape: zeros
    initial_file: str = ""  # where initial_data was read from (initial_state/<file>)


@dataclass(frozen=True)
class SequenceBatchingConfig:
    """A stateful model (Triton's sequence batcher; service/sequences/)."""

    strategy: Literal["direct", "oldest"] = "direct"
    max_sequence_idle_us: int = 1_000_000
    max_queue_delay_us: int = 0
    max_candidate_sequences: int = 16  # oldest: live sequences per instance
    preferred_batch_sizes: tuple[int, ...] = ()  # oldest
    controls: tuple[ControlInput, ...] = ()
    states: tuple[StateConfig, ...] = ()

    @property
    def internal_inputs(self) -> tuple[str, ...]:
        """Graph inputs the service fills itself: no client sends them."""
        return tuple(c.name for c in self.controls) + tuple(s.input_name for s in self.states)

    @property
    def state_outputs(self) -> tuple[str, ...]:
        return tuple(s.output_name for s in self.states)


@dataclass(frozen=True)
class RepeatConfig:
    """A decoupled producer over a plain graph: one run, and one response, per element of `inputs`
    (service/decoupled/repeat.py)."""

    inputs: tuple[str, ...]
    index_input: str = ""  # a graph input fed the run's index, UINT32 [1]
    delay_input: str = ""  # one of `inputs`: ms to wait before each response
    hold_input: str = ""  # ms the request holds its instance (Triton's repeat WAIT)
    max_delay_ms: int = 60_000


@dataclass(frozen=True)
class DecoupledConfig:
    """0..N responses per request over ModelStreamInfer (Triton's model_transaction_policy)."""

    repeat: RepeatConfig | None = None

    @property
    def internal_inputs(self) -> tuple[str, ...]:
        return (self.repeat.index_input,) if self.repeat is not None and self.repeat.index_input else ()


@dataclass(frozen=True)
class ModelConfig:
    max_batch_size: int = 0
    version_policy: VersionPolicy = field(default_factory=VersionPolicy)
    inputs: tuple[TensorConfig, ...] = ()
    outputs: tuple[TensorConfig, ...] = ()
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    dynamic_batching: DynamicBatchingConfig | None = None
    reload: ReloadConfig = field(default_factory=ReloadConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    # Triton's model_warmup: the samples a version runs before it serves (runtime/warmup.py);
    # () = synthetic inputs (zeros, empty strings), skipped where the model refuses them.
    model_warmup: tuple[WarmupSample, ...] = ()
    # Triton's platform: onnxruntime_onnx (a version is model.onnx) or ensemble (`ensemble` says
    # its steps; service/ensembles/ runs them).
    platform: str = "onnxruntime_onnx"
    ensemble: EnsembleConfig | None = None
    sequence_batching: SequenceBatchingConfig | None = None
    decoupled: DecoupledConfig | None = None

    @property
    def internal_inputs(self) -> tuple[str, ...]:
        """Graph inputs the service fills (sequence controls and state, a repeat's index): they
        are not part of the signature clients see."""
        inputs: tuple[str, ...] = ()
        if self.sequence_batching is not None:
            inputs += self.sequence_batching.internal_inputs
        if self.decoupled is not None:
            inputs += self.decoupled.internal_inputs
        return inputs

    @property
    def hidden_outputs(self) -> tuple[str, ...]:
        """Graph outputs clients do not see: a state's output, unless `outputs` lists it (as
        Triton, which returns the output state only to a client that the config lets ask)."""
        if self.sequence_batching is None:
            return ()
        listed = {t.name for t in self.outputs}
        return tuple(name for name in self.sequence_batching.state_outputs if name not in listed)


def load_config(model_dir: Path, root: Path | None = None) -> ModelConfig:
    """The model's config.yaml, or defaults when there is none. `root` is the repository (default:
    the model folder's parent); a config.yaml that resolves outside it is refused unopened."""
    root = model_dir.parent if root is None else root
    path = model_dir / CONFIG_FILE
    if not path.is_file():
        return ModelConfig()
    name = shown(root, path)
    try:
        text = read_inside(root, path).decode("utf-8")
    except ModelLoadError as exc:
        raise ConfigError(str(exc)) from None
    except UnicodeDecodeError:
        raise ConfigError(f"{name}: not UTF-8 text") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{name}: not valid YAML{_where(exc)}") from None
    try:
        config = parse_config(raw if raw is not None else {})
        return with_initial_states(config, model_dir, root)
    except ConfigError as exc:
        raise ConfigError(f"{name}: {exc}") from None


def _where(exc: yaml.YAMLError) -> str:
    """Where the YAML parser stopped, without its message: the parser quotes the text it read."""
    mark = getattr(exc, "problem_mark", None)
    if mark is None:
        return ""
    return f" (line {mark.line + 1}, column {mark.column + 1})"


def parse_config(raw: object) -> ModelConfig:
    """A parsed config.yaml as the service's ModelConfig: the keys checked against their declaration
    (model_config_schema.ConfigDoc), then what no single key can say."""
    try:
        doc = load(raw, ConfigDoc, "config")
        ensemble = _ensemble(doc)
        return ModelConfig(
            max_batch_size=doc.max_batch_size,
            version_policy=_version_policy(doc.version_policy),
            inputs=_tensors(doc.inputs, "inputs", doc.max_batch_size),
            outputs=_tensors(doc.outputs, "outputs", doc.max_batch_size),
            execution=_execution(doc.execution),
            dynamic_batching=None if doc.dynamic_batching is None else _batching(doc),
            reload=ReloadConfig(
                doc.reload.allow_schema_change, doc.reload.memory_budget_mb, doc.reload.when_over_budget
            ),
            generation=_generation(doc.generation),
            limits=LimitsConfig(doc.limits.max_elements, doc.limits.max_request_bytes),
            model_warmup=parse_warmup(doc.model_warmup),
            platform=doc.platform,
            ensemble=ensemble,
            sequence_batching=None
            if doc.sequence_batching is None
            else _sequences(doc, doc.sequence_batching),
            decoupled=None if doc.decoupled is None else _decoupled(doc, doc.decoupled),
        )
    except DocumentError as exc:
        raise ConfigError(str(exc)) from None


def _ensemble(doc: ConfigDoc) -> EnsembleConfig | None:
    """An ensemble's steps (platform: ensemble), and the keys that only a model file's version
    has refused beside them."""
    if doc.platform != "ensemble":
        if doc.ensemble_scheduling is not None:
            raise DocumentError("ensemble_scheduling", "needs platform: ensemble")
        return None
    if doc.ensemble_scheduling is None:
        raise DocumentError("platform", "ensemble needs ensemble_scheduling (its steps)")
    if not doc.inputs or not doc.outputs:
        raise DocumentError("platform", "an ensemble declares its inputs and outputs (it has no graph)")
    for key in ("dynamic_batching", "model_warmup"):
        if getattr(doc, key):
            raise DocumentError(key, "not for an ensemble (its steps' models batch and warm up)")
    return parse_ensemble(
        doc.ensemble_scheduling, [t.name for t in doc.inputs], [t.name for t in doc.outputs]
    )


def _version_policy(doc: VersionPolicyDoc) -> VersionPolicy:
    given = [key for key in ("latest", "specific", "all") if getattr(doc, key) is not UNSET]
    if len(given) != 1:
        raise DocumentError("version_policy", "give exactly one of latest, specific, all")
    if not isinstance(doc.latest, UnsetType):
        return VersionPolicy("latest", latest=doc.latest)
    if not isinstance(doc.specific, UnsetType):
        return VersionPolicy("specific", versions=tuple(doc.specific))
    return VersionPolicy("all")


def _tensors(
    docs: Sequence[InputDoc | OutputDoc], where: str, max_batch_size: int
) -> tuple[TensorConfig, ...]:
    tensors = []
    for i, doc in enumerate(docs):
        if not is_known(doc.datatype):
            raise DocumentError(f"{where}[{i}] ({doc.name}).datatype", f"unknown datatype {doc.datatype!r}")
        labels = doc.label_filename if isinstance(doc, OutputDoc) else ""
        layout = doc.format if isinstance(doc, InputDoc) else "FORMAT_NONE"
        if layout != "FORMAT_NONE" and len(doc.shape) - (1 if max_batch_size else 0) != 3:
            # As Triton: an image layout names three dimensions (beside the batch's).
            raise DocumentError(
                f"{where}[{i}] ({doc.name}).format",
                f"{layout} needs 3 dimensions beside the batch's, the shape {doc.shape} has "
                f"{len(doc.shape) - (1 if max_batch_size else 0)}",
            )
        tensors.append(TensorConfig(doc.name, doc.datatype, tuple(doc.shape), labels, layout))
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise DocumentError(where, "duplicate tensor names")
    return tuple(tensors)


def _execution(doc: ExecutionDoc) -> ExecutionConfig:
    device_ids: tuple[int, ...] = ()
    if not isinstance(doc.device_ids, UnsetType):
        if not isinstance(doc.device_id, UnsetType):
            raise DocumentError("execution", "give device_id or device_ids, not both")
        if doc.provider == "cpu":
            raise DocumentError("execution.device_ids", "names CUDA devices, but execution.provider is cpu")
        device_ids = tuple(doc.device_ids)
        if len(set(device_ids)) != len(device_ids):
            raise DocumentError(
                "execution.device_ids", f"{list(device_ids)} names a device twice (use instances)"
            )
    execution = ExecutionConfig(
        provider=doc.provider,
        device_id=device_ids[0]
        if device_ids
        else (0 if isinstance(doc.device_id, UnsetType) else doc.device_id),
        gpu_mem_limit_mb=doc.gpu_mem_limit_mb,
        intra_op_threads=doc.intra_op_threads,
        inter_op_threads=doc.inter_op_threads,
        instances=doc.instances,
        device_ids=device_ids,
        io_binding=doc.io_binding,
        max_concurrent_runs=doc.max_concurrent_runs,
        max_queued_runs=doc.max_queued_runs,
    )
    if execution.sessions > MAX_SESSIONS:
        raise DocumentError(
            "execution.instances",
            f"{execution.instances} on each of {len(execution.devices)} device(s) make {execution.sessions} "
            f"sessions; at most {MAX_SESSIONS} per version",
        )
    return execution


def _batching(config: ConfigDoc) -> DynamicBatchingConfig:
    doc = config.dynamic_batching
    assert doc is not None
    if config.max_batch_size < 1:
        raise DocumentError("dynamic_batching", "needs max_batch_size >= 1 (requests are batched along it)")
    preferred = tuple(doc.preferred_batch_sizes)
    if any(size > config.max_batch_size for size in preferred):
        raise DocumentError(
            "dynamic_batching.preferred_batch_sizes",
            f"{list(preferred)} has a size above max_batch_size {config.max_batch_size}",
        )
    return DynamicBatchingConfig(
        max_queue_delay_us=doc.max_queue_delay_us,
        preferred_batch_sizes=preferred,
        max_concurrent_batches=doc.max_concurrent_batches,
        admission=_admission(doc, "dynamic_batching", QueuePolicy()),
    )


def _admission(doc: _AdmissionDoc, where: str, base: QueuePolicy) -> AdmissionPolicy:
    """The admission keys of section `where`; `base` gives what default_queue_policy leaves out."""
    levels = doc.priority_levels
    # Requests that name no priority wait at the lowest level unless the config says otherwise, so
    # that latency-sensitive callers can go ahead by asking for a higher one.
    default_level = (
        levels if isinstance(doc.default_priority_level, UnsetType) else doc.default_priority_level
    )
    if default_level > levels:
        raise DocumentError(
            f"{where}.default_priority_level",
            f"{default_level} is not a level in 1..{levels} (priority_levels)",
        )
    default = _queue_policy(doc.default_queue_policy, base)
    per_level = []
    for key, value in sorted(doc.priority_queue_policy.items()):
        if not 1 <= key <= levels:
            raise DocumentError(
                f"{where}.priority_queue_policy", f"key {key!r} is not a priority level in 1..{levels}"
            )
        # Keys a level leaves out come from default_queue_policy.
        per_level.append((key, _queue_policy(value, default)))
    return AdmissionPolicy(levels, default_level, default, tuple(per_level))


def _queue_policy(doc: QueuePolicyDoc, base: QueuePolicy) -> QueuePolicy:
    return QueuePolicy(
        max_queue_size=base.max_queue_size
        if isinstance(doc.max_queue_size, UnsetType)
        else doc.max_queue_size,
        default_timeout_us=(
            base.default_timeout_us
            if isinstance(doc.default_timeout_us, UnsetType)
            else doc.default_timeout_us
        ),
        allow_timeout_override=(
            base.allow_timeout_override
            if isinstance(doc.allow_timeout_override, UnsetType)
            else doc.allow_timeout_override
        ),
    )


def _generation(doc: GenerationDoc) -> GenerationConfig:
    config = GenerationConfig(
        max_concurrent_sequences=doc.max_concurrent_sequences,
        max_tokens=doc.max_tokens,
        default_max_tokens=doc.default_max_tokens,
        context_length=doc.context_length,
        eos_token=doc.eos_token,
        continuous_batching=doc.continuous_batching,
        stream_buffer=doc.stream_buffer,
        stall_timeout_ms=doc.stall_timeout_ms,
        max_preempted=doc.max_preempted,
        chat_stop=tuple(doc.chat_stop),
        chat_reply_opening=doc.chat_reply_opening,
        admission=_admission(
            doc,
            "generation",
            QueuePolicy(
                max_queue_size=doc.max_waiting, default_timeout_us=DEFAULT_GENERATION_QUEUE_TIMEOUT_US
            ),
        ),
    )
    if config.default_max_tokens > config.max_tokens:
        raise DocumentError(
            "generation.default_max_tokens",
            f"{config.default_max_tokens} exceeds generation.max_tokens ({config.max_tokens})",
        )
    return config


# Triton's control kinds whose values are false/true flags, and the datatypes each kind may have.
_FLAG_TYPES = ("INT32", "FP32", "BOOL")
_CORRID_TYPES = ("UINT64", "INT64", "UINT32", "INT32", "BYTES")


def _sequences(config: ConfigDoc, doc: SequenceBatchingDoc) -> SequenceBatchingConfig:
    where = "sequence_batching"
    if config.dynamic_batching is not None:
        raise DocumentError(where, "a model has one scheduler: give dynamic_batching or sequence_batching")
    if config.decoupled is not None:
        raise DocumentError(where, "a decoupled sequence model is not supported")
    controls = []
    for i, control in enumerate(doc.control_inputs):
        at = f"{where}.control_inputs[{i}] ({control.name})"
        if control.kind == "corrid":
            if control.datatype not in _CORRID_TYPES:
                raise DocumentError(f"{at}.datatype", f"a corrid control is one of {list(_CORRID_TYPES)}")
            if not isinstance(control.false_true, UnsetType):
                raise DocumentError(f"{at}.false_true", "a corrid control carries the id, not flags")
            controls.append(ControlInput(control.name, control.kind, control.datatype))
            continue
        if control.datatype not in _FLAG_TYPES:
            raise DocumentError(f"{at}.datatype", f"a {control.kind} control is one of {list(_FLAG_TYPES)}")
        if isinstance(control.false_true, UnsetType):
            raise DocumentError(f"{at}.false_true", "give the values for false and true, e.g. [0, 1]")
        false, true = control.false_true
        controls.append(ControlInput(control.name, control.kind, control.datatype, (false, true)))
    kinds = [c.kind for c in controls]
    if len(set(kinds)) != len(kinds):
        raise DocumentError(f"{where}.control_inputs", "one control of each kind at most")
    states = []
    for i, state in enumerate(doc.states):
        at = f"{where}.states[{i}] ({state.input_name})"
        if not is_known(state.datatype):
            raise DocumentError(f"{at}.datatype", f"unknown datatype {state.datatype!r}")
        shape = tuple(state.shape)
        if config.max_batch_size and (not shape or shape[0] != -1):
            raise DocumentError(f"{at}.shape", "starts with the batch dimension (-1): max_batch_size > 0")
        initial_shape: tuple[int, ...] | None = None
        initial_file = ""
        if state.initial_state is not None:
            initial = state.initial_state
            if initial.zero_data == bool(initial.data_file):
                raise DocumentError(f"{at}.initial_state", "give zero_data: true or a data_file")
            initial_shape = tuple(initial.shape)
            fits = len(initial_shape) == len(shape) and all(
                want in (-1, have) for want, have in zip(shape, initial_shape, strict=True)
            )
            if not fits or (config.max_batch_size and initial_shape[0] != 1):
                raise DocumentError(
                    f"{at}.initial_state.shape",
                    f"{list(initial_shape)} does not fit the state's shape {list(shape)}"
                    + (" (one row: the batch dimension is 1)" if config.max_batch_size else ""),
                )
            initial_file = initial.data_file  # read with config.yaml (with_initial_states)
        states.append(
            StateConfig(
                state.input_name,
                state.output_name,
                state.datatype,
                shape,
                initial_shape,
                initial_file=initial_file,
            )
        )
    names = [c.name for c in controls] + [s.input_name for s in states]
    if len(set(names)) != len(names):
        raise DocumentError(where, "control and state inputs must have distinct names")
    outputs = [s.output_name for s in states]
    if len(set(outputs)) != len(outputs):
        raise DocumentError(f"{where}.states", "two states have the same output_name")
    listed = {t.name for t in config.inputs}
    clash = sorted(listed & set(names))
    if clash:
        raise DocumentError(
            "inputs",
            f"{clash[0]!r} is a control or state input, filled by the service: leave it out of inputs",
        )
    preferred = tuple(doc.preferred_batch_sizes)
    if any(size > max(1, config.max_batch_size) for size in preferred):
        raise DocumentError(
            f"{where}.preferred_batch_sizes",
            f"{list(preferred)} has a size above max_batch_size {config.max_batch_size}",
        )
    return SequenceBatchingConfig(
        strategy=doc.strategy,
        max_sequence_idle_us=doc.max_sequence_idle_us,
        max_queue_delay_us=doc.max_queue_delay_us,
        max_candidate_sequences=doc.max_candidate_sequences,
        preferred_batch_sizes=preferred,
        controls=tuple(controls),
        states=tuple(states),
    )


def _decoupled(config: ConfigDoc, doc: DecoupledDoc) -> DecoupledConfig:
    if config.dynamic_batching is not None:
        raise DocumentError(
            "decoupled", "a decoupled model runs each request alone: leave out dynamic_batching"
        )
    if doc.repeat is None:
        return DecoupledConfig()
    repeat = doc.repeat
    where = "decoupled.repeat"
    if config.max_batch_size:
        raise DocumentError(where, "needs max_batch_size 0 (each run takes one element, as Triton's repeat)")
    inputs = tuple(repeat.inputs)
    if len(set(inputs)) != len(inputs):
        raise DocumentError(f"{where}.inputs", "names an input twice")
    if repeat.delay_input and repeat.delay_input not in inputs:
        raise DocumentError(
            f"{where}.delay_input", f"{repeat.delay_input!r} is not one of inputs {list(inputs)}"
        )
    for key in ("index_input", "hold_input"):
        name = getattr(repeat, key)
        if name and name in inputs:
            raise DocumentError(f"{where}.{key}", f"{name!r} is one of inputs: it is not split")
    if repeat.index_input and repeat.index_input == repeat.hold_input:
        raise DocumentError(f"{where}.hold_input", "is the index input")
    return DecoupledConfig(
        RepeatConfig(inputs, repeat.index_input, repeat.delay_input, repeat.hold_input, repeat.max_delay_ms)
    )


# Where a state's initial value is read from: <model>/initial_state/<data_file> (as Triton).
INITIAL_STATE_DIR = "initial_state"


def with_initial_states(config: ModelConfig, model_dir: Path, root: Path) -> ModelConfig:
    """`config` with each state's initial_state.data_file read (its raw elements, exactly the
    state's size), from inside the repository. Without data files, `config` itself."""
    batching = config.sequence_batching
    if batching is None or not any(s.initial_file for s in batching.states):
        return config
    states = []
    for state in batching.states:
        if not state.initial_file or state.initial_shape is None:
            states.append(state)
            continue
        path = model_dir / INITIAL_STATE_DIR / state.initial_file
        where = f"sequence_batching.states ({state.input_name}).initial_state.data_file"
        size = NUMPY_BY_NAME[state.datatype].itemsize
        for dim in state.initial_shape:
            size *= dim
        if state.datatype == "BYTES":
            raise ConfigError(f"{where}: a BYTES state starts from zero_data only")
        try:
            data = read_inside(root, path, limit=size)
        except ModelLoadError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        if len(data) != size:
            raise ConfigError(
                f"{where}: {shown(root, path)} holds {len(data)} bytes; the state's initial shape "
                f"{list(state.initial_shape)} of {state.datatype} takes {size}"
            )
        states.append(replace(state, initial_data=data))
    return replace(config, sequence_batching=replace(batching, states=tuple(states)))
