"""NVIDIA's own example clients for stateful (sequence) and decoupled models, run unmodified
(tests/triton_examples/, copied from triton-inference-server/client under its BSD license) as a
Triton user runs them: against the service, through the sidecar (gRPC ones) and through the
gateway (the HTTP one, gateway -> sidecar -> service), on our builds of the models they expect
(tests/sequence_models.py). A client passes when it prints its PASS line and exits 0; each checks
every response of its sequences against Triton's expected values itself.

`-d` runs the dynamic (oldest strategy) variants: simple_dyna_sequence (CORRID UINT64, END) and
simple_string_dyna_sequence (a string correlation id, implicit state). `-o` gives each run its own
sequence ids, so a run cannot pass on another's sequences.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.sequence_models import write_triton_models
from tests.sidecar_support import start_sidecar_process
from tests.support import REPO_ROOT, ChildProcess, start_child, start_service_process

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tritonclient") is None, reason="tritonclient is not installed"
)

EXAMPLES = REPO_ROOT / "tests" / "triton_examples"
_GATEWAY_SERVING = re.compile(r"serving HTTP on http://(\S+) ")


@dataclass
class Stack:
    service: str
    sidecar: str
    gateway: str


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    repository = write_triton_models(tmp_path_factory.mktemp("triton_examples") / "models")
    service = start_service_process(repository)
    started: list[ChildProcess] = [service]
    try:
        sidecar = start_sidecar_process("--upstream", service.address)
        started.append(sidecar)
        gateway = start_child(
            [sys.executable, "-m", "modelyard.gateway", "--listen", "127.0.0.1:0"],
            _GATEWAY_SERVING,
            "gateway",
            env={"MODELYARD_GATEWAY_UPSTREAM": sidecar.address, "PATH": "/usr/bin:/bin"},
        )
        started.append(gateway)
        yield Stack(service.address, sidecar.address, gateway.ready.group(1))
    finally:
        for child in reversed(started):
            if child.proc.poll() is None:
                child.stop()


def run_example(script: str, url: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(EXAMPLES / script), "-u", url, *args],
        cwd=EXAMPLES,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def passed(process: subprocess.Popen[str], pass_line: str, timeout: float = 120) -> str:
    output, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0 and pass_line in output, output
    return output


GRPC_SEQUENCE_CLIENTS = [
    ("simple_grpc_sequence_stream_infer_client.py", "PASS: Sequence"),
    ("simple_grpc_sequence_sync_infer_client.py", "PASS: Sequence"),
    ("simple_grpc_aio_sequence_stream_infer_client.py", "PASS: grpc aio sequence stream"),
]


@pytest.mark.parametrize("via", ["service", "sidecar"])
@pytest.mark.parametrize("dyna", [False, True], ids=["direct", "dyna"])
@pytest.mark.parametrize(("script", "pass_line"), GRPC_SEQUENCE_CLIENTS, ids=lambda v: v.split("_client")[0])
def test_grpc_sequence_clients_pass_unmodified(
    stack: Stack, script: str, pass_line: str, via: str, dyna: bool, request: pytest.FixtureRequest
) -> None:
    url = stack.service if via == "service" else stack.sidecar
    offset = str(_offsets.setdefault(request.node.name, len(_offsets) + 1))
    output = passed(run_example(script, url, *(["-d"] if dyna else []), "-o", offset), pass_line)
    # The first line of results: START's output, Triton's expected values (1 : 101 : 21, or with
    # the dynamic models 1 : 101 : 20), not the 0 : 100 : 20 a server that ignores sequences gives.
    assert ("[0] 1 : 101 : 20" if dyna else "[0] 1 : 101 : 21") in output


def test_http_sequence_client_passes_through_the_gateway(stack: Stack) -> None:
    plain = run_example("simple_http_sequence_sync_infer_client.py", stack.gateway, "-o", "40")
    dyna = run_example("simple_http_sequence_sync_infer_client.py", stack.gateway, "-d", "-o", "41")
    assert "[0] 1 : 101 : 21" in passed(plain, "PASS: Sequence")
    assert "[0] 1 : 101 : 20" in passed(dyna, "PASS: Sequence")


def test_custom_repeat_client_passes_on_the_service_and_through_the_sidecar(stack: Stack) -> None:
    # Ten responses a second apart each (the example's DELAY of 1000 ms): both runs at once.
    direct = run_example("simple_grpc_custom_repeat.py", stack.service)
    proxied = run_example("simple_grpc_custom_repeat.py", stack.sidecar)
    for process in (direct, proxied):
        output = passed(process, "PASS: Decoupled API")
        assert [line for line in output.splitlines() if " : " in line] == [
            f"{value} : {value}" for value in range(100, 110)
        ]


_offsets: dict[str, int] = {}


def test_examples_are_unmodified_copies() -> None:
    """The copies carry NVIDIA's license header and nothing of ours."""
    for path in sorted(Path(EXAMPLES).glob("*.py")):
        text = path.read_text()
        assert "NVIDIA CORPORATION" in text.splitlines()[1], path
        assert "modelyard" not in text, path
