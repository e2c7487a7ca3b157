"""Triton's model configuration (model_config.proto), both ways: as JSON in a load request's
`config` parameter -> our config.yaml document, validated by the same parser as a repository
config; and a served version's configuration rendered as Triton's ModelConfig (`triton_config`).

Triton's JSON is parsed into the ModelConfig message itself, so a malformed document or an unknown
field fails exactly where Triton's would. Every field that is set must map onto our config; one
that has no counterpart here is refused by name rather than ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import Message

from modelyard.kserve.v2 import model_config_pb2 as config_pb
from modelyard.kserve.v2.grpc_service_pb2 import ModelRepositoryParameter
from modelyard.service.api.kserve.triton_sequences import sequence_document, sequence_message
from modelyard.service.api.model_control import LoadParameters
from modelyard.service.api.names import clipped, quoted
from modelyard.service.errors import InvalidInput, ModelLoadError
from modelyard.service.repository.model_config import ModelConfig, parse_config
from modelyard.service.repository.uploads import check_paths
from modelyard.service.runtime.served import ServedVersion
from modelyard.service.scheduling.queue import QueuePolicy

PLATFORM = "onnxruntime_onnx"
ENSEMBLE = "ensemble"
BACKEND = "onnxruntime"

_TOP = {
    "name",
    "platform",
    "backend",
    "max_batch_size",
    "input",
    "output",
    "version_policy",
    "dynamic_batching",
    "instance_group",
    "model_warmup",
    "ensemble_scheduling",
    "sequence_batching",
    "model_transaction_policy",
}
_INPUT = {"name", "data_type", "dims", "format"}
_OUTPUT = {"name", "data_type", "dims", "label_filename"}
_BATCHING = {
    "preferred_batch_size",
    "max_queue_delay_microseconds",
    "priority_levels",
    "default_priority_level",
    "default_queue_policy",
    "priority_queue_policy",
}
_QUEUE = {"timeout_action", "default_timeout_microseconds", "allow_timeout_override", "max_queue_size"}
_GROUP = {"name", "kind", "count", "gpus"}


def load_parameters(model: str, parameters: Mapping[str, ModelRepositoryParameter]) -> LoadParameters:
    """A RepositoryModelLoad's parameters, validated: `config` (Triton JSON) and `file:<path>`
    (bytes). Anything else is refused by name, never ignored."""
    config: ModelConfig | None = None
    files: dict[str, bytes] = {}
    for key, value in parameters.items():
        kind = value.WhichOneof("parameter_choice")
        if key == "config":
            if kind != "string_param":
                raise InvalidInput("load parameter 'config' must be a string holding JSON")
            config = parse_triton_config(value.string_param, model)
        elif key.startswith("file:"):
            if kind != "bytes_param":
                raise InvalidInput(f"load parameter {quoted(key)} must be bytes (the file's content)")
            files[key.removeprefix("file:")] = value.bytes_param
        else:
            raise InvalidInput(
                f"load parameter {quoted(key)} is not supported (supported: config, file:<path>)"
            )
    if files:
        if config is None:
            # As Triton: the files replace the model's folder, so its config.yaml is not there.
            raise InvalidInput("load parameters 'file:<path>' need the 'config' parameter as well")
        check_paths(files)
    return LoadParameters(config, files)


def parse_triton_config(text: str, model: str) -> ModelConfig:
    """The model's config from a Triton JSON ModelConfig; InvalidInput naming what is wrong."""
    try:
        message = json_format.Parse(text, config_pb.ModelConfig())
    except json_format.ParseError as exc:
        raise InvalidInput(
            f"load parameter 'config' is not a Triton model configuration: {clipped(str(exc))}"
        ) from None
    try:
        return parse_config(_to_document(message, model))
    except ModelLoadError as exc:  # ConfigError: the same checks as a repository's config.yaml
        raise InvalidInput(f"load parameter 'config': {exc}") from None


def _to_document(config: config_pb.ModelConfig, model: str) -> dict[str, Any]:
    _only(config, _TOP, "")
    if config.name and config.name != model:
        raise InvalidInput(
            f"load parameter 'config': name {quoted(config.name)} is not the model {quoted(model)}"
        )
    if config.platform and config.platform not in (PLATFORM, ENSEMBLE):
        raise InvalidInput(
            f"load parameter 'config': platform {quoted(config.platform)} (only {PLATFORM!r} or {ENSEMBLE!r})"
        )
    if config.backend and config.backend != BACKEND:
        raise InvalidInput(f"load parameter 'config': backend {quoted(config.backend)} (only {BACKEND!r})")
    batch = config.max_batch_size
    doc: dict[str, Any] = {"max_batch_size": batch}
    if config.input:
        doc["inputs"] = [_tensor(t, _INPUT, f"input[{i}]", batch) for i, t in enumerate(config.input)]
    if config.output:
        doc["outputs"] = [_tensor(t, _OUTPUT, f"output[{i}]", batch) for i, t in enumerate(config.output)]
    if config.HasField("version_policy"):
        doc["version_policy"] = _version_policy(config.version_policy)
    if config.HasField("dynamic_batching"):
        doc["dynamic_batching"] = _batching(config.dynamic_batching)
    if config.instance_group:
        doc["execution"] = _execution(config.instance_group)
    if config.platform == ENSEMBLE:
        doc["platform"] = ENSEMBLE
    if config.HasField("ensemble_scheduling"):
        doc["ensemble_scheduling"] = {
            "step": [
                {
                    "model_name": step.model_name,
                    "model_version": step.model_version,
                    "input_map": dict(step.input_map),
                    "output_map": dict(step.output_map),
                }
                for step in config.ensemble_scheduling.step
            ]
        }
    if config.model_warmup:
        doc["model_warmup"] = [_warmup(w, f"model_warmup[{i}]") for i, w in enumerate(config.model_warmup)]
    if config.HasField("sequence_batching"):
        doc["sequence_batching"] = sequence_document(config.sequence_batching, batch)
    if config.model_transaction_policy.decoupled:
        doc["decoupled"] = {}
    return doc


def _only(message: Message, allowed: set[str], where: str) -> None:
    for descriptor, _ in message.ListFields():
        if descriptor.name not in allowed:
            raise InvalidInput(
                f"load parameter 'config': field {where}{descriptor.name} is not supported by this server"
            )


def _datatype(value: config_pb.DataType.ValueType, where: str) -> str:
    name = config_pb.DataType.Name(value).removeprefix("TYPE_")
    if name == "INVALID":
        raise InvalidInput(f"load parameter 'config': {where}.data_type is missing")
    return "BYTES" if name == "STRING" else name


def _tensor(tensor: Any, allowed: set[str], where: str, batch: int) -> dict[str, Any]:
    _only(tensor, allowed, f"{where}.")
    # Triton's dims leave out the batch dimension when the model batches; ours include it.
    shape = ([-1] if batch else []) + list(tensor.dims)
    doc: dict[str, Any] = {
        "name": tensor.name,
        "datatype": _datatype(tensor.data_type, where),
        "shape": shape,
    }
    if getattr(tensor, "label_filename", ""):
        doc["label_filename"] = tensor.label_filename
    if getattr(tensor, "format", 0):
        doc["format"] = config_pb.ModelInput.Format.Name(tensor.format)
    return doc


def _version_policy(policy: config_pb.ModelVersionPolicy) -> dict[str, Any]:
    match policy.WhichOneof("policy_choice"):
        case "latest":
            return {"latest": policy.latest.num_versions}
        case "specific":
            return {"specific": list(policy.specific.versions)}
        case _:
            return {"all": {}}


def _batching(batching: config_pb.ModelDynamicBatching) -> dict[str, Any]:
    _only(batching, _BATCHING, "dynamic_batching.")
    doc: dict[str, Any] = {
        "max_queue_delay_us": batching.max_queue_delay_microseconds,
        "preferred_batch_sizes": list(batching.preferred_batch_size),
    }
    if batching.priority_levels:
        doc["priority_levels"] = batching.priority_levels
    if batching.default_priority_level:
        doc["default_priority_level"] = batching.default_priority_level
    if batching.HasField("default_queue_policy"):
        doc["default_queue_policy"] = _queue_policy(batching.default_queue_policy, "default_queue_policy")
    if batching.priority_queue_policy:
        doc["priority_queue_policy"] = {
            int(level): _queue_policy(policy, f"priority_queue_policy[{level}]")
            for level, policy in batching.priority_queue_policy.items()
        }
    return doc


def _queue_policy(policy: config_pb.ModelQueuePolicy, where: str) -> dict[str, Any]:
    _only(policy, _QUEUE, f"dynamic_batching.{where}.")
    if policy.timeout_action != config_pb.ModelQueuePolicy.REJECT:
        raise InvalidInput(
            f"load parameter 'config': dynamic_batching.{where}.timeout_action: only REJECT (a request "
            "whose queue time runs out is answered, never run late)"
        )
    return {
        "max_queue_size": policy.max_queue_size,
        "default_timeout_us": policy.default_timeout_microseconds,
        "allow_timeout_override": policy.allow_timeout_override,
    }


def _warmup(sample: config_pb.ModelWarmup, where: str) -> dict[str, Any]:
    """A warm-up sample: the same keys in config.yaml, datatypes by their KServe names."""
    inputs = {}
    for name, item in sample.inputs.items():
        at = f"{where}.inputs[{name}]"
        entry: dict[str, Any] = {"datatype": _datatype(item.data_type, at), "dims": list(item.dims)}
        choice = item.WhichOneof("input_data_type")
        if choice == "input_data_file":
            entry["input_data_file"] = item.input_data_file
        elif choice is not None:
            entry[choice] = True
        inputs[name] = entry
    # Triton's batch_size 0 skips the sample; config.yaml's default is 1, so it is always given.
    return {"name": sample.name, "batch_size": sample.batch_size, "count": sample.count, "inputs": inputs}


def _execution(groups: Any) -> dict[str, Any]:
    """Triton's instance_group: `count` instances on each GPU it lists (KIND_GPU), or `count` on
    the CPU (KIND_CPU). One group only: a version's instances are all of one kind."""
    if len(groups) != 1:
        raise InvalidInput("load parameter 'config': instance_group: one group only (instances of one kind)")
    (group,) = groups
    _only(group, _GROUP, "instance_group[0].")
    doc: dict[str, Any] = {"instances": group.count} if group.count else {}  # 0: Triton's default, 1
    kind = config_pb.ModelInstanceGroup.Kind.Name(group.kind)
    if kind == "KIND_CPU":
        if group.gpus:
            raise InvalidInput(
                "load parameter 'config': instance_group[0].gpus: KIND_CPU places nothing on GPUs"
            )
        return {**doc, "provider": "cpu"}
    if kind == "KIND_GPU":
        # Without gpus, Triton places instances on every GPU; this server places them on device 0.
        return {**doc, "provider": "cuda", **({"device_ids": list(group.gpus)} if group.gpus else {})}
    if kind == "KIND_AUTO":
        if group.gpus:
            return {**doc, "provider": "auto", "device_ids": list(group.gpus)}
        return {**doc, "provider": "auto"}
    raise InvalidInput(f"load parameter 'config': instance_group[0].kind {kind} is not supported")


# -- a served version as Triton's ModelConfig -------------------------------------------------


def _triton_type(datatype: str) -> config_pb.DataType.ValueType:
    return config_pb.DataType.Value("TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}")


def _instance_group(served: ServedVersion) -> config_pb.ModelInstanceGroup:
    """The version's instances as Triton says them: `count` on each GPU listed, or on the CPU."""
    execution = served.config.execution
    if "CUDA" in served.runner.provider:
        return config_pb.ModelInstanceGroup(
            kind=config_pb.ModelInstanceGroup.KIND_GPU, count=execution.instances, gpus=execution.devices
        )
    return config_pb.ModelInstanceGroup(
        kind=config_pb.ModelInstanceGroup.KIND_CPU, count=len(served.instances.all)
    )


def triton_config(served: ServedVersion) -> config_pb.ModelConfig:
    """A served version's configuration as Triton's ModelConfig (the ModelConfig RPC)."""
    signature = served.runner.signature
    config: ModelConfig = served.config
    # Triton's dims leave out the batch dimension when the model batches.
    skip = 1 if signature.max_batch_size else 0
    labels = {t.name: t.label_filename for t in config.outputs}
    formats = {t.name: config_pb.ModelInput.Format.Value(t.format) for t in config.inputs}
    ensemble = config.ensemble
    triton = config_pb.ModelConfig(
        name=served.model,
        platform=config.platform,
        backend="" if ensemble is not None else BACKEND,  # an ensemble has none, as Triton's
        max_batch_size=signature.max_batch_size,
        input=[
            config_pb.ModelInput(
                name=t.name,
                data_type=_triton_type(t.datatype),
                dims=t.shape[skip:],
                format=formats.get(t.name, config_pb.ModelInput.FORMAT_NONE),
            )
            for t in signature.inputs
        ],
        output=[
            config_pb.ModelOutput(
                name=t.name,
                data_type=_triton_type(t.datatype),
                dims=t.shape[skip:],
                label_filename=labels.get(t.name, ""),
            )
            for t in signature.outputs
        ],
        instance_group=[] if ensemble is not None else [_instance_group(served)],
    )
    if ensemble is not None:
        for step in ensemble.steps:
            triton.ensemble_scheduling.step.add(
                model_name=step.model,
                model_version=step.version,
                input_map=dict(step.inputs),
                output_map=dict(step.outputs),
            )
    for sample in config.model_warmup:
        warmup = triton.model_warmup.add(name=sample.name, batch_size=sample.batch_size, count=sample.count)
        for name, item in sample.inputs:
            entry = warmup.inputs[name]
            entry.data_type = _triton_type(item.datatype)
            entry.dims.extend(item.dims)
            if item.source == "file":
                entry.input_data_file = item.file
            elif item.source == "random":
                entry.random_data = True
            else:
                entry.zero_data = True
    policy = config.version_policy
    if policy.kind == "latest":
        triton.version_policy.latest.num_versions = policy.latest
    elif policy.kind == "specific":
        triton.version_policy.specific.versions.extend(policy.versions)
    else:
        triton.version_policy.all.SetInParent()
    if config.dynamic_batching is not None:
        batching = config.dynamic_batching
        admission = batching.admission
        triton.dynamic_batching.max_queue_delay_microseconds = batching.max_queue_delay_us
        triton.dynamic_batching.preferred_batch_size.extend(batching.preferred_batch_sizes)
        triton.dynamic_batching.priority_levels = admission.priority_levels
        triton.dynamic_batching.default_priority_level = admission.default_priority_level
        triton.dynamic_batching.default_queue_policy.CopyFrom(
            _triton_queue_policy(admission.default_queue_policy)
        )
        for level, level_policy in admission.priority_queue_policy:
            triton.dynamic_batching.priority_queue_policy[level].CopyFrom(_triton_queue_policy(level_policy))
    if config.sequence_batching is not None:
        triton.sequence_batching.CopyFrom(
            sequence_message(config.sequence_batching, signature.max_batch_size)
        )
    if config.decoupled is not None:
        triton.model_transaction_policy.decoupled = True
    return triton


def _triton_queue_policy(policy: QueuePolicy) -> config_pb.ModelQueuePolicy:
    return config_pb.ModelQueuePolicy(
        timeout_action=config_pb.ModelQueuePolicy.REJECT,
        default_timeout_microseconds=policy.default_timeout_us,
        allow_timeout_override=policy.allow_timeout_override,
        max_queue_size=policy.max_queue_size,
    )
