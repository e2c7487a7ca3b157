"""Progressive rollouts through a real sidecar in front of a real service (scaler v1 stable, v2 the
canary), started over the admin endpoint with its token rules; the rollouts' clock is the test's,
so a minute of dwell passes when the test says. A good canary is promoted through every step; a
canary that starts failing at step 3 is rolled back to weight 0 at once, and no user sees an error
(its calls are answered by stable)."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import onnx

from models import demo_models
from modelyard.service.server import Service, build_service
from modelyard.service.settings import Settings as ServiceSettings
from modelyard.sidecar.server import Sidecar, build_sidecar
from modelyard.sidecar.settings import Settings
from tests.sidecar.integration.test_breakers import fails_on_large_values
from tests.sidecar_support import infer, known_versions
from tests.support import eventually

SCALER = {"max_batch_size": 64, "version_policy": {"latest": 2}}
TOKEN = "rollout-test-token"


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


@asynccontextmanager
async def serving(root: Path, canary: onnx.ModelProto) -> AsyncIterator[Service]:
    demo_models.write_model(root, "scaler", 1, demo_models.scaled_identity(16, 2.0), SCALER)
    demo_models.write_model(root, "scaler", 2, canary, SCALER)
    service = build_service(
        ServiceSettings(repository=root, listen="127.0.0.1:0", metrics_listen="127.0.0.1:0")
    )
    await service.start()
    try:
        yield service
    finally:
        await service.stop(grace_s=1.0)


@asynccontextmanager
async def sidecar_for(service: Service, tmp_path: Path, clock: Clock) -> AsyncIterator[Sidecar]:
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKEN + "\n")
    settings = Settings(
        listen="127.0.0.1:0",
        upstream=(service.address,),
        admin_listen="127.0.0.1:0",
        admin_tokens_file=str(tokens),
        state_file=str(tmp_path / "state.json"),
        rollout_tick_s=0.01,
    )
    sidecar = build_sidecar(settings, wall_clock=clock)
    await sidecar.start()
    try:
        await known_versions(sidecar, "scaler", {"1", "2"})
        yield sidecar
    finally:
        await sidecar.stop(grace_s=1.0)


def call(
    sidecar: Sidecar, path: str, method: str = "GET", body: object = None, token: str | None = TOKEN
) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"http://{sidecar.admin_address}{path}", data=data, method=method)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


async def traffic(channel: grpc.aio.Channel, clock: Clock, value: float = 1.0, calls: int = 20) -> set[str]:
    """Calls from new users each (a random bucket), then the dwell's time passes; the dyes seen.
    Every call must succeed: infer raises on an error."""
    dyes = set()
    for _ in range(calls):
        answer = await infer(channel, value=value)
        dyes.add(f"{answer.dye}/{answer.version}")
    clock.now += 5
    return dyes


async def test_a_good_canary_is_promoted_through_every_step(tmp_path: Path) -> None:
    clock = Clock()
    canary = demo_models.scaled_identity(16, 3.0)
    async with (
        serving(tmp_path / "models", canary) as service,
        sidecar_for(service, tmp_path, clock) as sidecar,
    ):
        spec = {"steps": [20, 50, 100], "dwell_s": 10, "min_calls": 5, "judge_calls": 5}
        assert (await _call(sidecar, "/rollouts/scaler", "POST", spec, token=None))[0] == 401
        assert (await _call(sidecar, "/rollouts/nosuch", "POST", spec))[0] == 404
        status, started = await _call(sidecar, "/rollouts/scaler", "POST", spec)
        assert status == 201 and (started["state"], started["step"], started["weight"]) == (
            "running",
            0,
            20,
        )
        assert (await _call(sidecar, "/rollouts/scaler", "POST", spec))[0] == 409
        status, _ = await _call(sidecar, "/canary/scaler", "PUT", {"canary_weight": 5})
        assert status == 409  # the rollout sets this model's weight

        async with grpc.aio.insecure_channel(sidecar.address) as channel:

            async def succeeded() -> bool:
                await traffic(channel, clock)
                return sidecar.rollouts.rollouts["scaler"].state == "succeeded"

            await eventually(succeeded, "the rollout to succeed", within_s=120)
            assert await traffic(channel, clock) == {"canary/2"}  # weight 100

        status, view = await _call(sidecar, "/rollouts/scaler")
        assert status == 200 and (view["state"], view["step"], view["weight"], view["reason"]) == (
            "succeeded",
            2,
            100,
            None,
        )
        weights = [(e["event"], e["weight"]) for e in view["history"]]
        assert weights == [("started", 20), ("step", 50), ("step", 100), ("succeeded", 100)]
        assert (await _call(sidecar, "/rollouts"))[1]["scaler"]["state"] == "succeeded"
        assert sidecar.routes.sources["scaler"].source == "rollout"
        metrics = await _metrics(sidecar)
        assert 'modelyard_sidecar_rollout_step{model="scaler"} 2.0' in metrics
        assert 'modelyard_sidecar_rollout_gate{gate="errors",model="scaler",result="green"} 1.0' in metrics


async def test_a_canary_failing_from_step_3_is_rolled_back_and_no_user_sees_an_error(tmp_path: Path) -> None:
    clock = Clock()
    async with serving(tmp_path / "models", fails_on_large_values()) as service:
        async with sidecar_for(service, tmp_path, clock) as sidecar:
            spec = {"steps": [10, 25, 50, 100], "dwell_s": 10, "min_calls": 5, "judge_calls": 5}
            assert (await _call(sidecar, "/rollouts/scaler", "POST", spec))[0] == 201
            rollout = sidecar.rollouts.rollouts["scaler"]
            async with grpc.aio.insecure_channel(sidecar.address) as channel:

                async def at_step_3() -> bool:
                    await traffic(channel, clock)  # values the canary handles
                    return rollout.step == 2

                await eventually(at_step_3, "the rollout at its third step", within_s=120)
                assert rollout.weight == 50

                async def failed() -> bool:
                    # Values the canary fails on: every call still answers (stable's fallback).
                    # A full round before the dwell's time passes: the step's canary calls may
                    # already hold a round of good ones (the round during which the rollout
                    # stepped), which a few faults would not turn red in time.
                    await traffic(channel, clock, value=100.0)
                    return rollout.state == "failed"

                await eventually(failed, "the rollback", within_s=60)
                assert sidecar.routes.table.route("scaler").canary_weight == 0
                assert await traffic(channel, clock, value=100.0) == {"stable/1"}  # weight 0
            status, view = await _call(sidecar, "/rollouts/scaler")
            assert status == 200 and (view["state"], view["weight"], view["step"]) == ("failed", 0, 2)
            assert "errors" in view["reason"] or "breaker" in view["reason"], view["reason"]
            assert (await _call(sidecar, "/rollouts/scaler/resume", "POST"))[0] == 409
        saved = json.loads((tmp_path / "state.json").read_text())
        assert saved["rollouts"]["scaler"]["state"] == "failed"
        assert saved["routes"]["overrides"]["scaler"]["canary_weight"] == 0


async def _call(sidecar: Sidecar, path: str, method: str = "GET", body: object = None, **kw: Any) -> Any:
    return await asyncio.to_thread(call, sidecar, path, method, body, **kw)


async def _metrics(sidecar: Sidecar) -> str:
    def scrape() -> str:
        with urllib.request.urlopen(f"http://{sidecar.admin_address}/metrics", timeout=10) as answer:
            return str(answer.read().decode())

    return await asyncio.to_thread(scrape)


async def test_a_restart_mid_rollout_resumes_it(tmp_path: Path) -> None:
    clock = Clock()
    async with serving(tmp_path / "models", demo_models.scaled_identity(16, 3.0)) as service:
        spec = {"steps": [20, 50, 100], "dwell_s": 10, "min_calls": 5, "judge_calls": 5}
        async with sidecar_for(service, tmp_path, clock) as sidecar:
            assert (await _call(sidecar, "/rollouts/scaler", "POST", spec))[0] == 201
            rollout = sidecar.rollouts.rollouts["scaler"]
            async with grpc.aio.insecure_channel(sidecar.address) as channel:

                async def at_step_2() -> bool:
                    await traffic(channel, clock)
                    return rollout.step == 1

                await eventually(at_step_2, "the rollout's second step", within_s=60)
            history = rollout.history
        async with sidecar_for(service, tmp_path, clock) as again:
            status, view = await _call(again, "/rollouts/scaler")
            assert status == 200 and (view["state"], view["step"], view["weight"]) == ("running", 1, 50)
            assert view["history"] == history
            assert again.routes.table.route("scaler").canary_weight == 50
            async with grpc.aio.insecure_channel(again.address) as channel:

                async def succeeded() -> bool:
                    await traffic(channel, clock)
                    return again.rollouts.rollouts["scaler"].state == "succeeded"

                await eventually(succeeded, "the resumed rollout to succeed", within_s=60)
