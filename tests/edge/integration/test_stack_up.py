"""`python -m modelyard.deploy` (make up): the whole stack comes up on ephemeral ports, answers through Envoy,
and goes away entirely, on SIGINT and when one of its processes dies."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support import REPO_ROOT

PAGE = re.compile(r"browser page\s+(http://\S+)/")
PID = re.compile(r"(\w+) started \(pid (\d+)\)")


class Stack:
    def __init__(self, repository: Path, tmp: Path) -> None:
        self.tmp = tmp  # its TMPDIR: where the run's own folder (Envoy's config) goes
        cmd = [
            sys.executable,
            "-m",
            "modelyard.deploy",
            "--repository",
            str(repository),
            "--service-listen",
            "127.0.0.1:0",
        ]
        cmd += ["--service-metrics", "", "--sidecar-listen", "127.0.0.1:0", "--sidecar-admin", ""]
        cmd += ["--gateway-listen", "127.0.0.1:0", "--gateway-metrics", ""]
        cmd += ["--envoy-port", "0", "--envoy-admin-port", "0"]
        tmp.mkdir(exist_ok=True)
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO_ROOT,
            env={**os.environ, "TMPDIR": str(tmp)},
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self.pids: dict[str, int] = {}
        self.url = ""
        self.up = threading.Event()
        threading.Thread(target=self._pump_out, daemon=True).start()
        threading.Thread(target=self._pump_err, daemon=True).start()

    def _pump_out(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.out.append(line)
            if m := PAGE.search(line):
                self.url = m.group(1)
                self.up.set()
        self.up.set()

    def _pump_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.err.append(line)
            if m := PID.search(line):
                self.pids[m.group(1)] = int(m.group(2))

    def wait_up(self) -> None:
        assert self.up.wait(180) and self.url, "".join(self.err[-40:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def stack(repository: Path, tmp_path: Path):
    running = Stack(repository, tmp_path / "tmp")
    try:
        yield running
    finally:
        running.stop()
        for pid in running.pids.values():
            if alive(pid):
                with_signal(pid, signal.SIGKILL)


def with_signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def test_stack_comes_up_answers_through_envoy_and_stops_on_sigint(stack) -> None:
    stack.wait_up()
    # The page's URL is Envoy's (its models panel is a gRPC-Web call), the one to open.
    printed = "".join(stack.out)
    gateway = re.search(r"gateway\s+(http://\S+)", printed)
    assert gateway and gateway.group(1) != stack.url and "open this one" in printed, printed
    with urllib.request.urlopen(stack.url + "/v1/models", timeout=10) as response:
        assert b'"classifier"' in response.read()
    with urllib.request.urlopen(stack.url + "/v2/health/ready", timeout=10) as response:
        assert response.status == 200
    assert {"service", "gateway", "envoy"} <= set(stack.pids)
    assert list(stack.tmp.glob("modelyard-up-*"))  # while it runs
    stack.proc.send_signal(signal.SIGINT)
    assert stack.proc.wait(60) == 0, "".join(stack.err[-30:])
    assert not list(stack.tmp.glob("modelyard-up-*"))  # its folder is removed on exit
    assert not [name for name, pid in stack.pids.items() if alive(pid)]
    port = int(stack.url.rsplit(":", 1)[1])
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass


def test_a_process_that_dies_is_reported_and_the_rest_are_stopped(stack) -> None:
    stack.wait_up()
    with_signal(stack.pids["gateway"], signal.SIGKILL)
    assert stack.proc.wait(60) == 1
    assert any("gateway exited with -9; stopping the rest" in line for line in stack.err)
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in stack.pids.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [name for name, pid in stack.pids.items() if alive(pid)]


def test_a_supervisor_that_is_killed_takes_its_processes_with_it(stack) -> None:
    # SIGKILL: the supervisor stops nothing itself; the parent-death signal stops its children.
    stack.wait_up()
    stack.proc.kill()
    stack.proc.wait()
    deadline = time.monotonic() + 20
    while any(alive(pid) for pid in stack.pids.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [name for name, pid in stack.pids.items() if alive(pid)]
