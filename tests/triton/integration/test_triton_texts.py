"""The error texts Triton's clients and tests match, over gRPC and through the gateway's HTTP: the
message starts as Triton's does, the code and x-error-reason stay ours. And BYTES that are not
UTF-8 through the gateway's binary tensors, to a model that takes them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import pytest_asyncio

from models.demo_models import write_model
from modelyard.gateway.app import Gateway
from modelyard.gateway.settings import Settings as GatewaySettings
from modelyard.kserve.v2 import grpc_service_pb2 as kpb
from modelyard.kserve.v2 import grpc_service_pb2_grpc as kgrpc
from modelyard.service.server import Service, build_service
from modelyard.service.settings import Settings
from tests import triton_models
from tests.strings_model import byte_lookup

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("texts") / "models"
    write_model(root, "simple", 1, triton_models.simple(), triton_models.SIMPLE_CONFIG)
    write_model(root, "lookup", 1, byte_lookup([b"\xff\xfe", b"\x89PNG\r\n"]), {"max_batch_size": 8})
    return root


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(root: Path) -> AsyncIterator[tuple[Service, Gateway]]:
    service = build_service(
        Settings(repository=root, listen="127.0.0.1:0", metrics_listen="", management_open=True)
    )
    await service.start()
    gateway = Gateway(GatewaySettings(listen="127.0.0.1:0", upstream=service.address))
    await gateway.start()
    try:
        yield service, gateway
    finally:
        await gateway.stop()
        await service.stop(grace_s=1.0)


async def refused(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


def reason(error: grpc.aio.AioRpcError) -> str:
    metadata: Any = error.trailing_metadata() or ()
    return str(dict(metadata).get("x-error-reason"))


def simple_request(model: str = "simple", version: str = "") -> kpb.ModelInferRequest:
    request = kpb.ModelInferRequest(model_name=model, model_version=version)
    for name in ("INPUT0", "INPUT1"):
        request.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        request.raw_input_contents.append(np.arange(16, dtype=np.int32).tobytes())
    return request


async def test_grpc_texts(stack: tuple[Service, Gateway]) -> None:
    service, _ = stack
    async with grpc.aio.insecure_channel(service.address) as channel:
        stub: Any = kgrpc.GRPCInferenceServiceStub(channel)
        for call in (
            stub.ModelInfer(simple_request("wrong_model_name")),
            stub.ModelMetadata(kpb.ModelMetadataRequest(name="wrong_model_name")),
            stub.ModelConfig(kpb.ModelConfigRequest(name="wrong_model_name")),
        ):
            error = await refused(call)
            assert (error.code(), reason(error)) == (grpc.StatusCode.NOT_FOUND, "model_not_found")
            assert (error.details() or "").startswith(
                "Request for unknown model: 'wrong_model_name' is not found"
            )
        missing = await refused(stub.ModelInfer(simple_request(version="9")))
        assert (missing.code(), reason(missing)) == (grpc.StatusCode.NOT_FOUND, "version_not_found")
        assert (missing.details() or "").startswith(
            "Request for unknown model: 'simple' version 9 is not found"
        )
        bad = await refused(stub.ModelInfer(simple_request(version="wrong_specification")))
        assert (bad.code(), reason(bad)) == (grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument")
        assert (bad.details() or "").startswith(
            "failed to get model version from specified version string 'wrong_specification'"
        )
        both = simple_request()
        both.inputs[0].contents.int_contents.extend(range(16))
        mixed = await refused(stub.ModelInfer(both))
        assert mixed.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (mixed.details() or "") == (
            "contents field must not be specified when using raw_input_contents for 'INPUT0' "
            "for model 'simple'"
        )
        loads: tuple[tuple[str, dict[str, str], grpc.StatusCode], ...] = (
            ("wrong_model_name", {}, grpc.StatusCode.NOT_FOUND),
            ("simple", {"config": '"max_batch_size": {{16}}'}, grpc.StatusCode.INVALID_ARGUMENT),
        )
        for name, parameters, code in loads:
            load = kpb.RepositoryModelLoadRequest(model_name=name)
            for key, value in parameters.items():
                load.parameters[key].string_param = value
            failed = await refused(stub.RepositoryModelLoad(load))
            assert (failed.details() or "").startswith(f"failed to load '{name}': "), failed.details()
            assert failed.code() == code  # the code stays ours
        # Nothing the refusals touched changed: simple still answers.
        assert (await stub.ModelInfer(simple_request())).model_version == "1"


async def test_http_texts_through_the_gateway(stack: tuple[Service, Gateway]) -> None:
    _, gateway = stack
    body = {
        "inputs": [
            {"name": n, "datatype": "INT32", "shape": [1, 16], "data": list(range(16))}
            for n in ("INPUT0", "INPUT1")
        ]
    }
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        unknown = await http.post("/v2/models/wrong_model_name/infer", json=body)
        assert unknown.status_code == 404
        assert unknown.json()["error"].startswith(
            "Request for unknown model: 'wrong_model_name' is not found"
        )
        config = await http.get("/v2/models/wrong_model_name/config")
        assert config.json()["error"].startswith("Request for unknown model")
        load = await http.post("/v2/repository/models/wrong_model_name/load", content=b"")
        assert load.json()["error"].startswith("failed to load 'wrong_model_name'")


async def test_non_utf8_bytes_through_the_gateway_binary_tensors(stack: tuple[Service, Gateway]) -> None:
    _, gateway = stack
    elements = [b"\x89PNG\r\n", b"\xff\xfe", b"\xff"]
    raw = b"".join(len(e).to_bytes(4, "little") + e for e in elements)
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "TEXT",
                    "datatype": "BYTES",
                    "shape": [1, 3],
                    "parameters": {"binary_data_size": len(raw)},
                }
            ],
            "outputs": [{"name": "ID", "parameters": {"binary_data": False}}],
        }
    ).encode()
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        answer = await http.post(
            "/v2/models/lookup/infer",
            content=header + raw,
            headers={
                "Inference-Header-Content-Length": str(len(header)),
                "content-type": "application/octet-stream",
            },
        )
    assert answer.status_code == 200, answer.text
    assert answer.json()["outputs"][0]["data"] == [1, 0, -1]
