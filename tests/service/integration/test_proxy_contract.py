"""The service as a proxy sees it, through both APIs: request metadata (x-model-version,
x-request-id, x-priority) fills what the message leaves empty, every answer names its version in
x-served-version (a unary answer's trailing metadata, a stream's initial metadata), and every
error names its reason in x-error-reason (trailing metadata), so that overload and faults are
told from client mistakes without parsing messages.

The service runs in this process with the loader seam of build_service: every version loads as a
RecordingRunner whose runs can be held at a gate (to build a queue), and the "scaler" model's runner
fails any run whose input holds a NaN (a runtime fault on valid-looking input). The batching clock
is stepped by hand for the queue timeout."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from models import demo_models
from modelyard.common import headers
from modelyard.common.reasons import ErrorReason, is_server_fault
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.inference.v1 import model_service_pb2 as mpb
from modelyard.inference.v1 import model_service_pb2_grpc as mpb_grpc
from modelyard.kserve.v2 import grpc_service_pb2 as kpb
from modelyard.kserve.v2 import grpc_service_pb2_grpc as kpb_grpc
from modelyard.service.api.kserve.servicer import ERROR_REASON_PARAMETER
from modelyard.service.batching.batcher import Batcher
from modelyard.service.repository.model_config import ModelConfig
from modelyard.service.runtime.providers import ProviderChoice
from modelyard.service.runtime.session import ModelRunner
from modelyard.service.server import Service, build_service
from modelyard.service.settings import Settings
from modelyard.tensors import to_array, to_tensor
from tests.batching_fakes import ManualClock, RecordingRunner, Runners
from tests.support import eventually

LIMIT = 1 << 20  # the service's max_message_bytes here; gRPC's own limit is twice that
WIDTH = 8  # the batching model "scaled"
QUEUED = {
    "priority_levels": 2,
    "default_priority_level": 2,
    "default_queue_policy": {"max_queue_size": 2, "allow_timeout_override": True},
    "max_concurrent_batches": 1,
}


@dataclass(frozen=True)
class NaNFailingRunner(RecordingRunner):
    """A runtime fault on input the schema accepts: any NaN makes the run raise."""

    def run(
        self, feeds: Mapping[str, np.ndarray], output_names: Sequence[str], options: Any = None
    ) -> list[np.ndarray]:
        if any(np.isnan(v).any() for v in feeds.values()):
            raise RuntimeError("the kernel failed on a NaN")
        return super().run(feeds, output_names, options)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    demo_models.build_demo_repository(root)  # classifier, scaler v1 (x2) and v2 (x3), mixed
    demo_models.write_model(
        root,
        "scaled",
        1,
        demo_models.scaled_identity(WIDTH, 2.0),
        {"max_batch_size": 2, "dynamic_batching": QUEUED},
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
    recording = runners.loader()

    def load(model_file: Path, config: ModelConfig, providers: ProviderChoice) -> ModelRunner:
        runner = recording(model_file, config, providers)
        if model_file.parent.parent.name != "scaler":
            return runner
        return NaNFailingRunner(**{f.name: getattr(runner, f.name) for f in fields(runner)})

    settings = Settings(
        repository=root,
        listen="127.0.0.1:0",
        metrics_listen="",
        control_mode="explicit",
        load_model=("*",),
        management_open=True,
        max_message_bytes=LIMIT,
    )
    service = build_service(settings, loader=load, clock=clock)
    await service.start()
    try:
        yield service
    finally:
        for runner in runners.loaded.values():
            runner.gate.open()
        await service.stop(grace_s=1.0)


@pytest.fixture
async def channel(live: Service) -> AsyncIterator[grpc.aio.Channel]:
    # The client may send more than the server takes: the server's answer is what is tested.
    options = [("grpc.max_send_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(live.address, options=options) as chan:
        yield chan


@pytest.fixture
def stub(channel: grpc.aio.Channel) -> pb_grpc.InferenceServiceAsyncStub:
    return pb_grpc.InferenceServiceStub(channel)  # an async stub on an aio channel


@pytest.fixture
def kserve(channel: grpc.aio.Channel) -> kpb_grpc.GRPCInferenceServiceAsyncStub:
    return kpb_grpc.GRPCInferenceServiceStub(channel)


def meta(**values: str) -> tuple[tuple[str, str], ...]:
    """Request metadata: meta(version="1") sends x-model-version: 1."""
    keys = {"version": headers.MODEL_VERSION, "request_id": headers.REQUEST_ID, "priority": headers.PRIORITY}
    return tuple((keys[name], value) for name, value in values.items())


def first(metadata: Any, key: str) -> str | None:
    for name, value in metadata or ():
        if name == key:
            return str(value)
    return None


def reason(error: grpc.aio.AioRpcError) -> str | None:
    return first(error.trailing_metadata(), headers.ERROR_REASON)


def scaler(version: str = "", rows: int = 1, value: float = 1.0, **fields: Any) -> pb.InferRequest:
    x = np.full((rows, 16), value, np.float32)
    return pb.InferRequest(
        model_name="scaler", model_version=version, inputs=[to_tensor("INPUT0", x)], **fields
    )


def kserve_scaler(version: str = "", value: float = 1.0, **fields: Any) -> kpb.ModelInferRequest:
    request = kpb.ModelInferRequest(model_name="scaler", model_version=version, **fields)
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16])
    request.raw_input_contents.append(np.full((1, 16), value, np.float32).tobytes())
    return request


def kserve_scaled(value: float, **parameters: kpb.InferParameter) -> kpb.ModelInferRequest:
    request = kpb.ModelInferRequest(model_name="scaled")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, WIDTH])
    request.raw_input_contents.append(np.full((1, WIDTH), value, np.float32).tobytes())
    for name, parameter in parameters.items():
        request.parameters[name].CopyFrom(parameter)
    return request


async def refused(call: Any) -> grpc.aio.AioRpcError:
    """The error a call ends with (unary, or a stream read to its end)."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        if hasattr(call, "__aiter__"):
            async for _ in call:
                pass
        else:
            await call
    return caught.value


# --- request metadata ---------------------------------------------------------------------------


async def test_headers_fill_empty_fields_and_fields_win_on_our_api(stub) -> None:
    call = stub.Infer(scaler(), metadata=meta(version="1", request_id="from-header"))
    response = await call
    assert (response.model_version, response.request_id) == ("1", "from-header")
    np.testing.assert_array_equal(to_array(response.outputs[0]), np.full((1, 16), 2.0, np.float32))
    assert first(await call.trailing_metadata(), headers.SERVED_VERSION) == "1"
    # A unary answer sends no initial metadata of its own (a write of its own in grpc.aio).
    assert first(await call.initial_metadata(), headers.SERVED_VERSION) is None
    # The message's own fields win over the headers.
    call = stub.Infer(scaler("2", request_id="mine"), metadata=meta(version="1", request_id="theirs"))
    response = await call
    assert (response.model_version, response.request_id) == ("2", "mine")
    assert first(await call.trailing_metadata(), headers.SERVED_VERSION) == "2"
    # Neither: the newest version, and x-served-version says which it was.
    call = stub.Infer(scaler())
    assert (await call).model_version == "2"
    assert first(await call.trailing_metadata(), headers.SERVED_VERSION) == "2"


async def test_infer_stream_takes_the_headers_and_names_its_version_before_the_first_chunk(stub) -> None:
    request = pb.InferStreamRequest(
        model_name="scaler", inputs=[to_tensor("INPUT0", np.ones((3, 16), np.float32))], chunk_size=1
    )
    call = stub.InferStream(request, metadata=meta(version="1", request_id="s-1"))
    assert first(await call.initial_metadata(), headers.SERVED_VERSION) == "1"
    responses = [r async for r in call]
    assert len(responses) == 3
    assert {(r.model_version, r.request_id) for r in responses} == {("1", "s-1")}
    request.model_version, request.request_id = "2", "own"
    call = stub.InferStream(request, metadata=meta(version="1", request_id="s-1"))
    assert first(await call.initial_metadata(), headers.SERVED_VERSION) == "2"
    assert {(r.model_version, r.request_id) async for r in call} == {("2", "own")}


async def test_kserve_takes_the_headers_where_the_request_leaves_them_empty(kserve) -> None:
    call = kserve.ModelInfer(kserve_scaler(), metadata=meta(version="1", request_id="k-1"))
    response = await call
    assert (response.model_version, response.id) == ("1", "k-1")
    assert np.frombuffer(response.raw_output_contents[0], np.float32)[0] == 2.0
    assert first(await call.trailing_metadata(), headers.SERVED_VERSION) == "1"
    call = kserve.ModelInfer(kserve_scaler("2", id="own"), metadata=meta(version="1", request_id="k-1"))
    response = await call
    assert (response.model_version, response.id) == ("2", "own")
    assert first(await call.trailing_metadata(), headers.SERVED_VERSION) == "2"
    # The calls that describe one version name it too.
    for describe, version in (
        (kserve.ModelMetadata(kpb.ModelMetadataRequest(name="scaler", version="1")), "1"),
        (kserve.ModelConfig(kpb.ModelConfigRequest(name="scaler")), "2"),
    ):
        await describe
        assert first(await describe.trailing_metadata(), headers.SERVED_VERSION) == version


async def test_kserve_stream_names_its_first_version_and_answers_each_request(kserve) -> None:
    # One stream, several versions: x-served-version is the first response's; each response
    # names its own. A failed request answers in-band, with its reason as a parameter.
    requests = [kserve_scaler(id="a"), kserve_scaler("2", id="b"), kserve_scaler("7", id="c")]
    call = kserve.ModelStreamInfer(iter(requests), metadata=meta(version="1"))
    assert first(await call.initial_metadata(), headers.SERVED_VERSION) == "1"
    answers = [r async for r in call]
    assert [(r.infer_response.id, r.infer_response.model_version) for r in answers[:2]] == [
        ("a", "1"),
        ("b", "2"),
    ]
    assert [r.error_message for r in answers[:2]] == ["", ""]
    failed = answers[2]
    assert "'scaler' version 7 is not found" in failed.error_message and failed.infer_response.id == "c"
    assert failed.infer_response.parameters[ERROR_REASON_PARAMETER].string_param == "version_not_found"
    # A stream whose first answer is an error has no served version to name.
    call = kserve.ModelStreamInfer(iter([kserve_scaler("7"), kserve_scaler()]))
    assert first(await call.initial_metadata(), headers.SERVED_VERSION) is None
    answers = [r async for r in call]
    assert answers[0].error_message and answers[1].infer_response.model_version == "2"


def batcher(service: Service, model: str = "scaled") -> Batcher:
    served = service.manager.served(model)
    assert served is not None and service.batching is not None
    found = service.batching.batcher(served.versions[1])
    assert found is not None
    return found


def scaled(value: float, **fields: Any) -> pb.InferRequest:
    x = np.full((1, WIDTH), value, np.float32)
    return pb.InferRequest(model_name="scaled", inputs=[to_tensor("INPUT0", x)], **fields)


async def hold_first(
    live: Service, runners: Runners, stub: pb_grpc.InferenceServiceAsyncStub
) -> asyncio.Future[pb.InferResponse]:
    """Take the only run slot of "scaled" with a held run, so that what follows queues."""
    gate = runners["scaled", 1].gate
    entered = gate.entered
    gate.close()
    held = asyncio.ensure_future(stub.Infer(scaled(0)))
    await eventually(lambda: gate.entered == entered + 1, "the held run to start")
    return held


async def test_priority_header_where_the_request_names_none_on_both_apis(
    live: Service, runners: Runners, stub, kserve
) -> None:
    # The model has 2 levels: on our API a header naming level 3 is refused, so the header was
    # read. (KServe runs a priority the model lacks at the default level, as Triton does, for the
    # parameter and the header alike.)
    error = await refused(stub.Infer(scaled(1), metadata=meta(priority="3")))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "priority 3" in error.details()
    assert (await kserve.ModelInfer(kserve_scaled(1), metadata=meta(priority="3"))).model_version == "1"
    for bad in ("high", "-1", "1.5", str(2**32)):
        error = await refused(stub.Infer(scaled(1), metadata=meta(priority=bad)))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert headers.PRIORITY in error.details() and reason(error) == ErrorReason.INVALID_ARGUMENT
    # The request's own priority wins: the bad header is not even read.
    assert (await stub.Infer(scaled(1, priority=1), metadata=meta(priority="high"))).model_version == "1"
    one = kpb.InferParameter(uint64_param=1)
    answer = await kserve.ModelInfer(kserve_scaled(1, priority=one), metadata=meta(priority="x"))
    assert answer.model_version == "1"
    # And the header's level is the one queued at.
    held = await hold_first(live, runners, stub)
    ours = asyncio.ensure_future(stub.Infer(scaled(2), metadata=meta(priority="1")))
    await eventually(lambda: batcher(live).queued_at(1) == 1, "our request queued at level 1")
    theirs = asyncio.ensure_future(kserve.ModelInfer(kserve_scaled(3), metadata=meta(priority="1")))
    await eventually(lambda: batcher(live).queued_at(1) == 2, "the KServe request queued at level 1")
    assert batcher(live).queued_at(2) == 0
    runners["scaled", 1].gate.open()
    await asyncio.gather(held, ours, theirs)


# --- error reasons --------------------------------------------------------------------------------


async def test_client_mistakes_name_their_reason_on_both_apis(stub, kserve) -> None:
    cases = [
        (stub.Infer(pb.InferRequest(model_name="scaler")), "INVALID_ARGUMENT", "invalid_argument"),
        (stub.Infer(scaler("v9")), "NOT_FOUND", "version_not_found"),
        (stub.Infer(scaler("banana")), "INVALID_ARGUMENT", "invalid_argument"),
        (stub.Infer(pb.InferRequest(model_name="nope")), "NOT_FOUND", "model_not_found"),
        (stub.Infer(scaler(), metadata=meta(version="9")), "NOT_FOUND", "version_not_found"),
        (
            stub.Generate(pb.GenerateRequest(model_name="classifier", prompt="hi")),
            "FAILED_PRECONDITION",
            "failed_precondition",
        ),
        (stub.Generate(pb.GenerateRequest(model_name="nope", prompt="hi")), "NOT_FOUND", "model_not_found"),
        (
            stub.InferStream(pb.InferStreamRequest(model_name="scaler", model_version="9")),
            "NOT_FOUND",
            "version_not_found",
        ),
        (kserve.ModelInfer(kserve_scaler("9")), "NOT_FOUND", "version_not_found"),
        (kserve.ModelInfer(kpb.ModelInferRequest(model_name="nope")), "NOT_FOUND", "model_not_found"),
        (
            kserve.ModelInfer(kpb.ModelInferRequest(model_name="scaler")),
            "INVALID_ARGUMENT",
            "invalid_argument",
        ),
        (kserve.ModelMetadata(kpb.ModelMetadataRequest(name="nope")), "NOT_FOUND", "model_not_found"),
    ]
    for call, code, why in cases:
        error = await refused(call)
        assert (error.code().name, reason(error)) == (code, why), error.details()
        assert not is_server_fault(why)


async def test_a_runtime_fault_is_model_failed_and_counts_against_a_breaker(stub, kserve) -> None:
    error = await refused(stub.Infer(scaler(value=float("nan"))))
    assert error.code() == grpc.StatusCode.INTERNAL and "NaN" in error.details()
    assert reason(error) == ErrorReason.MODEL_FAILED and is_server_fault(reason(error) or "")
    error = await refused(kserve.ModelInfer(kserve_scaler(value=float("nan"))))
    assert (error.code(), reason(error)) == (grpc.StatusCode.INTERNAL, ErrorReason.MODEL_FAILED)
    # The model still answers good requests.
    assert (await stub.Infer(scaler())).model_version == "2"


async def test_an_unloaded_model_is_draining(live: Service, stub, channel) -> None:
    await mpb_grpc.ModelServiceStub(channel).UnloadModel(mpb.UnloadModelRequest(name="scaler"))
    error = await refused(stub.Infer(scaler()))
    assert (error.code(), reason(error)) == (grpc.StatusCode.UNAVAILABLE, ErrorReason.DRAINING)


def big(rows: int) -> pb.InferRequest:
    return scaler(rows=rows)


async def test_queue_full_and_too_large_are_both_resource_exhausted_told_apart_by_reason(
    live: Service, runners: Runners, stub, kserve
) -> None:
    held = await hold_first(live, runners, stub)
    queued = [asyncio.ensure_future(stub.Infer(scaled(v))) for v in (1, 2)]
    await eventually(lambda: batcher(live).queued_at(2) == 2, "the level-2 queue to fill")
    full = await refused(stub.Infer(scaled(3)))
    too_big = await refused(stub.Infer(big(rows=LIMIT // 64 + 1000)))  # over the limit, under 2x
    assert full.code() == too_big.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (reason(full), reason(too_big)) == (ErrorReason.QUEUE_FULL, ErrorReason.TOO_LARGE)
    assert f"limit of {LIMIT} bytes" in too_big.details()
    full = await refused(kserve.ModelInfer(kserve_scaled(3)))
    assert (full.code(), reason(full)) == (grpc.StatusCode.RESOURCE_EXHAUSTED, ErrorReason.QUEUE_FULL)
    runners["scaled", 1].gate.open()
    await asyncio.gather(held, *queued)


async def test_too_large_on_every_kind_of_call(live: Service, stub, kserve) -> None:
    rows = LIMIT // 64 + 1000
    x = np.ones((rows, 16), np.float32)
    calls: list[Callable[[], Any]] = [
        lambda: stub.Infer(big(rows)),
        lambda: stub.InferStream(pb.InferStreamRequest(model_name="scaler", inputs=[to_tensor("INPUT0", x)])),
        lambda: stub.Generate(pb.GenerateRequest(model_name="scaler", prompt="x" * (LIMIT + 10))),
        lambda: kserve.ModelInfer(kserve_big(x)),
        # On a KServe stream an oversized message ends the stream (the servicer never saw it, so
        # it cannot answer it in-band); the answers before it arrive first.
        lambda: kserve.ModelStreamInfer(iter([kserve_scaler(id="ok"), kserve_big(x)])),
    ]
    for make in calls:
        error = await refused(make())
        assert (error.code(), reason(error)) == (grpc.StatusCode.RESOURCE_EXHAUSTED, ErrorReason.TOO_LARGE)
    answers: list[kpb.ModelStreamInferResponse] = []
    stream = kserve.ModelStreamInfer(iter([kserve_scaler(id="ok"), kserve_big(x)]))
    with pytest.raises(grpc.aio.AioRpcError):
        async for answer in stream:
            answers.append(answer)
    assert [a.infer_response.id for a in answers] == ["ok"]
    # A message under the limit passes the check (and is refused only for its 16000 rows, more
    # than the model's max batch of 64), and the service is unharmed.
    error = await refused(stub.Infer(big(rows=LIMIT // 64 - 100)))
    assert (error.code(), reason(error)) == (grpc.StatusCode.INVALID_ARGUMENT, ErrorReason.INVALID_ARGUMENT)
    assert (await stub.Infer(scaler())).model_version == "2"


def kserve_big(x: np.ndarray) -> kpb.ModelInferRequest:
    request = kpb.ModelInferRequest(model_name="scaler")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=list(x.shape))
    request.raw_input_contents.append(x.tobytes())
    return request


async def test_beyond_the_transport_limit_grpc_answers_alone_without_a_reason(stub) -> None:
    # Over twice the limit gRPC itself refuses the message before any handler runs: the one
    # RESOURCE_EXHAUSTED without x-error-reason (a proxy reads it as too_large; queue_full always
    # carries its reason).
    error = await refused(stub.Infer(big(rows=2 * LIMIT // 64 + 1000)))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and reason(error) is None
    assert (await stub.Infer(scaler())).model_version == "2"


async def test_a_queue_timeout_is_deadline(
    live: Service, runners: Runners, stub, kserve, clock: ManualClock
) -> None:
    held = await hold_first(live, runners, stub)
    ours = asyncio.ensure_future(stub.Infer(scaled(1, timeout_us=1000)))
    theirs = asyncio.ensure_future(
        kserve.ModelInfer(kserve_scaled(2, timeout=kpb.InferParameter(int64_param=1000)))
    )
    await eventually(lambda: batcher(live).queued_at(2) == 2, "both queued")
    clock.advance(0.002)
    for call in (ours, theirs):
        error = await refused(call)
        assert (error.code(), reason(error)) == (grpc.StatusCode.DEADLINE_EXCEEDED, ErrorReason.DEADLINE)
    runners["scaled", 1].gate.open()
    await held


@pytest.fixture
async def gen_live(tmp_path: Path) -> AsyncIterator[Service]:
    root = tmp_path / "generation"
    assert demo_models.copy_trained_models(demo_models.COMMITTED_ROOT, root) == ["codelm"]
    service = build_service(Settings(repository=root, listen="127.0.0.1:0", metrics_listen=""))
    await service.start()
    try:
        yield service
    finally:
        await service.stop(grace_s=1.0)


async def test_generate_takes_the_headers_and_names_its_version_before_the_first_token(
    gen_live: Service,
) -> None:
    async with grpc.aio.insecure_channel(gen_live.address) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        request = pb.GenerateRequest(model_name="codelm", prompt="def ", max_tokens=3)
        call = stub.Generate(request, metadata=meta(version="1", request_id="g-1", priority="1"))
        assert first(await call.initial_metadata(), headers.SERVED_VERSION) == "1"
        events = [e async for e in call]
        assert events[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert {(e.model_version, e.request_id) for e in events} == {("1", "g-1")}
        for version, why in (("9", "version_not_found"), ("x", "invalid_argument")):
            error = await refused(stub.Generate(request, metadata=meta(version=version)))
            assert reason(error) == why, error.details()
        error = await refused(stub.Generate(request, metadata=meta(priority="urgent")))
        assert reason(error) == "invalid_argument" and headers.PRIORITY in error.details()
