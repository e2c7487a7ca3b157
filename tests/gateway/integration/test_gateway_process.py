"""`python -m modelyard.gateway` as an operator runs it: in a child process that refuses numpy, ONNX Runtime
and the service package, serving the HTTP API over a real service, stopped by SIGTERM."""

from __future__ import annotations

import json
import re
import signal
import sys
import urllib.request
from pathlib import Path

from tests.deploy.integration.test_entry_points import HEAVY, RUN_REFUSING
from tests.support import ServiceProcess, start_child

_SERVING = re.compile(r"serving HTTP on (http://\S+) ")


def test_gateway_process_serves_and_stops_cleanly(repository: Path, service_process) -> None:
    upstream: ServiceProcess = service_process(repository)
    gateway = start_child(
        [
            *(sys.executable, "-c", RUN_REFUSING, HEAVY + ",modelyard.service", "modelyard.gateway"),
            *("--listen", "127.0.0.1:0"),
        ],
        _SERVING,
        "gateway",
        env={"MODELYARD_GATEWAY_UPSTREAM": upstream.address, "PATH": "/usr/bin:/bin"},
    )
    try:
        with urllib.request.urlopen(gateway.ready.group(1) + "/v1/models", timeout=10) as response:
            listed = json.load(response)
        assert {m["id"] for m in listed["data"]} >= {"classifier", "scaler"}
        assert gateway.stop(signal.SIGTERM) == 0, "\n".join(gateway.log)
    finally:
        if gateway.proc.poll() is None:
            gateway.stop(signal.SIGKILL)
