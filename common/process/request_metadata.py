"""A call's request metadata as its method's look-up was given it, for the handler to read.

grpc.aio builds the request metadata for a generic handler's `service(handler_call_details)`, and
context.invocation_metadata() builds it again, on every call that reads it (docs/benchmarks.md,
"Costs the code is shaped by"), so the look-up keeps the one it was given. grpc.aio looks a call's
method up and runs its handler in one task of the call's own, so a context variable set in the
look-up is that call's alone (tasks the handler starts copy it, for the same call).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Any, TypeAlias

Metadata: TypeAlias = Sequence[tuple[str, "str | bytes"]]

_looked_up: ContextVar[Metadata | None] = ContextVar("modelyard_invocation_metadata", default=None)

# `keep(metadata)`, in a generic handler's `service`: the metadata of the call being looked up.
# The context variable's own set (a C call: no Python frame per call).
keep: Callable[[Metadata], object] = _looked_up.set


def invocation_metadata(context: Any) -> Metadata:
    """The call's request metadata: the look-up's, or, for a handler that no look-up that keeps
    it ran before (called directly: tests, benchmarks), the context's."""
    metadata = _looked_up.get()
    if metadata is None:
        metadata = context.invocation_metadata() or ()
    return metadata
