"""The whole stack as `make up` runs it (python -m modelyard.deploy: service, sidecar, gateway, Envoy), on
ephemeral or chosen loopback ports, for the benchmarks that go through the chain."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.lib.trees import pythonpath
from bench.processes import start_announced
from modelyard.process import children

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A loopback port that was free a moment ago (for listeners whose address `deploy` prints as
    given: the metrics and admin ports)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Stack:
    """`python -m modelyard.deploy` in a child process: the addresses read from what it prints, stopped by
    SIGINT (the supervisor then stops its children in order), killed if it hangs."""

    def __init__(self, *args: str, metrics: bool = False, tree: Path = ROOT) -> None:
        """The stack from `tree`'s code (its code first on PYTHONPATH; default this one)."""
        cmd = [sys.executable, "-m", "modelyard.deploy", "--service-listen", "127.0.0.1:0"]
        self.service_metrics = f"127.0.0.1:{free_port()}" if metrics else ""
        self.sidecar_admin = f"127.0.0.1:{free_port()}" if metrics else ""
        cmd += ["--service-metrics", self.service_metrics, "--sidecar-admin", self.sidecar_admin]
        cmd += ["--sidecar-listen", "127.0.0.1:0", "--gateway-listen", "127.0.0.1:0"]
        cmd += ["--envoy-port", "0", "--envoy-admin-port", "0", *args]
        env = dict(os.environ, PYTHONPATH=pythonpath(tree)) if tree != ROOT else None
        self.proc: subprocess.Popen[str] = children.popen(
            cmd,
            cwd=tree,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            own_session=True,
        )
        self.lines: list[str] = []
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("  service "):
                break
        text = "".join(self.lines)
        if "Modelyard is up" not in text:
            self.stop()
            raise RuntimeError("the stack did not come up:\n" + text)
        self.edge = _find(r"browser page\s+(http://\S+)/", text)
        self.gateway = _find(r"gateway\s+(http://\S+)", text)
        self.service = _find(r"service\s+(\S+)", text)
        found = re.search(r"\(Envoy\), (\S+) \(sidecar\)", text)
        self.sidecar = found.group(1) if found else None

    def pid_of(self, process: str) -> int:
        """The pid of one of the supervisor's children: `service`, `sidecar` or `gateway`."""
        for line in subprocess.run(
            ["ps", "-o", "pid=,args=", "--ppid", str(self.proc.pid)], capture_output=True, text=True
        ).stdout.splitlines():
            if f"-m modelyard.{process} " in line + " ":
                return int(line.split()[0])
        raise RuntimeError(f"{process} process not found")

    def gateway_pid(self) -> int:
        return self.pid_of("gateway")

    def stop(self) -> None:
        children.stop(self.proc, signal.SIGINT, grace_s=60)


def _find(pattern: str, text: str) -> str:
    found = re.search(pattern, text)
    assert found, pattern
    return found.group(1)


class Gateway:
    """One more gateway process beside the stack's (`python -m modelyard.gateway`), from `tree`'s
    code (first on PYTHONPATH) and with extra `flags`, calling `upstream`: a hop of its own to
    measure (gateway -> service), or the same hop from another tree or with other flags, taking
    turns with the stack's in one run."""

    def __init__(self, upstream: str, tree: Path = ROOT, flags: Sequence[str] = ()) -> None:
        env = dict(os.environ, PYTHONPATH=pythonpath(tree))
        cmd = [sys.executable, "-m", "modelyard.gateway", "--listen", "127.0.0.1:0", "--upstream", upstream]
        self.proc, self.url = start_announced(
            [*cmd, *flags], tree, env, r"serving HTTP on (http://\S+)", f"the gateway from {tree}"
        )
        self.pid = self.proc.pid

    def stop(self) -> None:
        children.stop(self.proc, signal.SIGTERM, grace_s=30)
