"""Servers in child processes for the benchmarks: started, their port read from their log,
stopped for sure (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

from modelyard.process import children

ROOT = Path(__file__).resolve().parent.parent
SERVICE_READY = re.compile(r"serving gRPC on [^\s;,]+:(\d+)")
SIDECAR_READY = r"sidecar serving gRPC on ([^\s;,]+)"  # its address
CLK_TCK = os.sysconf("SC_CLK_TCK")


def start_announced(
    argv: Sequence[str], tree: Path, env: dict[str, str], ready: str, what: str
) -> tuple[subprocess.Popen[str], str]:
    """A bench child run from `tree` that says on stderr, by matching `ready` (one group: its
    address), that it serves; the process and that address. One that does not say so within 60 s
    is stopped, and raises."""
    proc: subprocess.Popen[str] = children.popen(
        list(argv), cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    assert proc.stderr is not None
    lines = children.ReadyLine(re.compile(ready))
    if not children.follow(proc.stderr, lines).wait(60) or lines.match is None:
        children.stop(proc, signal.SIGTERM, grace_s=30)
        raise RuntimeError(f"{what} did not start")
    return proc, lines.match.group(1)


class ServerProcess:
    """A server in a child process: started, its port parsed from its output, stopped for sure."""

    def __init__(
        self, name: str, argv: list[str], workdir: Path, port_pattern: re.Pattern[str], cwd: Path = ROOT
    ) -> None:
        self.name = name
        self.argv = argv
        self.cwd = cwd
        self.log_path = workdir / f"{name}.log"
        self.port_pattern = port_pattern
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def spawn(self) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with self.log_path.open("wb") as log:
            try:
                # Own session: a Ctrl-C in the terminal reaches the benchmark, which stops its children.
                # Dying with it: a benchmark killed outright (a timeout's SIGKILL) leaves no server behind.
                self.proc = children.popen(
                    self.argv,
                    cwd=self.cwd,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    own_session=True,
                    with_parent=True,
                )
            except OSError as exc:
                raise RuntimeError(f"cannot start {self.name}: {exc}") from None

    async def wait_ready(self, timeout_s: float = 90.0) -> int:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            match = self.port_pattern.search(self.log())
            if match:
                self.port = int(match.group(1))
                return self.port
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            await asyncio.sleep(0.05)
        raise RuntimeError(f"{self.name} reported no port within {timeout_s:.0f} s:\n{self.log_tail()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def cpu_seconds(self) -> float:
        """User + system CPU time of the whole process (all threads), from /proc."""
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK

    def stop(self) -> None:
        if self.proc is not None:
            children.stop(self.proc, signal.SIGTERM, grace_s=10)


def service_command(repository: Path, prefix: Sequence[str] = ()) -> list[str]:
    """`python -m modelyard.service` on the repository and an ephemeral loopback port, under `prefix`
    (a wrapper such as taskset)."""
    return [
        *prefix,
        sys.executable,
        "-m",
        "modelyard.service",
        "--repository",
        str(repository),
        "--listen",
        "127.0.0.1:0",
    ]


@asynccontextmanager
async def running_service(
    repository: Path, workdir: Path, *args: str, name: str = "service", prefix: Sequence[str] = ()
) -> AsyncIterator[ServerProcess]:
    """`python -m modelyard.service` on the repository, on an ephemeral loopback port, stopped on exit;
    `prefix` runs it under a wrapper (taskset)."""
    argv = [*service_command(repository, prefix), "--metrics-listen", "", *args]
    server = ServerProcess(name, argv, workdir, SERVICE_READY)
    server.spawn()
    try:
        await server.wait_ready()
        yield server
    finally:
        server.stop()
