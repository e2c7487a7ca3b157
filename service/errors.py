"""Domain errors of the service. They carry no transport status: api/errors.py maps them to gRPC."""

from __future__ import annotations


class ServiceError(Exception):
    """Base of every error the service answers a request with."""


class ModelNotFound(ServiceError):
    """No model of that name is known."""


# Triton's words for a model or version it does not serve, which Triton's clients and tests match
# ("Request for unknown model"); the quoted name (names.echo) goes in the braces.
UNKNOWN_MODEL = "Request for unknown model: {} is not found"
UNKNOWN_VERSION = "Request for unknown model: {} version {} is not found"


class VersionNotFound(ModelNotFound):
    """The model is known, but the requested version is not served (a subclass: callers that only
    care that nothing answers catch ModelNotFound)."""


class InvalidInput(ServiceError):
    """A request's tensors or fields do not fit the model; the message names the tensor or field."""


class ModelRejected(ServiceError):
    """The model's graph refused a request that passed every declared check (a kernel's check on
    the shapes or values it computed): this version's fault or the values', not told apart here
    (FAILED_PRECONDITION, model_rejected)."""


class ModelUnavailable(ServiceError):
    """The model exists but cannot serve right now (loading, draining, shutting down)."""


class TooLarge(ServiceError):
    """A request or response exceeds a configured size limit."""


class RunMemoryExceeded(TooLarge):
    """A run needed more memory than the run memory bound allows (the arena's max_mem): a request
    whose values ask for a huge tensor (ConstantOfShape, Expand...). RESOURCE_EXHAUSTED, too_large."""


class ModelLoadError(ServiceError):
    """A model version could not be loaded; the message says which file and why."""

    def __init__(self, message: str, kind: str = "load") -> None:
        super().__init__(message)
        # Why, in one word, for metrics: config, checksum, load, schema, incompatible, warmup, memory.
        self.kind = kind


class Unsupported(ServiceError):
    """The request asks for something this model or server does not do."""


class ModelRunError(ServiceError):
    """The runtime failed while running a model on valid-looking input."""


class DeviceFault(ModelRunError):
    """The device or its runtime failed a run (a CUDA error, an execution provider failure), not the
    request's input: the model instance that ran it is skipped for a while (runtime/instances.py)."""


class SequenceStateError(ServiceError):
    """A sequence step the state of its sequence does not allow: a step of a sequence that is not
    live (never started, ended, or released after idling), or a START for a live one
    (FAILED_PRECONDITION, failed_precondition: the request is well formed, the sequence is not
    where it says)."""


class NotGenerative(ServiceError):
    """Generate was asked of a model that cannot generate: not a decoder, or no tokenizer."""


class Overloaded(ServiceError):
    """The model's queue for this kind of work is full; the client may retry later."""


class ShadowDropped(Overloaded):
    """A shadow call (x-model-dye: shadow) found no spare capacity and was dropped, not queued:
    RESOURCE_EXHAUSTED, shadow_dropped (runtime/capacity.py)."""


class DeadlineExceeded(ServiceError):
    """The request's deadline passed before its work was done; the work is dropped, not finished."""


class ReaderStalled(ServiceError):
    """A stream's reader took nothing for longer than the stall limit; its work was dropped."""


class PreemptedDropped(ReaderStalled):
    """A stream whose reader fell behind gave up its decode slot to waiting work and was then the
    oldest of more such streams than generation.max_preempted: its work was dropped (ABORTED,
    reader_stalled, as a stalled reader's)."""
