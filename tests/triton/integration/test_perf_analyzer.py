"""Triton's own load generator, perf_analyzer, drives the service unchanged (metadata, config,
statistics and inference over KServe V2 gRPC). `run_perf_analyzer` is shared with the tests that
run it with other options and through the sidecar."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import nvidia.cuda_runtime


@dataclass(frozen=True)
class PerfRun:
    stdout: str
    requests: int  # the server's statistics, as perf_analyzer reports them
    inferences: int
    executions: int


def run_perf_analyzer(address: str, *options: str, model: str = "classifier") -> PerfRun:
    """A short perf_analyzer run at concurrency 2 against `address`; fails with its output."""
    binary = shutil.which("perf_analyzer", path=str(Path(sys.executable).parent))
    assert binary, "perf_analyzer is missing: `make test` installs tritonclient with it"
    cudart = Path(next(iter(nvidia.cuda_runtime.__path__))) / "lib"
    env = {**os.environ, "LD_LIBRARY_PATH": f"{cudart}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    command = [binary, "-m", model, "-i", "grpc", "-u", address, "--concurrency-range", "2"]
    command += ["--measurement-interval", "500", "--max-trials", "4", "--stability-percentage", "1000"]
    result = subprocess.run([*command, *options], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "throughput:" in result.stdout, result.stdout
    server = result.stdout.split("Server:")[1]

    def count(label: str) -> int:
        found = re.search(rf"{label}: (\d+)", server)
        assert found, f"no {label!r} in perf_analyzer's server statistics:\n{result.stdout}"
        return int(found.group(1))

    return PerfRun(
        result.stdout, count("Successful request count"), count("Inference count"), count("Execution count")
    )


def test_perf_analyzer_measures_the_service(service_process, repository: Path) -> None:
    process = service_process(repository)
    run = run_perf_analyzer(process.address, "-b", "4")
    # Requests of 4 rows; the classifier batches dynamically, so a run may serve both clients'
    # requests at once: the statistics extension counts rows and runs the way Triton does.
    assert run.requests > 0 and run.inferences == 4 * run.requests
    assert 0 < run.executions <= run.requests, run.stdout
    assert process.stop() == 0
