"""`python -m modelyard.service` as an operator runs it: start-up line, health, graceful SIGTERM,
exit code."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from urllib.request import urlopen

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from models import demo_models
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.tensors import to_array, to_tensor
from tests.support import eventually, metric

SLOW_ROWS = 3000


@pytest.fixture
def slow_repository(tmp_path: Path) -> Path:
    """A model whose run takes a noticeable time (a stack of 512x512 layers on many rows). It runs
    one batch at a time, so that a second request waits in its queue, where /metrics shows it."""
    root = tmp_path / "models"
    demo_models.write_model(
        root,
        "slow",
        1,
        demo_models.dense_stack(layers=8, width=512, seed=0),
        {"max_batch_size": SLOW_ROWS, "dynamic_batching": {"max_concurrent_batches": 1}},
    )
    demo_models.write_model(root, "fast", 1, demo_models.scaled_identity(4, 2.0), {"max_batch_size": 8})
    return root


async def test_sigterm_drains_in_flight_requests_then_exits_zero(
    service_process, slow_repository: Path
) -> None:
    process = service_process(slow_repository, "--grace-s", "20")
    big = [("grpc.max_receive_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(process.address, options=big) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        assert (
            await health.Check(health_pb2.HealthCheckRequest())
        ).status == health_pb2.HealthCheckResponse.SERVING
        x = np.ones((SLOW_ROWS, 512), np.float32)
        in_flight = [
            asyncio.ensure_future(
                stub.Infer(pb.InferRequest(model_name="slow", inputs=[to_tensor("INPUT0", x)]))
            )
            for _ in range(2)
        ]

        # Both arrived once one waits in the queue (the other one holds the only run slot).
        def queued() -> float | None:  # a loopback scrape: a millisecond
            body = urlopen(process.metrics_url, timeout=5).read().decode()
            return metric(body, "modelyard_queue_depth", model="slow", version="1", priority="1")

        await eventually(lambda: queued() == 1 or any(c.done() for c in in_flight), "both requests in")
        assert not any(c.done() for c in in_flight), "a request finished before the other one arrived"
        process.proc.send_signal(signal.SIGTERM)
        results = await asyncio.gather(*in_flight)
        assert all(
            r.model_version == "1" and to_array(r.outputs[0]).shape == (SLOW_ROWS, 512) for r in results
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Infer(
                pb.InferRequest(model_name="fast", inputs=[to_tensor("INPUT0", np.ones((1, 4), np.float32))]),
                timeout=5,
            )
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert await asyncio.to_thread(process.proc.wait, 30) == 0
    assert any("shutting down" in line for line in process.log)
    assert process.log[-1].endswith("stopped")


async def test_sigint_stops_an_idle_service_at_once(service_process, slow_repository: Path) -> None:
    process = service_process(slow_repository)
    started = time.perf_counter()
    assert process.stop(signal.SIGINT) == 0
    assert time.perf_counter() - started < 5


def test_start_up_line_and_metrics_endpoint(service_process, repository: Path) -> None:
    import urllib.request

    process = service_process(repository)
    serving = [line for line in process.log if "serving gRPC on" in line]
    assert len(serving) == 1 and "models ready: classifier, mixed, scaler" in serving[0]
    assert any("execution provider: CPUExecutionProvider" in line for line in process.log)
    assert process.metrics_url is not None
    body = urllib.request.urlopen(process.metrics_url, timeout=5).read().decode()
    assert "modelyard_model_versions_ready" in body
    assert process.stop() == 0


def test_taken_port_fails_loudly(service_process, repository: Path) -> None:
    import subprocess
    import sys

    first = service_process(repository)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "modelyard.service",
            "--repository",
            str(repository),
            "--listen",
            first.address,
            "--metrics-listen",
            "",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert first.address.rsplit(":", 1)[1] in result.stderr
