"""Shared fixtures: model repositories built by the test, and real services on 127.0.0.1:0."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest

from models import demo_models
from modelyard.service.server import Service, build_service
from modelyard.service.settings import Settings
from tests.sidecar_support import SidecarProcess, start_sidecar_process
from tests.support import ServiceProcess, start_service_process


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    """A small repository: classifier (batched), scaler v1 (x2) and v2 (x3), mixed (two dtypes)."""
    root = tmp_path / "models"
    demo_models.build_demo_repository(root)
    return root


@pytest.fixture
async def service(repository: Path, request: pytest.FixtureRequest) -> AsyncIterator[Service]:
    """The real service, in this process, on an ephemeral port; a test's
    `@pytest.mark.service_settings(**fields)` overrides its settings (e.g. management_open=True)."""
    marker = request.node.get_closest_marker("service_settings")
    overrides = marker.kwargs if marker is not None else {}
    running = build_service(
        Settings(repository=repository, listen="127.0.0.1:0", metrics_listen="127.0.0.1:0", **overrides)
    )
    await running.start()
    try:
        yield running
    finally:
        await running.stop(grace_s=1.0)


@pytest.fixture
async def channel(service: Service) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(service.address) as chan:
        yield chan


P = TypeVar("P", ServiceProcess, SidecarProcess)


def _stopped_at_the_end(start_one: Callable[..., P]) -> Iterator[Callable[..., P]]:
    """A fixture's factory of processes (`start_one`): every process it starts is stopped at the end."""
    started: list[P] = []

    def start(*args: Any, **options: Any) -> P:
        process = start_one(*args, **options)
        started.append(process)
        return process

    yield start
    for process in started:
        if process.proc.poll() is None:
            process.stop(signal.SIGKILL)


@pytest.fixture
def service_process() -> Iterator[Callable[..., ServiceProcess]]:
    """start(repository, *args): a service process, stopped at the end."""
    yield from _stopped_at_the_end(start_service_process)


@pytest.fixture
def sidecar_process() -> Iterator[Callable[..., SidecarProcess]]:
    """start(*args, prefix=..., env=...): a sidecar process, stopped at the end."""
    yield from _stopped_at_the_end(start_sidecar_process)
