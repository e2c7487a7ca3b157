"""Helpers for the fleet rollout tests: three service + sidecar pairs on loopback (each sidecar a
child process on fixed ports, so a restarted one comes back where the controller and Prometheus
look), the real Prometheus binary scraping the sidecars every second, the controller as a child
process (`python -m modelyard.rollouts`), and traffic through every sidecar."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import yaml

from models import demo_models
from modelyard.process import children
from tests.sidecar.integration.test_breakers import fails_on_large_values
from tests.sidecar_support import infer
from tests.support import ChildProcess, ServiceProcess, start_child, start_service_process

PROMETHEUS = Path("/usr/bin/prometheus")
TOKEN = "fleet-test-token"
CONFIG = {"max_batch_size": 64, "version_policy": {"latest": 2}}
# A short window: the tests scrape every second and dwell seconds, not minutes.
QUERIES = {"min_window_s": 3, "max_window_s": 30, "timeout_s": 2}
_SIDECAR_READY = re.compile(r"sidecar serving gRPC on (\S+?), admin on (http://\S+?);")
_CONTROLLER_READY = re.compile(r"rollout controller serving on (http://\S+?);")


_GIVEN: set[int] = set()


def free_port() -> int:
    """A free port below the kernel's ephemeral range (32768 up): a sidecar restarted on it, or
    Prometheus started late on it, does not find it taken by some process's outgoing connection;
    never the same one twice in a run."""
    while True:
        port = random.randrange(20_000, 32_768)
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port


def request(url: str, method: str = "GET", body: object = None, token: str | None = TOKEN) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as answer:
            raw = answer.read()
            status = answer.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    text = raw.decode()
    return status, (json.loads(text) if text.startswith(("{", "[")) else text)


async def call(
    url: str, method: str = "GET", body: object = None, token: str | None = TOKEN
) -> tuple[int, Any]:
    return await asyncio.to_thread(request, url, method, body, token)


@dataclass
class Pod:
    service: ServiceProcess
    grpc_port: int
    admin_port: int
    sidecar: ChildProcess | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    @property
    def instance(self) -> str:  # Prometheus' name for it
        return f"127.0.0.1:{self.admin_port}"


@dataclass
class Controller:
    process: ChildProcess
    url: str

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process.proc.poll() is None:
            self.process.stop(sig)

    async def rollout(self, model: str) -> dict[str, Any]:
        status, view = await call(f"{self.url}/rollouts/{model}")
        assert status == 200, view
        return dict(view)


@dataclass
class Fleet:
    root: Path
    tokens: Path
    pods: list[Pod]
    controllers: list[Controller] = field(default_factory=list)
    prometheuses: list[subprocess.Popen[bytes]] = field(default_factory=list)
    prometheus_url: str = ""

    # --- sidecars -------------------------------------------------------------------------

    def start_sidecar(self, pod: Pod) -> None:
        cmd = [
            sys.executable,
            *("-m", "modelyard.sidecar"),
            *("--listen", pod.address),
            *("--admin-listen", pod.instance),
            *("--upstream", pod.service.address),
            *("--admin-tokens-file", str(self.tokens)),
        ]
        pod.sidecar = start_child(cmd, _SIDECAR_READY, "sidecar")

    def kill_sidecar(self, pod: Pod) -> None:
        assert pod.sidecar is not None
        pod.sidecar.stop(signal.SIGKILL)

    async def weights(self, model: str) -> list[float | None]:
        """Each sidecar's configured weight of `model`, from its own GET /canary (None: no answer)."""

        async def one(pod: Pod) -> float | None:
            try:
                _, doc = await call(f"{pod.admin}/canary")
            except OSError:
                return None
            weight = (doc["models"].get(model) or {}).get("canary_weight")
            return float(weight) if weight is not None else None

        return list(await asyncio.gather(*(one(p) for p in self.pods)))

    async def owners(self, model: str) -> list[str | None]:
        async def one(pod: Pod) -> str | None:
            _, doc = await call(f"{pod.admin}/canary")
            owner = (doc["models"].get(model) or {}).get("owner")
            return str(owner) if owner is not None else None

        return list(await asyncio.gather(*(one(p) for p in self.pods)))

    # --- Prometheus -------------------------------------------------------------------------

    def start_prometheus(self, port: int) -> str:
        """Prometheus on `port`, scraping every sidecar each second; its URL once every target is up."""
        where = self.root / f"prometheus-{port}-{len(self.prometheuses)}"
        where.mkdir()
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [
                {
                    "job_name": "modelyard-sidecar",
                    "scrape_interval": "1s",
                    "scrape_timeout": "1s",
                    "static_configs": [{"targets": [p.instance for p in self.pods]}],
                }
            ],
        }
        (where / "prometheus.yml").write_text(yaml.safe_dump(config))
        proc = children.popen(
            [
                str(PROMETHEUS),
                f"--config.file={where / 'prometheus.yml'}",
                f"--storage.tsdb.path={where / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=subprocess.DEVNULL,
            stderr=(where / "log").open("wb"),
        )
        self.prometheuses.append(proc)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:  # its targets' health through its own API: the event we wait on
            assert proc.poll() is None, (where / "log").read_text()
            with contextlib.suppress(OSError, ValueError, TypeError, KeyError):  # starting: 503 text
                _, doc = request(f"{url}/api/v1/targets", token=None)
                health = [t["health"] for t in doc["data"]["activeTargets"]]
                if len(health) == len(self.pods) and set(health) == {"up"}:
                    return url
            assert time.monotonic() < deadline, "prometheus' targets did not come up"
            time.sleep(0.1)

    def stop_prometheus(self, sig: int = signal.SIGKILL) -> None:
        for proc in self.prometheuses:
            children.stop(proc, sig, 30)

    # --- the controller -----------------------------------------------------------------------

    def start_controller(self, port: int, prometheus: str, state: str) -> Controller:
        queries = self.root / "queries.yaml"
        queries.write_text(yaml.safe_dump(QUERIES))
        cmd = [
            sys.executable,
            *("-m", "modelyard.rollouts"),
            *("--listen", f"127.0.0.1:{port}"),
            *(arg for pod in self.pods for arg in ("--sidecar", pod.admin)),
            *("--prometheus", prometheus),
            *("--state-file", str(self.root / state)),
            *("--queries", str(queries)),
            *("--tokens-file", str(self.tokens)),
            *("--sidecar-token-file", str(self.tokens)),
            *("--tick-s", "0.5"),
            *("--lease-s", "30"),
        ]
        child = start_child(cmd, _CONTROLLER_READY, "rollout controller")
        controller = Controller(child, child.ready.group(1))
        self.controllers.append(controller)
        return controller

    def stop(self) -> None:
        for controller in self.controllers:
            controller.stop(signal.SIGKILL)
        self.stop_prometheus()
        for pod in self.pods:
            if pod.sidecar is not None and pod.sidecar.proc.poll() is None:
                pod.sidecar.stop(signal.SIGKILL)
            if pod.service.proc.poll() is None:
                pod.service.stop(signal.SIGKILL)


def write_repositories(root: Path, pods: int) -> list[Path]:
    """Three models per pod, v1 stable and v2 the canary: `scaler` and `held` healthy everywhere,
    `flaky` whose canary fails (on values above 16) on the first pod only."""
    repositories = []
    for i in range(pods):
        repo = root / f"models-{i}"
        for model in ("scaler", "flaky", "held"):
            demo_models.write_model(repo, model, 1, demo_models.scaled_identity(16, 2.0), CONFIG)
            canary = (
                fails_on_large_values()
                if model == "flaky" and i == 0
                else demo_models.scaled_identity(16, 3.0)
            )
            demo_models.write_model(repo, model, 2, canary, CONFIG)
        repositories.append(repo)
    return repositories


@contextlib.contextmanager
def running_fleet(root: Path, size: int = 3) -> Iterator[Fleet]:
    tokens = root / "tokens"
    tokens.write_text(TOKEN + "\n")
    repositories = write_repositories(root, size)
    with ThreadPoolExecutor(size) as pool:  # the services load at the same time
        services = list(pool.map(start_service_process, repositories))
    fleet = Fleet(root, tokens, [Pod(s, free_port(), free_port()) for s in services])
    try:
        with ThreadPoolExecutor(size) as pool:
            list(pool.map(fleet.start_sidecar, fleet.pods))
        yield fleet
    finally:
        fleet.stop()


@dataclass
class Traffic:
    """Calls through every sidecar from new users each (random buckets), counted by outcome."""

    fleet: Fleet
    model: str
    value: float = 1.0
    ok: int = 0
    errors: list[str] = field(default_factory=list)
    dyes: set[str] = field(default_factory=set)

    def reset(self) -> None:
        self.ok, self.errors, self.dyes = 0, [], set()

    async def _loop(self, pod: Pod) -> None:
        async with grpc.aio.insecure_channel(pod.address) as channel:
            while True:
                try:
                    answer = await infer(
                        channel, self.model, user=f"u{random.getrandbits(32)}", value=self.value, deadline_s=5
                    )
                except grpc.aio.AioRpcError as exc:
                    self.errors.append(f"{pod.address}: {exc.code().name} {exc.details()}")
                    if exc.code() == grpc.StatusCode.UNAVAILABLE:
                        await asyncio.sleep(0.05)  # a killed sidecar: do not spin on it
                    continue
                self.ok += 1
                self.dyes.add(f"{answer.dye}/{answer.version}")

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Traffic]:
        tasks = [asyncio.create_task(self._loop(pod)) for pod in self.fleet.pods]
        try:
            yield self
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
