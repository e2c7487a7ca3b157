"""What a model's `config.yaml` may say: its keys as written, their types, defaults, bounds and help,
declared once (modelyard.process.documents). The parsing and key-path messages come from it, and so
does `service/repository/config.schema.json`, the JSON Schema editors validate config.yaml with.
service/repository/model_config.py turns a document into the ModelConfig the service uses and checks
what a single key cannot say (one version policy, batch sizes within max_batch_size, ...).

Keys left out are UNSET where the default depends on other keys (device_id vs device_ids, a
queue policy inheriting from default_queue_policy).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from modelyard.tensors import NUMPY_BY_NAME

Count = Annotated[int, Meta(ge=0)]
Positive = Annotated[int, Meta(ge=1)]
# A label file is a plain file name beside config.yaml: no folders, nothing hidden.
LABEL_FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


class _Keys(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """A mapping of known keys: an unknown key is an error (a typo must fail loudly)."""


class _TensorDoc(_Keys):
    name: Annotated[str, Meta(min_length=1, description="tensor name, as in the model file")]
    datatype: Annotated[
        str,
        Meta(
            description="KServe datatype (FP32, INT64, BYTES, ...)",
            extra_json_schema={"enum": sorted(NUMPY_BY_NAME)},
        ),
    ]
    shape: Annotated[
        list[Annotated[int, Meta(ge=-1)]],
        Meta(description="dimensions, -1 = any; includes the batch dimension (-1) when max_batch_size > 0"),
    ]


# Triton's ModelInput.Format: how an image input's dimensions are laid out (clients read it).
InputFormat = Literal["FORMAT_NONE", "FORMAT_NHWC", "FORMAT_NCHW"]


class InputDoc(_TensorDoc):
    format: Annotated[
        InputFormat,
        Meta(description="image layout (Triton's): NHWC and NCHW need 3 dimensions beside the batch's"),
    ] = "FORMAT_NONE"


class OutputDoc(_TensorDoc):
    label_filename: Annotated[
        str,
        Meta(
            pattern=f"^$|{LABEL_FILE.pattern}",
            description="a file in the model's folder with one class label per line (classification)",
            extra={"expects": "a file name in the model's folder"},
        ),
    ] = ""


class VersionPolicyDoc(_Keys):
    """Exactly one of latest, specific, all."""

    latest: Annotated[Positive | UnsetType, Meta(description="serve the newest N versions")] = UNSET
    specific: Annotated[
        Annotated[list[Count], Meta(min_length=1)] | UnsetType, Meta(description="serve these versions")
    ] = UNSET
    all: Annotated[
        Annotated[dict[str, Any], Meta(max_length=0, extra={"expects": "{}"})] | UnsetType | None,
        Meta(description="serve every version on disk: {}"),
    ] = UNSET


# `execution.max_queued_runs`: how many runs of a version may wait for its run bound.
DEFAULT_MAX_QUEUED_RUNS = 128


class ExecutionDoc(_Keys):
    provider: Annotated[
        Literal["auto", "cuda", "cpu"], Meta(description="execution provider; auto: CUDA when available")
    ] = "auto"
    device_id: Annotated[Count | UnsetType, Meta(description="the CUDA device (or give device_ids)")] = UNSET
    device_ids: Annotated[
        Annotated[list[Count], Meta(min_length=1)] | UnsetType,
        Meta(description="CUDA devices to place instances on"),
    ] = UNSET
    gpu_mem_limit_mb: Annotated[Count, Meta(description="GPU memory per session, MiB; 0 = no limit")] = 0
    intra_op_threads: Annotated[Count, Meta(description="per session; 0 = ONNX Runtime's default")] = 0
    inter_op_threads: Annotated[Count, Meta(description="per session; 0 = ONNX Runtime's default")] = 0
    instances: Annotated[Positive, Meta(description="sessions on each device")] = 1
    max_concurrent_runs: Annotated[
        Count,
        Meta(
            description="runs of each version on the service's run threads at once; 0 = a share of "
            "the threads among the served versions that run there"
        ),
    ] = 0
    max_queued_runs: Annotated[
        Count,
        Meta(
            description="runs of each version (without dynamic_batching) that may wait for one of "
            "those; more: RESOURCE_EXHAUSTED; 0 = no bound"
        ),
    ] = DEFAULT_MAX_QUEUED_RUNS
    io_binding: Annotated[
        bool, Meta(description="CUDA runs bind inputs and outputs to the device; false: plain session.run")
    ] = True


class QueuePolicyDoc(_Keys):
    """One priority level's queue (Triton's ModelQueuePolicy); keys left out are inherited."""

    max_queue_size: Annotated[
        Count | UnsetType, Meta(description="requests waiting at this level; 0 = no bound")
    ] = UNSET
    default_timeout_us: Annotated[
        Count | UnsetType, Meta(description="how long a request may wait at this level, µs; 0 = no limit")
    ] = UNSET
    allow_timeout_override: Annotated[
        bool | UnsetType, Meta(description="may a request ask for a shorter wait than the default?")
    ] = UNSET


class _AdmissionDoc(_Keys):
    """The admission keys, the same in every section that queues work."""

    priority_levels: Annotated[Positive, Meta(description="priority levels; 1 is the highest")] = 1
    default_priority_level: Annotated[
        Positive | UnsetType, Meta(description="the level of requests that name none; default: the lowest")
    ] = UNSET
    default_queue_policy: Annotated[QueuePolicyDoc, Meta(description="the queue rules of every level")] = (
        msgspec.field(default_factory=QueuePolicyDoc)
    )
    priority_queue_policy: Annotated[
        dict[int, QueuePolicyDoc], Meta(description="levels whose queue rules differ from the default")
    ] = msgspec.field(default_factory=dict)


class DynamicBatchingDoc(_AdmissionDoc):
    max_queue_delay_us: Annotated[
        Count, Meta(description="how long a request may wait for others to share its run, µs; 0 = none")
    ] = 0
    preferred_batch_sizes: Annotated[
        list[Positive], Meta(description="a batch leaves as soon as it reaches the largest of these")
    ] = msgspec.field(default_factory=list)
    max_concurrent_batches: Annotated[
        Count, Meta(description="batches of a version that run at once; 0 = sized to the machine")
    ] = 0


class ReloadDoc(_Keys):
    allow_schema_change: Annotated[bool, Meta(description="may a new version change inputs/outputs?")] = False
    memory_budget_mb: Annotated[
        Count, Meta(description="what all served versions together may take, MiB; 0 = no budget")
    ] = 0
    when_over_budget: Annotated[
        Literal["fail", "drain_first"],
        Meta(description="fail: keep the old version serving; drain_first: release it, then load"),
    ] = "fail"


# `generation.max_waiting`: how many sequences may wait for a decode slot, unless the section's
# default_queue_policy sets max_queue_size itself.
DEFAULT_MAX_WAITING = 64


class GenerationDoc(_AdmissionDoc):
    max_concurrent_sequences: Annotated[Positive, Meta(description="sequences decoding at once")] = 16
    max_tokens: Annotated[Positive, Meta(description="the largest max_tokens a request may ask for")] = 512
    default_max_tokens: Annotated[Positive, Meta(description="for requests that leave max_tokens at 0")] = 64
    context_length: Annotated[
        Count,
        Meta(
            description=(
                "0 = the export's own (config.json, model metadata, its position table); "
                "else used when it states none, or to lower it"
            )
        ),
    ] = 0
    eos_token: Annotated[str, Meta(description='"" = the tokenizer\'s end-of-text token')] = ""
    continuous_batching: Annotated[bool, Meta(description="false: every sequence decodes alone")] = True
    stream_buffer: Annotated[
        Positive, Meta(description="tokens buffered per stream before its sequence pauses")
    ] = 16
    stall_timeout_ms: Annotated[
        Count, Meta(description="how long a sequence may stay paused for its reader; 0 = no limit")
    ] = 30_000
    max_preempted: Annotated[
        Count,
        Meta(
            description=(
                "paused sequences kept (cache in host memory) after giving their slot to waiting ones; "
                "0 = paused sequences keep their slots"
            )
        ),
    ] = 64
    chat_stop: Annotated[
        list[Annotated[str, Meta(min_length=1, max_length=256)]],
        Meta(max_length=16, description="stop sequences of a chat reply when the request sends none"),
    ] = []
    chat_reply_opening: Annotated[
        bool,
        Meta(
            description="a chat reply's text begins with what the template writes for add_generation_prompt"
        ),
    ] = False
    # At least 1: a max_queue_size of 0 means "no bound", the opposite of what 0 waiting once meant.
    max_waiting: Annotated[
        Positive, Meta(description="sequences that may wait for a decode slot (the default queue's size)")
    ] = DEFAULT_MAX_WAITING


class LimitsDoc(_Keys):
    max_elements: Annotated[Positive, Meta(description="elements across all inputs of a request")] = 1 << 24
    max_request_bytes: Annotated[Positive, Meta(description="bytes of a request's tensor payloads")] = (
        64 << 20
    )


# model_warmup (service/repository/warmup_config.py): Triton's warm-up samples.
# A warm-up file is a plain file name in the model's `warmup` folder: no folders, nothing hidden.
WARMUP_FILE = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"
WARMUP_FOLDER = "warmup"


class WarmupInputDoc(_Keys):
    datatype: Annotated[
        str,
        Meta(
            description="KServe datatype of the input (FP32, BYTES, ...)",
            extra_json_schema={"enum": sorted(NUMPY_BY_NAME)},
        ),
    ]
    dims: Annotated[
        list[Annotated[int, Meta(ge=0)]],
        Meta(description="the sample's dimensions, without the batch dimension; fixed sizes only"),
    ]
    zero_data: Annotated[bool, Meta(description="zeros (empty strings for BYTES)")] = False
    random_data: Annotated[
        bool, Meta(description="random values of the datatype (empty strings for BYTES)")
    ] = False
    input_data_file: Annotated[
        str,
        Meta(
            pattern=f"^$|{WARMUP_FILE}",
            description="a file in the model's warmup folder: the row's raw little-endian bytes, or for "
            "BYTES its elements each after a 4-byte little-endian length (Triton's layout)",
            extra={"expects": "a file name in the model's warmup folder"},
        ),
    ] = ""


# -- stateful models (Triton's sequence batcher) and decoupled models ---------------------------

# How long an idle sequence is kept (Triton's default max_sequence_idle_microseconds: 1 s).
DEFAULT_MAX_SEQUENCE_IDLE_US = 1_000_000


class ControlInputDoc(_Keys):
    """A graph input the sequence batcher fills (Triton's control_input with one control)."""

    name: Annotated[str, Meta(min_length=1, description="the graph input, as in the model file")]
    kind: Annotated[
        Literal["start", "end", "ready", "corrid"],
        Meta(description="CONTROL_SEQUENCE_START, _END, _READY or _CORRID"),
    ]
    datatype: Annotated[
        Literal["INT32", "FP32", "BOOL", "UINT64", "INT64", "UINT32", "BYTES"],
        Meta(
            description="start/end/ready: INT32, FP32 or BOOL; corrid: UINT64, INT64, UINT32, INT32 or BYTES"
        ),
    ]
    false_true: Annotated[
        Annotated[list[float], Meta(min_length=2, max_length=2)] | UnsetType,
        Meta(description="start/end/ready: the values for false and true (Triton's *_false_true)"),
    ] = UNSET


class InitialStateDoc(_Keys):
    """A state's value at the start of a sequence (Triton's initial_state): zeros or a file."""

    shape: Annotated[
        list[Count], Meta(description="its dimensions; with the batch dimension (1) when max_batch_size > 0")
    ]
    zero_data: Annotated[bool, Meta(description="zeros (give this or data_file)")] = False
    data_file: Annotated[
        str,
        Meta(
            pattern=f"^$|{LABEL_FILE.pattern}",
            description="a file in the model's initial_state/ folder: the value's raw little-endian elements",
            extra={"expects": "a file name in the model's initial_state/ folder"},
        ),
    ] = ""


class WarmupDoc(_Keys):
    name: Annotated[str, Meta(min_length=1, description="the sample's name, for logs")]
    batch_size: Annotated[int, Meta(ge=0, description="rows of the sample; 0: skipped")] = 1
    count: Annotated[int, Meta(ge=0, description="runs of the sample; 0: once")] = 0
    inputs: Annotated[dict[str, WarmupInputDoc], Meta(description="every input of the model, by name")] = (
        msgspec.field(default_factory=dict)
    )


# ensemble_scheduling (service/repository/ensemble_config.py): Triton's ensembles.
class EnsembleStepDoc(_Keys):
    model_name: Annotated[str, Meta(min_length=1, description="the model this step runs")]
    model_version: Annotated[
        int, Meta(ge=-1, description="the version it runs; -1: the newest served (pinned per request)")
    ] = -1
    input_map: Annotated[
        dict[str, str], Meta(description="the step model's input name -> the ensemble tensor it is fed")
    ] = msgspec.field(default_factory=dict)
    output_map: Annotated[
        dict[str, str], Meta(description="the step model's output name -> the ensemble tensor it makes")
    ] = msgspec.field(default_factory=dict)


class EnsembleSchedulingDoc(_Keys):
    step: Annotated[
        Annotated[list[EnsembleStepDoc], Meta(min_length=1)],
        Meta(description="the steps; each runs once its inputs exist (a DAG of tensors)"),
    ]


class StateDoc(_Keys):
    """Implicit state (Triton's state): a step's output fed back as the next step's input."""

    input_name: Annotated[str, Meta(min_length=1, description="the graph input that takes the state")]
    output_name: Annotated[str, Meta(min_length=1, description="the graph output that gives the next state")]
    datatype: Annotated[
        str,
        Meta(description="KServe datatype of the state", extra_json_schema={"enum": sorted(NUMPY_BY_NAME)}),
    ]
    shape: Annotated[
        list[Annotated[int, Meta(ge=-1)]],
        Meta(description="dimensions, -1 = any; with the batch dimension (-1) when max_batch_size > 0"),
    ]
    initial_state: Annotated[
        InitialStateDoc | None, Meta(description="the first step's value; default zeros, -1 dimensions 1")
    ] = None


class SequenceBatchingDoc(_Keys):
    """A stateful model: steps of a sequence (KServe parameter sequence_id) go to one instance, in
    order, with the control inputs and implicit state filled by the service."""

    strategy: Annotated[
        Literal["direct", "oldest"],
        Meta(description="direct: a batch slot per sequence; oldest: batches of the oldest steps"),
    ] = "direct"
    max_sequence_idle_us: Annotated[
        Positive, Meta(description="an idle sequence is released after this long, µs")
    ] = DEFAULT_MAX_SEQUENCE_IDLE_US
    max_queue_delay_us: Annotated[
        Count, Meta(description="how long a batch that is not full may wait for other sequences' steps, µs")
    ] = 0
    max_candidate_sequences: Annotated[
        Positive, Meta(description="oldest: live sequences per instance; beyond, a START is refused")
    ] = 16
    preferred_batch_sizes: Annotated[
        list[Positive], Meta(description="oldest: a batch leaves as soon as it reaches the largest of these")
    ] = msgspec.field(default_factory=list)
    control_inputs: Annotated[
        list[ControlInputDoc], Meta(description="graph inputs the service fills per step")
    ] = msgspec.field(default_factory=list)
    states: Annotated[list[StateDoc], Meta(description="implicit state kept per sequence")] = msgspec.field(
        default_factory=list
    )


class RepeatDoc(_Keys):
    """A decoupled producer: the graph runs once per element of `inputs`, each run one response."""

    inputs: Annotated[
        list[Annotated[str, Meta(min_length=1)]],
        Meta(min_length=1, description="inputs split along their first dimension (one element a run)"),
    ]
    index_input: Annotated[
        str, Meta(description="a graph input the service feeds the run's index (UINT32 [1]); optional")
    ] = ""
    delay_input: Annotated[
        str, Meta(description="one of `inputs` (UINT32): ms to wait before each response; optional")
    ] = ""
    hold_input: Annotated[
        str,
        Meta(
            description="an input (UINT32 [1]): ms the request holds its instance (the repeat WAIT); optional"
        ),
    ] = ""
    max_delay_ms: Annotated[
        Positive, Meta(description="the longest wait a request may ask for, per response or hold")
    ] = 60_000


class DecoupledDoc(_Keys):
    """Triton's model_transaction_policy {decoupled: true}: 0..N responses per request, on
    ModelStreamInfer only."""

    repeat: Annotated[
        RepeatDoc | None, Meta(description="run the graph once per input element; without it, one response")
    ] = None


class ConfigDoc(_Keys):
    """models/<name>/config.yaml."""

    max_batch_size: Annotated[
        Count, Meta(description="largest batch along the first dimension; 0 = the model is not batched")
    ] = 0
    version_policy: Annotated[
        VersionPolicyDoc,
        Meta(
            description="which versions on disk are served: one of latest, specific, all",
            extra_json_schema={"minProperties": 1, "maxProperties": 1},
        ),
    ] = msgspec.field(default_factory=lambda: VersionPolicyDoc(latest=1))
    inputs: list[InputDoc] = msgspec.field(default_factory=list)
    outputs: list[OutputDoc] = msgspec.field(default_factory=list)
    execution: ExecutionDoc = msgspec.field(default_factory=ExecutionDoc)
    dynamic_batching: Annotated[
        DynamicBatchingDoc | None, Meta(description="queue and batch requests (needs max_batch_size >= 1)")
    ] = None
    reload: ReloadDoc = msgspec.field(default_factory=ReloadDoc)
    generation: Annotated[GenerationDoc, Meta(description="how a decoder language model serves Generate")] = (
        msgspec.field(default_factory=GenerationDoc)
    )
    limits: Annotated[LimitsDoc, Meta(description="what one request may ask of the model")] = msgspec.field(
        default_factory=LimitsDoc
    )
    model_warmup: Annotated[
        list[WarmupDoc],
        Meta(description="the samples a version runs before it serves (Triton's model_warmup)"),
    ] = msgspec.field(default_factory=list)
    platform: Annotated[
        Literal["onnxruntime_onnx", "ensemble"],
        Meta(description="onnxruntime_onnx (versions hold model.onnx) or ensemble (steps of other models)"),
    ] = "onnxruntime_onnx"
    ensemble_scheduling: Annotated[
        EnsembleSchedulingDoc | None, Meta(description="an ensemble's steps (platform: ensemble)")
    ] = None
    sequence_batching: Annotated[
        SequenceBatchingDoc | None,
        Meta(description="a stateful model: Triton's sequence batcher (sequence_id, controls, state)"),
    ] = None
    decoupled: Annotated[
        DecoupledDoc | None, Meta(description="0..N responses per request over ModelStreamInfer")
    ] = None
