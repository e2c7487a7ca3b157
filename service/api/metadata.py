"""What a proxy in front of the service sends and reads in gRPC metadata: the request's version,
id and priority in headers (used where the message leaves its own fields empty), and the version
that answered (x-served-version: in the trailing metadata of a unary answer, in the initial
metadata of a stream, before its first message; service/api/errors.py `serving` sends it)."""

from __future__ import annotations

from modelyard.common import headers
from modelyard.common.names import echo
from modelyard.process.request_metadata import invocation_metadata
from modelyard.service.api.errors import Context
from modelyard.service.api.names import check_model
from modelyard.service.errors import InvalidInput

_UINT32_MAX = 2**32 - 1


def call_fields(
    context: Context, model: str, version: str, request_id: str, priority: int
) -> tuple[str, str, int, str]:
    """The request's model version, request id and priority: the message's own fields where set,
    else the x-model-version, x-request-id and x-priority headers; and its x-model-dye ("" when
    none): a proxy's call, whose unary answer carries its run's timing (x-queue-us, x-run-us),
    and which as a shadow only ever has its priority lowered. The headers are read in one pass.
    Every inference call passes here first, so this is where its model name and version meet the
    name rule (InvalidInput naming the field or header)."""
    version_field = "model_version"
    dye = ""
    # Values are str: only keys ending in -bin carry bytes.
    for key, value in invocation_metadata(context):
        if key == headers.MODEL_VERSION:
            if not version:
                version, version_field = str(value), headers.MODEL_VERSION
        elif key == headers.REQUEST_ID:
            request_id = request_id or str(value)
        elif key == headers.PRIORITY:
            if not priority:
                priority = _priority(str(value))
        elif key == headers.MODEL_DYE:
            dye = str(value)
    check_model(model, version, version_field=version_field)
    return version, request_id, priority, dye


def _priority(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) > _UINT32_MAX:
        raise InvalidInput(
            f"header {headers.PRIORITY!r} must be a non-negative integer priority level, got {echo(text)}"
        )
    return int(text)
