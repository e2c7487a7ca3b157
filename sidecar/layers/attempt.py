"""Layer 4, attempt: one try of a call, frozen: where it goes (its version, dye and upstream),
what it holds (its breaker and the permit taken from it), the metadata it carries, and what the
client's answer gets from the sidecar (`answer_metadata`). A retry or a fallback is a new
Attempt (retry.py); what becomes of an attempt (its verdict to the breaker, given once) is the
call's state, kept by its scope (scope.py).

The values an attempt's `fallback` takes (the answer's `x-dye-fallback`) are named here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from modelyard.common import headers
from modelyard.sidecar.breakers import Breaker, Permit
from modelyard.sidecar.dyeing import CANARY, PINNED, STABLE
from modelyard.sidecar.layers.frozen import Frozen
from modelyard.sidecar.layers.read import Asked, Metadata
from modelyard.sidecar.layers.view import Target
from modelyard.sidecar.message_fields import WireError, read_model_fields, with_version

U = TypeVar("U", bound=Target)

# Why a canary-dyed call was answered by stable (x-dye-fallback):
FALLBACK_BREAKER = "breaker-open"  # every canary upstream's breaker refused the call
FALLBACK_UNAVAILABLE = "unavailable"  # no canary upstream, or the one tried was unreachable
FALLBACK_CANARY_FAULT = "canary-fault"  # the canary failed it (a fault, or its graph refused it)
# A canary's `model_rejected` replayed on stable that stable did not answer either (it refused the
# request too, or the call ended first): the request's fault, charged to neither version.
FALLBACK_REPLAYED = "replayed"


@dataclass(slots=True, eq=False)
class _AttemptFields(Generic[U]):
    """An Attempt's fields and reads (see Attempt, the frozen class over them: only its __new__
    makes one of these). `breaker` None: a model (or version) the upstreams do not serve, which
    gets no state; `caller` is who made the call (read.caller_key: the breakers' leave-one-out);
    `replay_of` the canary attempt this one replays on stable (its verdict waits for this one's
    outcome: retry.settle_replay)."""

    model: str
    version: str
    dye: str
    fallback: str
    stable: str  # the stable version a canary attempt is judged against and falls back to
    upstream: U
    breaker: Breaker | None
    permit: Permit | None
    forward: Metadata  # request metadata for the upstream
    caller: int | None
    label: str  # the model's metric label: its name when the upstreams serve it, else `_other`
    answer_metadata: Metadata  # what the client's response metadata gets (`answer_metadata`)
    asked: Asked | None = None  # the call as it asked (its first message as read, its view)
    fell_back: bool = False  # this attempt is the fallback to stable (counted once)
    replay_of: Attempt[Any] | None = None

    def body(self, message: bytes) -> bytes:
        """The message with the chosen version in field 2, unless it carries one already."""
        if not self.version or not self.dye:
            return message
        asked = self.asked
        read = asked.read if asked is not None else None
        if read is not None and read[0] is message:
            fields = read[1]  # the first message, read by the read layer already
        else:
            try:
                fields = read_model_fields(message)
            except WireError:
                return message  # the upstream answers INVALID_ARGUMENT for it
        if not fields.complete or fields.version or (fields.name and fields.name != self.model):
            return message
        return with_version(message, self.version)


class Attempt(Frozen, _AttemptFields[U]):
    """One attempt of a call (see the module's docstring), frozen and made fast (frozen.py)."""

    __slots__ = ()
    fields_class = _AttemptFields


# The usual answers' metadata, made once (by dye, without a fallback).
ANSWERS: dict[str, Metadata] = {"": (), **{d: ((headers.MODEL_DYE, d),) for d in (STABLE, CANARY, PINNED)}}


def answer_metadata(dye: str, fallback: str) -> Metadata:
    """What the client's response metadata gets from the sidecar for an attempt so dyed: its dye
    (none without one) and the fallback, if any."""
    md = ANSWERS.get(dye) or ((headers.MODEL_DYE, dye),) if dye else ()
    return (*md, (headers.DYE_FALLBACK, fallback)) if fallback and dye else md


def unrouted(asked: Asked, upstream: U) -> Attempt[U]:
    """The one attempt of a call that is not dyed: no state (no breaker, no permit, no dye)."""
    label = asked.view.label
    return Attempt(
        asked.model,
        asked.pin,
        "",
        "",
        "",
        upstream,
        None,
        None,
        asked.forward,
        None,
        label,
        (),
        asked,
        False,
        None,
    )


def following(
    attempt: Attempt[Any],
    version: str,
    dye: str,
    fallback: str,
    found: tuple[U, Breaker | None, Permit | None],
    forward: Metadata,
    *,
    fell_back: bool = False,
    replay_of: Attempt[Any] | None = None,
) -> Attempt[U]:
    """The attempt after `attempt` failed (retry.after_failure): at `found`, for `version` so dyed,
    with `forward` (the call's metadata without the sidecar's version and dye headers)."""
    upstream, breaker, permit = found
    forward = (*forward, (headers.MODEL_VERSION, version), (headers.MODEL_DYE, dye))
    return Attempt(
        attempt.model,
        version,
        dye,
        fallback,
        attempt.stable,
        upstream,
        breaker,
        permit,
        forward,
        attempt.caller,
        attempt.label,
        answer_metadata(dye, fallback),
        attempt.asked,
        fell_back,
        replay_of,
    )


def replayed_unanswered(attempt: Attempt[U]) -> Attempt[U]:
    """A replay of a canary attempt that stable did not answer either: its answer says `replayed`."""
    a = attempt
    answer = answer_metadata(a.dye, FALLBACK_REPLAYED)
    return Attempt(
        a.model,
        a.version,
        a.dye,
        FALLBACK_REPLAYED,
        a.stable,
        a.upstream,
        a.breaker,
        a.permit,
        a.forward,
        a.caller,
        a.label,
        answer,
        a.asked,
        a.fell_back,
        a.replay_of,
    )


def stripped(forward: Metadata) -> Metadata:
    """The forwarded metadata without the sidecar's own version and dye headers."""
    return tuple((k, v) for k, v in forward if k not in (headers.MODEL_VERSION, headers.MODEL_DYE))
