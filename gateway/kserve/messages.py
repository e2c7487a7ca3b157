"""Protobuf messages of the KServe gRPC API as Triton's HTTP front end writes them: field names as
in the .proto, every scalar and list present (defaults included), a message field only when set
(a client tests `"sequence_batching" in config`; `every_message` writes unset ones too, as
Triton's statistics do: zero counts), 64-bit integers as JSON numbers (protobuf's
JSON mapping makes them strings, which Triton's HTTP answers and perf_analyzer do not), enums by
name, and bytes as base64."""

from __future__ import annotations

import base64
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message


def to_json(message: Message, every_message: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {}
    field: Any
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            out[field.name] = {str(k): _scalar(value_field, v, every_message) for k, v in value.items()}
        elif field.is_repeated:
            out[field.name] = [_scalar(field, v, every_message) for v in value]
        elif field.containing_oneof is not None or (
            field.type == FieldDescriptor.TYPE_MESSAGE and not every_message
        ):
            if message.HasField(field.name):
                out[field.name] = _scalar(field, value, every_message)
        else:
            out[field.name] = _scalar(field, value, every_message)
    return out


def _scalar(field: Any, value: Any, every_message: bool) -> Any:  # a FieldDescriptor (two classes)
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return to_json(value, every_message)
    if field.type == FieldDescriptor.TYPE_ENUM:
        described = field.enum_type.values_by_number.get(value)
        return described.name if described is not None else value
    if field.type == FieldDescriptor.TYPE_BYTES:
        return base64.b64encode(value).decode("ascii")
    return value
