"""Helpers the tests share that are not fixtures: the one polling wait, metric reading, a service
in this process (`serving`) and a service in a child process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from modelyard.process import children

if TYPE_CHECKING:
    from modelyard.service.server import Service

REPO_ROOT = Path(__file__).resolve().parents[1]
EVENTUALLY_LIMIT_S = 20.0  # bounds a broken test only; nothing waits this long when things work


@contextlib.asynccontextmanager
async def serving(repository: Path, **fields: Any) -> AsyncIterator[Service]:
    """The real service in this process on an ephemeral port, without a metrics listener unless
    `fields` give one (any other setting too), stopped at the end."""
    from modelyard.service.server import build_service
    from modelyard.service.settings import Settings

    fields = {"listen": "127.0.0.1:0", "metrics_listen": "", **fields}
    running = build_service(Settings(repository=repository, **fields))
    await running.start()
    try:
        yield running
    finally:
        await running.stop(grace_s=1.0)


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


@dataclass
class ChildProcess:
    """One of our processes, started as an operator runs it. Its stderr is read all along (so the
    child never blocks on a full pipe) and kept in `log`; `ready` is its first ready line's match."""

    proc: subprocess.Popen[str]
    ready: re.Match[str]
    log: list[str] = field(default_factory=list)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Its exit code; one that outlives `timeout` is killed and the test fails."""
        if not children.stop(self.proc, sig, timeout):
            raise subprocess.TimeoutExpired(self.proc.args, timeout)
        return self.proc.returncode


def start_child(
    cmd: Sequence[str],
    ready: re.Pattern[str],
    what: str,
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 60.0,
) -> ChildProcess:
    """Start `cmd` in the repository and wait until a stderr line matches `ready`; fail with the
    child's log if it exits or the timeout passes first. MODELYARD_* variables of the test run
    are not passed on unless `env` gives them."""
    if env is None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MODELYARD_")}
    proc: subprocess.Popen[str] = children.popen(
        cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env, cwd=REPO_ROOT
    )
    lines: list[str] = []
    output = children.ReadyLine(ready, lines.append)
    assert proc.stderr is not None
    if not children.follow(proc.stderr, output).wait(timeout) or output.match is None:
        proc.kill()
        proc.wait()
        raise AssertionError(f"{what} did not start:\n" + "\n".join(lines))
    return ChildProcess(proc, output.match, lines)


_SERVING = re.compile(r"serving gRPC on (\S+?)(?:, metrics on (http://\S+/metrics))?;")


class ServiceProcess(ChildProcess):
    """`python -m modelyard.service` in a child process."""

    @property
    def address(self) -> str:
        return self.ready.group(1)

    @property
    def metrics_url(self) -> str | None:
        return self.ready.group(2)


def start_service_process(repository: Path, *args: str, timeout: float = 60.0) -> ServiceProcess:
    cmd = [
        sys.executable,
        "-m",
        "modelyard.service",
        "--repository",
        str(repository),
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
        *args,
    ]
    child = start_child(cmd, _SERVING, "service", timeout=timeout)
    return ServiceProcess(child.proc, child.ready, child.log)
