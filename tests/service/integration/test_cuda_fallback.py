"""Where CUDA cannot run, the service says why, in one line, and a version that wanted it says so:
`auto` serves on the CPU as degraded (status reason, metric), `cuda` fails its load.

The host with a driver but no working CUDA is real here: an NVIDIA driver file is faked, the
library preload and the probe session really run (this host has no GPU, so the probe fails)."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import onnxruntime
import pytest

from models.demo_models import scaled_identity, write_model
from modelyard.inference.v1 import model_service_pb2 as mpb
from modelyard.inference.v1 import model_service_pb2_grpc as mpb_grpc
from modelyard.service import server
from modelyard.service.runtime import providers
from modelyard.service.runtime.providers import CPU, CUDA, ProviderChoice, detect_providers
from modelyard.service.settings import Settings
from tests.support import eventually, metric


@pytest.fixture(scope="module")
def host_with_a_driver(tmp_path_factory: pytest.TempPathFactory) -> ProviderChoice:
    driver = tmp_path_factory.mktemp("proc") / "version"
    driver.write_text("NVRM version: faked for the test\n")
    # This build has the CUDA provider or not; either way the probe cannot run on a host without a
    # GPU (on a GPU host CUDA works, and tests/service/integration/test_cuda.py is the one that runs).
    choice = detect_providers(driver=driver, available=lambda: [CUDA, CPU])
    if choice.cuda_usable:
        pytest.skip("CUDA works on this host")
    return choice


def test_no_driver_is_not_a_fallback(tmp_path: Path) -> None:
    choice = detect_providers(
        driver=tmp_path / "absent", available=lambda: [CUDA, CPU], preload=lambda: ["libcudnn.so.9"]
    )
    assert not choice.cuda_usable and not choice.fallback
    assert "no NVIDIA driver" in choice.reason and str(tmp_path / "absent") in choice.reason
    # What the preload found is said even so: here the install lacks cuDNN.
    assert "libraries missing: libcudnn.so.9" in choice.reason
    assert (
        choice.summary().startswith("onnxruntime ") and "CUDA not used: no NVIDIA driver" in choice.summary()
    )


def test_a_build_without_cuda_names_the_extra(tmp_path: Path) -> None:
    choice = detect_providers(driver=tmp_path / "absent", available=lambda: [CPU])
    assert "no CUDA execution provider" in choice.reason and "service-cuda" in choice.reason


def test_a_driver_without_working_cuda_is_a_fallback_that_says_why(
    host_with_a_driver: ProviderChoice,
) -> None:
    choice = host_with_a_driver
    assert not choice.cuda_usable and choice.fallback and choice.default == CPU
    assert "CUDA" in choice.reason and ("failed" in choice.reason or "missing" in choice.reason)


def test_missing_libraries_are_named(tmp_path: Path) -> None:
    driver = tmp_path / "version"
    driver.write_text("faked\n")
    choice = detect_providers(driver=driver, available=lambda: [CUDA, CPU], preload=lambda: ["libcudnn.so.9"])
    if choice.cuda_usable:  # pragma: no cover - a real GPU host
        pytest.skip("CUDA works here")
    assert "libcudnn.so.9" in choice.reason or "probe failed" in choice.reason


def test_the_preload_reports_what_did_not_load(monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_preload() -> None:
        print("Failed to load libcublasLt.so.12: cannot open shared object file")
        print("Failed to load libcudnn.so.9: cannot open shared object file")

    monkeypatch.setattr(onnxruntime, "preload_dlls", fake_preload, raising=False)
    assert providers.preload_cuda_libraries() == ["libcublasLt.so.12", "libcudnn.so.9"]


@pytest.fixture
async def fallback_service(
    tmp_path: Path, host_with_a_driver: ProviderChoice, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Any]:
    root = tmp_path / "models"
    write_model(root, "auto", 1, scaled_identity(4, 2.0), {"max_batch_size": 4})
    write_model(root, "gpu_only", 1, scaled_identity(4, 2.0), {"execution": {"provider": "cuda"}})
    write_model(root, "cpu", 1, scaled_identity(4, 2.0), {"execution": {"provider": "cpu"}})
    monkeypatch.setattr(server, "detect_providers", lambda: host_with_a_driver)
    service = server.build_service(
        Settings(repository=root, listen="127.0.0.1:0", metrics_listen="127.0.0.1:0")
    )
    await service.start()
    try:
        yield service
    finally:
        await service.stop(grace_s=1.0)


async def test_auto_serves_degraded_and_cuda_fails_its_load(fallback_service: Any) -> None:
    async with grpc.aio.insecure_channel(fallback_service.address) as channel:
        models = mpb_grpc.ModelServiceStub(channel)

        async def described(name: str) -> Any:
            return (await models.GetModel(mpb.GetModelRequest(name=name))).model

        auto = await described("auto")
        assert auto.versions[0].state == mpb.MODEL_STATE_READY
        assert auto.versions[0].reason.startswith("degraded: on the CPU: ")
        assert auto.versions[0].execution_provider == CPU
        cpu = await described("cpu")
        assert cpu.versions[0].state == mpb.MODEL_STATE_READY and cpu.versions[0].reason == ""
        gpu_only = await described("gpu_only")
        assert gpu_only.versions[0].state == mpb.MODEL_STATE_FAILED
        assert "execution.provider is cuda" in gpu_only.versions[0].reason

    def scrape() -> str:
        url = f"http://{fallback_service.metrics_address}/metrics"
        with urllib.request.urlopen(url, timeout=10) as answer:
            return str(answer.read().decode())

    async def degraded_counted() -> bool:
        text = await asyncio.to_thread(scrape)  # the metrics server shares this event loop
        found = {m: metric(text, "modelyard_model_versions_degraded", model=m) for m in ("auto", "cpu")}
        return found == {"auto": 1.0, "cpu": 0.0}

    await eventually(degraded_counted, what="the degraded gauge")
