"""Breakers and canary fallback with the canary in its own service process: a model that fails,
a killed process, a slow canary; client mistakes never trip. Stable is scaler v1 (x2) in one
process, the canary scaler v2 in another; the sidecar in this process routes between them."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper

from models import demo_models
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.tensors import to_tensor
from tests.sidecar_support import (
    SteppedClock,
    admin_async,
    breaker_state,
    infer,
    known_versions,
    pairs,
    running_sidecar,
)
from tests.support import ServiceProcess, eventually

SCALER = {"max_batch_size": 64, "version_policy": {"latest": 2}}
USERS = [f"user-{i}" for i in range(40)]
CANARY = {"x-canary-weight": "100"}


def fails_on_large_values() -> onnx.ModelProto:
    """OUTPUT0 = GatherElements(INPUT0, indices=INPUT0): fine for inputs in [0, 16) (the load's
    warm-up passes), an ONNX Runtime error for larger ones, as a model with a bug on real traffic."""
    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["INPUT0"], ["index"], to=TensorProto.INT64),
            helper.make_node("GatherElements", ["INPUT0", "index"], ["OUTPUT0"], axis=1),
        ],
        "fails_on_large_values",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", 16])],
    )
    return demo_models.make_model(graph, "a canary with a bug")


def routes(path: Path, **breaker: float) -> Path:
    doc = {
        "models": {"scaler": {"canary_weight": 50}},
        "breaker": {"window_s": 60, "min_calls": 6, "error_rate": 0.5, "probes": 2, **breaker},
    }
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture
def stable(tmp_path: Path, service_process: Callable[..., ServiceProcess]) -> ServiceProcess:
    root = tmp_path / "stable"
    demo_models.write_model(root, "scaler", 1, demo_models.scaled_identity(16, 2.0), SCALER)
    return service_process(root)


def canary_repository(tmp_path: Path, model: onnx.ModelProto) -> Path:
    root = tmp_path / "canary"
    demo_models.write_model(root, "scaler", 2, model, SCALER)
    return root


async def test_a_failing_canary_is_cut_off_for_a_lone_caller(
    tmp_path: Path, stable: ServiceProcess, service_process
) -> None:
    """One connection, no tenant or user header (a single client process; the gateway's one
    channel): the canary's breaker still opens, since its callers fall back to stable."""
    canary = service_process(canary_repository(tmp_path, fails_on_large_values()))
    config = routes(tmp_path / "routes.yaml", backoff_s=60, backoff_max_s=60, latency_floor_s=5)
    async with running_sidecar([stable.address, canary.address], config=config) as sidecar:
        await known_versions(sidecar, "scaler", {"1", "2"})
        async with grpc.aio.insecure_channel(sidecar.address) as channel:
            fallbacks = []
            for _ in range(40):
                answer = await infer(channel, value=100.0, metadata=list(CANARY.items()))
                assert (answer.version, answer.dye) == ("1", "stable")  # never an error
                fallbacks.append(answer.fallback)
                if answer.fallback == "breaker-open":
                    break
            assert fallbacks[0] == "canary-fault" and fallbacks[-1] == "breaker-open"
            assert breaker_state(sidecar, "scaler", "2") == {"open"}
            assert breaker_state(sidecar, "scaler", "1") == {"closed"}


async def test_a_failing_canary_trips_falls_back_without_errors_and_recovers(
    tmp_path: Path, stable: ServiceProcess, service_process
) -> None:
    root = canary_repository(tmp_path, fails_on_large_values())
    canary = service_process(root)
    config = routes(tmp_path / "routes.yaml", backoff_s=2, backoff_max_s=2, latency_floor_s=5)
    clock = SteppedClock()  # the breaker stays open until the test moves time on
    async with running_sidecar([stable.address, canary.address], config=config, clock=clock) as sidecar:
        await known_versions(sidecar, "scaler", {"1", "2"})
        async with grpc.aio.insecure_channel(sidecar.address) as channel:
            fallbacks = []
            for user in USERS * 3:  # no client sees an error: a canary fault is answered by stable
                answer = await infer(channel, user=user, value=100.0)
                if answer.fallback:
                    assert (answer.version, answer.dye) == ("1", "stable")
                    fallbacks.append(answer.fallback)
                if breaker_state(sidecar, "scaler", "2") == {"open"}:
                    break
            assert fallbacks and set(fallbacks) == {"canary-fault"}
            assert breaker_state(sidecar, "scaler", "2") == {"open"}
            assert breaker_state(sidecar, "scaler", "1") == {"closed"}
            # Open, the canary's effective weight is 0: every user is routed to stable (no fallback
            # to tell); a call that asks for the canary with x-canary-weight falls back.
            answers = [await infer(channel, user=user, value=100.0) for user in USERS]
            assert {(a.version, a.dye, a.fallback) for a in answers} == {("1", "stable", None)}
            answer = await infer(channel, user="u", value=100.0, metadata=list(CANARY.items()))
            assert (answer.version, answer.fallback) == ("1", "breaker-open")

            # Pinned to the version whose breaker is open: fails fast, says why.
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await infer(channel, user="u", value=100.0, version="2")
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert ("x-error-reason", "breaker_open") in pairs(caught.value.trailing_metadata())

            (shown,) = [b for b in await admin_async(sidecar, "/breakers") if b["version"] == "2"]
            assert shown["state"] == "open" and shown["reason"] in ("error_rate", "consecutive_faults")
            metrics = await admin_async(sidecar, "/metrics")
            assert 'modelyard_sidecar_breaker_state{model="scaler",upstream="' in metrics
            assert 'reason="breaker-open"' in metrics

            # The canary heals (a fixed model is deployed); half-open probes close the breaker.
            demo_models.write_model(root, "scaler", 2, demo_models.scaled_identity(16, 3.0), SCALER)

            async def canary_answers() -> bool:
                clock.now += 2  # each backoff ends at once (a probe may come before the reload)
                answer = await infer(channel, user="u", value=100.0, metadata=list(CANARY.items()))
                return answer.version == "2" and answer.dye == "canary" and answer.fallback is None

            await eventually(canary_answers, within_s=60, what="the canary answers again")
            await canary_answers()  # the second probe
            assert breaker_state(sidecar, "scaler", "2") == {"closed"}


async def test_a_killed_canary_process_is_routed_around_and_comes_back(
    tmp_path: Path, stable: ServiceProcess, service_process
) -> None:
    root = canary_repository(tmp_path, demo_models.scaled_identity(16, 3.0))
    canary = service_process(root)
    config = routes(tmp_path / "routes.yaml", backoff_s=0.5, backoff_max_s=1, latency_floor_s=5)
    # Labelled upstreams: each version lives in its own process.
    upstreams = [f"{stable.address}@1", f"{canary.address}@2"]
    async with running_sidecar(upstreams, config=config) as sidecar:
        await known_versions(sidecar, "scaler", {"1", "2"})
        async with grpc.aio.insecure_channel(sidecar.address) as channel:
            assert (await infer(channel, user="u", metadata=list(CANARY.items()))).version == "2"
            canary.stop(signal.SIGKILL)
            # A server stream that fails before its first message is retried too: on stable.
            stub = pb_grpc.InferenceServiceStub(channel)
            x = to_tensor("INPUT0", np.ones((4, 16), np.float32))
            stream = stub.InferStream(
                pb.InferStreamRequest(model_name="scaler", inputs=[x], chunk_size=2),
                metadata=[*CANARY.items(), ("x-user-id", "u")],
            )
            chunks = [chunk async for chunk in stream]
            assert [c.model_version for c in chunks] == ["1", "1"]
            assert dict(pairs(await stream.initial_metadata()))["x-dye-fallback"] == "unavailable"
            reasons = set()
            for user in USERS * 3:
                answer = await infer(channel, user=user, metadata=list(CANARY.items()))
                assert answer.version == "1"  # zero client-visible errors
                reasons.add(answer.fallback)
                if answer.fallback == "breaker-open":
                    break
            # Routed around either way, by whichever the sidecar learns first: its attempts' faults
            # open the canary's breaker (`breaker-open`), or its health watch of the dead upstream
            # leaves no upstream to try for version 2 (`unavailable`, no attempt, nothing for the
            # breaker to count). Which comes first is a race of the kill's reset (seen both ways).
            assert "unavailable" in reasons and reasons <= {"unavailable", "breaker-open"}
            if "breaker-open" in reasons:
                assert breaker_state(sidecar, "scaler", "2") == {"open"}

            revived = service_process(root, "--listen", canary.address)
            assert revived.address == canary.address

            async def canary_answers() -> bool:
                return (await infer(channel, user="u", metadata=list(CANARY.items()))).version == "2"

            await eventually(canary_answers, within_s=60, what="the revived canary answers")
            assert await canary_answers()  # the second probe
            # Its breaker is closed once the sidecar follows the revived upstream: made anew from
            # its WatchModels where it was dropped with the dead upstream's versions, or closed by
            # the probes where it had stayed open. (A call may reach the revived upstream first,
            # as any upstream for a version not yet known again.)
            await eventually(
                lambda: breaker_state(sidecar, "scaler", "2") == {"closed"}, what="its breaker closed"
            )


async def test_client_mistakes_never_trip_a_breaker(
    tmp_path: Path, stable: ServiceProcess, service_process
) -> None:
    canary = service_process(canary_repository(tmp_path, demo_models.scaled_identity(16, 3.0)))
    config = routes(tmp_path / "routes.yaml", backoff_s=5, backoff_max_s=5)
    async with running_sidecar([stable.address, canary.address], config=config) as sidecar:
        await known_versions(sidecar, "scaler", {"1", "2"})
        async with grpc.aio.insecure_channel(sidecar.address) as channel:
            for i in range(20):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await infer(channel, user=f"u{i}", features=15, metadata=list(CANARY.items()))
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await infer(channel, user=f"u{i}", version="9")
                assert caught.value.code() == grpc.StatusCode.NOT_FOUND
            assert breaker_state(sidecar, "scaler", "2") == {"closed"}
            assert (await infer(channel, user="u", metadata=list(CANARY.items()))).version == "2"


async def test_a_slow_canary_trips_on_latency(tmp_path: Path, service_process) -> None:
    root = tmp_path / "models"
    config = {"max_batch_size": 4096, "version_policy": {"latest": 2}}
    demo_models.write_model(root, "wide", 1, demo_models.scaled_identity(512, 2.0), config)
    demo_models.write_model(root, "wide", 2, demo_models.dense_stack(layers=32, width=512), config)
    upstream = service_process(root)
    doc = {
        "models": {"wide": {"canary_weight": 100}},
        "breaker": {
            "window_s": 120,
            "min_calls": 8,
            "latency_min_calls": 100,  # p99 from 100+ calls: one hiccup of the machine is not it
            "latency_multiple": 3,
            "latency_floor_s": 0.1,  # small calls take ~2 ms; the slow ones ~0.5 s
            "latency_check_s": 0,
            "backoff_s": 60,
            "backoff_max_s": 60,
        },
    }
    (tmp_path / "routes.yaml").write_text(yaml.safe_dump(doc))
    big = [("grpc.max_receive_message_length", 64 << 20)]
    async with running_sidecar([upstream.address], config=tmp_path / "routes.yaml") as sidecar:
        await known_versions(sidecar, "wide", {"1", "2"})
        async with grpc.aio.insecure_channel(sidecar.address, options=big) as channel:
            for i in range(120):  # fast while small: the baseline is learned
                answer = await infer(channel, "wide", user=f"u{i}", features=512)
                assert answer.version == "2"
            for i in range(20):  # a batch of 4000 rows is slow on the canary only (~67 GFLOP)
                answer = await infer(channel, "wide", user=f"u{i}", rows=4000, features=512, deadline_s=60)
                if answer.version == "1":
                    break
            (shown,) = [b for b in sidecar.breakers.snapshot() if b["version"] == "2"]
            # The canary's effective weight is 0 while it is open: routed to stable, no fallback.
            assert (answer.version, answer.dye, answer.fallback) == ("1", "stable", None), repr(shown)
            assert shown["reason"] == "latency"
