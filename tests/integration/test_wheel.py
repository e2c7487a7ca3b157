"""The wheel as users install it: one `modelyard` namespace (no top-level `service` or `gateway`),
the processes' packages and data inside it, and a process that starts from the wheel alone."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support import REPO_ROOT


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # From a copy of what deploy/Dockerfile copies: no stale build/ folder, and that set suffices.
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "node_modules", "web")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, source / name)
    for folder in ("proto/python", "service", "sidecar", "gateway", "deploy", "envoy"):
        shutil.copytree(REPO_ROOT / folder, source / folder, symlinks=True, ignore=skip)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", source, "-w", out],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (built,) = out.glob("modelyard-*.whl")
    return built


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
    ):
        assert expected in names
    assert not [name for name in names if "node_modules" in name or "/web/" in name]


def test_a_process_starts_from_the_wheel_alone(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", target, wheel],
        check=True,
        capture_output=True,
        timeout=300,
    )
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
