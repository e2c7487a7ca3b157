"""Triton's own load generator, perf_analyzer, drives the service unchanged (metadata, config,
statistics and inference over KServe V2 gRPC)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nvidia.cuda_runtime


def perf_analyzer() -> tuple[str, dict[str, str]]:
    binary = shutil.which("perf_analyzer", path=str(Path(sys.executable).parent))
    assert binary, "perf_analyzer is missing: `make test` installs tritonclient with it"
    cudart = Path(next(iter(nvidia.cuda_runtime.__path__))) / "lib"
    env = {**os.environ, "LD_LIBRARY_PATH": f"{cudart}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    return binary, env


def test_perf_analyzer_measures_the_service(service_process, repository: Path) -> None:
    process = service_process(repository)
    binary, env = perf_analyzer()
    result = subprocess.run(
        [
            binary,
            "-m",
            "classifier",
            "-i",
            "grpc",
            "-u",
            process.address,
            "-b",
            "4",
            "--concurrency-range",
            "2",
            "--measurement-interval",
            "500",
            "--max-trials",
            "4",
            "--stability-percentage",
            "1000",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    server = result.stdout.split("Server:")[1]
    inferences = int(re.search(r"Inference count: (\d+)", server).group(1))
    executions = int(re.search(r"Execution count: (\d+)", server).group(1))
    requests = int(re.search(r"Successful request count: (\d+)", server).group(1))
    # Requests of 4 rows; the classifier batches dynamically, so a run may serve both clients'
    # requests at once: the statistics extension counts rows and runs the way Triton does.
    assert requests > 0 and inferences == 4 * requests and 0 < executions <= requests
    assert "throughput:" in result.stdout
    assert process.stop() == 0
