"""Shadow comparison: output differences and argmax agreement from real response bytes; the
bound on shadow calls in flight (extra ones are dropped, never queued)."""

from __future__ import annotations

import asyncio
import math
import struct

from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import tensor_pb2
from modelyard.kserve.v2 import grpc_service_pb2 as kserve
from modelyard.sidecar.metrics import SidecarMetrics
from modelyard.sidecar.shadow import (
    INFER,
    MODEL_INFER,
    ShadowPolicy,
    Shadows,
    compare,
    decode_outputs,
    is_greedy,
    token_agreement,
    token_ids,
)


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
