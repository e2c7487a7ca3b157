"""JSON logs and the access log, as an operator turns them on: the service, the sidecar and the
gateway in child processes with `--log-format json --access-log`, a call through each, and the
lines they write: the same fields in every process, one access line per call, none for probes."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from modelyard.common import headers
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.kserve.v2 import grpc_service_pb2 as kserve_pb
from modelyard.kserve.v2 import grpc_service_pb2_grpc as kserve_grpc
from modelyard.service.server import build_service
from modelyard.service.settings import Settings
from modelyard.tensors import to_tensor
from tests.gateway.integration.test_gateway_process import _SERVING as GATEWAY_SERVING
from tests.sidecar_support import start_sidecar_process
from tests.support import ChildProcess, ServiceProcess, eventually, start_child

COMMON = ("ts", "level", "logger", "msg", "process", "pid")
JSON_ACCESS = ("--log-format", "json", "--access-log")


def _base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("MODELYARD_", "OTEL_"))}


def _lines(child: ChildProcess) -> list[dict[str, Any]]:
    return [json.loads(line) for line in list(child.log) if line.startswith("{")]


def _access(child: ChildProcess, **match: str) -> list[dict[str, Any]]:
    return [
        e
        for e in _lines(child)
        if e["logger"] == "modelyard.access" and all(e.get(k) == v for k, v in match.items())
    ]


def _http(request: urllib.request.Request) -> tuple[int, str]:
    """Status and x-error-reason of an HTTP request (a thread: urllib blocks)."""
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.headers.get("x-error-reason", "")
    except urllib.error.HTTPError as error:
        return error.code, error.headers.get("x-error-reason", "")


def _request(stub: pb_grpc.InferenceServiceStub, model: str, request_id: str) -> Any:
    tensor = to_tensor("INPUT0", np.ones((1, 16), np.float32))
    return stub.Infer(
        pb.InferRequest(model_name=model, inputs=[tensor]), metadata=((headers.REQUEST_ID, request_id),)
    )


async def test_every_process_writes_the_same_json_fields_and_one_access_line_per_call(
    repository: Path, service_process
) -> None:
    service: ServiceProcess = service_process(repository, *JSON_ACCESS)
    sidecar = start_sidecar_process("--upstream", service.address, *JSON_ACCESS)
    gateway = start_child(
        [sys.executable, "-m", "modelyard.gateway", "--listen", "127.0.0.1:0", *JSON_ACCESS],
        GATEWAY_SERVING,
        "gateway",
        env={**_base_env(), "MODELYARD_GATEWAY_UPSTREAM": sidecar.address},
    )
    try:
        async with grpc.aio.insecure_channel(sidecar.address) as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            reply = await _request(stub, "scaler", "rid-through")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _request(stub, "nosuch", "rid-missing")
            assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        base = gateway.ready.group(1)
        ready_request = urllib.request.Request(
            base + "/v2/models/scaler/versions/1/ready", headers={"x-request-id": "rid-http"}
        )
        assert (await asyncio.to_thread(_http, ready_request))[0] == 200
        body = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "FP32", "data": [1]}]})
        status, reason = await asyncio.to_thread(
            _http, urllib.request.Request(base + "/v2/models/nosuch/infer", body.encode())
        )
        assert status == 404 and reason == "model_not_found"

        infer = "/modelyard.inference.v1.InferenceService/Infer"
        await eventually(lambda: bool(_access(service, request_id="rid-missing")), "the service's lines")
        await eventually(lambda: bool(_access(sidecar, request_id="rid-missing")), "the sidecar's lines")
        await eventually(lambda: bool(_access(gateway, model="nosuch")), "the gateway's lines")

        (served,) = _access(service, request_id="rid-through")
        assert (served["method"], served["code"], served["model"], served["version"]) == (
            infer,
            "OK",
            "scaler",
            reply.model_version,
        )
        assert served["duration_ms"] > 0 and served["peer"].startswith("ipv4:127.0.0.1:")
        (unknown,) = _access(service, request_id="rid-missing")
        assert (unknown["code"], unknown["model"], unknown["reason"]) == (
            "NOT_FOUND",
            "nosuch",
            "model_not_found",
        )
        (proxied,) = _access(sidecar, request_id="rid-through")
        assert (proxied["method"], proxied["code"], proxied["model"]) == (infer, "OK", "scaler")
        (ready,) = _access(gateway, request_id="rid-http")
        assert ready["method"] == "GET /v2/models/scaler/versions/1/ready" and ready["code"] == "200"
        assert (ready["model"], ready["version"]) == ("scaler", "1")
        (absent,) = _access(gateway, model="nosuch")
        assert absent["method"] == "POST /v2/models/nosuch/infer"
        assert (absent["code"], absent["reason"]) == ("404", "model_not_found")

        # The kubelet's probes are not callers' traffic: no line for the health check.
        assert not [e for e in _lines(sidecar) if "Health" in e.get("method", "")]
        for child, name in ((service, "service"), (sidecar, "sidecar"), (gateway, "gateway")):
            lines = _lines(child)
            assert lines and len(lines) == len(child.log), [x for x in child.log if not x.startswith("{")]
            for entry in lines:
                assert all(field in entry for field in COMMON), entry
                assert entry["process"] == name
    finally:
        for child in (gateway, sidecar):
            if child.proc.poll() is None:
                child.stop(signal.SIGTERM)


async def test_the_access_log_is_off_by_default(repository: Path, caplog: pytest.LogCaptureFixture) -> None:
    # In-process, with and without the flag: the same call writes a line only with it.
    caplog.set_level(logging.INFO, logger="modelyard.access")
    for access_log in (False, True):
        service = build_service(
            Settings(repository=repository, listen="127.0.0.1:0", metrics_listen="", access_log=access_log)
        )
        await service.start()
        try:
            async with grpc.aio.insecure_channel(service.address) as channel:
                await _request(pb_grpc.InferenceServiceStub(channel), "scaler", f"rid-{access_log}")
        finally:
            await service.stop(grace_s=1.0)
        written = [r for r in caplog.records if r.name == "modelyard.access"]
        assert len(written) == (1 if access_log else 0), written


async def test_streaming_calls_get_one_line_each_with_the_model(
    repository: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Server streaming (InferStream) and both-ways streaming (KServe's ModelStreamInfer): the line
    # is written when the stream ends, with the model of its first request.
    caplog.set_level(logging.INFO, logger="modelyard.access")
    service = build_service(
        Settings(repository=repository, listen="127.0.0.1:0", metrics_listen="", access_log=True)
    )
    await service.start()
    try:
        async with grpc.aio.insecure_channel(service.address) as channel:
            ours = pb_grpc.InferenceServiceStub(channel)
            tensor = to_tensor("INPUT0", np.ones((4, 16), np.float32))
            replies = [
                r async for r in ours.InferStream(pb.InferStreamRequest(model_name="scaler", inputs=[tensor]))
            ]
            assert replies
            kserve = kserve_grpc.GRPCInferenceServiceStub(channel)
            request = kserve_pb.ModelInferRequest(
                model_name="scaler",
                inputs=[
                    kserve_pb.ModelInferRequest.InferInputTensor(
                        name="INPUT0", datatype="FP32", shape=[1, 16]
                    )
                ],
                raw_input_contents=[np.ones((1, 16), np.float32).tobytes()],
            )

            async def requests() -> Any:
                yield request
                yield request

            answers = [a async for a in kserve.ModelStreamInfer(requests())]
            assert len(answers) == 2 and not [a for a in answers if a.error_message]
    finally:
        await service.stop(grace_s=1.0)
    lines = {r.fields["method"]: r.fields for r in caplog.records if r.name == "modelyard.access"}  # type: ignore[attr-defined]
    stream = lines["/modelyard.inference.v1.InferenceService/InferStream"]
    both = lines["/inference.GRPCInferenceService/ModelStreamInfer"]
    assert (stream["code"], stream["model"]) == ("OK", "scaler") and stream["version"]
    assert (both["code"], both["model"]) == ("OK", "scaler")
