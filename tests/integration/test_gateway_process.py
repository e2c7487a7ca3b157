"""`python -m gateway` as an operator runs it: in a child process that refuses numpy, ONNX Runtime
and the service package, serving the HTTP API over a real service, stopped by SIGTERM."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

from tests.integration.test_entry_points import HEAVY, RUN_REFUSING
from tests.support import REPO_ROOT, ServiceProcess

_SERVING = re.compile(r"serving HTTP on (http://\S+) ")


def test_gateway_process_serves_and_stops_cleanly(repository: Path, service_process) -> None:
    upstream: ServiceProcess = service_process(repository)
    proc = subprocess.Popen(
        [sys.executable, "-c", RUN_REFUSING, HEAVY + ",service", "gateway", "--listen", "127.0.0.1:0"],
        env={"MODELYARD_GATEWAY_UPSTREAM": upstream.address, "PATH": "/usr/bin:/bin"},
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        cwd=REPO_ROOT,
    )
    lines: list[str] = []
    found = threading.Event()
    url: list[str] = []

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if not url and (m := _SERVING.search(line)):
                url.append(m.group(1))
                found.set()
        found.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        assert found.wait(60) and url, "".join(lines)
        with urllib.request.urlopen(url[0] + "/v1/models", timeout=10) as response:
            listed = json.load(response)
        assert {m["id"] for m in listed["data"]} >= {"classifier", "scaler"}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
