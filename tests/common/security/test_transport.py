"""What the gRPC listeners (service and sidecar) do with hostile connections: a rapid-reset run on
one connection must cost that connection, not the calls of another; connections that never finish
their HTTP/2 preface, or stay without calls, are closed by the server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from models import demo_models
from tests.http2_raw import PREFACE, RST_STREAM, RawConnection
from tests.sidecar_support import SidecarProcess, start_sidecar_process
from tests.support import ServiceProcess, eventually

PAIRS = 3000  # HEADERS + RST_STREAM pairs of one rapid-reset run
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
Listener = Callable[..., str]  # flags -> the address of a running listener of that kind


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    demo_models.write_model(root, "scaler", 1, demo_models.scaled_identity(4, 2.0))
    return root


@pytest.fixture(params=["service", "sidecar"])
def listener(
    request: pytest.FixtureRequest, root: Path, service_process: Callable[..., ServiceProcess]
) -> Iterator[Listener]:
    """Starts the listener under test (a sidecar in front of a service), as processes."""
    sidecars: list[SidecarProcess] = []

    def start(*flags: str) -> str:
        if request.param == "service":
            return service_process(root, *flags).address
        upstream = service_process(root)
        sidecar = start_sidecar_process("--upstream", upstream.address, *flags)
        sidecars.append(sidecar)
        return sidecar.address

    yield start
    for sidecar in sidecars:
        sidecar.stop()


async def test_rapid_reset_on_one_connection_does_not_disturb_another(listener: Listener) -> None:
    address = listener()
    host, port = address.rsplit(":", 1)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
        latencies: list[float] = []
        failures: list[str] = []
        done = asyncio.Event()

        async def probe() -> None:
            while not done.is_set():
                started = time.perf_counter()
                try:
                    await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
                except grpc.aio.AioRpcError as exc:
                    failures.append(exc.code().name)
                latencies.append(time.perf_counter() - started)
                await asyncio.sleep(0.002)

        prober = asyncio.get_running_loop().create_task(probe())
        attacker = await RawConnection.open(host, int(port))
        try:
            await attacker.rapid_reset(PAIRS, HEALTH_CHECK)
            # The streams past the connection's bound are refused by the server itself...
            await eventually(
                lambda: attacker.seen.get(RST_STREAM, 0) >= PAIRS // 2, "the server refusing streams", 10.0
            )
            # ...and the prober goes on a while after the run.
            probes = len(latencies)
            await eventually(lambda: len(latencies) >= probes + 50, "more probes", 10.0)
        finally:
            done.set()
            await prober
            await attacker.close()
        worst = max(latencies)
        print(f"rapid reset x{PAIRS}: {len(latencies)} probes, failed {failures}, worst {worst * 1e3:.0f} ms")
        assert failures == []
        assert worst < 1.0  # generous: a frozen loop shows as seconds
        await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)


async def _closed_within(host: str, port: int, send: bytes, within_s: float) -> float:
    """Seconds until the server closes a connection on which `send` was written, then nothing."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(send)
        await writer.drain()
        started = time.monotonic()
        async with asyncio.timeout(within_s):
            while await reader.read(65536):  # b"" is EOF: the server closed it
                pass
        return time.monotonic() - started
    finally:
        writer.close()


async def test_silent_half_open_and_idle_connections_are_closed(listener: Listener) -> None:
    address = listener("--grpc-handshake-timeout-s", "1", "--grpc-max-connection-idle-s", "1")
    host, port = address.rsplit(":", 1)
    # Nothing at all, and half a preface: the handshake timeout. (TimeoutError when left open.)
    silent, partial = await asyncio.gather(
        _closed_within(host, int(port), b"", 10.0), _closed_within(host, int(port), PREFACE[:10], 10.0)
    )
    assert silent >= 0.5 and partial >= 0.5  # closed by the timeout, not refused at once
    # A complete HTTP/2 connection that makes no call: GOAWAY, then closed.
    idle = await RawConnection.open(host, int(port))
    try:
        async with asyncio.timeout(10.0):
            await idle.closed.wait()
        assert idle.goaway.is_set()
    finally:
        await idle.close()
    # A connection in use is not idle: calls keep answering on a channel that keeps calling.
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for _ in range(4):
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
            await asyncio.sleep(0.4)
