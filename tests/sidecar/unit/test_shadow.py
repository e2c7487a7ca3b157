"""Shadow comparison: output differences and argmax agreement from real response bytes; the
bound on shadow calls in flight (extra ones are dropped, never queued); a shadow the service
dropped (shadow_dropped) counts as dropped and holds its target for the service's pushback."""

from __future__ import annotations

import asyncio
import math
import struct

import grpc

from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import tensor_pb2
from modelyard.kserve.v2 import grpc_service_pb2 as kserve
from modelyard.sidecar.metrics import SidecarMetrics
from modelyard.sidecar.shadow.compare import (
    DEFAULT_PUSHBACK_S,
    INFER,
    MAX_PUSHBACK_S,
    MODEL_INFER,
    ShadowPolicy,
    Shadows,
    compare,
    decode_outputs,
    is_greedy,
    pushback_s,
    token_agreement,
    token_ids,
)
from tests.support import eventually


def answer(rows: list[list[float]]) -> bytes:
    raw = b"".join(struct.pack(f"<{len(r)}f", *r) for r in rows)
    tensor = tensor_pb2.Tensor(
        name="OUTPUT0", datatype=tensor_pb2.DATA_TYPE_FP32, shape=[len(rows), len(rows[0])], raw_data=raw
    )
    return pb.InferResponse(model_name="m", outputs=[tensor]).SerializeToString()


def test_differences_and_argmax_agreement() -> None:
    stable = decode_outputs(INFER, answer([[0.1, 0.9, 0.0], [0.5, 0.2, 0.3]]))
    canary = decode_outputs(INFER, answer([[0.2, 0.7, 0.1], [0.1, 0.6, 0.3]]))
    result = compare(stable, canary)
    assert math.isclose(result.max_abs_diff, 0.4, rel_tol=1e-6)
    assert (result.rows, result.rows_agreeing) == (2, 1)
    assert compare(stable, stable).max_abs_diff == 0.0


def test_a_shape_change_is_an_infinite_difference() -> None:
    result = compare(
        decode_outputs(INFER, answer([[1.0, 2.0]])), decode_outputs(INFER, answer([[1.0], [2.0]]))
    )
    assert result.max_abs_diff == math.inf


def test_kserve_answers_are_compared_too() -> None:
    def kserve_answer(values: list[float]) -> bytes:
        out = kserve.ModelInferResponse.InferOutputTensor(
            name="OUTPUT0", datatype="FP32", shape=[1, len(values)]
        )
        raw = struct.pack(f"<{len(values)}f", *values)
        return kserve.ModelInferResponse(outputs=[out], raw_output_contents=[raw]).SerializeToString()

    result = compare(
        decode_outputs(MODEL_INFER, kserve_answer([1.0, 2.0])),
        decode_outputs(MODEL_INFER, kserve_answer([1.0, 2.5])),
    )
    assert (result.max_abs_diff, result.rows, result.rows_agreeing) == (0.5, 1, 1)


async def test_shadow_calls_are_bounded_and_extra_ones_dropped() -> None:
    metrics = SidecarMetrics()
    shadows = Shadows(metrics, chance=lambda: 0.0)
    policy = ShadowPolicy(share=100, max_in_flight=2)
    release = asyncio.Event()
    stable = answer([[1.0, 2.0]])

    async def slow_canary(request: bytes) -> bytes:
        await release.wait()
        return answer([[1.0, 3.0]])

    assert shadows.wants(policy) and not shadows.wants(ShadowPolicy(share=0))
    started = [shadows.mirror(policy, "m", INFER, b"", stable, slow_canary) for _ in range(5)]
    assert started == [True, True, False, False, False]
    release.set()
    await shadows.close()  # cancels what is left; here both finish first
    await asyncio.sleep(0)

    def sample(name: str, **labels: str) -> float:
        return metrics.registry.get_sample_value(name, {"model": "m", **labels}) or 0.0

    assert sample("modelyard_sidecar_shadow_calls_total", outcome="dropped") == 3


def test_greedy_generations_compare_by_their_common_prefix() -> None:
    assert is_greedy(pb.GenerateRequest(model_name="m", prompt="x").SerializeToString())
    assert not is_greedy(pb.GenerateRequest(model_name="m", temperature=0.7).SerializeToString())
    assert not is_greedy(b"\x0a\x10abc")  # not a message
    assert token_ids(pb.GenerateResponse(token_ids=[5, 6]).SerializeToString()) == [5, 6]
    assert token_agreement([1, 2, 3, 4], [1, 2, 9, 4]) == (4, 2)  # after a difference, nothing counts
    assert token_agreement([1, 2], [1, 2, 3]) == (3, 2)
    assert token_agreement([], []) == (0, 0)


def dropped_by_service(pushback_ms: str | None = "100") -> grpc.aio.AioRpcError:
    """The service's answer to a shadow it had no spare capacity for (as runtime/capacity.py)."""
    trailing = [("x-error-reason", "shadow_dropped")]
    if pushback_ms is not None:
        trailing.append(("grpc-retry-pushback-ms", pushback_ms))
    return grpc.aio.AioRpcError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(*trailing),
        "no spare capacity for a shadow call",
        None,
    )


def test_a_pushback_is_read_from_a_shadow_dropped_answer_only() -> None:
    assert pushback_s(dropped_by_service("250")) == 0.25
    assert pushback_s(dropped_by_service(None)) == DEFAULT_PUSHBACK_S
    assert pushback_s(dropped_by_service("junk")) == DEFAULT_PUSHBACK_S
    assert pushback_s(dropped_by_service("99999999")) == MAX_PUSHBACK_S  # no long silence on request
    busy = grpc.aio.AioRpcError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(("x-error-reason", "queue_full"), ("grpc-retry-pushback-ms", "100")),
        "queue full",
        None,
    )
    assert pushback_s(busy) is None  # a real call's load shed is the canary's finding, not a drop
    assert pushback_s(RuntimeError("boom")) is None


async def test_a_shadow_the_service_dropped_counts_as_dropped_and_holds_its_target() -> None:
    metrics = SidecarMetrics()
    now = [10.0]
    shadows = Shadows(metrics, chance=lambda: 0.0, clock=lambda: now[0])
    policy = ShadowPolicy(share=100, max_in_flight=4)
    stable = answer([[1.0, 2.0]])
    sent = []

    async def busy_canary(request: bytes) -> bytes:
        sent.append(request)
        raise dropped_by_service("100")

    def sample(outcome: str) -> float:
        labels = {"model": "m", "outcome": outcome}
        return metrics.registry.get_sample_value("modelyard_sidecar_shadow_calls_total", labels) or 0.0

    target = ("127.0.0.1:1", "m", "2")
    assert not shadows.held(target, "m")
    assert shadows.mirror(policy, "m", INFER, b"", stable, busy_canary, ("1", "2"), target)
    await eventually(lambda: sample("dropped") == 1, "the shadow answered")
    assert (len(sent), sample("failed")) == (1, 0)
    # Until the pushback has passed, no shadow goes to that target (each one counted as dropped).
    assert shadows.held(target, "m") and shadows.held(target, "m")
    assert not shadows.held(("127.0.0.1:1", "m", "3"), "m")  # another version is not held
    assert sample("dropped") == 3
    now[0] += 0.1
    assert not shadows.held(target, "m")
    assert sample("dropped") == 3

    async def failing_canary(request: bytes) -> bytes:
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(), "kernel failed", None
        )

    assert shadows.mirror(policy, "m", INFER, b"", stable, failing_canary, ("1", "2"), target)
    await eventually(lambda: sample("failed") == 1, "the shadow failed")
    assert not shadows.held(target, "m")  # a failure holds nothing
    await shadows.close()
