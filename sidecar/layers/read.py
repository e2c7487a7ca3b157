"""Layer 1, read the call: the model and version it names, checked by the one name rule before
they reach any state, label or message, its forwarded metadata, and who it is (its tenant
bucket, its caller key). The value it gives the next layers is `Asked`.

Status codes are named by their gRPC names ("INVALID_ARGUMENT"): the proxy translates.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from modelyard.common import headers
from modelyard.common.names import InvalidName, check_name, check_version
from modelyard.common.reasons import ErrorReason
from modelyard.sidecar.layers.frozen import Frozen
from modelyard.sidecar.message_fields import ModelFields, WireError, read_model_fields
from modelyard.sidecar.tenant_limits import ANY_TENANT, TenantLimit

Metadata = tuple[tuple[str, str | bytes], ...]
Read = tuple[bytes, ModelFields]  # a message and its fields 1 and 2 (message_fields.read_model_fields)

OTHER = "_other"  # the one metric label of every model or tenant the sidecar holds no state for
# Request headers the sidecar sets itself (or that only make sense on one hop).
_DROP = frozenset({headers.MODEL_VERSION, headers.MODEL_DYE, "user-agent", "te", "content-type"})
# Model names that passed the name rule, kept by a `Names` (one per proxy): the same few on every
# call, so checked once each. Bounded, since a client may send any number of valid names: past
# it, each is checked.
VALID_NAMES_KEPT = 1024


class Refused(Exception):
    """The call is answered by the sidecar itself: `code` is a gRPC status code's name."""

    def __init__(self, code: str, message: str, reason: str, extra: Metadata = ()) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.extra = extra

    @property
    def metadata(self) -> Metadata:
        """The trailing metadata of the refusal."""
        return ((headers.ERROR_REASON, self.reason), *self.extra)


class Names:
    """The model names one proxy has seen pass the name rule (bounded: VALID_NAMES_KEPT)."""

    __slots__ = ("valid",)

    def __init__(self) -> None:
        self.valid: set[str] = set()

    def checked(self, model: str, received: Mapping[str, str]) -> str:
        """The model name from field 1 (else its header), checked unless seen valid before."""
        if model in self.valid:
            return model
        model = _checked(check_name, model, "model_name", received, headers.MODEL_NAME)
        if model and len(self.valid) < VALID_NAMES_KEPT:
            self.valid.add(model)
        return model


@dataclass(slots=True, eq=False)
class _AskedFields:
    """An Asked's fields (see Asked, the frozen class over them, as attempt.Attempt is)."""

    model: str
    pin: str  # the version it pinned (field 2 or x-model-version); empty: none
    received: Mapping[str, str]  # its string-valued request headers
    forward: Metadata  # its request metadata for the upstream, the sidecar's own headers dropped
    view: Any  # its model as the sidecar knew it (view.ModelView)
    read: Read | None = None  # its first message and that message's fields 1 and 2 (once)

    @property
    def label(self) -> str:
        """The model's metric label: its name when the upstreams serve it, else `_other`."""
        return str(self.view.label)


class Asked(Frozen, _AskedFields):
    """A call as it asked (what `read` found): the model and the version it pinned, its headers,
    the metadata forwarded upstream, its model's view, and its first message as read. Frozen,
    and made fast (frozen.py)."""

    __slots__ = ()
    fields_class = _AskedFields


def read(
    request: bytes | None,
    md: Metadata,
    views: Callable[[str], Any],
    names: Names,
    model_addressed: bool,
) -> Asked:
    """The model and pinned version a call names (its fields 1 and 2, else its headers), checked
    by the one name rule; its metadata read in one pass; its model's view (`views`)."""
    received: dict[str, str] = {}
    kept: list[tuple[str, str | bytes]] = []
    for item in md:  # one pass over the call's metadata
        key, value = item
        if isinstance(value, str):
            received[key] = value
        if key not in _DROP and key[:1] != ":":
            kept.append(item)  # the pair itself, not a copy
    forward = tuple(kept)
    if not model_addressed:
        return Asked("", "", received, forward, views(""), None)
    message = request or b""
    try:
        fields = read_model_fields(message)
    except WireError as exc:
        raise Refused(
            "INVALID_ARGUMENT", f"the request is not a valid message: {exc}", ErrorReason.INVALID_ARGUMENT
        ) from exc
    pin = ""
    try:
        model = fields.name
        if model not in names.valid:  # a name seen valid before is not checked again
            model = names.checked(model, received)
        if fields.version or headers.MODEL_VERSION in received:  # most calls pin none
            pin = _checked(check_version, fields.version, "model_version", received, headers.MODEL_VERSION)
    except InvalidName as exc:
        raise Refused("INVALID_ARGUMENT", str(exc), ErrorReason.INVALID_ARGUMENT) from exc
    return Asked(model, pin, received, forward, views(model), (message, fields))


def caller_key(received: Mapping[str, str], stickiness_header: str, peer: str | Callable[[], str]) -> int:
    """Who a call is, as far as the sidecar can tell: its tenant, else its user's sticky key, else
    its connection (`peer`, or what gives it: gRPC's context.peer builds a string per call, asked
    only when needed). Only a hash is kept (in the breakers' windows)."""
    tenant = received.get(headers.TENANT_ID)
    if tenant:
        return hash(("tenant", tenant))
    user = received.get(stickiness_header)
    if user:
        return hash(("user", user))
    return hash(("peer", peer if isinstance(peer, str) else peer()))


def tenant_bucket(tenants: Mapping[str, TenantLimit], received: Mapping[str, str]) -> str:
    """The tenant-limit bucket of a call, or empty when no tenant is configured. A configured
    tenant has its own bucket and label; every other one (and a call without x-tenant-id) shares
    the `*` bucket and one label: rotating ids buys no new state."""
    if not tenants:
        return ""
    named = received.get(headers.TENANT_ID) or ""
    return named if named in tenants and named != ANY_TENANT else ANY_TENANT


def _checked(
    check: Callable[[str, str], str], field_value: str, field: str, received: Mapping[str, str], header: str
) -> str:
    """The name or version from the message's field, else from its header, through `check`."""
    if field_value:
        return str(check(field_value, field))
    from_header = received.get(header, "")
    return str(check(from_header, header)) if from_header else ""
