"""When the sidecar knows what its upstreams serve: once each reported its whole initial state
(WatchModels' x-initial-state-count, 0 for an empty repository). Before that, an admin change for
a model it has not heard of is a retryable 503 (not a 404) and the sidecar is not ready; after,
an unknown model is a 404. Against the real service (an empty repository; the demo one behind a
sidecar process, changed right after its ready line) and a grpc.aio upstream on loopback whose
watch says nothing until the test releases it."""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from modelyard.common import headers, health
from modelyard.inference.v1 import model_service_pb2 as mpb
from modelyard.service.server import build_service
from modelyard.service.settings import Settings as ServiceSettings
from modelyard.sidecar import upstreams as upstreams_module
from modelyard.sidecar.admin import AdminServer, Request
from modelyard.sidecar.routes.route_table import RouteSource
from modelyard.sidecar.server import Sidecar
from modelyard.sidecar.settings import Settings as SidecarSettings
from modelyard.sidecar.workers import role
from modelyard.sidecar.workers import supervisor as supervisor_module
from modelyard.sidecar.workers.supervisor import Supervisor
from tests.sidecar_support import SidecarProcess, running_sidecar, upstream_server
from tests.support import ServiceProcess, eventually

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def put(url: str, body: object) -> tuple[int, dict[str, Any], dict[str, str]]:
    """PUT a JSON body: the status, the JSON answer and the headers, whatever the status."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="PUT")
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, json.loads(answer.read()), dict(answer.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), dict(exc.headers)


async def put_route(sidecar: Sidecar, model: str, body: object) -> tuple[int, dict[str, Any], dict[str, str]]:
    return await asyncio.to_thread(put, f"http://{sidecar.admin_address}/canary/{model}", body)


async def readiness(sidecar: Sidecar) -> int:
    async with grpc.aio.insecure_channel(sidecar.address) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        return int((await check(health_pb2.HealthCheckRequest(service=""), timeout=10)).status)


class Held:
    """An upstream on loopback whose health serves and whose WatchModels says nothing (no initial
    metadata, no event) until `release`: then, as the service, the count of `models` and their
    events (`count=False`: as an older service, the events alone)."""

    def __init__(self, models: list[tuple[str, str]], count: bool = True) -> None:
        self.models = models
        self.count = count
        self.released = asyncio.Event()
        self.server, self.health = upstream_server(self.watch_models)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"

    async def watch_models(self, request: Any, context: Any) -> AsyncIterator[mpb.WatchModelsResponse]:
        await self.released.wait()
        if self.count:
            await context.send_initial_metadata(((headers.INITIAL_STATE_COUNT, str(len(self.models))),))
        for model, version in self.models:
            yield mpb.WatchModelsResponse(model_name=model, version=version, state=mpb.MODEL_STATE_READY)
        await asyncio.Event().wait()  # a watch never ends by itself


async def held(models: list[tuple[str, str]], count: bool = True) -> Held:
    upstream = Held(models, count)
    await upstream.server.start()
    await upstream.health.set(health.SERVER, health.SERVING)
    return upstream


async def test_a_change_before_the_upstream_reported_is_a_retryable_503(monkeypatch) -> None:
    # No older-service fallback here: the upstream says nothing until it is released.
    monkeypatch.setattr(upstreams_module, "REPORT_WAIT_S", 120.0, raising=False)
    upstream = await held([("scaler", "1"), ("scaler", "2")])
    try:
        async with running_sidecar([upstream.address], admin_open=True) as sidecar:
            (mine,) = sidecar.upstreams.all
            await eventually(lambda: mine.serving, "the upstream's health")
            status, answer, heard = await put_route(sidecar, "scaler", {"canary_weight": 10})
            assert (status, answer["reason"]) == (503, "unavailable"), answer
            assert "not reported" in answer["error"] and "retry" in answer["error"]
            assert heard["Retry-After"] == "1"
            assert await readiness(sidecar) == NOT_SERVING  # health serves, the models are not known
            assert not mine.watched

            upstream.released.set()
            await eventually(lambda: mine.watched, "the initial state")
            assert mine.served == {"scaler": frozenset({"1", "2"})}  # taken whole
            status, answer, _ = await put_route(sidecar, "scaler", {"canary_weight": 10})
            assert (status, answer["canary_weight"]) == (200, 10)
            status, answer, _ = await put_route(sidecar, "nope", {"canary_weight": 10})
            assert (status, answer["reason"]) == (404, "model_not_found")
            await eventually(lambda: _is(readiness(sidecar), SERVING), "readiness")
    finally:
        await upstream.server.stop(0)


async def test_an_empty_repository_is_reported(tmp_path: Path) -> None:
    """The real service with nothing to serve sends no event, only its count (0): the sidecar
    knows the upstream serves nothing, is ready, and a change for any model is a 404."""
    (tmp_path / "empty").mkdir()
    service = build_service(
        ServiceSettings(repository=tmp_path / "empty", listen="127.0.0.1:0", metrics_listen="")
    )
    await service.start()
    try:
        async with running_sidecar([service.address], admin_open=True) as sidecar:
            (mine,) = sidecar.upstreams.all
            await eventually(lambda: mine.watched, "the empty repository's report")
            assert mine.served == {} and not sidecar.upstreams.pending()
            status, answer, _ = await put_route(sidecar, "scaler", {"canary_weight": 10})
            assert (status, answer["reason"]) == (404, "model_not_found"), answer
            await eventually(lambda: mine.serving, "the upstream's health")
            await eventually(lambda: _is(readiness(sidecar), SERVING), "readiness")
    finally:
        await service.stop(grace_s=1.0)


async def test_an_older_service_with_no_models_counts_as_reported_after_a_wait(monkeypatch) -> None:
    """No count and no event (an older service with an empty repository): reported after
    REPORT_WAIT_S of serving health, what it serves unknown (routing as before: anything)."""
    monkeypatch.setattr(upstreams_module, "REPORT_WAIT_S", 0.2, raising=False)
    upstream = await held([], count=False)
    upstream.released.set()
    try:
        async with running_sidecar([upstream.address], admin_open=True) as sidecar:
            (mine,) = sidecar.upstreams.all
            await eventually(lambda: mine.reported, "the wait for an older service's report")
            assert not mine.watched and mine.serves("scaler", "")
            status, answer, _ = await put_route(sidecar, "scaler", {"canary_weight": 10})
            assert (status, answer["reason"]) == (404, "model_not_found"), answer
    finally:
        await upstream.server.stop(0)


async def test_an_upstream_without_watch_models_counts_as_reported() -> None:
    """It will never say what it serves: reported at once (routing by its label, or anything)."""
    server = grpc.aio.server()
    servicer = health.new_servicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await servicer.set(health.SERVER, health.SERVING)
    try:
        async with running_sidecar([f"127.0.0.1:{port}"]) as sidecar:
            (mine,) = sidecar.upstreams.all
            await eventually(lambda: mine.reported, "an upstream without WatchModels")
            assert not mine.watched and not sidecar.upstreams.pending()
            await eventually(lambda: _is(readiness(sidecar), SERVING), "readiness")
    finally:
        await server.stop(0)


async def test_a_change_right_after_the_ready_line_is_never_a_404(
    repository: Path,
    service_process: Callable[..., ServiceProcess],
    sidecar_process: Callable[..., SidecarProcess],
) -> None:
    """An operator's script that sets a route as soon as the sidecar says it serves: taken, or a
    503 `unavailable` that a retry turns into the change taken."""
    upstream = service_process(repository)
    sidecar = sidecar_process("--upstream", upstream.address, admin_open=True)
    assert sidecar.admin_url is not None
    url = f"{sidecar.admin_url}/canary/scaler"
    status, answer, _ = await asyncio.to_thread(put, url, {"canary_weight": 10})
    assert status in (200, 503), answer
    if status == 503:
        assert answer["reason"] == "unavailable", answer

        async def taken() -> bool:
            status, answer, _ = await asyncio.to_thread(put, url, {"canary_weight": 10})
            assert status in (200, 503) and answer.get("reason", "unavailable") == "unavailable", answer
            return status == 200

        await eventually(taken, "the change taken")
    assert sidecar.stop() == 0


async def _is(status: Awaitable[int], wanted: int) -> bool:
    return await status == wanted


class Worker:
    """A worker's admin endpoint on its private socket (the real server), whose upstreams have not
    reported (`pending`) and which knows a model from its `known_from`-th question on."""

    def __init__(self, folder: Path, index: int, known_from: int | None) -> None:
        self.routes = RouteSource(None)
        self.asked = 0
        self.known_from = known_from
        self.server = AdminServer(
            "",
            0,
            CollectorRegistry(),
            self.routes,
            list,
            known=self.known,
            pending=lambda: True,
            unix_path=str(role.admin_socket(folder, index)),
        )

    def known(self, model: str) -> bool:
        self.asked += 1
        return self.known_from is not None and self.asked >= self.known_from


async def test_the_supervisor_asks_the_first_worker_again_until_it_can_judge(monkeypatch) -> None:
    """--workers N: the first worker's 503 (its upstreams not reported) is asked again, so a change
    right after start is taken; past CHANGE_WAIT_S that 503 (with Retry-After) is the answer."""
    folder = Path(tempfile.mkdtemp(prefix="race-"))  # short: a unix socket's path is bounded
    supervisor = Supervisor(SidecarSettings(), 2)
    supervisor.folder = folder
    first, other = Worker(folder, 0, known_from=3), Worker(folder, 1, known_from=None)
    change = Request("PUT", "/canary/scaler", "HTTP/1.1", {}, b'{"canary_weight": 10}')
    try:
        for worker in (first, other):
            await worker.server.start()
        for slot in supervisor.slots():
            slot.serving = True
        answer = await supervisor.change(change)
        assert answer.status == 200, answer.body
        assert first.asked == 3  # two 503s, then known
        assert other.routes.table.route("scaler").canary_weight == 10  # it followed, unasked
        assert other.asked == 0

        monkeypatch.setattr(supervisor_module, "CHANGE_WAIT_S", 0.2)
        first.known_from, first.asked = None, 0
        answer = await supervisor.change(Request("PUT", "/canary/nope", "HTTP/1.1", {}, b"{}"))
        assert answer.status == 503 and json.loads(answer.body)["reason"] == "unavailable"
        assert ("Retry-After", "1") in answer.headers and first.asked > 1
        assert "nope" not in other.routes.table.models  # refused, for all
    finally:
        for worker in (first, other):
            await worker.server.stop()
        shutil.rmtree(folder, ignore_errors=True)
