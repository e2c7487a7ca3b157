"""The wheel as users install it: one `modelyard` namespace (no top-level `service` or `gateway`),
the processes' packages and data inside it (the .proto/.fbs sources, the demo models), a process
that starts from the wheel alone, and the ONNX Runtime each `service*` extra takes on each platform."""

from __future__ import annotations

import email
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests import installs
from tests.support import REPO_ROOT


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # From a copy of what deploy/Dockerfile's wheel stage copies (tests/dockerfile.py): that set
    # suffices, and no stale build/ folder comes in.
    return installs.build_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="module")
def site(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel installed alone (no dependencies) into a folder of its own, once for the module."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", target, wheel],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return target


def test_everything_installs_under_one_namespace(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"modelyard", wheel.name.split("-py")[0] + ".dist-info"}
    for expected in (
        "modelyard/service/__main__.py",
        "modelyard/sidecar/__main__.py",
        "modelyard/gateway/__main__.py",
        "modelyard/deploy/__main__.py",
        "modelyard/envoy/render.py",
        "modelyard/process/lifecycle.py",
        "modelyard/gateway/static/index.html",
        "modelyard/inference/v1/inference_service_pb2.py",
        # The sources for other languages, as a buf module rooted at modelyard/proto (docs/api.md).
        "modelyard/proto/modelyard/inference/v1/inference_service.proto",
        "modelyard/proto/modelyard/inference/v1/model_service.proto",
        "modelyard/proto/modelyard/inference/v1/tensor.proto",
        "modelyard/proto/modelyard/kserve/v2/grpc_service.proto",
        "modelyard/proto/modelyard/kserve/v2/model_config.proto",
        "modelyard/proto/modelyard/flat/v1/inference.fbs",
        "modelyard/demo/repository/codelm/1/model.onnx",
        "modelyard/demo/repository/classifier/config.yaml",
    ):
        assert expected in names
    shipped = {n.removeprefix("modelyard/proto/") for n in names if n.endswith((".proto", ".fbs"))}
    sources = {str(p.relative_to(REPO_ROOT / "proto")) for p in (REPO_ROOT / "proto/modelyard").rglob("*.*")}
    assert shipped == {s for s in sources if s.endswith((".proto", ".fbs"))}
    assert not [name for name in names if "node_modules" in name or "/web/" in name]


def test_a_process_starts_from_the_wheel_alone(site: Path, tmp_path: Path) -> None:
    target = site
    # The target comes first on the path, ahead of this checkout's editable install.
    probe = (
        "import modelyard, modelyard.envoy.render, modelyard.sidecar.cli; "
        "print(modelyard.__file__); print(modelyard.envoy.render.HERE)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    module_file, render_home = done.stdout.split()
    assert Path(module_file).is_relative_to(target) and Path(render_home).is_relative_to(target)
    helped = subprocess.run(
        [sys.executable, "-m", "modelyard.sidecar", "--help"],
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert helped.returncode == 0 and "--upstream" in helped.stdout, helped.stderr


# Each platform as pip describes it to markers (packaging's default environment, overridden).
PLATFORMS = {
    "linux x86_64": {"sys_platform": "linux", "platform_machine": "x86_64", "platform_system": "Linux"},
    "linux aarch64": {"sys_platform": "linux", "platform_machine": "aarch64", "platform_system": "Linux"},
    "macOS arm64": {"sys_platform": "darwin", "platform_machine": "arm64", "platform_system": "Darwin"},
    "macOS x86_64": {"sys_platform": "darwin", "platform_machine": "x86_64", "platform_system": "Darwin"},
    "windows": {"sys_platform": "win32", "platform_machine": "AMD64", "platform_system": "Windows"},
}


def chosen(wheel: Path, platform: str, extra: str) -> list[Requirement]:
    """What `pip install 'modelyard[extra]'` would take on `platform`, its self-references
    (`modelyard[...]`) followed: the built wheel's own METADATA, markers evaluated as pip does."""
    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        message = email.message_from_bytes(archive.read(metadata))
    taken = []
    for line in message.get_all("Requires-Dist") or []:
        requirement = Requirement(line)
        marker = requirement.marker
        if marker is None or not marker.evaluate({**PLATFORMS[platform], "extra": extra}):
            continue
        if requirement.name == "modelyard":
            taken += [r for inner in sorted(requirement.extras) for r in chosen(wheel, platform, inner)]
        else:
            taken.append(requirement)
    return taken


@pytest.mark.parametrize("platform", sorted(PLATFORMS))
@pytest.mark.parametrize("extra", ["service", "service-cpu", "service-cuda", ""])
def test_each_service_extra_gets_one_pinned_onnxruntime_each_platform(
    wheel: Path, platform: str, extra: str
) -> None:
    # No registry needed (nothing is downloaded here; test_installs.py installs service-cpu and
    # service-cuda for real). onnxruntime-gpu has wheels only for Linux x86_64 among these; plain
    # onnxruntime has them for all. Both provide the `onnxruntime` module: never both at once.
    runtimes = {r.name: r for r in chosen(wheel, platform, extra) if r.name.startswith("onnxruntime")}
    if not extra:
        assert runtimes == {}  # the base install: no ONNX Runtime
        return
    gpu_here = platform == "linux x86_64" and extra != "service-cpu"
    assert set(runtimes) == {"onnxruntime-gpu" if gpu_here else "onnxruntime"}, runtimes
    if extra == "service-cuda" and gpu_here:
        assert [r for r in chosen(wheel, platform, extra) if r.extras == {"cuda", "cudnn"}]
    import onnxruntime

    for runtime in chosen(wheel, platform, extra):
        if runtime.name.startswith("onnxruntime"):
            (pin,) = runtime.specifier
            # The same version on every platform: one ONNX Runtime behaviour to test.
            assert pin.operator == "==" and pin.version == onnxruntime.__version__, runtime


def test_the_installed_command_has_a_version_and_the_demo_models(site: Path, tmp_path: Path) -> None:
    target = site
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}

    def modelyard(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "modelyard.cli", *args]
        return subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)

    version = modelyard("--version")
    assert version.returncode == 0 and version.stdout.split() == ["modelyard", "0.1.0"], version
    made = modelyard("demo-models", "repo")
    assert made.returncode == 0, made.stderr
    assert "--repository repo" in made.stdout
    for name in ("codelm/1/model.onnx", "scaler/2/model.onnx", "classifier/config.yaml"):
        assert (tmp_path / "repo" / name).read_bytes() == (REPO_ROOT / "models/demo" / name).read_bytes()
    again = modelyard("demo-models", "repo")  # models already there are not overwritten
    assert again.returncode == 2 and "already has" in again.stderr
