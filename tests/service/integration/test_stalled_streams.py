"""Stalled readers: a Generate stream whose client stops reading (its HTTP/2 window closed) gives
its decode slot to the next stream at once (preemption) and is dropped after
generation.stall_timeout_ms; the metrics count it, and the stalled client, when it reads again,
gets its tokens and then ABORTED."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from models import demo_models
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.service.repository.model_config import DEFAULT_GENERATION_QUEUE_TIMEOUT_US, parse_config
from modelyard.service.server import Service
from tests.support import eventually, serving

# One slot, one queue place, a 2-token stream buffer, and a short stall limit.
STALLING = """generation:
  max_concurrent_sequences: 1
  max_waiting: 1
  max_tokens: 200
  stream_buffer: 2
  stall_timeout_ms: 300
"""
PROMPT = "def add(a, b):\n    return"  # codelm writes past 200 tokens from it without an end


@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[Service]:
    root = tmp_path / "models"
    shutil.copytree(demo_models.COMMITTED_ROOT / "codelm" / "1", root / "lm" / "1")
    (root / "lm" / "config.yaml").write_text(STALLING)
    async with serving(root) as running:
        yield running


def _count(service: Service, name: str, **labels: str) -> float:
    value = service.metrics.registry.get_sample_value(name, {"model": "lm", "version": "1", **labels})
    return value or 0.0


async def test_a_stalled_reader_loses_its_slot_and_ends_aborted(service: Service) -> None:
    # The smallest fixed HTTP/2 window gRPC allows: a client that stops reading stalls at once.
    options = [("grpc.http2.lookahead_bytes", 1), ("grpc.http2.bdp_probe", 0)]
    async with (
        grpc.aio.insecure_channel(service.address, options=options) as slow,
        grpc.aio.insecure_channel(service.address) as fast,
    ):
        stalled: Any = pb_grpc.InferenceServiceStub(slow).Generate(
            pb.GenerateRequest(model_name="lm", prompt=PROMPT, max_tokens=200)
        )
        first = await stalled.read()
        assert first.sequence_number == 0
        # The one slot is the stalled stream's; it gives it up to this one, which waits in the queue
        # (without that, it would wait for the stall limit to free the slot).
        responses = [
            r
            async for r in pb_grpc.InferenceServiceStub(fast).Generate(
                pb.GenerateRequest(model_name="lm", prompt="import", max_tokens=5), timeout=20
            )
        ]
        assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert _count(service, "modelyard_generation_preemptions_total") == 1
        # Preempted, its reader still takes nothing: the stall limit drops it all the same.
        await eventually(
            lambda: _count(service, "modelyard_generation_cancellations_total", cause="stalled") == 1,
            "the stalled stream dropped",
        )
        assert _count(service, "modelyard_generation_finished_total", reason="stalled") == 1
        # The stalled client reads again: the tokens written before the stall, then ABORTED.
        read = 1
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            while (await stalled.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
                read += 1
        assert caught.value.code() == grpc.StatusCode.ABORTED
        assert "generation.stall_timeout_ms" in (caught.value.details() or "")
        trailers: Any = caught.value.trailing_metadata() or ()
        assert [v for k, v in trailers if k == "x-error-reason"] == ["reader_stalled"]
        assert read < 200


def test_queued_streams_wait_a_bounded_time_by_default() -> None:
    policy = parse_config({}).generation.admission.default_queue_policy
    assert policy.default_timeout_us == DEFAULT_GENERATION_QUEUE_TIMEOUT_US > 0
    assert parse_config({"generation": {"stall_timeout_ms": 0}}).generation.stall_timeout_ms == 0
