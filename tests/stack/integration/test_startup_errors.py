"""A start that cannot work ends with exit status 2 and one line on stderr naming the flag, its
environment variable and the value, no traceback: a taken port, an address that is not HOST:PORT,
a repository folder that is not there. Real processes, started as an operator starts them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest

from modelyard.process.lifecycle import Process, run_process
from tests.support import REPO_ROOT

# (process, prog, env prefix): run as python -m modelyard.<process>
PROCESSES = {
    "service": ("service", "modelyard serve", "MODELYARD_SERVICE_"),
    "sidecar": ("sidecar", "modelyard sidecar", "MODELYARD_SIDECAR_"),
    "gateway": ("gateway", "modelyard gateway", "MODELYARD_GATEWAY_"),
}


def run(
    module: str, *args: str, env: Mapping[str, str] | None = None, cwd: Path = REPO_ROOT
) -> subprocess.CompletedProcess[str]:
    """The process's exit, bounded: one that starts serving instead is killed and the test fails."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("MODELYARD_")}
    # From another folder `python -m` finds `models` through the path, and modelyard as this process
    # does (the editable install, or a link tree first on PYTHONPATH: bench/lib/trees.py).
    base["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return subprocess.run(
        [sys.executable, "-m", f"modelyard.{module}", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env={**base, **(env or {})},
    )


def assert_one_line(result: subprocess.CompletedProcess[str], *named: str) -> str:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for text in named:
        assert text in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port on 127.0.0.1 that a socket of the test listens on."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    folder = tmp_path / "models"
    folder.mkdir()
    return folder


@pytest.mark.parametrize(
    ("process", "flag", "others"),
    [
        ("service", "--listen", ["--metrics-listen", ""]),
        ("service", "--metrics-listen", ["--listen", "127.0.0.1:0"]),
        ("sidecar", "--listen", ["--admin-listen", ""]),
        ("sidecar", "--admin-listen", ["--listen", "127.0.0.1:0"]),
        ("gateway", "--listen", []),
    ],
)
def test_a_taken_port_is_named(
    process: str, flag: str, others: list[str], taken_port: int, repository: Path
) -> None:
    module, prog, prefix = PROCESSES[process]
    extra = ["--repository", str(repository)] if process == "service" else []
    address = f"127.0.0.1:{taken_port}"
    result = run(module, *extra, *others, flag, address)
    env = prefix + flag[2:].replace("-", "_").upper()
    line = assert_one_line(result, f"{prog}: error:", flag, env, repr(address))
    assert "in use" in line


@pytest.mark.parametrize("process", sorted(PROCESSES))
def test_an_address_that_is_not_host_port_is_named(process: str, repository: Path) -> None:
    module, prog, prefix = PROCESSES[process]
    extra = ["--repository", str(repository)] if process == "service" else []
    result = run(module, *extra, "--listen", "garbage")
    assert_one_line(result, f"{prog}: error:", "--listen", f"{prefix}LISTEN", "'garbage'", "HOST:PORT")


@pytest.mark.parametrize("process", sorted(PROCESSES))
def test_an_address_from_the_environment_is_checked_too(process: str, repository: Path) -> None:
    module, prog, prefix = PROCESSES[process]
    extra = ["--repository", str(repository)] if process == "service" else []
    result = run(module, *extra, env={f"{prefix}LISTEN": "127.0.0.1:65536"})
    assert_one_line(result, f"{prog}: error:", f"{prefix}LISTEN", "--listen", "'127.0.0.1:65536'")


def test_a_missing_repository_is_named() -> None:
    result = run("service", "--repository", "/nonexistent", "--listen", "127.0.0.1:0")
    assert_one_line(
        result,
        "modelyard serve: error:",
        "--repository",
        "MODELYARD_SERVICE_REPOSITORY",
        "'/nonexistent'",
        "modelyard demo-models DIR",
    )


def test_the_default_repository_missing_says_how_to_get_models(tmp_path: Path) -> None:
    # As an installed service started in a folder without models/demo (the wheel ships it as data).
    result = run("service", "--listen", "127.0.0.1:0", cwd=tmp_path)
    assert_one_line(
        result, "--repository", "MODELYARD_SERVICE_REPOSITORY", "'models/demo'", "modelyard demo-models DIR"
    )


def test_the_stack_checks_its_addresses() -> None:
    result = run("deploy", "--gateway-listen", "garbage")
    assert_one_line(result, "modelyard up: error:", "--gateway-listen", "MODELYARD_UP_GATEWAY_LISTEN")


def _service(address: str, flag: str, repository: Path) -> Process:
    from modelyard.service.server import build_service
    from modelyard.service.settings import parse_settings

    others = {"--listen": "127.0.0.1:0", "--metrics-listen": ""}
    args = [*(x for k, v in others.items() if k != flag for x in (k, v)), flag, address]
    return build_service(parse_settings(["--repository", str(repository), *args], {}))


def _supervisor(address: str, flag: str, repository: Path) -> Process:
    from modelyard.service.settings import parse_settings
    from modelyard.service.workers.supervisor import Supervisor

    args = ["--repository", str(repository), "--metrics-listen", "", flag, address]
    return Supervisor(parse_settings(args, {}), 2)


def _sidecar(address: str, flag: str, repository: Path) -> Process:
    from modelyard.sidecar.server import build_sidecar
    from modelyard.sidecar.settings import parse_settings

    others = {"--listen": "127.0.0.1:0", "--admin-listen": ""}
    args = [*(x for k, v in others.items() if k != flag for x in (k, v)), flag, address]
    return build_sidecar(parse_settings(args, {}))


def _gateway(address: str, flag: str, repository: Path) -> Process:
    from modelyard.gateway.app import build_gateway
    from modelyard.gateway.settings import parse_settings

    return build_gateway(parse_settings([flag, address], {}))


@pytest.mark.parametrize(
    ("process", "flag", "build"),
    [
        ("service", "--listen", _service),
        ("service", "--metrics-listen", _service),
        ("service", "--listen", _supervisor),
        ("sidecar", "--listen", _sidecar),
        ("sidecar", "--admin-listen", _sidecar),
        ("gateway", "--listen", _gateway),
    ],
)
async def test_a_bind_that_fails_after_the_check_is_named_too(
    process: str,
    flag: str,
    build: Callable[[str, str, Path], Process],
    taken_port: int,
    repository: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The port taken between the check and the bind: the servers' own failure, one line too.
    _, prog, prefix = PROCESSES[process]
    address = f"127.0.0.1:{taken_port}"
    code = await run_process(lambda: build(address, flag, repository), process, 0.0, prog)
    assert code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    env = prefix + flag[2:].replace("-", "_").upper()
    (line,) = [line for line in err.splitlines() if "error:" in line]
    assert line.startswith(f"{prog}: error: argument {flag}: cannot listen on {address!r}: "), line
    assert line.endswith(f"(env {env})"), line
