"""TLS on the sidecar: its gRPC listener (TLS, mTLS, a renewed certificate served without a restart),
its channels to a TLS or mTLS service (the caller's token passing through untouched, a renewed client
certificate used without a restart), and its admin endpoint over HTTPS, whose changes need a token."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from modelyard.kserve.v2 import grpc_service_pb2 as kserve
from modelyard.kserve.v2 import grpc_service_pb2_grpc as kserve_grpc
from modelyard.process import auth
from modelyard.service.server import Service, build_service
from modelyard.service.settings import Settings as ServiceSettings
from modelyard.sidecar import upstreams
from modelyard.sidecar.server import _security
from modelyard.sidecar.settings import parse_settings
from tests.certs import Authority, Pem, install, make_pki
from tests.sidecar_support import infer, known_versions, running_sidecar
from tests.support import eventually

TOKEN = "sidecar-test-token"
BEARER = (("authorization", f"Bearer {TOKEN}"),)


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Any]:
    return make_pki(tmp_path)


@pytest.fixture
def tokens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(auth, "RECHECK_S", 0.0)
    path = tmp_path / "tokens"
    path.write_text(f"# the admin's token\n{TOKEN}\n")
    return path


@pytest.fixture
async def start_service(repository: Path) -> AsyncIterator[Callable[..., Any]]:
    services: list[Service] = []

    async def starter(**settings: Any) -> Service:
        local: dict[str, Any] = {"listen": "127.0.0.1:0", "metrics_listen": "127.0.0.1:0"}
        service = build_service(ServiceSettings(repository=repository, **local, **settings))
        await service.start()
        services.append(service)
        return service

    yield starter
    for service in services:
        await service.stop(grace_s=1.0)


def listener_tls(pki: dict[str, Any], mtls: bool = False) -> dict[str, Any]:
    settings: dict[str, Any] = {"tls_cert": str(pki["server"].cert), "tls_key": str(pki["server"].key)}
    if mtls:
        settings["tls_client_ca"] = str(pki["ca"].path)
    return settings


def client_credentials(ca: Path, client: Pem | None = None) -> grpc.ChannelCredentials:
    key, cert = (client.key.read_bytes(), client.cert.read_bytes()) if client else (None, None)
    return grpc.ssl_channel_credentials(ca.read_bytes(), key, cert)


async def handshakes(address: str, credentials: grpc.ChannelCredentials | None) -> bool:
    """Whether a fresh channel (a fresh handshake) gets an answer from the sidecar's health service."""
    channel = (
        grpc.aio.secure_channel(address, credentials)
        if credentials is not None
        else grpc.aio.insecure_channel(address)
    )
    async with channel:
        try:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.aio.AioRpcError as exc:
            assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), exc
            return False
    return True


async def test_tls_client_through_the_sidecar_to_a_tls_service_with_the_callers_token(
    start_service: Any, pki: dict[str, Any], tokens: Path
) -> None:
    service = await start_service(auth_tokens_file=str(tokens), **listener_tls(pki))
    ca = pki["ca"].path
    async with running_sidecar([service.address], upstream_ca=str(ca), **listener_tls(pki)) as sidecar:
        await known_versions(sidecar, "scaler", {"1", "2"})  # WatchModels answered over TLS
        async with grpc.aio.secure_channel(sidecar.address, client_credentials(ca)) as channel:
            answer = await infer(channel)
            assert answer.version in ("1", "2") and answer.response.outputs
            # The caller's authorization reaches the service as it was sent: the service judges it
            # (the KServe repository index is a management call there).
            index = kserve_grpc.GRPCInferenceServiceStub(channel).RepositoryIndex
            listed = await index(kserve.RepositoryIndexRequest(), metadata=BEARER, timeout=10)
            assert "scaler" in {model.name for model in listed.models}
            for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await index(kserve.RepositoryIndexRequest(), metadata=metadata, timeout=10)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # A plaintext client, and one that does not trust the sidecar's CA, get no session.
        assert not await handshakes(sidecar.address, None)
        stranger = Authority(ca.parent.parent / "stranger", "stranger-ca")
        assert not await handshakes(sidecar.address, client_credentials(stranger.path))
    # A sidecar speaking plaintext to the TLS service never learns what it serves.
    async with (
        running_sidecar([service.address]) as plain,
        grpc.aio.insecure_channel(plain.address) as channel,
    ):
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await infer(channel, deadline_s=5)
        assert failed.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


async def test_mtls_listener_refuses_clients_without_a_certificate_of_its_ca_and_mtls_upstream(
    start_service: Any, pki: dict[str, Any]
) -> None:
    service = await start_service(
        auth_client_names=("good-client",), auth_inference=True, **listener_tls(pki, mtls=True)
    )
    ca = pki["ca"].path
    upstream_client: dict[str, Any] = {
        "upstream_cert": str(pki["client"].cert),
        "upstream_key": str(pki["client"].key),
    }
    async with running_sidecar(
        [service.address], upstream_ca=str(ca), **upstream_client, **listener_tls(pki, mtls=True)
    ) as sidecar:
        await known_versions(sidecar, "scaler", {"1", "2"})
        assert await handshakes(sidecar.address, client_credentials(ca, pki["client"]))
        assert not await handshakes(sidecar.address, client_credentials(ca))
        assert not await handshakes(sidecar.address, client_credentials(ca, pki["rogue"]))
        # The sidecar's client certificate is the identity the service allows: no token needed.
        async with grpc.aio.secure_channel(sidecar.address, client_credentials(ca, pki["other"])) as channel:
            assert (await infer(channel)).response.outputs


async def test_renewed_sidecar_certificate_is_served_without_a_restart(
    start_service: Any, pki: dict[str, Any], tmp_path: Path
) -> None:
    service = await start_service()
    live = Pem(tmp_path / "live.crt", tmp_path / "live.key")
    install(pki["server"], live)
    async with running_sidecar([service.address], tls_cert=str(live.cert), tls_key=str(live.key)) as sidecar:
        renewed_ca = Authority(tmp_path / "renewed", "renewed-ca")
        old, new = client_credentials(pki["ca"].path), client_credentials(renewed_ca.path)
        assert await handshakes(sidecar.address, old)
        assert not await handshakes(sidecar.address, new)
        install(renewed_ca.issue("server", server=True), live)
        assert await handshakes(sidecar.address, new)
        assert not await handshakes(sidecar.address, old)
        # The admin endpoint (HTTPS, the same files) follows too.
        async with httpx.AsyncClient(verify=trusting(renewed_ca.path), timeout=10) as http:
            assert (await http.get(f"https://{sidecar.admin_address}/breakers")).status_code == 200
        # A broken swap (a key that is not the certificate's) keeps the renewed certificate serving.
        install(Pem(pki["server"].cert, pki["other"].key), live)
        assert await handshakes(sidecar.address, new)


async def test_renewed_upstream_client_certificate_is_used_without_a_restart(
    start_service: Any,
    pki: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(upstreams, "RECHECK_S", 0.05)
    service = await start_service(
        auth_client_names=("good-client",), auth_inference=True, **listener_tls(pki, mtls=True)
    )
    live = Pem(tmp_path / "sidecar.crt", tmp_path / "sidecar.key")
    install(pki["other"], live)  # a verified identity, but not the allowed one
    files: dict[str, Any] = {"upstream_cert": str(live.cert), "upstream_key": str(live.key)}
    upstream_ca = str(pki["ca"].path)
    async with (
        running_sidecar([service.address], upstream_ca=upstream_ca, **files) as sidecar,
        grpc.aio.insecure_channel(sidecar.address) as channel,
    ):
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await infer(channel)
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # A broken swap (a key that is not the certificate's) keeps the previous credentials.
        install(Pem(pki["client"].cert, pki["other"].key), live)
        await eventually(lambda: "upstream TLS files changed but cannot be used" in caplog.text, "the check")
        with pytest.raises(grpc.aio.AioRpcError) as still:
            await infer(channel)
        assert still.value.code() == grpc.StatusCode.PERMISSION_DENIED
        install(pki["client"], live)

        async def allowed() -> bool:
            try:
                return bool((await infer(channel)).response.outputs)
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.PERMISSION_DENIED, exc
                return False

        await eventually(allowed, "a call with the renewed client certificate")
        # The watches moved to the new channel with it.
        await known_versions(sidecar, "scaler", {"1", "2"})


def trusting(ca: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=ca)


async def test_admin_changes_need_a_token_over_https(
    start_service: Any, pki: dict[str, Any], tokens: Path
) -> None:
    service = await start_service()
    async with running_sidecar(
        [service.address], admin_tokens_file=str(tokens), **listener_tls(pki)
    ) as sidecar:
        await known_versions(sidecar, "scaler", {"1", "2"})
        base = f"https://{sidecar.admin_address}"
        async with httpx.AsyncClient(base_url=base, verify=trusting(pki["ca"].path), timeout=10) as http:
            bodies = set()
            for headers in (
                {},
                {"authorization": "Bearer wrong"},
                {"authorization": TOKEN},
                {"authorization": "Basic eDp5"},
            ):
                refused = await http.put("/canary/scaler", json={"canary_weight": 40}, headers=headers)
                assert refused.status_code == 401, refused.text
                assert refused.headers["www-authenticate"] == "Bearer"
                bodies.add(refused.text)
            assert len(bodies) == 1  # the same words whatever was wrong
            assert sidecar.routes.table.route("scaler").canary_weight != 40
            assert (await http.post("/canary/scaler", json={})).status_code == 401  # any other write
            applied = await http.put(
                "/canary/scaler", json={"canary_weight": 40}, headers={"authorization": f"Bearer {TOKEN}"}
            )
            assert applied.status_code == 200, applied.text
            assert applied.json()["canary_weight"] == 40
            assert sidecar.routes.table.route("scaler").canary_weight == 40
            # Reads stay open unless admin_auth_reads; the refusals are counted.
            assert (await http.get("/breakers")).status_code == 200
            metrics = (await http.get("/metrics")).text
            assert 'modelyard_sidecar_admin_denials_total{outcome="unauthenticated"} 5.0' in metrics
        # Plain HTTP to the admin endpoint gets no answer.
        async with httpx.AsyncClient(timeout=10) as http:
            with pytest.raises(httpx.TransportError):
                await http.get(f"http://{sidecar.admin_address}/breakers")


async def test_admin_reads_need_a_token_with_admin_auth_reads(start_service: Any, tokens: Path) -> None:
    service = await start_service()
    async with (
        running_sidecar([service.address], admin_tokens_file=str(tokens), admin_auth_reads=True) as sidecar,
        httpx.AsyncClient(base_url=f"http://{sidecar.admin_address}", timeout=10) as http,
    ):
        for path in ("/breakers", "/canary", "/metrics"):
            assert (await http.get(path)).status_code == 401
            answer = await http.get(path, headers={"authorization": f"Bearer {TOKEN}"})
            assert answer.status_code == 200, path


def test_tls_settings_come_from_flags_and_environment(pki: dict[str, Any], tmp_path: Path) -> None:
    (tmp_path / "tokens").write_text("t\n")
    settings = parse_settings(
        ["--tls-cert", str(pki["server"].cert), "--tls-key", str(pki["server"].key), "--admin-auth-reads"],
        {
            "MODELYARD_SIDECAR_TLS_CLIENT_CA": str(pki["ca"].path),
            "MODELYARD_SIDECAR_UPSTREAM_CA": str(pki["ca"].path),
            "MODELYARD_SIDECAR_ADMIN_TOKENS_FILE": str(tmp_path / "tokens"),
        },
    )
    assert settings.tls_client_ca == str(pki["ca"].path) and settings.admin_auth_reads
    tls, upstream_tls, admin_auth = _security(settings)
    assert tls is not None and tls.client_ca == pki["ca"].path
    assert upstream_tls is not None and upstream_tls.ca == pki["ca"].path
    assert admin_auth.configured
    for wrong in (
        ["--tls-cert", "server.pem"],
        ["--upstream-cert", "client.pem"],
        ["--tls-client-ca", "ca.pem"],
        ["--admin-auth-reads"],
    ):
        with pytest.raises(ValueError):
            _security(parse_settings(wrong, {}))
