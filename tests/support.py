"""Helpers the tests share that are not fixtures: the one polling wait, metric reading, and a
service in a child process."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

REPO_ROOT = Path(__file__).resolve().parents[1]
EVENTUALLY_LIMIT_S = 20.0  # bounds a broken test only; nothing waits this long when things work


async def eventually(
    check: Callable[[], bool | Awaitable[bool]], what: str = "condition", within_s: float = EVENTUALLY_LIMIT_S
) -> None:
    """Wait until `check()` holds, polling, for things that send no event a test can wait on;
    fail after `within_s`. Nothing here depends on how fast the machine is. `check` may be a
    coroutine function (a check that makes a call, e.g. through the sidecar)."""
    deadline = time.monotonic() + within_s
    while True:
        held = check()
        if not isinstance(held, bool):
            held = await held
        if held:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


def metric(source: CollectorRegistry | str, name: str, **labels: str) -> float | None:
    """The value of one series, from a registry or a scraped /metrics text; None when the series
    does not exist (a check that a series is gone must tell that from a zero)."""
    if isinstance(source, CollectorRegistry):
        return source.get_sample_value(name, labels)
    for family in text_string_to_metric_families(source):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return None


_SERVING = re.compile(r"serving gRPC on (\S+?)(?:, metrics on (http://\S+/metrics))?;")


@dataclass
class ServiceProcess:
    """`python -m service` in a child process, as an operator runs it."""

    proc: subprocess.Popen[str]
    address: str
    metrics_url: str | None
    log: list[str] = field(default_factory=list)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


def start_service_process(repository: Path, *args: str, timeout: float = 60.0) -> ServiceProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELYARD_")}
    cmd = [
        sys.executable,
        "-m",
        "service",
        "--repository",
        str(repository),
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
        *args,
    ]
    proc = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env, cwd=REPO_ROOT
    )
    assert proc.stderr is not None
    lines: list[str] = []
    ready: list[re.Match[str]] = []
    found = threading.Event()

    def pump() -> None:  # keep reading so the child never blocks on a full pipe
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line.rstrip())
            if not ready and (m := _SERVING.search(line)):
                ready.append(m)
                found.set()
        found.set()

    threading.Thread(target=pump, daemon=True).start()
    if not found.wait(timeout) or not ready:
        proc.kill()
        proc.wait()
        raise AssertionError("service did not start:\n" + "\n".join(lines))
    return ServiceProcess(proc, ready[0].group(1), ready[0].group(2), lines)
