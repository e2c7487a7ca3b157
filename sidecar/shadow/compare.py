"""Shadow comparison: a share of stable-dyed unary calls is mirrored to the canary version and
the two answers compared (max absolute difference and per-row argmax agreement of each output),
as metrics; greedy Generate streams are compared token by token. Each comparison is also a span
in the mirrored call's trace (tracing on), naming the stable and canary versions compared, with
its result as an event, and a debug log line. The client only ever gets the
stable answer and never waits for the shadow: the mirror runs in the background after the answer
has gone, and at most `max_in_flight` at once; beyond that a new shadow call is dropped
(counted), so shadow load goes first under pressure. The service drops a shadow too when it would
delay a real call (RESOURCE_EXHAUSTED `shadow_dropped`, with `grpc-retry-pushback-ms`): counted as
dropped, and no new shadow goes to that upstream and version until the pushback has passed
(`held`), so a busy service is not sent a call per stable answer only to refuse it.

Answers are decoded here (protobuf only, no numpy): only for mirrored calls, off the hot path.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import random
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from google.protobuf.message import DecodeError

from modelyard.common import headers
from modelyard.common.reasons import ErrorReason
from modelyard.inference.v1 import inference_service_pb2, tensor_pb2
from modelyard.kserve.v2 import grpc_service_pb2
from modelyard.sidecar.metrics import SidecarMetrics

log = logging.getLogger(__name__)

INFER = "/modelyard.inference.v1.InferenceService/Infer"
GENERATE = "/modelyard.inference.v1.InferenceService/Generate"
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
METHODS = frozenset({INFER, MODEL_INFER})
MAX_COMPARED = 1 << 20  # elements per output; beyond it only the first ones are compared
# A service's shadow_dropped without a pushback of its own: how long to hold (its own is 100 ms);
# and the longest pushback honoured (an upstream cannot stop the shadows for long by asking).
DEFAULT_PUSHBACK_S = 0.1
MAX_PUSHBACK_S = 10.0

# KServe datatype names (our enum's names without DATA_TYPE_) -> array typecodes.
_TYPECODES = {
    "FP32": "f",
    "FP64": "d",
    "INT8": "b",
    "INT16": "h",
    "INT32": "i",
    "INT64": "q",
    "UINT8": "B",
    "UINT16": "H",
    "UINT32": "I",
    "UINT64": "Q",
}


@dataclass(frozen=True)
class ShadowPolicy:
    share: float = 0.0  # percent of stable-dyed unary Infer / ModelInfer calls mirrored
    max_in_flight: int = 4

    def __post_init__(self) -> None:
        if not 0 <= self.share <= 100 or self.max_in_flight < 0:
            raise ValueError("share must be 0-100 and max_in_flight not negative")


@dataclass(frozen=True)
class Output:
    shape: tuple[int, ...]
    datatype: str
    raw: bytes


@dataclass(frozen=True)
class Comparison:
    max_abs_diff: float  # over every compared output; inf when shapes or types differ
    rows: int  # rows whose argmax was compared
    rows_agreeing: int


def decode_outputs(method: str, answer: bytes) -> dict[str, Output]:
    if method == INFER:
        response = inference_service_pb2.InferResponse.FromString(answer)
        return {t.name: Output(tuple(t.shape), _type_name(t.datatype), t.raw_data) for t in response.outputs}
    kserve = grpc_service_pb2.ModelInferResponse.FromString(answer)
    raws = list(kserve.raw_output_contents)
    return {
        t.name: Output(tuple(t.shape), t.datatype, raws[i] if i < len(raws) else b"")
        for i, t in enumerate(kserve.outputs)
    }


def _type_name(datatype: int) -> str:
    return tensor_pb2.DataType.Name(datatype).removeprefix("DATA_TYPE_")  # type: ignore[arg-type]


def _values(output: Output) -> Sequence[float] | None:
    code = _TYPECODES.get(output.datatype)
    if code is None:
        return None
    values = array.array(code)
    size = values.itemsize
    values.frombytes(output.raw[: len(output.raw) // size * size][: MAX_COMPARED * size])
    if sys.byteorder != "little":
        values.byteswap()
    return values


def compare(stable: dict[str, Output], canary: dict[str, Output]) -> Comparison:
    worst = 0.0
    rows = agreeing = 0
    for name, a in stable.items():
        b = canary.get(name)
        if b is None or a.shape != b.shape or a.datatype != b.datatype:
            worst = float("inf")
            continue
        x, y = _values(a), _values(b)
        if x is None or y is None:
            worst = max(worst, 0.0 if a.raw == b.raw else float("inf"))
            continue
        worst = max(worst, max((abs(p - q) for p, q in zip(x, y, strict=False)), default=0.0))
        width = a.shape[-1] if len(a.shape) >= 2 and a.shape[-1] > 0 else len(x)
        for start in range(0, min(len(x), len(y)) - width + 1, width):
            rows += 1
            row_x, row_y = x[start : start + width], y[start : start + width]
            agreeing += row_x.index(max(row_x)) == row_y.index(max(row_y))
    return Comparison(worst, rows, agreeing)


def is_greedy(request: bytes) -> bool:
    """Only greedy generations (temperature 0) are comparable token by token."""
    try:
        return inference_service_pb2.GenerateRequest.FromString(request).temperature == 0
    except DecodeError:
        return False


def token_ids(event: bytes) -> list[int]:
    return list(inference_service_pb2.GenerateResponse.FromString(event).token_ids)


def token_agreement(stable: Sequence[int], canary: Sequence[int]) -> tuple[int, int]:
    """(tokens compared, tokens agreeing): the longer output's length, and the common prefix's
    (after a first difference, greedy outputs go their own ways)."""
    agreeing = 0
    for a, b in zip(stable, canary, strict=False):
        if a != b:
            break
        agreeing += 1
    return max(len(stable), len(canary)), agreeing


class Traces(Protocol):
    """The span of one comparison (tracing.Tracing.shadow; not imported here: the route table
    imports this module, and the call path's layers import the route table, never tracing)."""

    def shadow(
        self, model: str, stable: str, canary: str, method: str
    ) -> contextlib.AbstractContextManager[Any]: ...


class _Untraced:
    def shadow(
        self, model: str, stable: str, canary: str, method: str
    ) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()


Versions = tuple[str, str]  # (stable, canary): the versions a comparison is between
Send = Callable[[bytes], Awaitable[bytes]]
SendStream = Callable[[bytes], Awaitable[list[int]]]


def pushback_s(exc: BaseException) -> float | None:
    """How long the service asked the mirror to wait when it dropped a shadow (`shadow_dropped`:
    it had no spare capacity), in seconds; None for any other failure. Read from a gRPC error by
    its methods (grpc.aio.AioRpcError's): this module imports no transport (the layers import
    the route table, which imports this module)."""
    trailing_metadata = getattr(exc, "trailing_metadata", None)
    if trailing_metadata is None:
        return None
    trailing: Any = trailing_metadata() or ()
    found = {key: value for key, value in trailing if isinstance(value, str)}
    if found.get(headers.ERROR_REASON) != ErrorReason.SHADOW_DROPPED:
        return None
    try:
        asked = int(found.get(headers.RETRY_PUSHBACK_MS, "")) / 1000
    except ValueError:
        return DEFAULT_PUSHBACK_S
    return min(max(asked, 0.0), MAX_PUSHBACK_S)


Target = Hashable  # where a shadow goes (upstream, model, version): what a pushback holds


class Shadows:
    """Mirrors calls in the background, bounded; the proxy calls `mirror` once it has answered."""

    def __init__(
        self,
        metrics: SidecarMetrics,
        chance: Callable[[], float] = random.random,
        tracing: Traces | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._metrics = metrics
        self._chance = chance
        self._tracing: Traces = tracing if tracing is not None else _Untraced()
        self._clock = clock
        self._in_flight: set[asyncio.Task[None]] = set()
        # Targets whose service dropped a shadow, until when (its pushback); only the served
        # versions' upstreams ever get here, and a held target leaves once its time has passed.
        self._held: dict[Target, float] = {}

    def wants(self, policy: ShadowPolicy) -> bool:
        return policy.share > 0 and self._chance() * 100 < policy.share

    def held(self, target: Target, model: str) -> bool:
        """Whether a shadow to `target` waits out its service's pushback: if so it is dropped
        (counted), never sent."""
        until = self._held.get(target)
        if until is None:
            return False
        if self._clock() >= until:
            del self._held[target]
            return False
        self._metrics.shadow_calls.labels(model, "dropped").inc()
        return True

    def _hold(self, target: Target, seconds: float) -> None:
        until = self._clock() + seconds
        if until > self._held.get(target, 0.0):
            self._held[target] = until

    def mirror(
        self,
        policy: ShadowPolicy,
        model: str,
        method: str,
        request: bytes,
        stable: bytes,
        send: Send,
        versions: Versions = ("", ""),
        target: Target = None,
    ) -> bool:
        """Send `request` to the canary in the background and compare its answer with `stable`,
        unless `max_in_flight` shadow calls are running; returns whether it started. `versions`:
        (stable, canary), for the trace and the log; `target`: where it goes, held for the
        service's pushback if it drops the shadow."""
        return self._start(policy, model, self._run(model, method, request, stable, send, versions, target))

    def mirror_tokens(
        self,
        policy: ShadowPolicy,
        model: str,
        request: bytes,
        stable: list[int],
        send: SendStream,
        versions: Versions = ("", ""),
        target: Target = None,
    ) -> bool:
        """The same for a greedy Generate: the canary's tokens against the stable stream's."""
        return self._start(policy, model, self._run_tokens(model, request, stable, send, versions, target))

    def _start(self, policy: ShadowPolicy, model: str, work: Coroutine[Any, Any, None]) -> bool:
        if len(self._in_flight) >= policy.max_in_flight:
            work.close()
            self._metrics.shadow_calls.labels(model, "dropped").inc()
            return False
        task = asyncio.get_running_loop().create_task(work)
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)
        return True

    async def _run_tokens(
        self,
        model: str,
        request: bytes,
        stable: list[int],
        send: SendStream,
        versions: Versions,
        target: Target = None,
    ) -> None:
        with self._tracing.shadow(model, *versions, GENERATE) as span:
            try:
                canary = await send(request)
            except Exception as exc:
                self._failed(span, model, versions, exc, target)
                return
            compared, agreeing = token_agreement(stable, canary)
            self._metrics.shadow_calls.labels(model, "compared").inc()
            self._metrics.shadow_tokens.labels(model).inc(compared)
            self._metrics.shadow_tokens_agreeing.labels(model).inc(agreeing)
            self._compared(span, model, versions, {"tokens": compared, "tokens_agreeing": agreeing})

    async def _run(
        self,
        model: str,
        method: str,
        request: bytes,
        stable: bytes,
        send: Send,
        versions: Versions,
        target: Target = None,
    ) -> None:
        with self._tracing.shadow(model, *versions, method) as span:
            try:
                answer = await send(request)
            except Exception as exc:  # the canary's failure is a finding, not an error of ours
                self._failed(span, model, versions, exc, target)
                return
            try:
                result = compare(decode_outputs(method, stable), decode_outputs(method, answer))
            except Exception:
                log.exception("shadow comparison for %s failed", model)
                self._metrics.shadow_calls.labels(model, "failed").inc()
                return
            self._metrics.shadow_calls.labels(model, "compared").inc()
            self._metrics.shadow_max_abs_diff.labels(model).observe(result.max_abs_diff)
            self._metrics.shadow_rows.labels(model).inc(result.rows)
            self._metrics.shadow_rows_agreeing.labels(model).inc(result.rows_agreeing)
            found = {"rows": result.rows, "rows_agreeing": result.rows_agreeing}
            self._compared(span, model, versions, {**found, "max_abs_diff": result.max_abs_diff})

    def _failed(self, span: Any, model: str, versions: Versions, exc: Exception, target: Target) -> None:
        wait_s = pushback_s(exc)
        if wait_s is not None:  # the service had no spare capacity: dropped, not failed
            if target is not None:
                self._hold(target, wait_s)
            self._metrics.shadow_calls.labels(model, "dropped").inc()
            if span is not None:
                span.add_event("dropped", {"pushback_ms": round(wait_s * 1000)})
            return
        log.debug("shadow call on %s (stable %s, canary %s) failed: %s", model, *versions, exc)
        self._metrics.shadow_calls.labels(model, "failed").inc()
        if span is not None:
            span.add_event("failed", {"error": str(exc)[:200]})

    def _compared(self, span: Any, model: str, versions: Versions, found: dict[str, int | float]) -> None:
        log.debug(
            "shadow comparison on %s: stable %s against canary %s: %s",
            model,
            *versions,
            ", ".join(f"{key} {value:g}" for key, value in found.items()),
        )
        if span is not None:
            span.add_event("compared", found)

    async def close(self) -> None:
        for task in list(self._in_flight):
            task.cancel()
        await asyncio.gather(*self._in_flight, return_exceptions=True)
