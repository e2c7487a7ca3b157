"""TLS on the gateway: HTTPS and mTLS on its HTTP listener (certificates made in the test, renewed
without a restart), and its channel to a TLS, token- or certificate-protected service, whose
answers to a missing or refused credential come back as 401 and 403."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from models import demo_models
from modelyard.gateway import upstream
from modelyard.gateway.app import Gateway
from modelyard.gateway.settings import Settings as GatewaySettings
from modelyard.gateway.settings import parse_settings
from modelyard.process import auth
from modelyard.service.server import Service, build_service
from modelyard.service.settings import Settings as ServiceSettings
from tests.certs import Authority, Pem, install, make_pki

TOKEN = "gateway-test-token"
INFER = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}
NOWHERE = "127.0.0.1:9"  # for gateways whose tests never call upstream (the channel connects lazily)


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Any]:
    return make_pki(tmp_path)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    demo_models.write_model(root, "scaler", 1, demo_models.scaled_identity(4, 2.0))
    return root


@pytest.fixture
def tokens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(auth, "RECHECK_S", 0.0)
    path = tmp_path / "tokens"
    path.write_text(f"{TOKEN}\n")
    return path


@pytest.fixture
async def start(root: Path) -> AsyncIterator[Callable[..., Any]]:
    """start("service", **settings) or start("gateway", **settings); all stopped at the end."""
    services: list[Service] = []
    gateways: list[Gateway] = []

    async def starter(kind: str, **settings: Any) -> Any:
        if kind == "service":
            local: dict[str, Any] = {"listen": "127.0.0.1:0", "metrics_listen": "127.0.0.1:0"}
            service = build_service(ServiceSettings(repository=root, **local, **settings))
            await service.start()
            services.append(service)
            return service
        gateway = Gateway(GatewaySettings(listen="127.0.0.1:0", **settings))
        await gateway.start()
        gateways.append(gateway)
        return gateway

    yield starter
    for gateway in gateways:
        await gateway.stop()
    for service in services:
        await service.stop(grace_s=1.0)


def listener_tls(pki: dict[str, Any], mtls: bool = False) -> dict[str, str]:
    settings = {"tls_cert": str(pki["server"].cert), "tls_key": str(pki["server"].key)}
    if mtls:
        settings["tls_client_ca"] = str(pki["ca"].path)
    return settings


def trusting(ca: Path, client: Pem | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=ca)
    if client is not None:
        context.load_cert_chain(client.cert, client.key)
    return context


async def get(url: str, context: ssl.SSLContext | bool, **headers: str) -> httpx.Response | None:
    """The answer, or None when no TLS session could be had (refused handshake or certificate).
    A fresh client each time: no connection outlives the certificate it was made with."""
    try:
        async with httpx.AsyncClient(verify=context, timeout=10) as http:
            return await http.get(url, headers=headers)
    except httpx.TransportError:
        return None


async def test_https_serves_and_plain_http_is_refused(
    start: Any, pki: dict[str, Any], service: Service, tmp_path: Path
) -> None:
    gateway = await start("gateway", upstream=service.address, **listener_tls(pki))
    assert gateway.url.startswith("https://127.0.0.1:")
    answer = await get(f"{gateway.url}/v2/models/scaler/versions/1/ready", trusting(pki["ca"].path))
    assert answer is not None and answer.status_code == 200
    # A client that does not trust the gateway's CA, and one speaking plain HTTP, get nothing.
    stranger = Authority(tmp_path / "stranger", "stranger-ca")
    assert await get(f"{gateway.url}/healthz", trusting(stranger.path)) is None
    assert await get(gateway.url.replace("https://", "http://") + "/healthz", False) is None


async def test_mtls_refuses_clients_without_a_certificate_of_its_ca(start: Any, pki: dict[str, Any]) -> None:
    gateway = await start("gateway", upstream=NOWHERE, **listener_tls(pki, mtls=True))
    ca = pki["ca"].path
    answer = await get(f"{gateway.url}/healthz", trusting(ca, pki["client"]))
    assert answer is not None and answer.status_code == 200
    assert await get(f"{gateway.url}/healthz", trusting(ca)) is None
    assert await get(f"{gateway.url}/healthz", trusting(ca, pki["rogue"])) is None


async def test_certificate_renewal_is_served_without_a_restart(
    start: Any, pki: dict[str, Any], tmp_path: Path
) -> None:
    live = Pem(tmp_path / "live.crt", tmp_path / "live.key")
    install(pki["server"], live)
    gateway = await start("gateway", upstream=NOWHERE, tls_cert=str(live.cert), tls_key=str(live.key))
    renewed_ca = Authority(tmp_path / "renewed", "renewed-ca")
    renewed = renewed_ca.issue("server", server=True)
    health = f"{gateway.url}/healthz"  # by IP address: the client sends no server name
    assert await get(health, trusting(renewed_ca.path)) is None
    install(renewed, live)
    answer = await get(health, trusting(renewed_ca.path))
    assert answer is not None and answer.status_code == 200
    assert await get(health, trusting(pki["ca"].path)) is None
    # A broken swap (a key that is not the certificate's) keeps the renewed certificate serving.
    install(Pem(pki["server"].cert, pki["other"].key), live)
    answer = await get(health, trusting(renewed_ca.path))
    assert answer is not None and answer.status_code == 200


async def test_token_protected_service_through_the_gateway_over_tls(
    start: Any, pki: dict[str, Any], tokens: Path
) -> None:
    service = await start("service", auth_tokens_file=str(tokens), auth_inference=True, **listener_tls(pki))
    gateway = await start("gateway", upstream=service.address, upstream_ca=str(pki["ca"].path))
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        bearer = {"authorization": f"Bearer {TOKEN}"}
        answer = await http.post("/v2/models/scaler/infer", json=INFER, headers=bearer)
        assert answer.status_code == 200, answer.text
        assert answer.json()["outputs"][0]["data"] == [2, 4, 6, 8]
        listed = await http.get("/v1/models", headers=bearer)
        assert listed.status_code == 200 and [m["id"] for m in listed.json()["data"]] == ["scaler"]
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": TOKEN}):
            refused = await http.post("/v2/models/scaler/infer", json=INFER, headers=headers)
            assert refused.status_code == 401, refused.text
            assert refused.headers["x-error-reason"] == "unauthenticated"
            assert refused.json()["code"] == "UNAUTHENTICATED"
        refused = await http.get("/v1/models")  # the OpenAI error shape, the same status
        assert refused.status_code == 401 and refused.headers["x-error-reason"] == "unauthenticated"
    # The service takes TLS only: a gateway speaking plaintext to it does not get through.
    plain = await start("gateway", upstream=service.address)
    async with httpx.AsyncClient(base_url=plain.url, timeout=30) as http:
        answer = await http.post("/v2/models/scaler/infer", json=INFER, headers=bearer)
        assert answer.status_code == 503, answer.text


async def test_gateway_client_certificate_is_its_identity_upstream(
    start: Any, pki: dict[str, Any], tokens: Path
) -> None:
    service = await start(
        "service",
        auth_tokens_file=str(tokens),
        auth_client_names=("good-client",),
        auth_inference=True,
        **listener_tls(pki, mtls=True),
    )
    ca = str(pki["ca"].path)

    async def through(client: Pem | None, **headers: str) -> httpx.Response:
        files = {"upstream_cert": str(client.cert), "upstream_key": str(client.key)} if client else {}
        gateway = await start("gateway", upstream=service.address, upstream_ca=ca, **files)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
            return await http.post("/v2/models/scaler/infer", json=INFER, headers=headers)

    assert (await through(pki["client"])).status_code == 200  # an allowed identity needs no token
    denied = await through(pki["other"])  # a verified certificate, but not one allowed
    assert denied.status_code == 403 and denied.headers["x-error-reason"] == "permission_denied"
    assert (await through(pki["other"], authorization=f"Bearer {TOKEN}")).status_code == 200
    assert (await through(None, authorization=f"Bearer {TOKEN}")).status_code == 503  # no handshake


async def test_renewed_upstream_client_certificate_is_used_without_a_restart(
    start: Any, pki: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(upstream, "RECHECK_S", 0.0)
    service = await start(
        "service", auth_client_names=("good-client",), auth_inference=True, **listener_tls(pki, mtls=True)
    )
    live = Pem(tmp_path / "gateway.crt", tmp_path / "gateway.key")
    install(pki["other"], live)
    gateway = await start(
        "gateway",
        upstream=service.address,
        upstream_ca=str(pki["ca"].path),
        upstream_cert=str(live.cert),
        upstream_key=str(live.key),
    )
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        assert (await http.post("/v2/models/scaler/infer", json=INFER)).status_code == 403
        install(Pem(pki["client"].cert, pki["other"].key), live)  # a broken swap: the old one stays
        assert (await http.post("/v2/models/scaler/infer", json=INFER)).status_code == 403
        install(pki["client"], live)  # the allowed identity
        answer = await http.post("/v2/models/scaler/infer", json=INFER)
        assert answer.status_code == 200, answer.text


def test_tls_settings_come_from_flags_and_environment(pki: dict[str, Any]) -> None:
    settings = parse_settings(
        ["--tls-cert", str(pki["server"].cert), "--tls-key", str(pki["server"].key)],
        {"MODELYARD_GATEWAY_TLS_CLIENT_CA": str(pki["ca"].path), "MODELYARD_GATEWAY_UPSTREAM_CA": "ca.pem"},
    )
    gateway = Gateway(settings)
    assert gateway.tls is not None and gateway.tls.client_ca == pki["ca"].path
    assert gateway.upstream_tls is not None and gateway.upstream_tls.ca == Path("ca.pem")
    for half in (["--tls-cert", "server.pem"], ["--upstream-cert", "client.pem"]):
        with pytest.raises(ValueError):
            Gateway(parse_settings(half, {}))
