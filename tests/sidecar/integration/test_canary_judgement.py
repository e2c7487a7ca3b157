"""A canary judged by what it does to the requests stable serves (issue 34), with both versions in
one real service (a child process: ONNX Runtime runs there, not in this test's loop) and a real
sidecar in front of it (in this process, so that its spans and breakers can be read):

- a canary with a shape bug (models/canary_models.py reshape_bug: it refuses a batch of 2 inside
  its graph, `model_rejected`): its calls are replayed on stable, its users get stable's answers
  (`x-dye-fallback: canary-fault`), the faults are charged to it (its breaker trips, a progressive
  rollout rolls back), and its spans and metrics show them;
- a request that both versions refuse (a value outside the models' lookup table): the client's own
  fault, charged to neither version, even from a lone caller that sends nothing else;
- a canary several times slower than stable from its first call (a CPU-heavy Loop) is cut off on
  the service's own run times (x-run-us), at 1 and at 16 clients; a healthy one (the same graph as
  stable) under the same load is not.

No timing is asserted: outcomes only (who answered, tripped or not), with generous deadlines.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnx
import pytest
import yaml
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from models.canary_models import CONFIG, FEATURES, adds_one, reshape_bug
from models.demo_models import write_model
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.sidecar.breaker_policy import BreakerPolicy
from modelyard.sidecar.server import Sidecar
from modelyard.sidecar.tracing import Tracing
from modelyard.tensors import to_array, to_tensor
from tests.sidecar_support import breaker_state, known_versions, running_sidecar
from tests.support import ServiceProcess, eventually, metric, start_service_process

DEFAULT = BreakerPolicy()
STABLE_WORK = 300  # Loop iterations of stable's run: a few hundred microseconds
SLOW_WORK = 10 * STABLE_WORK  # a canary several times slower from its first call
TOKEN = "judgement-test-token"
CANARY = ("x-canary-weight", "100")  # every call dyed canary


@pytest.fixture(scope="module")
def shape_bug(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    yield from _service(tmp_path_factory.mktemp("shape"), reshape_bug(STABLE_WORK))


@pytest.fixture(scope="module")
def slow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    yield from _service(tmp_path_factory.mktemp("slow"), adds_one(SLOW_WORK))


@pytest.fixture(scope="module")
def healthy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    yield from _service(tmp_path_factory.mktemp("healthy"), adds_one(STABLE_WORK))


def _service(root: Path, canary: onnx.ModelProto) -> Iterator[ServiceProcess]:
    """Model `m`: v1 stable (adds one), v2 the canary, both served by one service."""
    write_model(root / "models", "m", 1, adds_one(STABLE_WORK), CONFIG)
    write_model(root / "models", "m", 2, canary, CONFIG)
    service = start_service_process(root / "models")
    try:
        yield service
    finally:
        service.stop()


def routes(tmp_path: Path, weight: float = 50) -> Path:
    path = tmp_path / "routes.yaml"
    path.write_text(yaml.safe_dump({"models": {"m": {"canary_weight": weight}}}))
    return path


@asynccontextmanager
async def sidecar_for(service: ServiceProcess, tmp_path: Path, **settings: Any) -> AsyncIterator[Sidecar]:
    async with running_sidecar([service.address], **settings) as sidecar:
        await known_versions(sidecar, "m", {"1", "2"})
        yield sidecar


class Answered:
    """One Infer through the sidecar: its rows (None for an error), the code, and the headers."""

    def __init__(self, code: grpc.StatusCode, rows: list[list[float]] | None, trailing: Any) -> None:
        self.code = code
        self.rows = rows
        self.md = {k: v for k, v in trailing or () if isinstance(v, str)}

    @property
    def version(self) -> str | None:
        return self.md.get("x-served-version")

    @property
    def dye(self) -> str | None:
        return self.md.get("x-model-dye")

    @property
    def fallback(self) -> str | None:
        return self.md.get("x-dye-fallback")

    @property
    def reason(self) -> str | None:
        return self.md.get("x-error-reason")


async def infer(
    channel: grpc.aio.Channel, rows: int = 1, value: float = 1.0, user: str = "", canary: bool = False
) -> Answered:
    """One call (an error is an answer too); `user`: its sticky key (none: its connection is who
    calls, and its dye is drawn per call)."""
    md = [*([("x-user-id", user)] if user else []), *([CANARY] if canary else [])]
    x = np.full((rows, FEATURES), value, np.float32)
    request = pb.InferRequest(model_name="m", inputs=[to_tensor("INPUT0", x)])
    call = pb_grpc.InferenceServiceStub(channel).Infer(request, metadata=md, timeout=60)
    try:
        response = await call
    except grpc.aio.AioRpcError as error:
        return Answered(error.code(), None, error.trailing_metadata())
    values: list[list[float]] = to_array(response.outputs[0]).tolist()
    return Answered(grpc.StatusCode.OK, values, await call.trailing_metadata())


def snapshot(sidecar: Sidecar, version: str) -> dict[str, Any]:
    (found,) = [b for b in sidecar.breakers.snapshot() if b["model"] == "m" and b["version"] == version]
    return found


# --- a canary that refuses requests stable serves ---------------------------------------------


async def test_a_canary_with_a_shape_bug_is_answered_by_stable_and_cut_off(
    shape_bug: ServiceProcess, tmp_path: Path
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    config = routes(tmp_path)
    async with (
        sidecar_for(shape_bug, tmp_path, config=config, tracing=Tracing(provider)) as sidecar,
        grpc.aio.insecure_channel(sidecar.address) as channel,
    ):
        seen = []
        for i in range(400):  # users of both dyes, half of them sending a batch of 2
            rows = 1 + i % 2
            answer = await infer(channel, rows, user=f"u{i}")
            assert (answer.code, answer.rows) == (grpc.StatusCode.OK, [[2.0] * FEATURES] * rows)
            seen.append((rows, answer.version, answer.dye, answer.fallback))
            if breaker_state(sidecar, "m", "2") == {"open"}:
                break
        assert breaker_state(sidecar, "m", "2") == {"open"}
        assert snapshot(sidecar, "2")["reason"] in ("error_rate", "consecutive_faults")
        assert breaker_state(sidecar, "m", "1") == {"closed"}
        replayed = seen.count((2, "1", "stable", "canary-fault"))
        assert replayed >= 1  # the canary's users with a batch of 2 got stable's answer
        assert (1, "2", "canary", None) in seen  # a batch of 1 the canary served itself
        assert not [s for s in seen if s[0] == 2 and s[1] == "2"]  # never the canary's error
        # Cut off: new users go to stable, told of no fallback.
        after = [await infer(channel, 2, user=f"new-{i}") for i in range(20)]
        assert {(a.code, a.version, a.dye, a.fallback) for a in after} == {
            (grpc.StatusCode.OK, "1", "stable", None)
        }

        registry = sidecar.metrics.registry
        canary = {"model": "m", "version": "2", "dye": "canary", "code": "FAILED_PRECONDITION"}

        def charged() -> float | None:
            return metric(registry, "modelyard_sidecar_attempts_total", **canary, fault="true")

        await eventually(lambda: charged() == replayed, "the canary's faults counted")
        assert metric(registry, "modelyard_sidecar_attempts_total", **canary, fault="false") is None
        fallbacks = "modelyard_sidecar_dye_fallbacks_total"
        assert metric(registry, fallbacks, model="m", reason="canary-fault") == replayed

    # The trace of a replayed call: the canary's attempt failed with model_rejected, stable's
    # answered, and the call (stable's answer to the client) says why it was stable's.
    spans = exporter.get_finished_spans()
    servers = [s for s in spans if s.kind is SpanKind.SERVER and _attrs(s).get("modelyard.fallback")]
    assert servers and _attrs(servers[0])["modelyard.fallback"] == "canary-fault"
    assert servers[0].status.status_code is StatusCode.UNSET  # the client got an answer
    trace_id = servers[0].context.trace_id if servers[0].context else None
    attempts = [
        s for s in spans if s.kind is SpanKind.CLIENT and s.context and s.context.trace_id == trace_id
    ]
    attempts.sort(key=lambda s: s.start_time or 0)
    assert [(_attrs(s)["modelyard.version"], s.status.status_code) for s in attempts] == [
        ("2", StatusCode.ERROR),
        ("1", StatusCode.UNSET),
    ]
    assert _attrs(attempts[0])["modelyard.error_reason"] == "model_rejected"


async def test_a_progressive_rollout_of_a_shape_bug_rolls_back_and_no_user_sees_its_error(
    shape_bug: ServiceProcess, tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKEN + "\n")
    async with (
        sidecar_for(shape_bug, tmp_path, admin_tokens_file=str(tokens), rollout_tick_s=0.05) as sidecar,
        grpc.aio.insecure_channel(sidecar.address) as channel,
    ):
        spec = {"steps": [10, 50, 100], "dwell_s": 1, "min_calls": 30}
        status, started = await asyncio.to_thread(_admin, sidecar, "/rollouts/m", "POST", spec)
        assert status == 201 and started["weight"] == 10
        rollout = sidecar.rollouts.rollouts["m"]
        calls = 0

        async def ended() -> bool:
            nonlocal calls
            for _ in range(20):  # new users, half of them with a batch of 2
                rows = 1 + calls % 2
                answer = await infer(channel, rows, user=f"r{calls}")
                assert (answer.code, answer.rows) == (grpc.StatusCode.OK, [[2.0] * FEATURES] * rows)
                calls += 1
            return not rollout.active

        await eventually(ended, "the rollout to end", within_s=90)
        assert rollout.state == "failed", rollout.reason  # never promoted
        assert "errors" in (rollout.reason or "") or "breaker" in (rollout.reason or "")
        assert sidecar.routes.table.route("m").canary_weight == 0
        after = [await infer(channel, 2, user=f"after-{i}") for i in range(20)]
        assert {(a.version, a.dye) for a in after} == {("1", "stable")}


async def test_a_request_both_versions_refuse_is_the_clients_fault_and_charged_to_neither(
    shape_bug: ServiceProcess, tmp_path: Path
) -> None:
    async with (
        sidecar_for(shape_bug, tmp_path, config=routes(tmp_path)) as sidecar,
        grpc.aio.insecure_channel(sidecar.address) as channel,
    ):
        # One lone caller (a canary may trip on a lone caller's faults) sending only values that
        # no version serves: each is refused by the canary, replayed, and refused by stable too.
        calls = 4 * DEFAULT.consecutive_faults + DEFAULT.min_calls
        answers = [await infer(channel, 1 + i % 2, value=100.0, canary=True) for i in range(calls)]
        assert {(a.code, a.reason, a.dye, a.fallback) for a in answers} == {
            (grpc.StatusCode.FAILED_PRECONDITION, "model_rejected", "stable", "replayed")
        }
        for version in ("1", "2"):
            found = snapshot(sidecar, version)
            assert (found["state"], found["window_faults"]) == ("closed", 0), found
        # The canary still serves what it serves, to this caller and to others.
        assert (await infer(channel, canary=True)).version == "2"
        assert (await infer(channel, user="someone", canary=True)).version == "2"

        registry = sidecar.metrics.registry
        canary = {"model": "m", "version": "2", "dye": "canary", "code": "FAILED_PRECONDITION"}
        await eventually(
            lambda: metric(registry, "modelyard_sidecar_attempts_total", **canary, fault="false") == calls,
            "the canary's refusals counted, as no fault",
        )
        assert metric(registry, "modelyard_sidecar_attempts_total", **canary, fault="true") is None
        answered = {"method": "Infer", "model": "m", "version": "1", "dye": "stable"}
        refused = {"code": "FAILED_PRECONDITION", "fallback": "replayed"}
        assert metric(registry, "modelyard_sidecar_requests_total", **answered, **refused) == calls
        fallbacks = "modelyard_sidecar_dye_fallbacks_total"
        assert metric(registry, fallbacks, model="m", reason="replayed") == calls
        assert metric(registry, fallbacks, model="m", reason="canary-fault") is None


async def test_a_stream_the_canary_refuses_before_its_first_message_is_replayed_on_stable(
    shape_bug: ServiceProcess, tmp_path: Path
) -> None:
    """InferStream of 4 rows (chunks of 2): the canary refuses it before its first message, stable
    streams the answer, the canary is charged; values both refuse: charged to neither."""
    async with (
        sidecar_for(shape_bug, tmp_path, config=routes(tmp_path)) as sidecar,
        grpc.aio.insecure_channel(sidecar.address) as channel,
    ):
        stub = pb_grpc.InferenceServiceStub(channel)

        async def stream(value: float) -> tuple[list[pb.InferStreamResponse], dict[str, str], str]:
            x = np.full((4, FEATURES), value, np.float32)
            request = pb.InferStreamRequest(model_name="m", inputs=[to_tensor("INPUT0", x)], chunk_size=2)
            call = stub.InferStream(request, metadata=[CANARY], timeout=60)
            chunks: list[pb.InferStreamResponse] = []
            try:
                chunks = [chunk async for chunk in call]
            except grpc.aio.AioRpcError as error:
                trailing: Any = error.trailing_metadata() or ()
                return chunks, {k: v for k, v in trailing if isinstance(v, str)}, "error"
            initial = {k: v for k, v in await call.initial_metadata() or () if isinstance(v, str)}
            return chunks, initial, "ok"

        chunks, md, ended = await stream(1.0)
        assert ended == "ok" and chunks and {c.model_version for c in chunks} == {"1"}
        rows = [row for c in chunks for row in to_array(c.outputs[0]).tolist()]
        assert rows == [[2.0] * FEATURES] * 4
        assert (md["x-model-dye"], md["x-dye-fallback"]) == ("stable", "canary-fault")
        assert snapshot(sidecar, "2")["window_faults"] == 1
        chunks, md, ended = await stream(100.0)
        assert (ended, chunks, md["x-error-reason"], md["x-dye-fallback"]) == (
            "error",
            [],
            "model_rejected",
            "replayed",
        )
        assert snapshot(sidecar, "2")["window_faults"] == 1  # the request's fault: not charged


# --- latency: judged on the service's own run times -------------------------------------------


async def _load(sidecar: Sidecar, clients: int, until: Any, calls_each: int) -> list[Answered]:
    """`clients` callers, each on its own connection (its own caller key), calling back to back
    until `until()` holds or each made `calls_each` calls; every answer must be a good one."""
    answers: list[Answered] = []
    stop = asyncio.Event()

    async def client() -> None:
        async with grpc.aio.insecure_channel(sidecar.address) as channel:
            for _ in range(calls_each):
                if stop.is_set():
                    return
                answer = await infer(channel)
                assert (answer.code, answer.rows) == (grpc.StatusCode.OK, [[2.0] * FEATURES])
                answers.append(answer)
                if until():
                    stop.set()

    await asyncio.gather(*(client() for _ in range(clients)))
    return answers


@pytest.mark.parametrize("clients", [1, 16])
async def test_a_canary_several_times_slower_from_its_start_is_cut_off(
    slow: ServiceProcess, tmp_path: Path, clients: int
) -> None:
    async with sidecar_for(slow, tmp_path, config=routes(tmp_path)) as sidecar:
        opened = lambda: breaker_state(sidecar, "m", "2") == {"open"}  # noqa: E731
        answers = await _load(sidecar, clients, opened, calls_each=max(100, 3000 // clients))
        assert opened(), snapshot(sidecar, "2")
        assert snapshot(sidecar, "2")["reason"] == "latency"  # judged against stable's median
        assert {a.version for a in answers} <= {"1", "2"}
        async with grpc.aio.insecure_channel(sidecar.address) as channel:
            after = [await infer(channel, user=f"new-{i}") for i in range(20)]
        assert {(a.version, a.dye, a.fallback) for a in after} == {("1", "stable", None)}


@pytest.mark.parametrize("clients", [1, 16])
async def test_a_healthy_canary_under_the_same_load_is_not_cut_off(
    healthy: ServiceProcess, tmp_path: Path, clients: int
) -> None:
    async with sidecar_for(healthy, tmp_path, config=routes(tmp_path)) as sidecar:
        judged = 0

        def judged_enough() -> bool:
            nonlocal judged
            found = snapshot(sidecar, "2")
            if found["limit_s"] is not None:  # judged against stable at least once
                judged = max(judged, int(found["window_calls"]))
            return judged >= 2 * DEFAULT.latency_min_calls  # past the medians, on p99s

        answers = await _load(sidecar, clients, judged_enough, calls_each=max(200, 4000 // clients))
        assert judged_enough(), snapshot(sidecar, "2")
        assert breaker_state(sidecar, "m", "2") == {"closed"}
        transitions = metric(
            sidecar.metrics.registry,
            "modelyard_sidecar_breaker_transitions_total",
            upstream=healthy.address,
            model="m",
            version="2",
            to="open",
        )
        assert not transitions  # never opened, not even for a moment
        assert {a.version for a in answers} == {"1", "2"}
        assert not [a for a in answers if a.fallback]


def _attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def _admin(sidecar: Sidecar, path: str, method: str = "GET", body: object = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"http://{sidecar.admin_address}{path}", data=data, method=method)
    request.add_header("Authorization", f"Bearer {TOKEN}")
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
