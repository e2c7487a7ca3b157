"""perf_analyzer's Triton options against the service: batch 8, streaming, system shared memory."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.triton.integration.test_perf_analyzer import run_perf_analyzer


@pytest.mark.parametrize(
    "options",
    [
        pytest.param(("-b", "8"), id="batch-8"),
        pytest.param(("-b", "8", "--streaming"), id="streaming"),
        pytest.param(("-b", "8", "--shared-memory", "system"), id="shared-memory-system"),
    ],
)
def test_perf_analyzer_options(service_process, repository: Path, options: tuple[str, ...]) -> None:
    # perf_analyzer registers its shared memory without a credential: management open, as for Triton.
    process = service_process(repository, *(["--management-open"] if "--shared-memory" in options else []))
    run = run_perf_analyzer(process.address, *options)
    assert run.requests > 0 and run.inferences == 8 * run.requests, run.stdout
    assert process.stop() == 0
