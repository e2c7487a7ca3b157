"""perf_analyzer's Triton options against the service: batch 8, streaming, system shared memory."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.integration.test_perf_analyzer import perf_analyzer


def measure(address: str, *options: str) -> tuple[str, int, int]:
    binary, env = perf_analyzer()
    result = subprocess.run(
        [
            binary,
            "-m",
            "classifier",
            "-i",
            "grpc",
            "-u",
            address,
            "--concurrency-range",
            "2",
            "--measurement-interval",
            "500",
            "--max-trials",
            "4",
            "--stability-percentage",
            "1000",
            *options,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    server = result.stdout.split("Server:")[1]
    requests = int(re.search(r"Successful request count: (\d+)", server).group(1))
    inferences = int(re.search(r"Inference count: (\d+)", server).group(1))
    return result.stdout, requests, inferences


@pytest.mark.parametrize(
    "options",
    [
        pytest.param(("-b", "8"), id="batch-8"),
        pytest.param(("-b", "8", "--streaming"), id="streaming"),
        pytest.param(("-b", "8", "--shared-memory", "system"), id="shared-memory-system"),
    ],
)
def test_perf_analyzer_options(service_process, repository: Path, options: tuple[str, ...]) -> None:
    process = service_process(repository)
    stdout, requests, inferences = measure(process.address, *options)
    assert requests > 0 and inferences == 8 * requests, stdout
    assert "throughput:" in stdout
    assert process.stop() == 0
    assert not [line for line in process.log if "Traceback" in line], process.log[-20:]
