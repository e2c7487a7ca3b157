"""Per-model configuration (`models/<name>/config.yaml`), parsed strictly into frozen dataclasses.

Unknown keys are errors: a typo in a serving config must fail loudly, not be ignored.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import yaml
from modelyard.tensors import is_known

from service.errors import ModelLoadError
from service.repository.files import read_inside, shown
from service.scheduling.queue import AdmissionPolicy, QueuePolicy

CONFIG_FILE = "config.yaml"
# A label file is a plain file name beside config.yaml: no folders, nothing hidden.
_LABEL_FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


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
    device_ids: tuple[int, ...] = ()  # CUDA devices to place instances on; () = (device_id,)

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


# `generation.max_waiting`: how many sequences may wait for a decode slot, unless the section's
# default_queue_policy sets max_queue_size itself.
DEFAULT_MAX_WAITING = 64
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
    context_length: int = 0  # 0 = from the model file's metadata (context_length, n_positions, ...)
    eos_token: str = ""  # "" = the tokenizer's end-of-text special token, if it has a known one
    continuous_batching: bool = True  # False: every sequence decodes alone (a benchmark baseline)
    stream_buffer: int = 16  # tokens buffered per stream before its sequence pauses for the reader
    # How long a sequence may stay paused while its reader takes nothing (a stalled client): past
    # it the stream ends (ABORTED) and its decode slot is freed. 0 = no limit.
    stall_timeout_ms: int = 30_000
    admission: AdmissionPolicy = field(default_factory=_generation_admission)


@dataclass(frozen=True)
class LimitsConfig:
    """What one request may ask of a model, checked from its tensors' headers before decoding.
    Beyond them a request gets RESOURCE_EXHAUSTED naming the limit."""

    max_elements: int = 1 << 24  # elements across all inputs of a request (16 Mi)
    max_request_bytes: int = 64 << 20  # bytes of a request's tensor payloads (64 MiB)


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
        return parse_config(raw if raw is not None else {})
    except ConfigError as exc:
        raise ConfigError(f"{name}: {exc}") from None


def _where(exc: yaml.YAMLError) -> str:
    """Where the YAML parser stopped, without its message: the parser quotes the text it read."""
    mark = getattr(exc, "problem_mark", None)
    if mark is None:
        return ""
    return f" (line {mark.line + 1}, column {mark.column + 1})"


def parse_config(raw: object) -> ModelConfig:
    doc = _mapping(raw, "config")
    _known(
        doc,
        "config",
        {
            "max_batch_size",
            "version_policy",
            "inputs",
            "outputs",
            "execution",
            "dynamic_batching",
            "reload",
            "generation",
            "limits",
        },
    )
    batching = doc.get("dynamic_batching")
    return ModelConfig(
        max_batch_size=_int(doc.get("max_batch_size", 0), "max_batch_size", minimum=0),
        version_policy=_version_policy(doc.get("version_policy", {"latest": 1})),
        inputs=_tensors(doc.get("inputs", []), "inputs"),
        outputs=_tensors(doc.get("outputs", []), "outputs"),
        execution=_execution(doc.get("execution", {})),
        dynamic_batching=None if batching is None else _batching(batching, doc.get("max_batch_size", 0)),
        reload=_reload(doc.get("reload", {})),
        generation=_generation(doc.get("generation", {})),
        limits=_limits(doc.get("limits", {})),
    )


def _version_policy(raw: object) -> VersionPolicy:
    doc = _mapping(raw, "version_policy")
    if len(doc) != 1:
        raise ConfigError("version_policy: give exactly one of latest, specific, all")
    ((kind, value),) = doc.items()
    if kind == "latest":
        return VersionPolicy("latest", latest=_int(value, "version_policy.latest", minimum=1))
    if kind == "specific":
        if not isinstance(value, list) or not value:
            raise ConfigError("version_policy.specific: expected a non-empty list of versions")
        versions = tuple(_int(v, "version_policy.specific[]", minimum=0) for v in value)
        return VersionPolicy("specific", versions=versions)
    if kind == "all":
        if value not in (None, {}):
            raise ConfigError("version_policy.all: expected {}")
        return VersionPolicy("all")
    raise ConfigError(f"version_policy: unknown policy {kind!r} (expected latest, specific or all)")


def _tensors(raw: object, where: str) -> tuple[TensorConfig, ...]:
    if not isinstance(raw, list):
        raise ConfigError(f"{where}: expected a list")
    tensors = []
    for i, item in enumerate(raw):
        doc = _mapping(item, f"{where}[{i}]")
        _known(
            doc,
            f"{where}[{i}]",
            {"name", "datatype", "shape", *(("label_filename",) if where == "outputs" else ())},
        )
        name = doc.get("name")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}[{i}].name: expected a non-empty string")
        datatype = doc.get("datatype")
        if not isinstance(datatype, str) or not is_known(datatype):
            raise ConfigError(f"{where}[{i}] ({name}).datatype: unknown datatype {datatype!r}")
        shape = doc.get("shape")
        if not isinstance(shape, list):
            raise ConfigError(f"{where}[{i}] ({name}).shape: expected a list of integers")
        dims = tuple(_int(d, f"{where}[{i}] ({name}).shape[]", minimum=-1) for d in shape)
        labels = doc.get("label_filename", "")
        if not isinstance(labels, str) or (labels and not _LABEL_FILE.match(labels)):
            raise ConfigError(
                f"{where}[{i}] ({name}).label_filename: expected a file name in the model's folder, "
                f"got {labels!r}"
            )
        tensors.append(TensorConfig(name, datatype, dims, labels))
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}: duplicate tensor names")
    return tuple(tensors)


def _execution(raw: object) -> ExecutionConfig:
    doc = _mapping(raw, "execution")
    _known(
        doc,
        "execution",
        {
            "provider",
            "device_id",
            "device_ids",
            "gpu_mem_limit_mb",
            "intra_op_threads",
            "inter_op_threads",
            "instances",
        },
    )
    provider = doc.get("provider", "auto")
    if provider not in ("auto", "cuda", "cpu"):
        raise ConfigError(f"execution.provider: expected auto, cuda or cpu, got {provider!r}")
    device_ids = _device_ids(doc, provider)
    execution = ExecutionConfig(
        provider=provider,
        device_id=device_ids[0] if device_ids else _int(doc.get("device_id", 0), "execution.device_id", 0),
        gpu_mem_limit_mb=_int(doc.get("gpu_mem_limit_mb", 0), "execution.gpu_mem_limit_mb", minimum=0),
        intra_op_threads=_int(doc.get("intra_op_threads", 0), "execution.intra_op_threads", minimum=0),
        inter_op_threads=_int(doc.get("inter_op_threads", 0), "execution.inter_op_threads", minimum=0),
        instances=_int(doc.get("instances", 1), "execution.instances", minimum=1),
        device_ids=device_ids,
    )
    if execution.sessions > MAX_SESSIONS:
        raise ConfigError(
            f"execution.instances: {execution.instances} on each of {len(execution.devices)} device(s) "
            f"make {execution.sessions} sessions; at most {MAX_SESSIONS} per version"
        )
    return execution


def _device_ids(doc: Mapping[str, Any], provider: str) -> tuple[int, ...]:
    raw = doc.get("device_ids")
    if raw is None:
        return ()
    if "device_id" in doc:
        raise ConfigError("execution: give device_id or device_ids, not both")
    if provider == "cpu":
        raise ConfigError("execution.device_ids: names CUDA devices, but execution.provider is cpu")
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"execution.device_ids: expected a non-empty list of device numbers, got {raw!r}")
    ids = tuple(_int(d, "execution.device_ids[]", minimum=0) for d in raw)
    if len(set(ids)) != len(ids):
        raise ConfigError(f"execution.device_ids: {list(ids)} names a device twice (use instances)")
    return ids


def _batching(raw: object, max_batch_size: object) -> DynamicBatchingConfig:
    doc = _mapping(raw, "dynamic_batching")
    _known(
        doc,
        "dynamic_batching",
        {"max_queue_delay_us", "preferred_batch_sizes", "max_concurrent_batches", *ADMISSION_KEYS},
    )
    if not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise ConfigError("dynamic_batching: needs max_batch_size >= 1 (requests are batched along it)")
    sizes = doc.get("preferred_batch_sizes", [])
    if not isinstance(sizes, list):
        raise ConfigError("dynamic_batching.preferred_batch_sizes: expected a list of integers")
    preferred = tuple(_int(s, "dynamic_batching.preferred_batch_sizes[]", minimum=1) for s in sizes)
    if any(size > max_batch_size for size in preferred):
        raise ConfigError(
            f"dynamic_batching.preferred_batch_sizes: {list(preferred)} has a size above max_batch_size "
            f"{max_batch_size}"
        )
    return DynamicBatchingConfig(
        max_queue_delay_us=_int(doc.get("max_queue_delay_us", 0), "dynamic_batching.max_queue_delay_us", 0),
        preferred_batch_sizes=preferred,
        max_concurrent_batches=_int(
            doc.get("max_concurrent_batches", 0), "dynamic_batching.max_concurrent_batches", 0
        ),
        admission=_admission(doc, "dynamic_batching", QueuePolicy()),
    )


# The keys of a queue's admission rules, the same in every section that queues work.
ADMISSION_KEYS = (
    "priority_levels",
    "default_priority_level",
    "default_queue_policy",
    "priority_queue_policy",
)


def _admission(doc: Mapping[str, Any], where: str, base: QueuePolicy) -> AdmissionPolicy:
    """The admission keys of section `where`; `base` gives what default_queue_policy leaves out."""
    levels = _int(doc.get("priority_levels", 1), f"{where}.priority_levels", minimum=1)
    # Requests that name no priority wait at the lowest level unless the config says otherwise, so
    # that latency-sensitive callers can go ahead by asking for a higher one.
    default_level = _int(doc.get("default_priority_level", levels), f"{where}.default_priority_level", 1)
    if default_level > levels:
        raise ConfigError(
            f"{where}.default_priority_level: {default_level} is not a level in 1..{levels} (priority_levels)"
        )
    default = _queue_policy(doc.get("default_queue_policy", {}), f"{where}.default_queue_policy", base)
    raw_levels = _mapping(doc.get("priority_queue_policy", {}), f"{where}.priority_queue_policy")
    per_level = []
    for name, value in raw_levels.items():
        key: object = name  # YAML gives int keys for `{1: ...}`; anything else is an error
        if isinstance(key, bool) or not isinstance(key, int) or not 1 <= key <= levels:
            raise ConfigError(
                f"{where}.priority_queue_policy: key {key!r} is not a priority level in 1..{levels}"
            )
        # Keys a level leaves out come from default_queue_policy.
        per_level.append((key, _queue_policy(value, f"{where}.priority_queue_policy.{key}", default)))
    return AdmissionPolicy(levels, default_level, default, tuple(sorted(per_level, key=lambda kv: kv[0])))


def _queue_policy(raw: object, where: str, base: QueuePolicy) -> QueuePolicy:
    doc = _mapping(raw, where)
    _known(doc, where, {"max_queue_size", "default_timeout_us", "allow_timeout_override"})
    allow = doc.get("allow_timeout_override", base.allow_timeout_override)
    if not isinstance(allow, bool):
        raise ConfigError(f"{where}.allow_timeout_override: expected true or false, got {allow!r}")
    return QueuePolicy(
        max_queue_size=_int(doc.get("max_queue_size", base.max_queue_size), f"{where}.max_queue_size", 0),
        default_timeout_us=_int(
            doc.get("default_timeout_us", base.default_timeout_us), f"{where}.default_timeout_us", 0
        ),
        allow_timeout_override=allow,
    )


def _reload(raw: object) -> ReloadConfig:
    doc = _mapping(raw, "reload")
    _known(doc, "reload", {"allow_schema_change", "memory_budget_mb", "when_over_budget"})
    allow = _bool(doc.get("allow_schema_change", False), "reload.allow_schema_change")
    when = doc.get("when_over_budget", "fail")
    if when not in ("fail", "drain_first"):
        raise ConfigError(f"reload.when_over_budget: expected fail or drain_first, got {when!r}")
    return ReloadConfig(allow, _int(doc.get("memory_budget_mb", 0), "reload.memory_budget_mb", 0), when)


def _generation(raw: object) -> GenerationConfig:
    doc = _mapping(raw, "generation")
    defaults = GenerationConfig()
    flat = {f.name for f in fields(GenerationConfig)} - {"admission"}
    _known(doc, "generation", {*flat, "max_waiting", *ADMISSION_KEYS})
    eos = doc.get("eos_token", defaults.eos_token)
    if not isinstance(eos, str):
        raise ConfigError(f"generation.eos_token: expected a string, got {eos!r}")
    batching = _bool(
        doc.get("continuous_batching", defaults.continuous_batching), "generation.continuous_batching"
    )

    def count(key: str, minimum: int) -> int:
        return _int(doc.get(key, getattr(defaults, key)), f"generation.{key}", minimum)

    # max_waiting (older than the queue policies) is the default queue's size; it must be at least
    # 1 because a max_queue_size of 0 means "no bound", the opposite of what 0 waiting used to mean.
    waiting = _int(doc.get("max_waiting", DEFAULT_MAX_WAITING), "generation.max_waiting", minimum=1)
    config = GenerationConfig(
        max_concurrent_sequences=count("max_concurrent_sequences", 1),
        max_tokens=count("max_tokens", 1),
        default_max_tokens=count("default_max_tokens", 1),
        context_length=count("context_length", 0),
        eos_token=eos,
        continuous_batching=batching,
        stream_buffer=count("stream_buffer", 1),
        stall_timeout_ms=count("stall_timeout_ms", 0),
        admission=_admission(
            doc,
            "generation",
            QueuePolicy(max_queue_size=waiting, default_timeout_us=DEFAULT_GENERATION_QUEUE_TIMEOUT_US),
        ),
    )
    if config.default_max_tokens > config.max_tokens:
        raise ConfigError(
            f"generation.default_max_tokens ({config.default_max_tokens}) exceeds generation.max_tokens "
            f"({config.max_tokens})"
        )
    return config


def _limits(raw: object) -> LimitsConfig:
    doc = _mapping(raw, "limits")
    _known(doc, "limits", {"max_elements", "max_request_bytes"})
    defaults = LimitsConfig()
    return LimitsConfig(
        max_elements=_int(doc.get("max_elements", defaults.max_elements), "limits.max_elements", 1),
        max_request_bytes=_int(
            doc.get("max_request_bytes", defaults.max_request_bytes), "limits.max_request_bytes", 1
        ),
    )


def _mapping(raw: object, where: str) -> Mapping[str, Any]:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__}")
    return raw


def _known(doc: Mapping[str, Any], where: str, allowed: set[str]) -> None:
    unknown = sorted(set(doc) - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(map(str, unknown))}")


def _bool(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    return value


def _int(value: object, where: str, minimum: int) -> int:
    # bool is an int in Python; `true` is never a valid count.
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{where}: expected an integer >= {minimum}, got {value!r}")
    return value
