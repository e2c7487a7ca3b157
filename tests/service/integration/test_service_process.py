"""`python -m modelyard.service` as an operator runs it: start-up line, health, graceful SIGTERM,
exit code."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from pathlib import Path
from typing import Any
from urllib.request import urlopen

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from models import demo_models
from modelyard.common import headers
from modelyard.common.reasons import ErrorReason
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.inference.v1 import model_service_pb2 as mpb
from modelyard.inference.v1 import model_service_pb2_grpc as mpb_grpc
from modelyard.tensors import to_array, to_tensor
from tests.support import eventually, metric

SLOW_ROWS = 3000
BIG = [("grpc.max_receive_message_length", 64 << 20)]  # the slow model's answers


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


async def _both_in_flight(stub: Any, metrics_url: str) -> list[asyncio.Future[Any]]:
    """Two slow requests, once both arrived (one waits in the queue while the other holds the
    model's only run slot)."""
    x = np.ones((SLOW_ROWS, 512), np.float32)
    in_flight = [
        asyncio.ensure_future(stub.Infer(pb.InferRequest(model_name="slow", inputs=[to_tensor("INPUT0", x)])))
        for _ in range(2)
    ]

    def queued() -> float | None:  # a loopback scrape: a millisecond
        body = urlopen(metrics_url, timeout=5).read().decode()
        return metric(body, "modelyard_queue_depth", model="slow", version="1", priority="1")

    await eventually(lambda: queued() == 1 or any(c.done() for c in in_flight), "both requests in")
    assert not any(c.done() for c in in_flight), "a request finished before the other one arrived"
    return in_flight


def _whole(results: list[Any]) -> bool:
    return all(r.model_version == "1" and to_array(r.outputs[0]).shape == (SLOW_ROWS, 512) for r in results)


async def test_sigterm_drains_in_flight_requests_then_exits_zero(
    service_process, slow_repository: Path
) -> None:
    process = service_process(slow_repository, "--grace-s", "20")
    assert process.metrics_url is not None
    async with grpc.aio.insecure_channel(process.address, options=BIG) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        assert (
            await health.Check(health_pb2.HealthCheckRequest())
        ).status == health_pb2.HealthCheckResponse.SERVING
        # A call that holds the drain open until the test ends it (so the refusal below is seen
        # during the drain, however fast the slow requests end).
        watch = mpb_grpc.ModelServiceStub(channel).WatchModels(
            mpb.WatchModelsRequest(send_initial_state=True)
        )
        await watch.read()
        in_flight = await _both_in_flight(stub, process.metrics_url)
        process.proc.send_signal(signal.SIGTERM)

        # Health says NOT_SERVING once new calls are refused: a new call now is answered draining.
        async def not_serving() -> bool:
            reply = await health.Check(health_pb2.HealthCheckRequest())
            return bool(reply.status == health_pb2.HealthCheckResponse.NOT_SERVING)

        await eventually(not_serving, "health NOT_SERVING")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Infer(
                pb.InferRequest(model_name="fast", inputs=[to_tensor("INPUT0", np.ones((1, 4), np.float32))]),
                timeout=5,
            )
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        trailing: Any = caught.value.trailing_metadata() or ()
        assert (headers.ERROR_REASON, ErrorReason.DRAINING.value) in tuple(trailing)
        watch.cancel()
        assert _whole(await asyncio.gather(*in_flight))
    assert await asyncio.to_thread(process.proc.wait, 30) == 0
    assert any("shutting down" in line for line in process.log)
    assert process.log[-1].endswith("stopped")


# What a loaded client or a slow network reads of the service's answers: far less than the two
# drained answers (2 x 6 MiB) within the grace, slowly enough that their tails wait in the
# service's socket when their calls end.
SLOW_READER_BYTES_PER_S = 8e6


async def _pump(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rate: float, ended: list[str]
) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
            if rate:
                await asyncio.sleep(len(data) / rate)  # the pace of a slow reader, not a wait
        ended.append("eof")
    except OSError as exc:
        ended.append(repr(exc))
    finally:
        writer.close()


async def test_sigterm_drained_answers_reach_a_slow_reader(service_process, slow_repository: Path) -> None:
    """gRPC's stop(grace) alone shuts a connection as soon as its last call ended: the peer's next
    WINDOW_UPDATE draws a reset, which drops the answer's tail (UNAVAILABLE, "Connection reset by
    peer"). The service stops its server only once the peers acknowledged every byte."""
    process = service_process(slow_repository, "--grace-s", "20")
    assert process.metrics_url is not None
    host, port = process.address.rsplit(":", 1)
    upstream_ended: list[str] = []

    async def relay(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        service_r, service_w = await asyncio.open_connection(host, int(port))
        service_w.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        await asyncio.gather(
            _pump(client_r, service_w, 0, []),
            _pump(service_r, client_w, SLOW_READER_BYTES_PER_S, upstream_ended),
        )

    proxy = await asyncio.start_server(relay, "127.0.0.1", 0)
    try:
        address = f"127.0.0.1:{proxy.sockets[0].getsockname()[1]}"
        async with grpc.aio.insecure_channel(address, options=BIG) as channel:
            in_flight = await _both_in_flight(pb_grpc.InferenceServiceStub(channel), process.metrics_url)
            process.proc.send_signal(signal.SIGTERM)
            assert _whole(await asyncio.gather(*in_flight))
        assert await asyncio.to_thread(process.proc.wait, 30) == 0
        assert "ConnectionResetError" not in " ".join(upstream_ended)
    finally:
        proxy.close()
        await proxy.wait_closed()


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
