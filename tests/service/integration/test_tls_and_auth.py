"""TLS, mTLS and authorization on the service's listeners, with certificates made in the test."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import ssl
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from models import demo_models
from modelyard.inference.v1 import inference_service_pb2 as ipb
from modelyard.inference.v1 import inference_service_pb2_grpc as ipb_grpc
from modelyard.inference.v1 import model_service_pb2 as mpb
from modelyard.inference.v1 import model_service_pb2_grpc as mpb_grpc
from modelyard.kserve.v2 import grpc_service_pb2 as kpb
from modelyard.kserve.v2 import grpc_service_pb2_grpc as kpb_grpc
from modelyard.process import auth
from modelyard.service.server import Service, build_service
from modelyard.service.settings import Settings
from modelyard.tensors import to_tensor
from tests.certs import Authority, Pem, install, make_pki
from tests.support import ServiceProcess

TOKEN = "s3cret-token-for-tests"
INFER = ipb.InferRequest(model_name="scaler", inputs=[to_tensor("INPUT0", np.ones((1, 4), np.float32))])


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Any]:
    return make_pki(tmp_path)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    demo_models.write_model(root, "scaler", 1, demo_models.scaled_identity(4, 2.0))
    return root


@pytest.fixture
async def serve(root: Path) -> AsyncIterator[Callable[..., Any]]:
    started: list[Service] = []

    async def start(**settings: Any) -> Service:
        service = build_service(
            Settings(repository=root, listen="127.0.0.1:0", metrics_listen="127.0.0.1:0", **settings)
        )
        await service.start()
        started.append(service)
        return service

    yield start
    for service in started:
        await service.stop(grace_s=1.0)


def secure(port: int, ca: Path, client: Pem | None = None) -> grpc.aio.Channel:
    key_cert = client.read() if client else (None, None)
    credentials = grpc.ssl_channel_credentials(ca.read_bytes(), key_cert[1], key_cert[0])
    return grpc.aio.secure_channel(
        f"127.0.0.1:{port}", credentials, options=[("grpc.ssl_target_name_override", "localhost")]
    )


async def code_of(call: Any) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def tls_settings(pki: dict[str, Any], mtls: bool = False) -> dict[str, str]:
    settings = {"tls_cert": str(pki["server"].cert), "tls_key": str(pki["server"].key)}
    if mtls:
        settings["tls_client_ca"] = str(pki["ca"].path)
    return settings


async def test_tls_serves_grpc_and_metrics_and_refuses_plaintext(serve: Any, pki: dict[str, Any]) -> None:
    service = await serve(**tls_settings(pki))
    async with secure(service.port, pki["ca"].path) as channel:
        reply = await ipb_grpc.InferenceServiceStub(channel).Infer(INFER)
        assert reply.model_version == "1"
    async with grpc.aio.insecure_channel(service.address) as plain:
        assert await code_of(ipb_grpc.InferenceServiceStub(plain).Infer(INFER, timeout=5)) in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.DEADLINE_EXCEEDED,
        )
    assert await asyncio.to_thread(scrape, service, pki["ca"].path, "localhost")


async def test_mtls_refuses_clients_without_a_certificate_of_its_ca(serve: Any, pki: dict[str, Any]) -> None:
    service = await serve(**tls_settings(pki, mtls=True))
    ca = pki["ca"].path
    async with secure(service.port, ca, pki["client"]) as channel:
        assert await code_of(ipb_grpc.InferenceServiceStub(channel).Infer(INFER)) == grpc.StatusCode.OK
    for client in (None, pki["rogue"]):
        async with secure(service.port, ca, client) as channel:
            code = await code_of(ipb_grpc.InferenceServiceStub(channel).Infer(INFER, timeout=5))
            assert code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), client
    # The metrics endpoint asks for the same client certificates.
    assert await asyncio.to_thread(scrape, service, ca, "127.0.0.1", pki["client"])
    assert not await asyncio.to_thread(scrape, service, ca, "127.0.0.1")
    assert not await asyncio.to_thread(scrape, service, ca, "127.0.0.1", pki["rogue"])


async def test_certificates_reload_without_a_restart(serve: Any, pki: dict[str, Any], tmp_path: Path) -> None:
    live = Pem(tmp_path / "live.crt", tmp_path / "live.key")
    shutil.copy(pki["server"].cert, live.cert)
    shutil.copy(pki["server"].key, live.key)
    service = await serve(tls_cert=str(live.cert), tls_key=str(live.key))
    renewed_ca = Authority(tmp_path / "renewed", "renewed-ca")
    renewed = renewed_ca.issue("server", server=True)
    async with secure(service.port, renewed_ca.path) as channel:
        infer = ipb_grpc.InferenceServiceStub(channel)
        assert await code_of(infer.Infer(INFER, timeout=5)) != grpc.StatusCode.OK
    install(renewed, live)
    async with secure(service.port, renewed_ca.path) as channel:
        infer = ipb_grpc.InferenceServiceStub(channel)
        assert await code_of(infer.Infer(INFER, timeout=5)) == grpc.StatusCode.OK
    # The metrics endpoint too, for a scraper that connects by IP address (no server name sent).
    assert await asyncio.to_thread(scrape, service, renewed_ca.path, "127.0.0.1")


def scrape(service: Service, ca: Path, host: str, client: Pem | None = None) -> bool:
    """Whether /metrics answers over HTTPS to a client trusting `ca` (with `client`'s certificate)."""
    context = ssl.create_default_context(cafile=ca)
    context.check_hostname = False  # the test certificates name localhost and 127.0.0.1
    if client is not None:
        context.load_cert_chain(client.cert, client.key)
    assert service.metrics_server is not None
    url = f"https://{host}:{service.metrics_server.port}/metrics"
    try:
        with urllib.request.urlopen(url, context=context, timeout=10) as reply:
            return b"modelyard_requests" in reply.read()
    except (urllib.error.URLError, ssl.SSLError, ConnectionError):
        return False


async def test_tokens_guard_management_and_leave_inference_open(
    serve: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(auth, "RECHECK_S", 0.0)
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# operators\n{TOKEN}\n")
    service = await serve(auth_tokens_file=str(tokens))
    async with grpc.aio.insecure_channel(service.address) as channel:
        models = mpb_grpc.ModelServiceStub(channel)
        kserve = kpb_grpc.GRPCInferenceServiceStub(channel)
        unload = mpb.UnloadModelRequest(name="scaler")
        details = set()
        for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await models.UnloadModel(unload, metadata=metadata)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            trailers: Any = caught.value.trailing_metadata() or ()
            assert [v for k, v in trailers if k == "x-error-reason"] == ["unauthenticated"]
            details.add(caught.value.details())
        assert len(details) == 1, "a denial does not say what was wrong"
        kserve_unload = kpb.RepositoryModelUnloadRequest(model_name="scaler")
        code = await code_of(kserve.RepositoryModelUnload(kserve_unload))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        # Inference is open by default.
        assert await code_of(ipb_grpc.InferenceServiceStub(channel).Infer(INFER)) == grpc.StatusCode.OK
        # The right token unloads and loads.
        bearer = (("authorization", f"Bearer {TOKEN}"),)
        await models.UnloadModel(unload, metadata=bearer)
        await models.LoadModel(mpb.LoadModelRequest(name="scaler"), metadata=bearer)
        # A token added to the file is taken without a restart; one removed is refused.
        tokens.write_text("rotated-token\n")
        await models.LoadModel(
            mpb.LoadModelRequest(name="scaler"), metadata=(("authorization", "Bearer rotated-token"),)
        )
        assert await code_of(models.LoadModel(mpb.LoadModelRequest(name="scaler"), metadata=bearer)) == (
            grpc.StatusCode.UNAUTHENTICATED
        )
    denied = service.metrics.registry.get_sample_value(
        "modelyard_auth_denials_total", {"surface": "management", "outcome": "unauthenticated"}
    )
    assert denied == 5


async def test_inference_guarded_when_configured(serve: Any, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKEN + "\n")
    service = await serve(auth_tokens_file=str(tokens), auth_inference=True)
    async with grpc.aio.insecure_channel(service.address) as channel:
        infer = ipb_grpc.InferenceServiceStub(channel)
        assert await code_of(infer.Infer(INFER)) == grpc.StatusCode.UNAUTHENTICATED
        ok = infer.Infer(INFER, metadata=(("authorization", f"Bearer {TOKEN}"),))
        assert await code_of(ok) == grpc.StatusCode.OK
        # Health stays open for orchestrators.
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING


async def test_mtls_client_identity_authorizes_management(serve: Any, pki: dict[str, Any]) -> None:
    service = await serve(**tls_settings(pki, mtls=True), auth_client_names=("good-client",))
    unload = mpb.UnloadModelRequest(name="scaler")
    async with secure(service.port, pki["ca"].path, pki["other"]) as channel:
        code = await code_of(mpb_grpc.ModelServiceStub(channel).UnloadModel(unload))
        assert code == grpc.StatusCode.PERMISSION_DENIED
    async with secure(service.port, pki["ca"].path, pki["client"]) as channel:
        assert await code_of(mpb_grpc.ModelServiceStub(channel).UnloadModel(unload)) == grpc.StatusCode.OK


async def test_settings_that_cannot_work_are_refused(root: Path, pki: dict[str, Any]) -> None:
    base = Settings(repository=root, listen="127.0.0.1:0", metrics_listen="")
    for bad in (
        {"tls_cert": str(pki["server"].cert)},  # no key
        {"auth_client_names": ("good-client",)},  # identities without mTLS
        {"auth_inference": True},  # nothing to check
    ):
        with pytest.raises(ValueError):
            build_service(dataclasses.replace(base, **bad))


async def test_a_tls_service_process_logs_no_line_per_failed_handshake(
    root: Path, pki: dict[str, Any], service_process: Callable[..., ServiceProcess]
) -> None:
    """gRPC core would log every failed handshake at INFO (a line per connection, on demand)."""
    server = pki["server"]
    process = service_process(root, "--tls-cert", str(server.cert), "--tls-key", str(server.key))
    for _ in range(3):
        async with grpc.aio.insecure_channel(process.address) as plain:
            code = await code_of(ipb_grpc.InferenceServiceStub(plain).Infer(INFER, timeout=3))
            assert code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    port = int(process.address.rsplit(":", 1)[1])
    async with secure(port, pki["ca"].path) as channel:
        assert await code_of(ipb_grpc.InferenceServiceStub(channel).Infer(INFER)) == grpc.StatusCode.OK
    assert not [line for line in process.log if "Handshake failed" in line], process.log
