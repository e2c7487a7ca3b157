"""Triton's HTTP API on the gateway, as Triton HTTP users drive it: tritonclient.http's whole API
(configuration, statistics, repository, logging, trace, classification, compressed bodies),
Triton's generate extension, JSON errors for every unrouted path, and perf_analyzer -i http; the
real service upstream (the demo repository and the committed codelm)."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import threading
import zlib
from collections.abc import AsyncIterator
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import pytest_asyncio
import tritonclient.http as tritonhttp
from tritonclient.utils import InferenceServerException

from models import demo_models
from modelyard.gateway.app import Gateway
from modelyard.gateway.kserve.serving import GATEWAY_EXTENSIONS, REST_EXTENSIONS
from modelyard.gateway.settings import Settings as GatewaySettings
from modelyard.service.server import build_service
from modelyard.service.settings import Settings
from tests.sse_client import read_events
from tests.triton.integration.test_perf_analyzer import run_perf_analyzer

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def triton_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("triton_http") / "models"
    demo_models.build_demo_repository(root)
    assert demo_models.copy_trained_models(demo_models.COMMITTED_ROOT, root) == ["codelm"]
    return root


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(triton_repository: Path) -> AsyncIterator[Gateway]:
    # Management open (as Triton's explicit model control): the client's repository, log, trace and
    # shared-memory calls are what this test drives.
    settings = Settings(
        repository=triton_repository, listen="127.0.0.1:0", metrics_listen="", management_open=True
    )
    service = build_service(settings)
    await service.start()
    running = Gateway(GatewaySettings(listen="127.0.0.1:0", upstream=service.address))
    await running.start()
    try:
        yield running
    finally:
        await running.stop()
        await service.stop(grace_s=1.0)


def failure(call: Any) -> dict[str, Any] | None:
    try:
        call()
    except InferenceServerException as exc:
        return {"status": exc.status(), "message": exc.message()}
    return None


def session(address: str, repository: Path) -> dict[str, Any]:
    """Runs in a thread (tritonclient.http blocks): every call of the client's API we serve."""
    client = tritonhttp.InferenceServerClient(url=address)
    try:
        return _calls(client, repository)
    finally:
        client.close()
        del client  # its __del__ closes again: let that happen in this (gevent's) thread
        gc.collect()


def _calls(client: Any, repository: Path) -> dict[str, Any]:
    x = np.arange(48, dtype=np.float32).reshape(3, 16)

    def scaler(**kwargs: Any) -> Any:
        inp = tritonhttp.InferInput("INPUT0", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        return client.infer("scaler", [inp], **kwargs).as_numpy("OUTPUT0")

    rows = np.random.default_rng(3).standard_normal((2, 64), dtype=np.float32)
    top = tritonhttp.InferInput("INPUT0", list(rows.shape), "FP32")
    top.set_data_from_numpy(rows)
    out: dict[str, Any] = {
        "server": client.get_server_metadata(),
        "config": client.get_model_config("classifier"),
        "scaler_config": client.get_model_config("scaler", "2"),
        "gzip": scaler(request_compression_algorithm="gzip"),
        "deflate": scaler(request_compression_algorithm="deflate"),
        "top2": client.infer(
            "classifier", [top], outputs=[tritonhttp.InferRequestedOutput("OUTPUT0", class_count=2)]
        ).as_numpy("OUTPUT0"),
        "full": client.infer("classifier", [top]).as_numpy("OUTPUT0"),
    }
    out["stats"] = client.get_inference_statistics("scaler")
    out["all_stats"] = client.get_inference_statistics()
    out["index"] = client.get_model_repository_index()
    client.unload_model("scaler")
    out["unloaded_ready"] = client.is_model_ready("scaler")
    client.load_model("scaler")
    out["reloaded_ready"] = client.is_model_ready("scaler")
    # A config override, and the round trip of what /config answers; then a model from files.
    client.load_model("scaler", config='{"max_batch_size": 4}')
    out["overridden"] = client.get_model_config("scaler")["max_batch_size"]
    before = client.get_model_config("classifier")
    client.load_model("classifier", config=json.dumps(before))
    out["round_trip"] = client.get_model_config("classifier") == before
    client.load_model("scaler")
    model_bytes = (repository / "scaler" / "1" / "model.onnx").read_bytes()
    upload = {"max_batch_size": 8, "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [16]}]}
    client.load_model("uploaded", config=json.dumps(upload), files={"file:1/model.onnx": model_bytes})
    inp = tritonhttp.InferInput("INPUT0", [2, 16], "FP32")
    inp.set_data_from_numpy(np.ones((2, 16), np.float32))
    out["uploaded"] = client.infer("uploaded", [inp]).as_numpy("OUTPUT0")
    client.unload_model("uploaded")
    out["log"] = client.get_log_settings()
    out["log_updated"] = client.update_log_settings({"log_verbose_level": 1})
    client.update_log_settings({"log_verbose_level": 0})
    out["trace"] = client.get_trace_settings()
    out["trace_updated"] = client.update_trace_settings(settings={"trace_rate": "7"})
    out["model_trace"] = client.get_trace_settings(model_name="scaler")
    client.update_trace_settings(settings={"trace_rate": None})
    out["missing_config"] = failure(lambda: client.get_model_config("nosuch"))
    out.update(shm_calls(client, x))
    return out


def shm_calls(client: Any, x: np.ndarray) -> dict[str, Any]:
    """System shared memory over REST: register, status, infer in and out of regions, unregister."""
    tag = f"{os.getpid()}_{threading.get_ident()}"
    region_in = shared_memory.SharedMemory(f"modelyard_http_in_{tag}", create=True, size=x.nbytes + 16)
    region_out = shared_memory.SharedMemory(f"modelyard_http_out_{tag}", create=True, size=x.nbytes)
    try:
        region_in.buf[16 : 16 + x.nbytes] = x.tobytes()
        client.register_system_shared_memory("in", "/" + region_in.name, x.nbytes + 16)
        client.register_system_shared_memory("out", "/" + region_out.name, x.nbytes)
        status = client.get_system_shared_memory_status()
        inp = tritonhttp.InferInput("INPUT0", list(x.shape), "FP32")
        inp.set_shared_memory("in", x.nbytes, offset=16)
        requested = tritonhttp.InferRequestedOutput("OUTPUT0")
        requested.set_shared_memory("out", x.nbytes)
        result = client.infer("scaler", [inp], outputs=[requested])
        written = np.frombuffer(region_out.buf, np.float32, count=x.size).reshape(x.shape).copy()
        client.unregister_system_shared_memory()
        return {
            "shm_status": sorted((r["name"], r["byte_size"]) for r in status),
            "shm_output": result.get_output("OUTPUT0"),
            "shm_written": written,
            "shm_after": client.get_system_shared_memory_status(),
        }
    finally:
        for region in (region_in, region_out):
            region.close()
            region.unlink()


async def test_tritonclient_http_api_against_the_gateway(gateway, triton_repository) -> None:
    out = await asyncio.to_thread(session, gateway.address, triton_repository)
    extensions = out["server"]["extensions"]
    assert "binary_tensor_data" in extensions and "generate" in extensions
    assert set(extensions) <= set(REST_EXTENSIONS) | set(GATEWAY_EXTENSIONS)
    assert "cuda_shared_memory" not in extensions

    config = out["config"]  # Triton's JSON: numbers, not protobuf's int64 strings
    assert config["name"] == "classifier" and config["max_batch_size"] == 32
    assert config["input"][0]["name"] == "INPUT0" and config["input"][0]["data_type"] == "TYPE_FP32"
    assert config["input"][0]["dims"] == [64] and "dynamic_batching" in config
    assert "sequence_batching" not in config  # unset messages are absent, as Triton's
    assert out["scaler_config"]["name"] == "scaler"

    x = np.arange(48, dtype=np.float32).reshape(3, 16)
    np.testing.assert_array_equal(out["gzip"], x * 3)
    np.testing.assert_array_equal(out["deflate"], x * 3)
    # class_count: top-k "value:index" strings, not the full output.
    full = out["full"]
    assert out["top2"].shape == (2, 2)
    for row, classes in zip(full, out["top2"], strict=True):
        indexes = [int(c.decode().split(":")[1]) for c in classes]
        assert indexes == list(np.argsort(-row)[:2])

    stats = out["stats"]["model_stats"]
    assert {s["name"] for s in stats} == {"scaler"}
    newest = next(s for s in stats if s["version"] == "2")
    assert newest["inference_count"] >= 6 and isinstance(newest["inference_count"], int)
    assert newest["inference_stats"]["success"]["count"] >= 2
    assert {"classifier", "scaler"} <= {s["name"] for s in out["all_stats"]["model_stats"]}
    assert {"classifier", "scaler", "codelm"} <= {m["name"] for m in out["index"]}
    assert out["unloaded_ready"] is False and out["reloaded_ready"] is True
    assert out["overridden"] == 4 and out["round_trip"] is True
    np.testing.assert_array_equal(out["uploaded"], np.full((2, 16), 2, np.float32))  # scaler v1: x2

    assert out["log"]["log_verbose_level"] == 0 and out["log_updated"]["log_verbose_level"] == 1
    assert isinstance(out["trace"]["trace_level"], list) and isinstance(out["trace"]["trace_rate"], str)
    assert out["trace_updated"]["trace_rate"] == "7" and out["model_trace"]["trace_rate"] == "7"
    assert out["missing_config"]["status"] == "404" and "nosuch" in out["missing_config"]["message"]

    assert out["shm_status"] == [("in", x.nbytes + 16), ("out", x.nbytes)]
    np.testing.assert_array_equal(out["shm_written"], x * 3)
    assert out["shm_output"]["parameters"]["shared_memory_region"] == "out"
    assert "data" not in out["shm_output"] and out["shm_after"] == []


async def test_generate_and_generate_stream(gateway) -> None:
    body = {"text_input": "def add(a, b):", "parameters": {"max_tokens": 8, "temperature": 0}}
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
        whole = await http.post("/v2/models/codelm/generate", json=body)
        assert whole.status_code == 200, whole.text
        document = whole.json()
        assert set(document) == {"model_name", "model_version", "text_output"}
        assert document["model_name"] == "codelm" and document["text_output"]
        async with http.stream("POST", "/v2/models/codelm/generate_stream", json=body) as streamed:
            assert streamed.headers["content-type"].startswith("text/event-stream")
            events = [e async for e in read_events(streamed)]
        pieces = [json.loads(e.data) if isinstance(e.data, str) else e.data for e in events]
        assert len(pieces) > 1 and "".join(p["text_output"] for p in pieces) == document["text_output"]
        refused = await http.post("/v2/models/codelm/generate", json={"text_input": "x", "beam_width": 2})
        assert refused.status_code == 422 and "beam_width" in refused.json()["error"]
        not_decoder = await http.post("/v2/models/scaler/generate_stream", json={"text_input": "x"})
        assert not_decoder.status_code == 400 and not_decoder.headers["content-type"] == "application/json"


async def test_every_unrouted_path_answers_in_json_with_a_reason(gateway) -> None:
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        for method, path in [
            ("GET", "/v2/nosuch"),
            ("GET", "/v2/models/scaler/nosuch"),
            ("GET", "/v2/cudasharedmemory/nosuch"),
            ("GET", "/v2x"),
        ]:
            answer = await http.request(method, path)
            assert answer.status_code == 404, (path, answer.text)
            assert path in answer.json()["error"] and answer.headers["x-error-reason"] == "unsupported"
        wrong = await http.delete("/v2/models/scaler/config")
        assert wrong.status_code == 405 and "error" in wrong.json()
        # A body that inflates past --max-body-bytes is refused, however small it was sent.
        bomb = zlib.compress(b"{" + b" " * (2 << 20) + b"}")
        too_big = await http.post(
            "/v2/models/scaler/infer", content=bomb, headers={"content-encoding": "deflate"}
        )
        assert too_big.status_code == 413 and too_big.headers["x-error-reason"] == "too_large"


async def test_perf_analyzer_over_http_against_the_gateway(gateway) -> None:
    # In a thread: the gateway serves on this module's event loop meanwhile.
    run = await asyncio.to_thread(run_perf_analyzer, gateway.address, "-i", "http", "-b", "2")
    assert run.requests > 0 and run.inferences == 2 * run.requests
