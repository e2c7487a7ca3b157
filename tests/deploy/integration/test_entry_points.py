"""Each process's command line starts in a child process with only its own dependencies: an
import hook refuses the packages a process must not need (a sidecar or gateway host has no ONNX
Runtime and no numpy)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import REPO_ROOT

# Runs a module as `python -m` does, after installing a finder that refuses some packages (each
# with its submodules).
RUN_REFUSING = """
import runpy, sys

class Refuse:
    def __init__(self, names):
        self.names = names

    def find_spec(self, name, path=None, target=None):
        if any(name == n or name.startswith(n + ".") for n in self.names):
            raise ImportError(f"import of {name} refused: this process must start without it")
        return None

refused = {n for n in sys.argv[1].split(",") if n}
sys.meta_path.insert(0, Refuse(refused))
module, sys.argv = sys.argv[2], [sys.argv[2], *sys.argv[3:]]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""

HEAVY = "onnxruntime,numpy"


def run(refused: str, module: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", RUN_REFUSING, refused, module, *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
    )


def test_the_service_command_starts() -> None:
    result = run("", "modelyard.service", "--help")
    assert result.returncode == 0, result.stderr
    assert "--repository" in result.stdout and "MODELYARD_SERVICE_REPOSITORY" in result.stdout


def test_the_hook_refuses_what_a_process_needs() -> None:
    # The service needs ONNX Runtime: refused, it cannot start. Proves the refusal is real.
    result = run(HEAVY, "modelyard.service", "--help")
    assert result.returncode != 0
    assert "refused: this process must start without it" in result.stderr


def test_the_sidecar_command_starts_without_numpy_onnxruntime_or_the_service() -> None:
    result = run(HEAVY + ",modelyard.service", "modelyard.sidecar", "--help")
    assert result.returncode == 0, result.stderr
    assert "--upstream" in result.stdout and "MODELYARD_SIDECAR_UPSTREAM" in result.stdout


def test_the_gateway_command_starts_without_numpy_onnxruntime_or_the_service() -> None:
    result = run(HEAVY + ",modelyard.service", "modelyard.gateway", "--help")
    assert result.returncode == 0, result.stderr
    assert "--upstream" in result.stdout and "MODELYARD_GATEWAY_UPSTREAM" in result.stdout


@pytest.mark.parametrize(
    ("verb", "option"),
    [("serve", "--repository"), ("sidecar", "--upstream"), ("gateway", "--upstream"), ("up", "--envoy-port")],
)
def test_the_modelyard_command_dispatches_to_each_process(verb: str, option: str) -> None:
    result = run("", "modelyard.cli", verb, "--help")
    assert result.returncode == 0, result.stderr
    assert option in result.stdout


def test_an_unknown_verb_is_a_usage_error() -> None:
    result = run(HEAVY, "modelyard.cli", "fly")
    assert result.returncode == 2 and "unknown command 'fly'" in result.stderr


SHARED_IMPORTS = (
    "import modelyard.cli, modelyard.common.headers, modelyard.common.health, "
    "modelyard.process.lifecycle, modelyard.process.logs, modelyard.process.metrics_http, "
    "modelyard.common.reasons, modelyard.process.settings; "
    "from modelyard.inference.v1 import inference_service_pb2_grpc, model_service_pb2_grpc; "
    "from modelyard.kserve.v2 import grpc_service_pb2_grpc; print('ok')"
)


def test_the_contracts_and_shared_package_need_no_numpy_or_onnxruntime(tmp_path) -> None:
    script = tmp_path / "imports.py"
    script.write_text(SHARED_IMPORTS)
    result = subprocess.run(
        [sys.executable, "-c", RUN_REFUSING, HEAVY, "imports", ""],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
