"""Triton's own example clients, run unchanged as a Triton user runs them: the gRPC ones against the
service and through the sidecar, the HTTP ones through the gateway (gateway -> sidecar -> service),
on ONNX stand-ins of the models they expect (tests/triton_models.py).

The clients are NVIDIA's (github.com/triton-inference-server/client, src/python/examples, BSD-3),
copied into tests/triton_examples/ with their license headers and not edited: from the client
repository's commit 58a44caa, except simple_grpc_model_control.py, taken from before 3b3690bd (which
added a check that Triton answers an over-long file name INTERNAL; this server answers it
INVALID_ARGUMENT, the code Triton's own TODO there says is right). The sequence, decoupled
(custom_repeat) and CUDA shared-memory clients are not here: the first two are another part of
issue 38, the last need a GPU. memory_growth_test.py, which has no address flag, runs on Triton's own
ports in a network namespace of its own (the last test).

The service runs as Triton's examples expect the server: `--server-name triton` (the health and
metadata clients check the name), management open (they register shared memory, load and unload),
and for the model-control clients explicit model control with nothing loaded at start."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from models.demo_models import write_model
from tests import triton_models
from tests.sidecar_support import SidecarProcess, start_sidecar_process
from tests.support import REPO_ROOT, ChildProcess, ServiceProcess, start_child, start_service_process

EXAMPLES = REPO_ROOT / "tests" / "triton_examples"
_GATEWAY_SERVING = re.compile(r"serving HTTP on http://(\S+) ")
EXAMPLE_TIMEOUT_S = 120.0

pytestmark = pytest.mark.timeout(300)


@dataclass
class Stack:
    service: ServiceProcess
    sidecar: SidecarProcess
    gateway: ChildProcess
    images: Path  # red.png, blue.png: for the image clients (Pillow reads them)
    ppm: Path  # a folder of PPM images: the ensemble's preprocessing step reads them

    def grpc(self, target: str) -> str:
        return self.service.address if target == "service" else self.sidecar.address

    @property
    def http(self) -> str:
        return self.gateway.ready.group(1)

    def stop(self) -> None:
        for process in (self.gateway, self.sidecar, self.service):
            if process.proc.poll() is None:
                process.stop()


def start_stack(root: Path, *service_args: str) -> tuple[ServiceProcess, SidecarProcess, ChildProcess]:
    service = start_service_process(root, "--server-name", "triton", "--management-open", *service_args)
    try:
        sidecar = start_sidecar_process("--upstream", service.address)
    except BaseException:
        service.stop()
        raise
    try:
        gateway = start_child(
            [sys.executable, "-m", "modelyard.gateway", "--listen", "127.0.0.1:0"],
            _GATEWAY_SERVING,
            "gateway",
            env={
                **{k: v for k, v in os.environ.items() if not k.startswith("MODELYARD_")},
                "MODELYARD_GATEWAY_UPSTREAM": sidecar.address,
            },
        )
    except BaseException:
        sidecar.stop()
        service.stop()
        raise
    return service, sidecar, gateway


def write_images(folder: Path) -> tuple[Path, Path]:
    from PIL import Image

    images, ppm = folder / "images", folder / "ppm"
    images.mkdir()
    ppm.mkdir()
    for name, rgb in (("red", (230, 20, 10)), ("blue", (15, 30, 220))):
        Image.new("RGB", (32, 24), rgb).save(images / f"{name}.png")
        (ppm / f"{name}.ppm").write_bytes(triton_models.ppm(rgb))
    return images, ppm


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    folder = tmp_path_factory.mktemp("triton_examples")
    root = folder / "models"
    triton_models.write_example_repository(root)
    images, ppm = write_images(folder)
    running = Stack(*start_stack(root), images, ppm)
    try:
        yield running
    finally:
        running.stop()


def run(example: str, *args: str) -> str:
    """Run the example as its README says; its output, once it exited 0. tritonclient 2.41's
    shared-memory helpers import pkg_resources, which setuptools no longer ships: a stand-in
    for its one function is on the examples' path (tests/triton_examples/shim)."""
    path = os.pathsep.join(p for p in (str(EXAMPLES / "shim"), os.environ.get("PYTHONPATH", "")) if p)
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{example}.py"), *args],
        capture_output=True,
        text=True,
        timeout=EXAMPLE_TIMEOUT_S,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": path},
    )
    assert done.returncode == 0, (
        f"{example} {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    )
    return done.stdout


GRPC_EXAMPLES = [
    "grpc_client",
    "grpc_explicit_byte_content_client",
    "grpc_explicit_int8_content_client",
    "grpc_explicit_int_content_client",
    "simple_grpc_aio_infer_client",
    "simple_grpc_async_infer_client",
    "simple_grpc_custom_args_client",
    "simple_grpc_health_metadata",
    "simple_grpc_infer_client",
    "simple_grpc_keepalive_client",
    "simple_grpc_shm_client",
    "simple_grpc_shm_string_client",
    "simple_grpc_string_infer_client",
]
HTTP_EXAMPLES = [
    "simple_http_aio_infer_client",
    "simple_http_async_infer_client",
    "simple_http_health_metadata",
    "simple_http_infer_client",
    "simple_http_shm_client",
    "simple_http_shm_string_client",
    "simple_http_string_infer_client",
]


def passes(example: str) -> bool:
    """Whether the example prints PASS at its end (the others exit non-zero on any mismatch)."""
    return 'print("PASS' in (EXAMPLES / f"{example}.py").read_text()


@pytest.mark.parametrize("target", ["service", "sidecar"])
@pytest.mark.parametrize("example", GRPC_EXAMPLES)
def test_grpc_examples(stack: Stack, example: str, target: str) -> None:
    out = run(example, "-u", stack.grpc(target))
    if passes(example):
        assert "PASS" in out, out


@pytest.mark.parametrize("example", HTTP_EXAMPLES)
def test_http_examples_through_the_gateway(stack: Stack, example: str) -> None:
    out = run(example, "-u", stack.http)
    if passes(example):
        assert "PASS" in out, out


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_reuse_infer_objects(stack: Stack, protocol: str) -> None:
    urls = [stack.service.address, stack.sidecar.address] if protocol == "grpc" else [stack.http]
    for url in urls:
        out = run("reuse_infer_objects_client", "-i", protocol, "-u", url)
        assert "======== SHARED_MEMORY ========" in out and "======== NO_SHARED_MEMORY ========" in out


def classes(out: str) -> list[str]:
    """The labels the image clients print, in order ("    2.0 (0) = red")."""
    return re.findall(r"^\s+\S+ \(\d+\) = (\w+)$", out, re.MULTILINE)


@pytest.mark.parametrize("target", ["service", "sidecar", "gateway"])
def test_ensemble_image_client(stack: Stack, target: str) -> None:
    """Two images (sorted by name: blue, red) in one batch through the two-step ensemble, the top
    class of each by the classification extension, with the ensemble output's labels."""
    protocol, url = ("http", stack.http) if target == "gateway" else ("grpc", stack.grpc(target))
    out = run("ensemble_image_client", "-i", protocol, "-u", url, "-c", "1", str(stack.ppm))
    assert classes(out) == ["blue", "red"], out
    assert out.rstrip().endswith("PASS")


@pytest.mark.parametrize("target", ["service", "sidecar", "gateway"])
def test_image_client_on_an_nhwc_classifier(stack: Stack, target: str) -> None:
    """image_client.py reads the input's FORMAT_NHWC from the model config and lays the image out
    so; its variants: a batch of two, async requests, the gRPC stream."""
    protocol, url = ("http", stack.http) if target == "gateway" else ("grpc", stack.grpc(target))
    base = ["-m", "image_classifier", "-s", "NONE", "-i", protocol, "-u", url]
    assert classes(run("image_client", *base, "-c", "1", str(stack.images / "red.png"))) == ["red"]
    two = run("image_client", *base, "-c", "2", "-b", "2", str(stack.images))
    assert classes(two)[::2] == ["blue", "red"], two  # two classes each, the first the top one
    assert classes(run("image_client", *base, "-a", str(stack.images / "blue.png"))) == ["blue"]
    if protocol == "grpc":
        assert classes(run("image_client", *base, "--streaming", str(stack.images / "red.png"))) == ["red"]
        raw = run(
            "grpc_image_client",
            "-m",
            "image_classifier",
            "-s",
            "NONE",
            "-u",
            url,
            str(stack.images / "blue.png"),
        )
        assert classes(raw) == ["blue"], raw


def test_model_control_in_explicit_mode(tmp_path: Path) -> None:
    """The model-control clients, against a service in explicit mode that loads nothing at start:
    the repository index lists its models (eight for the gRPC client, seven for the HTTP one, as
    each counts), a bad config override fails "failed to load", a good one applies, an unknown
    model fails "failed to load"."""
    eight = tmp_path / "eight"
    triton_models.write_example_repository(eight)
    service, sidecar, gateway = start_stack(eight, "--control-mode", "explicit")
    try:
        for url in (service.address, sidecar.address):
            assert "PASS: model control" in run("simple_grpc_model_control", "-u", url)
    finally:
        for process in (gateway, sidecar, service):
            process.stop()
    seven = tmp_path / "seven"
    triton_models.write_example_repository(seven)
    (seven / "densenet_onnx" / "config.yaml").unlink(missing_ok=True)
    for path in sorted((seven / "densenet_onnx").rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    (seven / "densenet_onnx").rmdir()
    service, sidecar, gateway = start_stack(seven, "--control-mode", "explicit")
    try:
        assert "PASS: model control" in run("simple_http_model_control", "-u", gateway.ready.group(1))
    finally:
        for process in (gateway, sidecar, service):
            process.stop()


def test_memory_growth_test_on_triton_s_own_ports(tmp_path: Path) -> None:
    """memory_growth_test.py has no address flag: it calls localhost:8001 (gRPC) and :8000 (HTTP).
    It runs in a network namespace of its own (`unshare --net`, as root in CI), where those ports
    are the sidecar's and the gateway's and nothing else's (tests/triton_examples_netns.py)."""
    if subprocess.run(["unshare", "--net", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare --net is not permitted here (it needs root or user namespaces)")
    root = tmp_path / "models"
    write_model(
        root, "custom_identity_int32", 1, triton_models.custom_identity_int32(), {"max_batch_size": 8}
    )
    done = subprocess.run(
        ["unshare", "--net", sys.executable, "-m", "tests.triton_examples_netns", str(root)],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=REPO_ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (
        "memory_growth_test -i grpc: exit 0" in done.stdout
        and "memory_growth_test -i http: exit 0" in done.stdout
    )
