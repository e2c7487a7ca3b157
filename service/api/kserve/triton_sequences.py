"""Triton's sequence_batching and model_transaction_policy, both ways (triton_config.py's part for
stateful and decoupled models): a load's Triton JSON -> config.yaml keys, and a served version's
config -> ModelConfig.

Triton's dims leave out the batch dimension where the model batches; config.yaml's shapes include
it (a state's -1, an initial state's 1: one sequence is one row). Every field set must map onto
config.yaml; one without a counterpart is refused by name.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.message import Message

from modelyard.kserve.v2 import model_config_pb2 as config_pb
from modelyard.service.errors import InvalidInput
from modelyard.service.repository.model_config import SequenceBatchingConfig
from modelyard.service.repository.model_config_schema import DEFAULT_MAX_SEQUENCE_IDLE_US

_Batching = config_pb.ModelSequenceBatching
_SEQUENCE = {"max_sequence_idle_microseconds", "direct", "oldest", "control_input", "state"}
_DIRECT = {"max_queue_delay_microseconds"}
_OLDEST = {
    "max_candidate_sequences",
    "preferred_batch_size",
    "max_queue_delay_microseconds",
    "preserve_ordering",
}
_CONTROL_INPUT = {"name", "control"}
_STATE = {"input_name", "output_name", "data_type", "dims", "initial_state"}
_INITIAL = {"data_type", "dims", "zero_data", "data_file", "name"}
_KINDS = {
    _Batching.Control.CONTROL_SEQUENCE_START: "start",
    _Batching.Control.CONTROL_SEQUENCE_END: "end",
    _Batching.Control.CONTROL_SEQUENCE_READY: "ready",
    _Batching.Control.CONTROL_SEQUENCE_CORRID: "corrid",
}
_KIND_VALUES = {kind: value for value, kind in _KINDS.items()}


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


def _triton_type(datatype: str) -> config_pb.DataType.ValueType:
    return config_pb.DataType.Value("TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}")


def sequence_document(batching: config_pb.ModelSequenceBatching, max_batch_size: int) -> dict[str, Any]:
    """Triton's sequence_batching as config.yaml's `sequence_batching`."""
    where = "sequence_batching."
    _only(batching, _SEQUENCE, where)
    doc: dict[str, Any] = {
        "max_sequence_idle_us": batching.max_sequence_idle_microseconds or DEFAULT_MAX_SEQUENCE_IDLE_US
    }
    if batching.WhichOneof("strategy_choice") == "oldest":
        oldest = batching.oldest
        _only(oldest, _OLDEST, f"{where}oldest.")
        doc["strategy"] = "oldest"
        if oldest.max_candidate_sequences:
            doc["max_candidate_sequences"] = oldest.max_candidate_sequences
        doc["preferred_batch_sizes"] = list(oldest.preferred_batch_size)
        doc["max_queue_delay_us"] = oldest.max_queue_delay_microseconds
        # preserve_ordering: a sequence's steps are answered in order here, always.
    else:
        _only(batching.direct, _DIRECT, f"{where}direct.")
        doc["strategy"] = "direct"
        doc["max_queue_delay_us"] = batching.direct.max_queue_delay_microseconds
    controls = []
    for i, control_input in enumerate(batching.control_input):
        at = f"{where}control_input[{i}]"
        _only(control_input, _CONTROL_INPUT, f"{at}.")
        if len(control_input.control) != 1:
            raise InvalidInput(f"load parameter 'config': {at}.control: one control per input")
        (control,) = control_input.control
        kind = _KINDS[control.kind]
        entry: dict[str, Any] = {"name": control_input.name, "kind": kind}
        flags = [
            (name, list(getattr(control, field)))
            for name, field in (
                ("INT32", "int32_false_true"),
                ("FP32", "fp32_false_true"),
                ("BOOL", "bool_false_true"),
            )
            if getattr(control, field)
        ]
        if kind == "corrid":
            if flags:
                raise InvalidInput(
                    f"load parameter 'config': {at}: a CORRID control has a data_type, not values"
                )
            entry["datatype"] = _datatype(control.data_type, f"{at}.control[0]")
        else:
            if len(flags) != 1 or control.data_type:
                raise InvalidInput(
                    f"load parameter 'config': {at}: give one of int32_false_true, fp32_false_true, "
                    "bool_false_true"
                )
            datatype, values = flags[0]
            entry["datatype"] = datatype
            entry["false_true"] = [float(v) for v in values]
        controls.append(entry)
    doc["control_inputs"] = controls
    states = []
    for i, state in enumerate(batching.state):
        at = f"{where}state[{i}]"
        _only(state, _STATE, f"{at}.")
        datatype = _datatype(state.data_type, at)
        entry = {
            "input_name": state.input_name,
            "output_name": state.output_name,
            "datatype": datatype,
            "shape": ([-1] if max_batch_size else []) + list(state.dims),
        }
        if state.initial_state:
            if len(state.initial_state) != 1:
                raise InvalidInput(f"load parameter 'config': {at}.initial_state: one initial state")
            (initial,) = state.initial_state
            _only(initial, _INITIAL, f"{at}.initial_state[0].")
            if _datatype(initial.data_type, f"{at}.initial_state[0]") != datatype:
                raise InvalidInput(
                    f"load parameter 'config': {at}.initial_state[0].data_type differs from the state's"
                )
            first: dict[str, Any] = {"shape": ([1] if max_batch_size else []) + list(initial.dims)}
            if initial.WhichOneof("state_data") == "data_file":
                raise InvalidInput(
                    f"load parameter 'config': {at}.initial_state[0].data_file: a file needs the model's "
                    "folder; give it in config.yaml (sequence_batching.states[].initial_state.data_file)"
                )
            first["zero_data"] = True
            entry["initial_state"] = first
        states.append(entry)
    doc["states"] = states
    return doc


def sequence_message(config: SequenceBatchingConfig, max_batch_size: int) -> config_pb.ModelSequenceBatching:
    """config.yaml's sequence_batching as Triton's (the ModelConfig RPC)."""
    message = config_pb.ModelSequenceBatching(max_sequence_idle_microseconds=config.max_sequence_idle_us)
    if config.strategy == "oldest":
        message.oldest.max_candidate_sequences = config.max_candidate_sequences
        message.oldest.preferred_batch_size.extend(config.preferred_batch_sizes)
        message.oldest.max_queue_delay_microseconds = config.max_queue_delay_us
        message.oldest.preserve_ordering = True
    else:
        message.direct.max_queue_delay_microseconds = config.max_queue_delay_us
    for control in config.controls:
        entry = message.control_input.add(name=control.name)
        triton = entry.control.add(kind=_KIND_VALUES[control.kind])
        if control.kind == "corrid":
            triton.data_type = _triton_type(control.datatype)
        elif control.datatype == "INT32":
            triton.int32_false_true.extend(int(v) for v in control.false_true)
        elif control.datatype == "FP32":
            triton.fp32_false_true.extend(control.false_true)
        else:
            triton.bool_false_true.extend(bool(v) for v in control.false_true)
    skip = 1 if max_batch_size else 0
    for state in config.states:
        entry_state = message.state.add(
            input_name=state.input_name,
            output_name=state.output_name,
            data_type=_triton_type(state.datatype),
            dims=state.shape[skip:],
        )
        if state.initial_shape is not None:
            initial = entry_state.initial_state.add(
                data_type=_triton_type(state.datatype), dims=state.initial_shape[skip:], name="initial state"
            )
            if state.initial_file:
                initial.data_file = state.initial_file
            else:
                initial.zero_data = True
    return message
