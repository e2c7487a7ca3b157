"""A canary's breaker judged against stable, through a real sidecar in front of real grpc.aio
upstreams on loopback: one server per version (labelled upstreams `ADDR@1`, `ADDR@2`), each
serving scaler at its version (WatchModels, health) and answering Infer as the test sets it (slow,
failing a share of calls, or stopped). The breakers' clock is stepped by the test, so a backoff ends
when the test says; latencies are the real ones the sidecar measures.

Covered: a canary slow from its first call is cut off; a canary failing 30% is cut off at the
default policy, its effective weight is 0 in GET /canary and /metrics while open, and back once a
healed canary passed its run of probes; a dead canary trips within `consecutive_faults` calls, and
its backoff, grown while it was down, starts over when it is reachable again."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import yaml

from modelyard.common import health
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import model_service_pb2 as mpb
from modelyard.sidecar.breaker_policy import BreakerPolicy
from modelyard.sidecar.server import Sidecar
from tests.sidecar_support import (
    SteppedClock,
    admin_async,
    breaker_state,
    infer,
    known_versions,
    running_sidecar,
    upstream_server,
)
from tests.support import eventually, metric

DEFAULT = BreakerPolicy()
HEADER = [("x-canary-weight", "100")]


class Version:
    """One version of scaler on its own grpc.aio server: `delay_s` per call, and `fails(n)` says
    whether the n-th call fails (a model failure)."""

    def __init__(self, version: str, port: int = 0) -> None:
        self.version = version
        self.delay_s = 0.0
        self.failing: tuple[int, ...] = ()  # call numbers (mod 10) that fail
        self.calls = 0
        self.server, self.health = upstream_server(
            self.watch_models,
            grpc.method_handlers_generic_handler(
                "modelyard.inference.v1.InferenceService",
                {"Infer": grpc.unary_unary_rpc_method_handler(self.infer)},
            ),
        )
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        await self.server.start()
        await self.health.set(health.SERVER, health.SERVING)

    async def watch_models(self, request: Any, context: Any) -> AsyncIterator[mpb.WatchModelsResponse]:
        yield mpb.WatchModelsResponse(model_name="scaler", version=self.version, state=mpb.MODEL_STATE_READY)
        await asyncio.Event().wait()  # a watch never ends by itself

    async def infer(self, request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        n, self.calls = self.calls, self.calls + 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if n % 10 in self.failing:
            await context.abort(
                grpc.StatusCode.INTERNAL, "kernel failed", (("x-error-reason", "model_failed"),)
            )
        context.set_trailing_metadata((("x-served-version", self.version),))  # as the service: unary
        return pb.InferResponse(model_name="scaler", model_version=self.version).SerializeToString()


@asynccontextmanager
async def versions() -> AsyncIterator[tuple[Version, Version]]:
    stable, canary = Version("1"), Version("2")
    await stable.start()
    await canary.start()
    try:
        yield stable, canary
    finally:
        await stable.server.stop(0)
        await canary.server.stop(0)


def route_file(tmp_path: Path, **breaker: float) -> Path:
    doc: dict[str, Any] = {"models": {"scaler": {"canary_weight": 50}}}
    if breaker:
        doc["breaker"] = breaker
    path = tmp_path / "routes.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


async def canary_view(sidecar: Sidecar) -> dict[str, Any]:
    shown: dict[str, Any] = (await admin_async(sidecar, "/canary"))["models"]["scaler"]
    return shown


def snapshot(sidecar: Sidecar, version: str) -> dict[str, Any]:
    (found,) = [b for b in sidecar.breakers.snapshot() if b["version"] == version]
    return found


async def test_a_canary_slow_from_its_first_call_is_cut_off(tmp_path: Path) -> None:
    # The defaults (latency_min_calls 100: medians below it; the floor 0.25 s), but a check on each
    # call: the breakers' clock is stepped by the test, so latency_check_s would never pass.
    config = route_file(tmp_path, latency_check_s=0)
    async with versions() as (stable, canary):
        canary.delay_s = 1.0  # 4x the floor, and far over 4x stable (milliseconds), from the first call
        ups = [f"{stable.address}@1", f"{canary.address}@2"]
        async with running_sidecar(ups, config=config, clock=SteppedClock()) as sidecar:
            await known_versions(sidecar, "scaler", {"1", "2"})
            async with grpc.aio.insecure_channel(sidecar.address) as channel:
                for batch in range(10):  # concurrent calls: ~half of each batch is canary-dyed
                    users = [f"u{batch}-{i}" for i in range(40)]
                    answers = await asyncio.gather(*(infer(channel, user=u) for u in users))
                    assert all(a.version in ("1", "2") for a in answers)  # never an error
                    if breaker_state(sidecar, "scaler", "2") == {"open"}:
                        break
                assert breaker_state(sidecar, "scaler", "2") == {"open"}
                assert snapshot(sidecar, "2")["reason"] == "latency"
                # No new user goes to the canary: each is answered by stable, told of no fallback.
                answers = [await infer(channel, user=f"new-{i}") for i in range(20)]
                assert {(a.version, a.dye, a.fallback) for a in answers} == {("1", "stable", None)}
                shown = await canary_view(sidecar)
                assert (shown["canary_weight"], shown["effective_weight"], shown["breaker"]) == (
                    50,
                    0,
                    "open",
                )


async def test_a_thirty_percent_failing_canary_is_cut_off_at_the_defaults_and_comes_back(
    tmp_path: Path,
) -> None:
    clock = SteppedClock()
    async with versions() as (stable, canary):
        canary.failing = (0, 3, 6)  # 30%, spread out: never a burst
        ups = [f"{stable.address}@1", f"{canary.address}@2"]
        async with running_sidecar(ups, config=route_file(tmp_path), clock=clock) as sidecar:
            await known_versions(sidecar, "scaler", {"1", "2"})

            # The breaker series exist from the start: 0 for both versions, before any call.
            def series() -> list[float | None]:
                return [
                    metric(sidecar.metrics.registry, "modelyard_sidecar_breaker_state", **labels)
                    for labels in (
                        {"upstream": stable.address, "model": "scaler", "version": "1"},
                        {"upstream": canary.address, "model": "scaler", "version": "2"},
                    )
                ]

            await eventually(lambda: series() == [0, 0], "the breaker series of both versions")
            assert stable.calls == canary.calls == 0
            shown = await canary_view(sidecar)
            assert (shown["canary_weight"], shown["effective_weight"], shown["breaker"]) == (50, 50, "closed")
            async with grpc.aio.insecure_channel(sidecar.address) as channel:
                for i in range(400):
                    answer = await infer(channel, user=f"u{i}")  # never an error: stable answers
                    assert answer.version in ("1", "2")
                    if breaker_state(sidecar, "scaler", "2") == {"open"}:
                        break
                assert breaker_state(sidecar, "scaler", "2") == {"open"}
                assert snapshot(sidecar, "2")["reason"] == "error_rate"
                assert canary.calls <= 2 * DEFAULT.min_calls  # cut off in about min_calls calls
                shown = await canary_view(sidecar)
                assert (shown["canary_weight"], shown["effective_weight"], shown["breaker"]) == (
                    50,
                    0,
                    "open",
                )
                scraped = await admin_async(sidecar, "/metrics")
                assert metric(scraped, "modelyard_sidecar_canary_effective_weight", model="scaler") == 0
                assert metric(scraped, "modelyard_sidecar_canary_weight", model="scaler") == 50
                served = canary.calls
                answers = [await infer(channel, user=f"new-{i}") for i in range(40)]
                assert {(a.version, a.dye, a.fallback) for a in answers} == {("1", "stable", None)}
                assert canary.calls == served  # routing sent it nobody

                # Healed: after the backoff, canary-dyed users probe it; a run of good probes closes.
                canary.failing = ()
                clock.now += DEFAULT.backoff_s
                for i in range(200):
                    await infer(channel, user=f"again-{i}")
                    if breaker_state(sidecar, "scaler", "2") == {"closed"}:
                        break
                assert breaker_state(sidecar, "scaler", "2") == {"closed"}
                assert canary.calls - served >= 9  # the run a 30% share asks for
                shown = await canary_view(sidecar)
                assert (shown["effective_weight"], shown["breaker"]) == (50, "closed")
                scraped = await admin_async(sidecar, "/metrics")
                assert metric(scraped, "modelyard_sidecar_canary_effective_weight", model="scaler") == 50


async def test_a_dead_canary_trips_in_a_few_calls_and_its_backoff_resets_when_it_is_back(
    tmp_path: Path,
) -> None:
    clock = SteppedClock()
    async with versions() as (stable, canary):
        ups = [f"{stable.address}@1", f"{canary.address}@2"]
        async with running_sidecar(ups, config=route_file(tmp_path), clock=clock) as sidecar:
            await known_versions(sidecar, "scaler", {"1", "2"})
            async with grpc.aio.insecure_channel(sidecar.address) as channel:
                for i in range(60):  # a full window of good calls
                    assert (await infer(channel, user=f"u{i}", metadata=HEADER)).version == "2"
                port = canary.port
                await canary.server.stop(0)  # dead
                fallbacks = []
                for i in range(60):
                    answer = await infer(channel, user=f"u{i}", metadata=HEADER)
                    assert answer.version == "1"  # never an error
                    fallbacks.append(answer.fallback)
                    if answer.fallback == "breaker-open":
                        break
                # Tripped by the burst: `consecutive_faults` calls, not once half the window aged out.
                assert fallbacks == ["unavailable"] * DEFAULT.consecutive_faults + ["breaker-open"]
                assert snapshot(sidecar, "2")["reason"] == "consecutive_faults"
                for _ in range(5):  # its probes fail while it is down: the backoff grows
                    clock.now += float(snapshot(sidecar, "2")["backoff_s"])
                    assert (await infer(channel, user="p", metadata=HEADER)).fallback == "unavailable"
                assert snapshot(sidecar, "2")["backoff_s"] == DEFAULT.backoff_max_s  # 1, 2, 4, 8, 16, 30

                revived = Version("2", port)
                await revived.start()
                try:
                    await eventually(
                        lambda: snapshot(sidecar, "2")["backoff_s"] == DEFAULT.backoff_s,
                        "the backoff starts over once the canary's health is back",
                    )
                    clock.now += DEFAULT.backoff_s

                    async def closed() -> bool:
                        await infer(channel, user="p", metadata=HEADER)
                        return breaker_state(sidecar, "scaler", "2") == {"closed"}

                    await eventually(closed, "the revived canary passes its run of probes")
                    assert (await infer(channel, user="p", metadata=HEADER)).version == "2"
                finally:
                    await revived.server.stop(0)
