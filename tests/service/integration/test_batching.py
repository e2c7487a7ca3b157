"""Dynamic batching through the real service: both gRPC APIs, ONNX Runtime, the served table.

Every version loads as a RecordingRunner (the loader seam of build_service), whose runs can be held
at a gate: a held first request takes the only run slot (max_concurrent_batches: 1) and the test
builds the queue it wants behind it. The batching clock is stepped by hand where a queue timeout
is tested. Nothing waits on the machine's speed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort
import pytest

from models import demo_models
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.kserve.v2 import grpc_service_pb2 as kpb
from modelyard.kserve.v2 import grpc_service_pb2_grpc as kpb_grpc
from modelyard.service.batching.batcher import Batcher
from modelyard.service.runtime.status import VersionState
from modelyard.service.server import Service, build_service
from modelyard.service.settings import Settings
from modelyard.tensors import to_array, to_tensor
from tests.batching_fakes import ManualClock, RecordingRunner, Runners
from tests.support import eventually, metric

WIDTH = 8
DENSE_WIDTH = 64
QUEUED = {
    "priority_levels": 2,
    "default_priority_level": 2,
    "default_queue_policy": {"max_queue_size": 4, "allow_timeout_override": True},
    "priority_queue_policy": {1: {"max_queue_size": 4}},
    "max_concurrent_batches": 1,
}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    # Elementwise: batched outputs are bit-identical to unbatched ones. Batches of 2 rows, so that
    # the order of runs shows who went first.
    demo_models.write_model(
        root,
        "scaled",
        1,
        demo_models.scaled_identity(WIDTH, 2.0),
        {"max_batch_size": 2, "dynamic_batching": QUEUED},
    )
    # MatMuls: ONNX Runtime may pick other kernels for other row counts, so batched outputs are
    # compared with a float tolerance.
    demo_models.write_model(
        root,
        "dense",
        1,
        demo_models.dense_stack(layers=4, width=DENSE_WIDTH, seed=3),
        {"max_batch_size": 32, "dynamic_batching": {"max_concurrent_batches": 1}},
    )
    return root


@pytest.fixture
def runners() -> Runners:
    return Runners()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
async def live(root: Path, runners: Runners, clock: ManualClock) -> AsyncIterator[Service]:
    settings = Settings(
        repository=root, listen="127.0.0.1:0", metrics_listen="", control_mode="explicit", load_model=("*",)
    )
    service = build_service(settings, loader=runners.loader(), clock=clock)
    await service.start()
    try:
        yield service
    finally:
        for runner in runners.loaded.values():
            runner.gate.open()
        await service.stop(grace_s=1.0)


@pytest.fixture
async def channel(live: Service) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(live.address) as chan:
        yield chan


@pytest.fixture
def stub(channel: grpc.aio.Channel) -> pb_grpc.InferenceServiceAsyncStub:
    return pb_grpc.InferenceServiceStub(channel)  # an async stub on an aio channel


@pytest.fixture
def kserve(channel: grpc.aio.Channel) -> kpb_grpc.GRPCInferenceServiceAsyncStub:
    return kpb_grpc.GRPCInferenceServiceStub(channel)


def batcher(service: Service, model: str, version: int = 1) -> Batcher:
    served = service.manager.served(model)
    assert served is not None
    assert service.batching is not None
    found = service.batching.batcher(served.versions[version])
    assert found is not None
    return found


def rejections(service: Service, reason: str) -> float | None:
    return metric(
        service.metrics.registry,
        "modelyard_queue_rejections_total",
        model="scaled",
        version="1",
        priority="2",
        reason=reason,
    )


def row(value: float) -> np.ndarray:
    return np.full((1, WIDTH), value, np.float32)


def infer(
    stub: pb_grpc.InferenceServiceAsyncStub,
    value: float,
    timeout: float | None = None,
    priority: int = 0,
    timeout_us: int = 0,
) -> asyncio.Future[pb.InferResponse]:
    request = pb.InferRequest(
        model_name="scaled",
        inputs=[to_tensor("INPUT0", row(value))],
        priority=priority,
        timeout_us=timeout_us,
    )
    return asyncio.ensure_future(stub.Infer(request, timeout=timeout))


def ran(runner: RecordingRunner) -> list[list[float]]:
    """Which requests (by value) each run held, in order."""
    return [[float(v) for v in x[:, 0]] for x in runner.runs]


async def hold_first(
    service: Service, runners: Runners, stub: pb_grpc.InferenceServiceAsyncStub
) -> asyncio.Future[pb.InferResponse]:
    runner = runners["scaled", 1]
    runner.gate.close()
    first = infer(stub, 0)
    await eventually(lambda: runner.gate.entered == 1, "the first run to start")
    return first


async def queue(
    service: Service,
    stub: pb_grpc.InferenceServiceAsyncStub,
    value: float,
    level: int,
    priority: int = 0,
    timeout_us: int = 0,
) -> asyncio.Future[pb.InferResponse]:
    """Send one request and wait until it is queued, so that arrival order is the order sent."""
    waiting = batcher(service, "scaled")
    before = waiting.queued_at(level)
    call = infer(stub, value, priority=priority, timeout_us=timeout_us)
    await eventually(lambda: waiting.queued_at(level) == before + 1 or call.done(), f"request {value} queued")
    return call


async def test_batches_form_under_concurrency_and_match_unbatched_runs(
    live: Service, runners: Runners, stub: pb_grpc.InferenceServiceAsyncStub, root: Path
) -> None:
    runner = runners["dense", 1]
    runner.gate.close()
    rng = np.random.default_rng(11)
    xs = [rng.standard_normal((1 + i % 2, DENSE_WIDTH), dtype=np.float32) for i in range(16)]
    calls = [
        asyncio.ensure_future(
            stub.Infer(pb.InferRequest(model_name="dense", inputs=[to_tensor("INPUT0", x)]))
        )
        for x in xs
    ]
    waiting = batcher(live, "dense")
    await eventually(lambda: runner.gate.entered == 1 and waiting.queued == 15, "one run and 15 queued")
    runner.gate.open()
    responses = await asyncio.gather(*calls)
    # The first request ran alone; the 15 that queued behind it (23 rows or fewer) ran as one batch.
    assert len(runner.runs) == 2 and len(runner.runs[1]) == sum(len(x) for x in xs) - len(runner.runs[0])
    session = ort.InferenceSession(
        str(root / "dense" / "1" / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    for x, response in zip(xs, responses, strict=True):
        (alone,) = session.run(None, {"INPUT0": x})
        np.testing.assert_allclose(to_array(response.outputs[0]), alone, rtol=1e-5, atol=1e-6)
    labels = {"model": "dense", "version": "1"}
    assert metric(live.metrics.registry, "modelyard_batch_size_count", **labels) == 2
    assert metric(live.metrics.registry, "modelyard_batch_size_sum", **labels) == sum(len(x) for x in xs)
    assert (
        metric(live.metrics.registry, "modelyard_queue_duration_seconds_count", **labels, priority="1") == 16
    )


async def test_high_priority_overtakes_a_saturated_low_priority_queue(
    live: Service, runners: Runners, stub: pb_grpc.InferenceServiceAsyncStub
) -> None:
    first = await hold_first(live, runners, stub)
    low = [await queue(live, stub, 10 + i, level=2) for i in range(4)]  # level 2 holds 4: full
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await infer(stub, 99)  # answered while every run slot is still held: no waiting
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "priority 2 queue" in refused.value.details()
    high = [await queue(live, stub, v, level=1, priority=1) for v in (1, 2)]
    runners["scaled", 1].gate.open()
    responses = await asyncio.gather(first, *low, *high)
    assert ran(runners["scaled", 1]) == [[0], [1, 2], [10, 11], [12, 13]]
    for value, response in zip([0, 10, 11, 12, 13, 1, 2], responses, strict=True):
        np.testing.assert_array_equal(to_array(response.outputs[0]), row(value) * np.float32(2))
    assert rejections(live, "queue_full") == 1


async def test_grpc_deadline_passed_while_queued_never_runs(
    live: Service, runners: Runners, stub: pb_grpc.InferenceServiceAsyncStub
) -> None:
    first = await hold_first(live, runners, stub)
    with pytest.raises(grpc.aio.AioRpcError) as late:
        await infer(stub, 5, timeout=0.3)
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await eventually(lambda: batcher(live, "scaled").queued == 0, "the expired request to leave")
    runners["scaled", 1].gate.open()
    await first
    assert ran(runners["scaled", 1]) == [[0]]


async def test_queue_timeout_from_either_api_expires_and_never_runs(
    live: Service,
    runners: Runners,
    stub: pb_grpc.InferenceServiceAsyncStub,
    kserve: kpb_grpc.GRPCInferenceServiceAsyncStub,
    clock: ManualClock,
) -> None:
    first = await hold_first(live, runners, stub)
    ours = await queue(live, stub, 5, level=2, timeout_us=1000)
    theirs_request = kserve_request(6, timeout=kpb.InferParameter(int64_param=3000))
    theirs = asyncio.ensure_future(kserve.ModelInfer(theirs_request))
    await eventually(lambda: batcher(live, "scaled").queued == 2, "both queued")
    clock.advance(0.002)  # past ours (1 ms), not past theirs (3 ms)
    with pytest.raises(grpc.aio.AioRpcError) as expired:
        await ours
    assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "not run" in expired.value.details()
    assert not theirs.done()
    clock.advance(0.002)
    with pytest.raises(grpc.aio.AioRpcError) as expired:
        await theirs
    assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    runners["scaled", 1].gate.open()
    await first
    assert ran(runners["scaled", 1]) == [[0]]
    assert rejections(live, "deadline") == 2


async def test_cancelled_while_queued_is_removed(
    live: Service, runners: Runners, stub: pb_grpc.InferenceServiceAsyncStub
) -> None:
    first = await hold_first(live, runners, stub)
    leaving = await queue(live, stub, 7, level=2)
    leaving.cancel()
    await eventually(lambda: batcher(live, "scaled").queued == 0, "the cancelled request to leave")
    assert rejections(live, "cancelled") == 1
    runners["scaled", 1].gate.open()
    await first
    assert ran(runners["scaled", 1]) == [[0]]


def kserve_request(value: float, **parameters: kpb.InferParameter) -> kpb.ModelInferRequest:
    request = kpb.ModelInferRequest(model_name="scaled")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, WIDTH])
    request.raw_input_contents.append(row(value).tobytes())
    for name, parameter in parameters.items():
        request.parameters[name].CopyFrom(parameter)
    return request


async def test_kserve_priority_parameter(
    live: Service,
    runners: Runners,
    stub: pb_grpc.InferenceServiceAsyncStub,
    kserve: kpb_grpc.GRPCInferenceServiceAsyncStub,
) -> None:
    for bad, words in (
        (kpb.InferParameter(string_param="high"), "'priority' must be a non-negative integer"),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await kserve.ModelInfer(kserve_request(1, priority=bad))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in refused.value.details()
    first = await hold_first(live, runners, stub)
    low = await queue(live, stub, 10, level=2)
    urgent = asyncio.ensure_future(
        kserve.ModelInfer(kserve_request(1, priority=kpb.InferParameter(uint64_param=1)))
    )
    await eventually(
        lambda: batcher(live, "scaled").queued_at(1) == 1, "the urgent request queued at level 1"
    )
    low_too = await queue(live, stub, 11, level=2)
    runners["scaled", 1].gate.open()
    answer = await urgent
    await asyncio.gather(first, low, low_too)
    assert ran(runners["scaled", 1]) == [[0], [1, 10], [11]]
    np.testing.assert_array_equal(
        np.frombuffer(answer.raw_output_contents[0], np.float32), np.full(WIDTH, 2.0)
    )
    # As Triton: a priority level the model does not have (it has 2) runs at the default level.
    fallback = await kserve.ModelInfer(kserve_request(1, priority=kpb.InferParameter(uint64_param=3)))
    np.testing.assert_array_equal(
        np.frombuffer(fallback.raw_output_contents[0], np.float32), np.full(WIDTH, 2.0)
    )


async def test_a_retiring_version_answers_what_it_has_queued(
    live: Service, runners: Runners, stub: pb_grpc.InferenceServiceAsyncStub, root: Path
) -> None:
    first = await hold_first(live, runners, stub)
    queued = await queue(live, stub, 4, level=2)
    served = live.manager.served("scaled")
    assert served is not None and live.batching is not None
    old = served.versions[1]
    assert live.batching.batcher(old) is not None
    demo_models.write_model(root, "scaled", 2, demo_models.scaled_identity(WIDTH, 3.0))
    await live.manager.load("scaled")  # version 2 replaces version 1 (latest 1)
    newer = await infer(stub, 1)
    assert newer.model_version == "2"
    np.testing.assert_array_equal(to_array(newer.outputs[0]), row(3))
    assert live.manager.status("scaled").versions[1].state == VersionState.DRAINING
    runners["scaled", 1].gate.open()
    for call, value in ((first, 0), (queued, 4)):
        response = await call
        assert response.model_version == "1"
        np.testing.assert_array_equal(to_array(response.outputs[0]), row(value) * np.float32(2))
    await eventually(
        lambda: live.manager.status("scaled").versions[1].state == VersionState.UNLOADED, "version 1 released"
    )
    # The batching layer let go of the retired version's batcher, and its queue series left the registry.
    assert live.batching.batcher(old) is None
    assert live.batching.batcher(live.manager.resolve("scaled")) is not None
    assert (
        metric(live.metrics.registry, "modelyard_queue_depth", model="scaled", version="1", priority="2")
        is None
    )


async def test_model_config_reports_the_batching_policy(
    live: Service, kserve: kpb_grpc.GRPCInferenceServiceAsyncStub
) -> None:
    config = (await kserve.ModelConfig(kpb.ModelConfigRequest(name="scaled"))).config
    batching = config.dynamic_batching
    assert batching.priority_levels == 2 and batching.default_priority_level == 2
    assert batching.default_queue_policy.max_queue_size == 4
    assert batching.default_queue_policy.allow_timeout_override
    assert batching.priority_queue_policy[1].max_queue_size == 4


async def test_stream_chunks_queue_at_the_request_priority(
    live: Service, stub: pb_grpc.InferenceServiceAsyncStub
) -> None:
    x = np.arange(2 * WIDTH, dtype=np.float32).reshape(2, WIDTH)
    request = pb.InferStreamRequest(
        model_name="scaled", inputs=[to_tensor("INPUT0", x)], chunk_size=1, priority=1
    )
    chunks = [to_array(r.outputs[0]) async for r in stub.InferStream(request)]
    assert [len(c) for c in chunks] == [1, 1]
    np.testing.assert_array_equal(np.concatenate(chunks), x * np.float32(2))
    assert (
        metric(
            live.metrics.registry,
            "modelyard_queue_duration_seconds_count",
            model="scaled",
            version="1",
            priority="1",
        )
        == 2
    )
    request.priority = 3
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        async for _ in stub.InferStream(request):
            pass
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
