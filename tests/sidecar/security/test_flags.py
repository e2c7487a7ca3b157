"""The sidecar's address-like flags, bad: `--upstream garbage` (or a port out of range, no host, a
version label that breaks the name rule; from the flag or MODELYARD_SIDECAR_UPSTREAM), like a bad
--listen or --admin-listen, ends with exit 2 and one line naming the flag, its variable and the
value, never a traceback. Real processes, as an operator starts them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support import REPO_ROOT


def sidecar_exit(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MODELYARD_")}
    return subprocess.run(
        [sys.executable, "-m", "modelyard.sidecar", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
        env={**base, **(env or {})},
    )


def one_line(result: subprocess.CompletedProcess[str], *named: str) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    for words in named:
        assert words in lines[0], lines[0]
    return lines[0]


BAD_UPSTREAMS = [
    "garbage",
    "127.0.0.1",
    ":50052",
    "127.0.0.1:",
    "127.0.0.1:99999",
    "127.0.0.1:0",
    "h:x1",
    "h:1@../v",
    "h:1@",
    "h:1@1+",
]


@pytest.mark.parametrize("upstream", BAD_UPSTREAMS)
def test_a_bad_upstream_is_one_line_and_exit_2(upstream: str) -> None:
    result = sidecar_exit("--listen", "127.0.0.1:0", "--admin-listen", "", "--upstream", upstream)
    one_line(result, "modelyard sidecar: error:", "--upstream", "MODELYARD_SIDECAR_UPSTREAM", repr(upstream))


def test_a_bad_upstream_among_good_ones_and_from_the_environment_too() -> None:
    args = ["--listen", "127.0.0.1:0", "--admin-listen", ""]
    result = sidecar_exit(*args, "--upstream", "127.0.0.1:50052", "--upstream", "garbage")
    one_line(result, "--upstream", "'garbage'")
    env = {"MODELYARD_SIDECAR_UPSTREAM": "127.0.0.1:50052,garbage"}
    one_line(sidecar_exit(*args, env=env), "MODELYARD_SIDECAR_UPSTREAM", "'garbage'")
    one_line(sidecar_exit(*args, env={"MODELYARD_SIDECAR_UPSTREAM": " , "}), "no upstream")


@pytest.mark.parametrize("flag", ["--listen", "--admin-listen"])
@pytest.mark.parametrize("address", ["garbage", "127.0.0.1:65536", ":1"])
def test_a_bad_listen_address_is_one_line_and_exit_2(flag: str, address: str) -> None:
    others = {"--listen": "127.0.0.1:0", "--admin-listen": ""}
    args = [x for name, value in others.items() if name != flag for x in (name, value)]
    result = sidecar_exit(*args, "--upstream", "127.0.0.1:50052", flag, address)
    env = "MODELYARD_SIDECAR_" + flag[2:].replace("-", "_").upper()
    one_line(result, flag, env, repr(address))
