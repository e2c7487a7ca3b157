"""KServe V2 REST on the gateway, mapped to the service's KServe gRPC API: NVIDIA's tritonclient.http
(binary tensor extension by default) and plain JSON requests."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import numpy as np
import pytest_asyncio
import tritonclient.http as tritonhttp
from tritonclient.utils import InferenceServerException

from modelyard.gateway.app import Gateway
from modelyard.gateway.settings import Settings as GatewaySettings
from modelyard.kserve.v2 import grpc_service_pb2 as kpb
from modelyard.kserve.v2 import grpc_service_pb2_grpc as kserve_grpc
from modelyard.service.server import Service, build_service
from modelyard.service.settings import Settings as ServiceSettings
from tests.support import eventually


@pytest_asyncio.fixture
async def gateway(service: Service) -> AsyncIterator[Gateway]:
    running = Gateway(GatewaySettings(listen="127.0.0.1:0", upstream=service.address))
    await running.start()
    try:
        yield running
    finally:
        await running.stop()


def triton_session(address: str) -> dict[str, Any]:
    """Runs in a thread (tritonclient.http blocks): what a Triton HTTP user does."""
    client = tritonhttp.InferenceServerClient(url=address)
    x = np.arange(48, dtype=np.float32).reshape(3, 16)
    out: dict[str, Any] = {
        "live": client.is_server_live(),
        "ready": client.is_server_ready(),
        "scaler_ready": client.is_model_ready("scaler", "1"),
        "metadata": client.get_model_metadata("mixed"),
    }
    for version in ("1", "2"):
        inp = tritonhttp.InferInput("INPUT0", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        result = client.infer("scaler", [inp], model_version=version)
        out[f"scaler_{version}"] = result.as_numpy("OUTPUT0")
    a = tritonhttp.InferInput("a", [2, 4], "FP32")
    a.set_data_from_numpy(np.array([[0, 3, 1, 0], [2, 0, 0, 1]], np.float32), binary_data=False)  # JSON
    b = tritonhttp.InferInput("b", [2, 4], "INT64")
    b.set_data_from_numpy(np.array([[1, 5, 2, 0], [9, 1, 1, 1]], np.int64))
    result = client.infer(
        "mixed",
        [a, b],
        outputs=[
            tritonhttp.InferRequestedOutput("argmax", binary_data=False),
            tritonhttp.InferRequestedOutput("sum", binary_data=True),
        ],
    )
    out["argmax"], out["sum"] = result.as_numpy("argmax"), result.as_numpy("sum")
    try:
        client.infer("nosuch", [a])
    except InferenceServerException as exc:
        out["missing"] = exc.status()
    client.close()
    del client  # its __del__ closes again: let that happen in this (gevent's) thread
    gc.collect()
    return out


async def test_tritonclient_http_works_against_the_gateway(gateway) -> None:
    out = await asyncio.to_thread(triton_session, gateway.address)
    assert out["live"] and out["ready"] and out["scaler_ready"]
    metadata = out["metadata"]
    assert metadata["name"] == "mixed"
    assert [(t["name"], t["datatype"]) for t in metadata["inputs"]] == [("a", "FP32"), ("b", "INT64")]
    x = np.arange(48, dtype=np.float32).reshape(3, 16)
    np.testing.assert_array_equal(out["scaler_1"], x * 2)
    np.testing.assert_array_equal(out["scaler_2"], x * 3)
    np.testing.assert_array_equal(out["argmax"], [1, 0])
    np.testing.assert_array_equal(out["sum"], np.array([[1, 8, 3, 0], [11, 1, 1, 2]], np.float32))
    assert out["missing"] == "404"


async def test_json_tensors_and_errors(gateway) -> None:
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        body = {
            "id": "r1",
            "inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": list(range(16))}],
        }
        answer = await http.post("/v2/models/scaler/versions/2/infer", json=body)
        assert answer.status_code == 200, answer.text
        document = answer.json()
        assert document["model_version"] == "2" and document["id"] == "r1"
        # The service names its version in the unary answer's trailing metadata; the gateway
        # returns it as a header.
        assert answer.headers["x-served-version"] == "2"
        assert document["outputs"][0]["data"] == [3 * i for i in range(16)]
        assert document["outputs"][0]["shape"] == [1, 16]
        nested = await http.post(
            "/v2/models/scaler/infer",
            json={
                "inputs": [
                    {"name": "INPUT0", "shape": [2, 16], "datatype": "FP32", "data": [[1] * 16, [2] * 16]}
                ]
            },
        )
        assert nested.status_code == 200 and nested.json()["outputs"][0]["data"] == [3] * 16 + [6] * 16
        assert (await http.get("/v2/models/scaler/versions/1/ready")).status_code == 200
        assert (await http.get("/v2/models/nosuch")).status_code == 404
        short = await http.post(
            "/v2/models/scaler/infer",
            json={"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2]}]},
        )
        assert short.status_code == 422 and "2 elements for shape [1, 4]" in short.json()["error"]
        wrong = await http.post(
            "/v2/models/scaler/infer",
            json={"inputs": [{"name": "WRONG", "shape": [1, 4], "datatype": "FP32", "data": [0] * 4}]},
        )
        assert wrong.status_code == 400 and wrong.json()["reason"] == "invalid_argument"
        assert (await http.post("/v2/models/scaler/infer", content=b"{")).status_code == 400


async def test_an_upstream_with_several_addresses_gets_calls_spread_over_all(repository, tmp_path) -> None:
    # Kubernetes gives the gateway one name for every sidecar pod (a headless Service); gRPC's
    # default (pick_first) would send every call to the first. Two real services stand for two pods.
    services = [
        build_service(ServiceSettings(repository=repository, listen="127.0.0.1:0", metrics_listen=""))
        for _ in range(2)
    ]
    for service in services:
        await service.start()
    both = "ipv4:" + ",".join(service.address for service in services)
    running = Gateway(GatewaySettings(listen="127.0.0.1:0", upstream=both))
    await running.start()
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [1.0] * 16}]}
    try:
        async with httpx.AsyncClient(base_url=f"http://{running.address}") as client:

            async def infer_counts() -> list[int]:
                counts = []
                for service in services:
                    async with grpc.aio.insecure_channel(service.address) as channel:
                        stats = await kserve_grpc.GRPCInferenceServiceStub(channel).ModelStatistics(
                            kpb.ModelStatisticsRequest(name="scaler")
                        )
                    counts.append(sum(s.inference_count for s in stats.model_stats))
                return counts

            async def both_served() -> bool:
                reply = await client.post("/v2/models/scaler/infer", json=body)
                assert reply.status_code == 200, reply.text
                return min(await infer_counts()) > 0

            await eventually(both_served, "calls through the gateway reaching both services")
    finally:
        await running.stop()
        for service in services:
            await service.stop(grace_s=1.0)
