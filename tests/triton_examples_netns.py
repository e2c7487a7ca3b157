"""Triton's memory_growth_test.py, unchanged, in a network namespace of its own: the client has no
address flag (it calls localhost:8001 over gRPC and localhost:8000 over HTTP, Triton's default
ports), so this script, run by `unshare --net` (tests/triton/integration/test_triton_examples.py), brings up
the namespace's loopback and serves those two ports there, where nothing else listens: the sidecar
on 8001 in front of the service, the gateway on 8000 in front of the sidecar. It runs the client
over both protocols and stops every process it started; it exits with the first client's failure.

    python -m tests.triton_examples_netns REPOSITORY
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.sidecar_support import start_sidecar_process
from tests.support import REPO_ROOT, ChildProcess, start_child, start_service_process

EXAMPLE = REPO_ROOT / "tests" / "triton_examples" / "memory_growth_test.py"
_GATEWAY_SERVING = re.compile(r"serving HTTP on http://(\S+) ")


def main(repository: Path) -> int:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    started: list[ChildProcess] = []
    try:
        service = start_service_process(repository)
        started.append(service)
        sidecar = start_sidecar_process("--listen", "127.0.0.1:8001", "--upstream", service.address)
        started.append(sidecar)
        environ = {k: v for k, v in os.environ.items() if not k.startswith("MODELYARD_")}
        gateway = start_child(
            [sys.executable, "-m", "modelyard.gateway", "--listen", "127.0.0.1:8000"],
            _GATEWAY_SERVING,
            "gateway",
            env={**environ, "MODELYARD_GATEWAY_UPSTREAM": sidecar.address},
        )
        started.append(gateway)
        for protocol in ("grpc", "http"):
            done = subprocess.run(
                [sys.executable, str(EXAMPLE), "-i", protocol], capture_output=True, text=True, timeout=120
            )
            print(
                f"memory_growth_test -i {protocol}: exit {done.returncode}\n{done.stdout}{done.stderr}",
                flush=True,
            )
            if done.returncode != 0:
                return done.returncode
        return 0
    finally:
        for process in reversed(started):
            if process.proc.poll() is None:
                process.stop()


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
