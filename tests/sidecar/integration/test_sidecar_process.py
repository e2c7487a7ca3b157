"""`python -m modelyard.sidecar` in front of `python -m modelyard.service`, both child processes,
as an operator runs them: health that follows the upstream, Generate streams and cancellation passing through,
tritonclient and perf_analyzer unchanged, a start without numpy or ONNX Runtime, SIGTERM."""

from __future__ import annotations

import asyncio
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from models import demo_models
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from tests.deploy.integration.test_entry_points import HEAVY, RUN_REFUSING
from tests.service.integration import test_service_process as service_tests
from tests.sidecar_support import infer, pairs
from tests.support import ServiceProcess, eventually, metric
from tests.triton.integration.test_perf_analyzer import run_perf_analyzer

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# The service's slow model and slow reader, for the drain (test_service_process.py).
slow_repository = service_tests.slow_repository
TIGHT = "generation:\n  max_concurrent_sequences: 1\n  max_tokens: 256\n  stream_buffer: 2\n"


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    demo_models.build_demo_repository(root)
    shutil.copytree(demo_models.COMMITTED_ROOT / "codelm" / "1", root / "tight" / "1")
    (root / "tight" / "config.yaml").write_text(TIGHT)
    for version in ("1", "2"):  # two identical versions of a decoder: a canary that agrees
        shutil.copytree(demo_models.COMMITTED_ROOT / "codelm" / "1", root / "twin" / version)
    (root / "twin" / "config.yaml").write_text("version_policy: {latest: 2}\n")
    return root


@pytest.fixture
def upstream(repository: Path, service_process: Callable[..., ServiceProcess]) -> ServiceProcess:
    return service_process(repository)


def scrape(url: str, name: str, **labels: str) -> float | None:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return metric(answer.read().decode(), name, **labels)


async def test_health_follows_the_upstream_and_sigterm_exits_zero(upstream, sidecar_process) -> None:
    sidecar = sidecar_process("--upstream", upstream.address)
    async with grpc.aio.insecure_channel(sidecar.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
        while (await watch.read()).status != SERVING:
            pass
        model = health.Watch(health_pb2.HealthCheckRequest(service="models/scaler"))
        while (await model.read()).status != SERVING:
            pass
        assert (await infer(channel, user="u")).version in {"1", "2"}
        upstream.stop()  # the service goes away: so does the sidecar's readiness
        while (await watch.read()).status != NOT_SERVING:
            pass
        while (await model.read()).status != NOT_SERVING:
            pass
        watch.cancel()
        model.cancel()
    assert sidecar.stop() == 0
    assert sidecar.log[-1].endswith("stopped")


async def test_generate_streams_through_and_a_cancel_frees_the_sequence(upstream, sidecar_process) -> None:
    sidecar = sidecar_process("--upstream", upstream.address)
    metrics = upstream.metrics_url
    assert metrics is not None
    labels = {"model": "tight", "version": "1"}
    # A client that reads slowly: the smallest HTTP/2 window, so the stream does not run ahead.
    options = [("grpc.http2.lookahead_bytes", 1), ("grpc.http2.bdp_probe", 0)]
    async with grpc.aio.insecure_channel(sidecar.address, options=options) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        events = [
            e async for e in stub.Generate(pb.GenerateRequest(model_name="tight", prompt="x", max_tokens=5))
        ]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[-1].finish_reason == pb.FINISH_REASON_LENGTH and events[-1].usage.completion_tokens == 5

        before = scrape(metrics, "modelyard_generation_cancellations_total", cause="cancelled", **labels) or 0
        call = stub.Generate(pb.GenerateRequest(model_name="tight", prompt="def f(", max_tokens=250))
        await call.read()
        await call.read()
        assert dict(await call.initial_metadata()).get("x-model-dye") == "stable"
        assert scrape(metrics, "modelyard_generation_active_sequences", **labels) == 1
        call.cancel()
        await eventually(lambda: scrape(metrics, "modelyard_generation_active_sequences", **labels) == 0)
        after = scrape(metrics, "modelyard_generation_cancellations_total", cause="cancelled", **labels)
        assert after == before + 1


TRITON_CLIENT = r"""
import sys
import numpy as np
import tritonclient.grpc as grpcclient

client = grpcclient.InferenceServerClient(url=sys.argv[1])
assert client.is_server_live() and client.is_server_ready()
assert client.is_model_ready("scaler")
meta = client.get_model_metadata("scaler", "1")
x = np.arange(32, dtype=np.float32).reshape(2, 16)
inp = grpcclient.InferInput("INPUT0", [2, 16], "FP32")
inp.set_data_from_numpy(x)
for version in ("1", "2"):
    out = client.infer("scaler", [inp], model_version=version).as_numpy("OUTPUT0")
    assert np.array_equal(out, x * (2.0 if version == "1" else 3.0)), version
result = client.infer("scaler", [inp], headers={"x-canary-weight": "100", "x-user-id": "u"})
assert result.get_response().model_version == "2"
try:
    client.infer("scaler", [grpcclient.InferInput("NOPE", [2, 16], "FP32").set_data_from_numpy(x)])
    raise SystemExit("no error")
except grpcclient.InferenceServerException as exc:
    assert exc.status() == "StatusCode.INVALID_ARGUMENT", exc.status()
print("ok", meta.name)
"""


def test_tritonclient_and_perf_analyzer_work_through_the_sidecar(upstream, sidecar_process) -> None:
    sidecar = sidecar_process("--upstream", upstream.address)
    result = subprocess.run(
        [sys.executable, "-c", TRITON_CLIENT, sidecar.address], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and result.stdout.startswith("ok scaler"), result.stdout + result.stderr
    run = run_perf_analyzer(sidecar.address, "-b", "2")
    assert run.requests > 0 and run.inferences == 2 * run.requests, run.stdout


async def test_the_sidecar_serves_without_numpy_or_onnxruntime(upstream, sidecar_process) -> None:
    sidecar = sidecar_process(
        "--upstream", upstream.address, prefix=("-c", RUN_REFUSING, HEAVY, "modelyard.sidecar")
    )
    async with grpc.aio.insecure_channel(sidecar.address) as channel:
        await eventually(lambda: _answers(channel), what="a call through the sidecar")
    assert sidecar.stop() == 0


async def test_tenant_rate_and_concurrency_limits(upstream, sidecar_process, tmp_path: Path) -> None:
    config = tmp_path / "routes.yaml"
    limits = {"acme": {"rate": 0.5, "burst": 2}, "beta": {"concurrency": 1}, "*": {"concurrency": 1}}
    config.write_text(yaml.safe_dump({"tenants": limits}))
    sidecar = sidecar_process("--upstream", upstream.address, "--config", str(config))
    async with grpc.aio.insecure_channel(sidecar.address) as channel:
        acme = [("x-tenant-id", "acme")]
        await infer(channel, user="u", metadata=acme)
        await infer(channel, user="u", metadata=acme)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await infer(channel, user="u", metadata=acme)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        trailers = dict(pairs(caught.value.trailing_metadata()))
        assert trailers["x-error-reason"] == "tenant_limit"
        assert 0 < int(trailers["grpc-retry-pushback-ms"]) <= 2000
        assert "acme" in caught.value.details()
        for _ in range(3):  # anyone else: one call at a time, and a finished call frees its place
            await infer(channel, user="u", metadata=[("x-tenant-id", "other")])
            await infer(channel, user="u")

        stub = pb_grpc.InferenceServiceStub(channel)
        beta = [("x-tenant-id", "beta")]
        stream = stub.Generate(
            pb.GenerateRequest(model_name="tight", prompt="x", max_tokens=250), metadata=beta
        )
        await stream.read()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await infer(channel, user="u", metadata=beta)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        stream.cancel()
        await eventually(lambda: _answers(channel, beta), what="beta's slot is free again")


async def _answers(channel: grpc.aio.Channel, metadata: list[tuple[str, str]] | None = None) -> bool:
    try:
        return (await infer(channel, user="u", metadata=metadata or [])).dye in {"stable", "canary"}
    except grpc.aio.AioRpcError:
        await asyncio.sleep(0.1)
        return False


async def test_shadow_compares_greedy_generations_token_by_token(upstream, sidecar_process, tmp_path) -> None:
    config = tmp_path / "routes.yaml"
    config.write_text(yaml.safe_dump({"shadow": {"share": 100, "max_in_flight": 8}}))
    sidecar = sidecar_process("--upstream", upstream.address, "--config", str(config))
    assert sidecar.admin_url is not None
    async with grpc.aio.insecure_channel(sidecar.address) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        request = pb.GenerateRequest(model_name="twin", prompt="def f(", max_tokens=6)

        async def stable_events() -> list[pb.GenerateResponse]:
            call = stub.Generate(request, metadata=[("x-user-id", "u")])
            events = [e async for e in call]
            assert dict(pairs(await call.initial_metadata()))["x-model-dye"] == "stable"
            return events

        async def knows_both() -> bool:  # a call dyed canary: both versions are known
            call = stub.Generate(request, metadata=[("x-canary-weight", "100"), ("x-user-id", "u")])
            _ = [e async for e in call]
            return bool(dict(pairs(await call.initial_metadata())).get("x-model-dye") == "canary")

        await eventually(knows_both, what="the sidecar knows both versions of twin")
        events = await stable_events()
        assert all(e.model_version == "1" for e in events)
        produced = sum(len(e.token_ids) for e in events)

        def compared(name: str) -> float | None:
            return scrape(f"{sidecar.admin_url}/metrics", name, model="twin")

        await eventually(lambda: compared("modelyard_sidecar_shadow_tokens_total") == produced)
        assert compared("modelyard_sidecar_shadow_tokens_agreeing_total") == produced  # the same weights


async def test_sigterm_drained_answers_reach_a_slow_reader(
    service_process: Callable[..., ServiceProcess], sidecar_process, slow_repository: Path
) -> None:
    """As the service's own drain (test_service_process.py): gRPC's stop(grace) alone would shut
    the caller's connection once its last call ended, and the slow reader's next window update
    would reset it, dropping the answer's tail. The sidecar stops its server only once the
    callers acknowledged every byte of the answers it relayed."""
    service = service_process(slow_repository)
    assert service.metrics_url is not None
    sidecar = sidecar_process("--upstream", service.address, "--grace-s", "20")
    host, port = sidecar.address.rsplit(":", 1)
    upstream_ended: list[str] = []

    async def relay(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        sidecar_r, sidecar_w = await asyncio.open_connection(host, int(port))
        sidecar_w.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        slow = service_tests.SLOW_READER_BYTES_PER_S
        await asyncio.gather(
            service_tests._pump(client_r, sidecar_w, 0, []),
            service_tests._pump(sidecar_r, client_w, slow, upstream_ended),
        )

    relay_server = await asyncio.start_server(relay, "127.0.0.1", 0)
    try:
        address = f"127.0.0.1:{relay_server.sockets[0].getsockname()[1]}"
        async with grpc.aio.insecure_channel(address, options=service_tests.BIG) as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            in_flight = await service_tests._both_in_flight(stub, service.metrics_url)
            sidecar.proc.send_signal(signal.SIGTERM)
            assert service_tests._whole(await asyncio.gather(*in_flight))
        assert await asyncio.to_thread(sidecar.proc.wait, 30) == 0
        assert "ConnectionResetError" not in " ".join(upstream_ended)
    finally:
        relay_server.close()
        await relay_server.wait_closed()
