"""The service as users install it: the built wheel with one extra in a fresh virtual environment,
from the package registry (tests/installs.py; `make test` makes them first), the service started
from there on the demo models (`modelyard demo-models DIR`) and answering on 127.0.0.1.

- `service-cpu`, the install for platforms without onnxruntime-gpu wheels (and CPU hosts): plain
  onnxruntime, never onnxruntime-gpu (both provide the `onnxruntime` module), CPU only.
- `service-cuda` (Linux x86_64): onnxruntime-gpu with NVIDIA's libraries from their wheels. The
  preload really loads them from the environment; this host has no NVIDIA driver, so the start-up
  line says that and the service serves on the CPU; with a driver file but no GPU (faked, as in
  test_cuda_fallback.py, but with the real libraries here) the version serves degraded. On a GPU
  host the same test expects CUDA.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.inference.v1 import model_service_pb2 as mpb
from modelyard.inference.v1 import model_service_pb2_grpc as mpb_grpc
from modelyard.service.runtime.providers import CPU, CUDA, NVIDIA_DRIVER
from modelyard.tensors import to_array, to_tensor
from tests import installs
from tests.support import _SERVING, ServiceProcess, start_child

pytestmark = pytest.mark.timeout(installs.INSTALL_TIMEOUT_S + 120)  # a first install included
ORT_VERSION = "1.31.1"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return installs.build_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="module")
def cpu_venv(wheel: Path) -> Path:
    return installs.environment("service-cpu", wheel)


@pytest.fixture(scope="module")
def cuda_venv(wheel: Path) -> Path:
    if not installs.CUDA_HERE:
        pytest.skip("service-cuda installs onnxruntime-gpu only on Linux x86_64")
    return installs.environment("service-cuda", wheel)


def in_venv(venv: Path, code: str, *args: str) -> Any:
    """Run `code` with the environment's own Python, isolated from this checkout; its JSON answer."""
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-I", "-c", code, *args],
        env=installs.clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def consistent(venv: Path) -> None:
    """pip's own check: every installed distribution's requirements are met, none conflict."""
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "check"],
        env=installs.clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


DISTRIBUTIONS = """
import importlib.metadata as m, json, onnxruntime, modelyard
print(json.dumps({
    "dists": {d.metadata["Name"].lower().replace("_", "-"): d.version for d in m.distributions()},
    "providers": onnxruntime.get_available_providers(),
    "modelyard": modelyard.__file__,
}))
"""


@pytest.fixture
def demo_repository(tmp_path: Path) -> Callable[[Path], Path]:
    def made(venv: Path) -> Path:
        repository = tmp_path / "models"
        done = subprocess.run(
            [str(venv / "bin" / "modelyard"), "demo-models", str(repository)],
            env=installs.clean_env(),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return repository

    return made


@pytest.fixture
def serve() -> Iterator[Callable[..., ServiceProcess]]:
    started: list[ServiceProcess] = []

    def start(command: list[str], repository: Path) -> ServiceProcess:
        address = ["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--workers", "1"]
        cmd = [*command, "--repository", str(repository), *address]
        child = start_child(cmd, _SERVING, "the installed service", env=installs.clean_env(), timeout=90)
        started.append(ServiceProcess(child.proc, child.ready, child.log))
        return started[-1]

    yield start
    for process in started:
        assert process.stop() == 0, "\n".join(process.log)


def provider_line(process: ServiceProcess) -> str:
    (line,) = [ln for ln in process.log if "execution provider:" in ln]
    return line


def infer_and_describe(process: ServiceProcess) -> mpb.ModelVersion:
    """An Infer on the demo scaler (v2: INPUT0 * 3) and that version's status."""
    with grpc.insecure_channel(process.address) as channel:
        values = np.arange(16, dtype=np.float32).reshape(1, 16)
        request = pb.InferRequest(model_name="scaler", inputs=[to_tensor("INPUT0", values)])
        reply = pb_grpc.InferenceServiceStub(channel).Infer(request, timeout=30)
        assert reply.model_version == "2"
        np.testing.assert_array_equal(to_array(reply.outputs[0]), values * 3)
        model = mpb_grpc.ModelServiceStub(channel).GetModel(mpb.GetModelRequest(name="scaler"), timeout=30)
    (version,) = [v for v in model.model.versions if v.version == "2"]
    return version


def test_the_cpu_extra_installs_plain_onnxruntime_only(cpu_venv: Path) -> None:
    found = in_venv(cpu_venv, DISTRIBUTIONS)
    assert found["dists"].get("onnxruntime") == ORT_VERSION
    assert "onnxruntime-gpu" not in found["dists"], "two builds of the one onnxruntime module"
    assert not [name for name in found["dists"] if name.startswith("nvidia-cu")], found["dists"]
    assert CUDA not in found["providers"] and CPU in found["providers"]
    assert Path(found["modelyard"]).is_relative_to(cpu_venv)  # the wheel, not this checkout
    consistent(cpu_venv)


def test_the_service_from_the_cpu_install_serves_on_the_cpu(
    cpu_venv: Path, demo_repository: Callable[[Path], Path], serve: Callable[..., ServiceProcess]
) -> None:
    process = serve([str(cpu_venv / "bin" / "modelyard"), "serve"], demo_repository(cpu_venv))
    line = provider_line(process)
    assert f"execution provider: {CPU} (onnxruntime {ORT_VERSION}" in line
    assert "no CUDA execution provider (install modelyard[service-cuda])" in line
    version = infer_and_describe(process)
    assert version.execution_provider == CPU and version.reason == ""  # the plan here, not degraded


# The preload in the environment, and the NVIDIA libraries that the process then holds (its maps).
PRELOAD = """
import json, sys
from modelyard.service.runtime.providers import preload_cuda_libraries
missing = preload_cuda_libraries()
maps = open("/proc/self/maps").read().split("\\n")
loaded = sorted({ln.split()[-1] for ln in maps if "/nvidia/" in ln and ".so" in ln})
print(json.dumps({"missing": missing, "loaded": loaded}))
"""
NVIDIA_LIBRARIES = ("libcudart.so", "libcublas.so", "libcublasLt.so", "libcudnn.so")


def test_the_cuda_extra_brings_the_libraries_and_the_preload_loads_them(cuda_venv: Path) -> None:
    found = in_venv(cuda_venv, DISTRIBUTIONS)
    assert found["dists"].get("onnxruntime-gpu") == ORT_VERSION
    assert "onnxruntime" not in found["dists"], "two builds of the one onnxruntime module"
    assert CUDA in found["providers"]
    assert {"nvidia-cublas", "nvidia-cuda-runtime"} <= set(found["dists"]), found["dists"]
    assert [name for name in found["dists"] if name.startswith("nvidia-cudnn")]
    consistent(cuda_venv)
    preloaded = in_venv(cuda_venv, PRELOAD)
    assert preloaded["missing"] == []
    for library in NVIDIA_LIBRARIES:
        paths = [Path(p) for p in preloaded["loaded"] if Path(p).name.startswith(library + ".")]
        assert paths, f"{library} not loaded: {preloaded['loaded']}"
        assert all(p.is_relative_to(cuda_venv) for p in paths), paths  # from the wheels, not the host


def test_the_service_from_the_cuda_install_says_why_it_is_on_the_cpu(
    cuda_venv: Path, demo_repository: Callable[[Path], Path], serve: Callable[..., ServiceProcess]
) -> None:
    process = serve([str(cuda_venv / "bin" / "modelyard"), "serve"], demo_repository(cuda_venv))
    line = provider_line(process)
    version = infer_and_describe(process)
    if NVIDIA_DRIVER.exists():  # a GPU host (bench/gpu_check.sh): the install serves on the GPU
        assert f"execution provider: {CUDA}" in line and version.execution_provider == CUDA
        return
    assert f"execution provider: {CPU} (onnxruntime {ORT_VERSION}, built for CUDA " in line
    # The preload ran before the driver was looked at: the install's libraries are all there.
    assert f"CUDA not used: no NVIDIA driver ({NVIDIA_DRIVER} is absent; the CUDA libraries loaded)" in line
    # No driver: a CPU host with the CUDA install, not a fallback.
    assert version.execution_provider == CPU and version.reason == ""


# The service's own start, on a host whose driver file is the given one (the seam that
# test_cuda_fallback.py patches in-process); everything else, the preload included, is real.
WITH_A_DRIVER_FILE = """
import sys
from pathlib import Path
from modelyard.service import cli, server
from modelyard.service.runtime import providers
driver = Path(sys.argv[1])
server.detect_providers = lambda: providers.detect_providers(driver=driver)
sys.exit(cli.main(sys.argv[2:]))
"""


def test_the_cuda_install_on_a_driver_without_a_gpu_serves_degraded(
    cuda_venv: Path,
    demo_repository: Callable[[Path], Path],
    serve: Callable[..., ServiceProcess],
    tmp_path: Path,
) -> None:
    if NVIDIA_DRIVER.exists():
        pytest.skip("a real driver here: CUDA works (the test above)")
    driver = tmp_path / "nvidia-version"
    driver.write_text("NVRM version: faked for the test\n")
    command = [str(cuda_venv / "bin" / "python"), "-I", "-c", WITH_A_DRIVER_FILE, str(driver)]
    process = serve(command, demo_repository(cuda_venv))
    line = provider_line(process)
    assert "CUDA not used: the CUDA provider failed to create a session" in line
    assert "libraries missing" not in line  # the wheels' libraries loaded; the GPU is what is absent
    version = infer_and_describe(process)
    assert version.execution_provider == CPU
    assert version.reason.startswith("degraded: on the CPU: ")
