"""Hostile and careless callers against the sidecar: one tenant's deadline storm or bad-values storm
never opens the breaker for another tenant; thousands of made-up model names and tenant ids leave
its state and /metrics flat; names are checked at the edge with capped echoes; every error a
client gets has a reason (an unreachable or vanishing upstream, an undecodable message, the
sidecar's own shutdown).

The upstream is a fake grpc.aio server on loopback that serves "scaler" version 1 (WatchModels,
health) and answers Infer as the `x-test` header asks: a slow run (the caller's deadline passes),
the deadline ending it on the service's side, the service's queue timeout, a bad-values
refusal, a model failure, a run held until released."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2_grpc

from modelyard.common import health
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import model_service_pb2 as mpb
from modelyard.sidecar.server import Sidecar, build_sidecar
from modelyard.sidecar.settings import Settings
from tests.sidecar_support import admin_async, breaker_state, infer, known_versions, pairs, running_sidecar
from tests.support import eventually

INFER = "/modelyard.inference.v1.InferenceService/Infer"
MODELS = "modelyard.inference.v1.ModelService"
INFER_STREAM = "/modelyard.inference.v1.InferenceService/InferStream"
MODEL_STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"
Context = grpc.aio.ServicerContext[bytes, bytes]


class FakeUpstream:
    """Serves scaler v1; Infer behaves as the call's `x-test` header says."""

    def __init__(self) -> None:
        self.server = grpc.aio.server()
        self.release = asyncio.Event()
        self.events: asyncio.Queue[mpb.WatchModelsResponse] = asyncio.Queue()
        self.held = 0
        self.health = health.new_servicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        handler = grpc.unary_unary_rpc_method_handler(self.infer)
        watch = grpc.unary_stream_rpc_method_handler(
            self.watch_models,
            request_deserializer=mpb.WatchModelsRequest.FromString,
            response_serializer=mpb.WatchModelsResponse.SerializeToString,
        )
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(MODELS, {"WatchModels": watch}),)
        )
        self.server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    "modelyard.inference.v1.InferenceService", {"Infer": handler}
                ),
            )
        )
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def watch_models(self, request: Any, context: Any) -> AsyncIterator[mpb.WatchModelsResponse]:
        yield mpb.WatchModelsResponse(model_name="scaler", version="1", state=mpb.MODEL_STATE_READY)
        while True:  # a watch never ends by itself
            yield await self.events.get()

    async def infer(self, request: bytes, context: Context) -> bytes:
        message = pb.InferRequest.FromString(request)
        behaviour = dict(pairs(context.invocation_metadata())).get("x-test", "")
        if message.model_name != "scaler":
            await abort(context, grpc.StatusCode.NOT_FOUND, "no such model", "model_not_found")
        if behaviour == "slow":
            await asyncio.sleep(10)  # longer than any caller here waits
        elif behaviour == "deadline-bare":  # the service's gRPC ending the call at the deadline
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        elif behaviour == "queue-timeout":
            await abort(context, grpc.StatusCode.DEADLINE_EXCEEDED, "queue timeout", "deadline")
        elif behaviour == "bad-values":
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "negative shape", "invalid_argument")
        elif behaviour == "model-failed":  # values the runtime fails on, told as a model failure
            await abort(context, grpc.StatusCode.INTERNAL, "kernel failed", "model_failed")
        elif behaviour == "hold":
            self.held += 1
            await self.release.wait()
        return pb.InferResponse(model_name="scaler", model_version="1").SerializeToString()


async def abort(context: Context, code: grpc.StatusCode, message: str, reason: str) -> None:
    await context.abort(code, message, (("x-error-reason", reason),))


@asynccontextmanager
async def fake_upstream() -> AsyncIterator[FakeUpstream]:
    fake = FakeUpstream()
    await fake.server.start()
    await fake.health.set(health.SERVER, health.SERVING)
    try:
        yield fake
    finally:
        fake.release.set()
        await fake.server.stop(0)


def route_file(tmp_path: Path, tenants: dict[str, Any] | None = None) -> Path:
    doc: dict[str, Any] = {
        "breaker": {"window_s": 600, "min_calls": 6, "error_rate": 0.5, "backoff_s": 60, "backoff_max_s": 60}
    }
    if tenants:
        doc["tenants"] = tenants
    path = tmp_path / "routes.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@asynccontextmanager
async def through_sidecar(
    upstreams: Sequence[str], config: Path | None, known: bool = True
) -> AsyncIterator[tuple[Sidecar, grpc.aio.Channel]]:
    async with running_sidecar(upstreams, config=config) as sidecar:
        if known:
            await known_versions(sidecar, "scaler", {"1"})
        async with grpc.aio.insecure_channel(sidecar.address) as channel:
            yield sidecar, channel


def call_md(behaviour: str, tenant: str, user: str = "u") -> list[tuple[str, str]]:
    return [("x-test", behaviour), ("x-tenant-id", tenant), ("x-user-id", user)]


async def storm(channel: grpc.aio.Channel, behaviour: str, tenant: str, deadline_s: float = 5) -> None:
    """40 failing calls from one tenant, many users (a rotating user id changes nothing)."""

    async def one(i: int) -> None:
        with pytest.raises(grpc.aio.AioRpcError):
            await infer(channel, metadata=call_md(behaviour, tenant, f"user-{i}"), deadline_s=deadline_s)

    await asyncio.gather(*(one(i) for i in range(40)))


@pytest.mark.parametrize(
    ("behaviour", "deadline_s"),
    [
        ("slow", 0.05),  # the caller's deadline passes in the sidecar (its call is cancelled)
        ("deadline-bare", 5),  # ... or first on the service's side: DEADLINE_EXCEEDED, no reason
        ("queue-timeout", 5),
        ("bad-values", 5),
        ("model-failed", 5),  # bad values that the service can only tell as a model failure
    ],
)
async def test_one_tenants_storm_never_opens_the_stable_breaker_for_another(
    tmp_path: Path, behaviour: str, deadline_s: float
) -> None:
    async with (
        fake_upstream() as fake,
        through_sidecar([fake.address], route_file(tmp_path)) as (sidecar, ch),
    ):
        await storm(ch, behaviour, "noisy", deadline_s)
        assert breaker_state(sidecar, "scaler", "1") == {"closed"}
        # Version 1 is all there is (nowhere to fall back to): the other tenant is still served.
        for i in range(10):
            answer = await infer(ch, metadata=call_md("", "quiet", f"q{i}"))
            assert answer.response.model_version == "1"


async def test_a_fault_that_every_tenant_sees_still_opens_the_breaker(tmp_path: Path) -> None:
    # The check above can fail: the same model failures from several tenants open it.
    async with (
        fake_upstream() as fake,
        through_sidecar([fake.address], route_file(tmp_path)) as (sidecar, ch),
    ):
        for tenant in ("t1", "t2", "t3", "t4"):
            for _ in range(3):
                with pytest.raises(grpc.aio.AioRpcError):
                    await infer(ch, metadata=call_md("model-failed", tenant))
        assert breaker_state(sidecar, "scaler", "1") == {"open"}
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await infer(ch, metadata=call_md("", "quiet"))
        assert ("x-error-reason", "breaker_open") in pairs(refused.value.trailing_metadata())


async def test_the_breaker_of_a_model_no_longer_served_is_dropped_with_its_series(tmp_path: Path) -> None:
    async with (
        fake_upstream() as fake,
        through_sidecar([fake.address], route_file(tmp_path)) as (sidecar, ch),
    ):
        for tenant in ("t1", "t2", "t3", "t4"):
            for _ in range(3):
                with pytest.raises(grpc.aio.AioRpcError):
                    await infer(ch, metadata=call_md("model-failed", tenant))
        assert breaker_state(sidecar, "scaler", "1") == {"open"}
        assert 'modelyard_sidecar_breaker_state{model="scaler"' in await admin_async(sidecar, "/metrics")
        unloaded = mpb.WatchModelsResponse(model_name="scaler", version="1", state=mpb.MODEL_STATE_UNLOADED)
        await fake.events.put(unloaded)
        await eventually(lambda: len(sidecar.breakers) == 0, "the breaker is dropped")
        metrics = await admin_async(sidecar, "/metrics")
        assert "modelyard_sidecar_breaker_state{" not in metrics
        assert "modelyard_sidecar_breaker_transitions_total{" not in metrics


async def test_made_up_names_and_rotating_tenants_leave_state_and_metrics_flat(tmp_path: Path) -> None:
    tenants = {"acme": {"rate": 1000, "burst": 1000}, "*": {"rate": 0.001, "burst": 1}}
    async with (
        fake_upstream() as fake,
        through_sidecar([fake.address], route_file(tmp_path, tenants)) as (sc, ch),
    ):
        await infer(ch, metadata=[("x-tenant-id", "acme")])

        async def unknown(i: int) -> str:
            try:
                await infer(ch, f"made-up-{i}", metadata=[("x-tenant-id", "acme")])
            except grpc.aio.AioRpcError as exc:
                return str(dict(pairs(exc.trailing_metadata()))["x-error-reason"])
            return "answered"

        async def rotating(i: int) -> str:
            try:
                await infer(ch, metadata=[("x-tenant-id", f"tenant-{i}")])
            except grpc.aio.AioRpcError as exc:
                return str(dict(pairs(exc.trailing_metadata()))["x-error-reason"])
            return "answered"

        # Each kind of answer once (a refused rotating tenant too), so the loop adds no label set.
        await unknown(0), await rotating(0), await rotating(-1)
        before = (len(sc.breakers), len(sc.proxy.limits), len(sc.routes.table.models))
        size = len(await admin_async(sc, "/metrics"))
        for start in range(1, 3000, 200):
            reasons = await asyncio.gather(*(unknown(i) for i in range(start, start + 200)))
            assert set(reasons) == {"model_not_found"}  # forwarded; the upstream answered
            reasons = await asyncio.gather(*(rotating(i) for i in range(start, start + 200)))
            assert set(reasons) == {"tenant_limit"}  # every other tenant shares the one `*` bucket
        assert (len(sc.breakers), len(sc.proxy.limits), len(sc.routes.table.models)) == before
        assert before[1] == 2  # acme's bucket and the shared one
        metrics = await admin_async(sc, "/metrics")
        assert len(metrics) < size + 2000, "metric series grew with made-up names"
        assert "made-up" not in metrics and "tenant-1" not in metrics
        assert 'model="_other"' in metrics and 'tenant="_other"' in metrics


@pytest.mark.parametrize(
    ("model", "version", "field"),
    [
        ("../etc", "", "model_name"),
        ("", "", None),
        ("scaler", "v" * 10_000, "model_version"),
        ("m" * 1_000_000, "", "model_name"),
        ("a\x00b", "", "model_name"),
    ],
)
async def test_names_are_checked_at_the_edge_with_capped_echoes(
    tmp_path: Path, model: str, version: str, field: str | None
) -> None:
    async with fake_upstream() as fake, through_sidecar([fake.address], None) as (sidecar, channel):
        big = [("grpc.max_send_message_length", 8 << 20)]
        async with grpc.aio.insecure_channel(sidecar.address, options=big) as wide:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await infer(wide, model, version=version)
        error = refused.value
        if field is None:  # an empty name is the upstream's to answer (it has no model "")
            assert error.code() == grpc.StatusCode.NOT_FOUND
            return
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert ("x-error-reason", "invalid_argument") in pairs(error.trailing_metadata())
        assert field in (error.details() or "") and len(error.details() or "") < 400
        # Nothing was made for it (the served version's breaker exists from the start).
        assert {(b["model"], b["version"]) for b in sidecar.breakers.snapshot()} <= {("scaler", "1")}
        # A hostile pin in the header is refused the same way.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await infer(channel, metadata=[("x-model-version", "../" + "x" * 5000)])
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_an_unreachable_upstream_and_an_undecodable_message_name_their_reason() -> None:
    async with fake_upstream() as fake:
        dead = fake.address
    async with through_sidecar([dead], None, known=False) as (_, channel):
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await infer(channel, deadline_s=10)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert ("x-error-reason", "unavailable") in pairs(failed.value.trailing_metadata())
        garbage = b"\x0a\x10abc"
        calls: list[Callable[[], Awaitable[Any]]] = [
            lambda: channel.unary_unary(INFER, None, None)(garbage, timeout=10),
            lambda: collect(channel.unary_stream(INFER_STREAM, None, None)(garbage, timeout=10)),
            lambda: collect(
                channel.stream_stream(MODEL_STREAM_INFER, None, None)(iter([garbage]), timeout=10)
            ),
        ]
        for make in calls:
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await make()
            assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert ("x-error-reason", "invalid_argument") in pairs(failed.value.trailing_metadata())


async def collect(call: Any) -> list[Any]:
    return [message async for message in call]


async def test_an_upstream_killed_mid_call_is_unavailable_not_cancelled(tmp_path: Path) -> None:
    async with fake_upstream() as fake, through_sidecar([fake.address], None) as (_, channel):
        call = asyncio.ensure_future(infer(channel, metadata=call_md("hold", "t")))
        await eventually_held(fake)
        await fake.server.stop(0)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await call
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value
        assert ("x-error-reason", "unavailable") in pairs(failed.value.trailing_metadata())


async def test_a_call_outliving_the_sidecars_grace_is_told_draining(tmp_path: Path) -> None:
    async with fake_upstream() as fake:
        settings = Settings(listen="127.0.0.1:0", upstream=(fake.address,), admin_listen="")
        sidecar = build_sidecar(settings)
        await sidecar.start()
        stopped = False
        try:
            await known_versions(sidecar, "scaler", {"1"})
            async with grpc.aio.insecure_channel(sidecar.address) as channel:
                call = asyncio.ensure_future(infer(channel, metadata=call_md("hold", "t")))
                await eventually_held(fake)
                await sidecar.stop(grace_s=1.0)
                stopped = True
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await call
        finally:
            if not stopped:
                await sidecar.stop(grace_s=1.0)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value
        assert ("x-error-reason", "draining") in pairs(failed.value.trailing_metadata())


async def eventually_held(fake: FakeUpstream) -> None:
    await eventually(lambda: fake.held > 0, "the upstream holds the call")
