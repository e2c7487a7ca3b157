"""The one supervisor of the local stack: starts service -> sidecar -> gateway -> Envoy, each once
the one before it is ready (a process is ready when it logs its bound address; Envoy when its
admin /ready says LIVE), prints the URLs, and on Ctrl-C (SIGINT) or SIGTERM stops them in reverse
order. A process that dies is reported and the rest are stopped: nothing is left behind.

Each address may use port 0: the supervisor reads every process's bound address from its log and
renders Envoy's config (envoy/python/render.py) with the addresses that are really in use. Without the
sidecar's extra installed (its dependencies, see sidecar_installed), the gateway and Envoy call the
service directly (same API).

Management is the caller's who ran it, by credential: at start a fresh management token is written
to a 0600 file in the run's private folder (removed at exit; `--management-tokens-file` uses an
operator's file instead), the service takes it as `--auth-tokens-file` and the sidecar as
`--admin-tokens-file`, and the supervisor prints how to use it. Envoy's public edge serves no
management at all (envoy/python/render.py): manage through the gateway's, the sidecar's or the service's
own port.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from msgspec import Meta

from modelyard.envoy import render
from modelyard.process import children
from modelyard.process.settings import LISTEN, LISTEN_OR_EMPTY
from modelyard.process.settings import parse_settings as parse

log = logging.getLogger("deploy")
ROOT = Path(__file__).resolve().parents[1]
ENVOY = Path(sys.executable).with_name("envoy")
ENV_PREFIX = "MODELYARD_UP_"


_PORT = Meta(ge=0, le=65535)


@dataclass(frozen=True)
class Settings:
    repository: Annotated[str, Meta(description="model repository the service serves")] = "models/demo"
    service_listen: Annotated[str, LISTEN, Meta(description="service gRPC address")] = "127.0.0.1:50052"
    service_metrics: Annotated[str, LISTEN_OR_EMPTY, Meta(description="service /metrics address")] = (
        "127.0.0.1:9102"
    )
    sidecar_listen: Annotated[str, LISTEN, Meta(description="sidecar gRPC address")] = "127.0.0.1:50051"
    sidecar_admin: Annotated[str, LISTEN_OR_EMPTY, Meta(description="sidecar admin/metrics address")] = (
        "127.0.0.1:9101"
    )
    gateway_listen: Annotated[str, LISTEN, Meta(description="gateway HTTP address")] = "127.0.0.1:8000"
    gateway_metrics: Annotated[
        str, LISTEN_OR_EMPTY, Meta(description="gateway /metrics (and /healthz) address")
    ] = "127.0.0.1:9104"
    envoy_port: Annotated[
        int, _PORT, Meta(description="Envoy listener port on 127.0.0.1 (0: any free port)")
    ] = 8080
    envoy_admin_port: Annotated[
        int, _PORT, Meta(description="Envoy admin port on 127.0.0.1 (0: any free port)")
    ] = 9901
    # Run only when its package is installed.
    sidecar: Annotated[
        bool, Meta(description="run the sidecar between gateway/Envoy and the service (when installed)")
    ] = True
    # Passed as the sidecar's --config.
    sidecar_config: Annotated[
        str, Meta(description="the sidecar's route file (YAML); empty: its defaults")
    ] = ""
    start_timeout_s: Annotated[float, Meta(gt=0, description="seconds each process gets to become ready")] = (
        120.0
    )
    grace_s: Annotated[
        float, Meta(ge=0, description="seconds each process gets to stop before it is killed")
    ] = 10.0
    management_tokens_file: Annotated[
        str,
        Meta(
            description="the service's and the sidecar admin's tokens file (TOKEN [management] [inference]);"
            " empty: a fresh management token in the run's private folder, removed at exit"
        ),
    ] = ""


def parse_settings(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    return parse(
        Settings,
        ENV_PREFIX,
        argv,
        environ,
        prog="modelyard up",
        description="Run service, sidecar, gateway and Envoy together until Ctrl-C.",
    )


class Child:
    """One process of the stack: its output is echoed with its name, its ready line is awaited."""

    def __init__(self, name: str, ready: re.Pattern[str] | None) -> None:
        self.name = name
        self.output = children.ReadyLine(ready, self._echo)
        self.proc: asyncio.subprocess.Process | None = None
        self.ready = asyncio.Event()
        self._pump: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        return self.output.match.group(1) if self.output.match is not None else ""

    async def start(self, *cmd: str) -> None:
        # Its own session: Ctrl-C reaches only the supervisor, which stops the stack in order; and
        # the child gets SIGTERM if the supervisor itself dies (Linux), so nothing is left behind.
        self.proc = await children.create(
            cmd,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            cwd=ROOT,
            own_session=True,
            with_parent=True,
        )
        log.info("%s started (pid %d)", self.name, self.proc.pid)
        assert self.proc.stderr is not None
        reading = children.follow_async(self.proc.stderr, self.output, self.ready)
        self._pump = asyncio.get_running_loop().create_task(reading)

    def _echo(self, line: str) -> None:
        print(f"[{self.name}] {line}", file=sys.stderr, flush=True)

    async def wait_ready(self, timeout_s: float) -> None:
        assert self.proc is not None
        if not await children.wait_ready(self.proc, self.ready, timeout_s):
            code = self.proc.returncode
            raise RuntimeError(
                f"{self.name} {'exited with ' + str(code) if code is not None else 'did not start'}"
            )

    async def stop(self, grace_s: float) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        if not await children.stop_async(self.proc, signal.SIGTERM, grace_s):
            log.warning("%s did not stop in %.0f s: killed", self.name, grace_s)
        if self._pump is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._pump, 5)


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


async def _envoy_ready(admin_file: Path, envoy: Child, timeout_s: float) -> tuple[str, int]:
    """Envoy has no ready line: poll its admin /ready (the one polling wait), then read its port."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    assert envoy.proc is not None
    while True:
        if envoy.proc.returncode is not None:
            raise RuntimeError(f"envoy exited with {envoy.proc.returncode}")
        text = await asyncio.to_thread(_read, admin_file)
        if text:
            admin = "http://" + text
            with contextlib.suppress(OSError):
                body = await asyncio.to_thread(_get, admin + "/ready")
                if body.strip() == b"LIVE":
                    listeners = json.loads(await asyncio.to_thread(_get, admin + "/listeners?format=json"))
                    port = listeners["listener_statuses"][0]["local_address"]["socket_address"]["port_value"]
                    return admin, int(port)
        if loop.time() > deadline:
            raise RuntimeError("envoy did not become ready")
        await asyncio.sleep(0.1)


def _read(path: Path) -> str:
    return path.read_text().strip() if path.exists() else ""


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=2) as response:
        body: bytes = response.read()
        return body


# What the sidecar imports beyond the base install (its `sidecar` extra). Its package is in every
# wheel, so whether it is installed is whether these are.
SIDECAR_NEEDS = ("pybreaker",)


TOKEN_FILE = "management-token"


def management_token_file(workdir: Path) -> Path:
    """A fresh management token in a new 0600 file of `workdir` (the run's private folder),
    in the tokens file format: `TOKEN management`."""
    path = workdir / TOKEN_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(f"{secrets.token_urlsafe(32)} management\n")
    return path


def tokens_file(settings: Settings, workdir: Path) -> Path:
    """The operator's tokens file, named from where they ran this (the processes run in the
    checkout), or a fresh one in the run's folder."""
    if settings.management_tokens_file:
        return Path(settings.management_tokens_file).absolute()
    return management_token_file(workdir)


def management_help(tokens: Path, own: bool, gateway: str, grpc: str, admin: str, edge_port: int) -> str:
    """How to manage this stack with its token, printed at start (the token itself stays in its file)."""
    token = (
        f"export MODELYARD_TOKEN=$(cut -d' ' -f1 {tokens})"
        if not own
        else f"export MODELYARD_TOKEN=<a management token of {tokens}>"
    )
    bearer = '-H "authorization: Bearer $MODELYARD_TOKEN"'
    lines = [
        f"  management       tokens file {tokens}" + ("" if own else " (a fresh token; removed at exit)"),
        f"                   {token}",
        f"                   curl -X POST {bearer} http://{gateway}/v2/repository/index",
        f"                   gRPC {grpc}: metadata authorization: Bearer $MODELYARD_TOKEN",
    ]
    if admin:
        lines.append(
            f"                   curl -X PUT {bearer} {admin}/canary/scaler -d '{{\"canary_weight\": 25}}'"
        )
    lines.append(f"                   (not through Envoy :{edge_port}: its public edge serves no management)")
    return "\n".join(lines) + "\n"


def sidecar_installed() -> bool:
    """Whether `modelyard[sidecar]` is installed: the sidecar's own dependencies are importable."""
    for name in SIDECAR_NEEDS:
        try:
            if importlib.util.find_spec(name) is None:
                return False
        except ImportError:
            return False
    return True


async def run(settings: Settings) -> int:
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)
    python = sys.executable
    use_sidecar = settings.sidecar and sidecar_installed()
    admin_url = ""
    children: list[Child] = []
    workdir = Path(tempfile.mkdtemp(prefix="modelyard-up-"))  # 0700
    code = 0
    try:
        own_tokens = bool(settings.management_tokens_file)
        tokens = tokens_file(settings, workdir)
        service = Child("service", re.compile(r"serving gRPC on (\S+?)[,;]"))
        children.append(service)
        await service.start(
            python,
            "-m",
            "modelyard.service",
            "--repository",
            settings.repository,
            "--listen",
            settings.service_listen,
            "--metrics-listen",
            settings.service_metrics,
            "--auth-tokens-file",
            str(tokens),
        )
        await _started(service, settings, stopping)
        upstream = service.address
        if use_sidecar:
            sidecar = Child(
                "sidecar", re.compile(r"sidecar serving gRPC on (\S+?)[,;](?: admin on (\S+?);)?")
            )
            children.append(sidecar)
            command = [
                python,
                "-m",
                "modelyard.sidecar",
                "--listen",
                settings.sidecar_listen,
                "--upstream",
                service.address,
            ]
            command += ["--admin-listen", settings.sidecar_admin, "--admin-tokens-file", str(tokens)]
            if settings.sidecar_config:
                command += ["--config", settings.sidecar_config]
            await sidecar.start(*command)
            await _started(sidecar, settings, stopping)
            upstream = sidecar.address
            if sidecar.output.match is not None and sidecar.output.match.group(2):
                admin_url = sidecar.output.match.group(2)  # the address it bound (the flag may say port 0)
        else:
            log.info("no sidecar extra (pybreaker): the gateway and Envoy call the service directly")
        started = re.compile(r"serving HTTP on http://(\S+) \(metrics (?:on (\S+/metrics))?")
        gateway = Child("gateway", started)
        children.append(gateway)
        command = [python, "-m", "modelyard.gateway", "--listen", settings.gateway_listen]
        command += ["--upstream", upstream, "--metrics-listen", settings.gateway_metrics]
        await gateway.start(*command)
        await _started(gateway, settings, stopping)

        config = render.RenderSettings(
            listen=("127.0.0.1", settings.envoy_port),
            admin=("127.0.0.1", settings.envoy_admin_port),
            gateway=_host_port(gateway.address),
            sidecar=_host_port(upstream),
        )
        config_file = workdir / "envoy.yaml"
        config_file.write_text(render.render(config))
        admin_file = workdir / "envoy-admin"
        envoy = Child("envoy", None)
        children.append(envoy)
        await envoy.start(
            str(ENVOY),
            "-c",
            str(config_file),
            "--admin-address-path",
            str(admin_file),
            "--use-dynamic-base-id",  # a free hot-restart id: several stacks may run on one host
            "--log-level",
            "warn",
        )
        admin, port = await _envoy_ready(admin_file, envoy, settings.start_timeout_s)
        edge = f"http://127.0.0.1:{port}"
        behind = "sidecar" if use_sidecar else "service"
        metrics = [f"{admin}/stats/prometheus"]
        gateway_metrics = gateway.output.match.group(2) if gateway.output.match is not None else None
        if gateway_metrics:  # the address it bound (the flag may say port 0)
            metrics.insert(0, gateway_metrics)
        if settings.service_metrics:
            metrics.insert(0, f"http://{settings.service_metrics}/metrics")
        if admin_url:
            metrics.insert(1, f"{admin_url}/metrics")
        print(
            "\nModelyard is up (Ctrl-C stops everything):\n"
            f"  browser page     {edge}/   <- open this one (Envoy: the page needs its gRPC-Web)\n"
            f"  SSE              {edge}/v1/models/codelm/generate?prompt=def%20main()\n"
            f"  OpenAI base URL  {edge}/v1\n"
            f"  KServe V2 REST   {edge}/v2\n"
            f"  gRPC / gRPC-Web  127.0.0.1:{port} (Envoy), {upstream} ({behind})\n"
            f"  gateway          http://{gateway.address} (HTTP APIs behind Envoy; no gRPC-Web)\n"
            f"  service          {service.address}\n"
            f"  metrics          {' '.join(metrics)}\n"
            + management_help(tokens, own_tokens, gateway.address, upstream, admin_url, port),
            flush=True,
        )
        code = await _watch(children, stopping)
    except RuntimeError as exc:
        log.error("%s; stopping the rest", exc)
        code = 1
    except asyncio.CancelledError:
        code = 1
    finally:
        for child in reversed(children):
            await child.stop(settings.grace_s)
        # Envoy's config and admin-address file: nothing of a run is left behind, Ctrl-C included.
        shutil.rmtree(workdir, ignore_errors=True)
        log.info("all stopped")
    return code


async def _started(child: Child, settings: Settings, stopping: asyncio.Event) -> None:
    waiting = asyncio.ensure_future(child.wait_ready(settings.start_timeout_s))
    interrupted = asyncio.ensure_future(stopping.wait())
    await asyncio.wait({waiting, interrupted}, return_when=asyncio.FIRST_COMPLETED)
    interrupted.cancel()
    if not waiting.done():
        waiting.cancel()
        raise asyncio.CancelledError
    waiting.result()


async def _watch(children: list[Child], stopping: asyncio.Event) -> int:
    """Until a signal (0) or a process's death (1, reported)."""
    waits = {asyncio.ensure_future(c.proc.wait()): c for c in children if c.proc is not None}
    stop = asyncio.ensure_future(stopping.wait())
    done, _ = await asyncio.wait({stop, *waits}, return_when=asyncio.FIRST_COMPLETED)
    for task in (stop, *waits):
        task.cancel()
    if stop in done:
        log.info("stopping (signal)")
        return 0
    for task in done:
        child = waits[task]
        assert child.proc is not None
        log.error("%s exited with %s; stopping the rest", child.name, child.proc.returncode)
    return 1
