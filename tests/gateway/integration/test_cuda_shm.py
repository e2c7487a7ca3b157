"""Triton's CUDA shared-memory routes over HTTP (`/v2/cudasharedmemory/...`), answered as the gRPC
side answers them: nothing is registered, a register is refused (UNIMPLEMENTED: this server imports
no CUDA IPC handle), an unregister has nothing to do; management calls like the system ones."""

from __future__ import annotations

import asyncio
import base64
import gc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from modelyard.gateway.app import Gateway
from modelyard.gateway.settings import Settings as GatewaySettings
from modelyard.service.server import build_service
from modelyard.service.settings import Settings

pytestmark = pytest.mark.asyncio(loop_scope="module")

CUDA = "/v2/cudasharedmemory"


async def _gateway(repository: Path, management_open: bool) -> AsyncIterator[Gateway]:
    service = build_service(
        Settings(
            repository=repository, listen="127.0.0.1:0", metrics_listen="", management_open=management_open
        )
    )
    await service.start()
    running = Gateway(GatewaySettings(listen="127.0.0.1:0", upstream=service.address))
    await running.start()
    try:
        yield running
    finally:
        await running.stop()
        await service.stop(grace_s=1.0)


@pytest.fixture(scope="module")
def empty_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cudashm")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(empty_repository: Path) -> AsyncIterator[Gateway]:
    async for running in _gateway(empty_repository, management_open=True):
        yield running


async def test_status_lists_nothing_and_an_unknown_region_is_not_found(gateway: Gateway) -> None:
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        status = await http.get(CUDA + "/status")
        assert status.status_code == 200 and status.json() == []
        region = await http.get(CUDA + "/region/r0/status")
        assert region.status_code == 404 and region.headers["x-error-reason"] == "model_not_found"
        assert "no CUDA shared memory region 'r0'" in region.json()["error"]


async def test_register_is_refused_as_unsupported_and_registers_nothing(gateway: Gateway) -> None:
    body = {"raw_handle": {"b64": base64.b64encode(b"\0" * 64).decode()}, "device_id": 0, "byte_size": 64}
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        refused = await http.post(CUDA + "/region/r0/register", json=body)
        assert refused.status_code == 501 and refused.headers["x-error-reason"] == "unsupported"
        assert "CUDA shared memory is not supported" in refused.json()["error"]
        assert (await http.get(CUDA + "/status")).json() == []  # still nothing registered
        bad = await http.post(CUDA + "/region/r0/register", json={**body, "raw_handle": {"b64": "%%"}})
        assert bad.status_code == 400 and "raw_handle.b64" in bad.json()["error"]
        negative = await http.post(CUDA + "/region/r0/register", json={**body, "byte_size": -1})
        assert negative.status_code in (400, 422) and "byte_size" in negative.json()["error"]


async def test_unregister_has_nothing_to_do(gateway: Gateway) -> None:
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        for path in (CUDA + "/unregister", CUDA + "/region/r0/unregister"):
            answer = await http.post(path)
            assert answer.status_code == 200, answer.text


def _client_calls(address: str) -> dict[str, Any]:
    """Runs in a thread (tritonclient.http blocks), as simple_http_shm_client.py calls them."""
    import tritonclient.http as tritonhttp
    from tritonclient.utils import InferenceServerException

    client = tritonhttp.InferenceServerClient(url=address)
    try:
        status = client.get_cuda_shared_memory_status()
        client.unregister_cuda_shared_memory()
        client.unregister_cuda_shared_memory("r0")
        try:
            client.register_cuda_shared_memory("r0", base64.b64encode(b"\0" * 64).decode(), 0, 64)
        except InferenceServerException as exc:
            refused = exc.message()
        return {"status": status, "refused": refused}
    finally:
        client.close()
        del client
        gc.collect()


async def test_tritonclient_http_calls_them(gateway: Gateway) -> None:
    out = await asyncio.to_thread(_client_calls, gateway.url.removeprefix("http://"))
    assert out["status"] == []
    assert "CUDA shared memory is not supported" in out["refused"]


async def test_they_are_management_routes(empty_repository: Path) -> None:
    async for closed in _gateway(empty_repository, management_open=False):
        async with httpx.AsyncClient(base_url=closed.url) as http:
            answer = await http.get(CUDA + "/status")
            assert answer.status_code == 403 and answer.headers["x-error-reason"] == "permission_denied"
