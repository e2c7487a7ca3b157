"""Model instances through the real service: two CPU sessions of one version serve requests side by
side (held at the loader seam's gates, so that which instance is busy is decided by the test), with
and without dynamic batching, across hot swaps; per-instance metrics show the spread; Triton's
instance_group loads and is reported; a decoder asking for two instances is refused."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from models import demo_models
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.kserve.v2 import grpc_service_pb2 as kpb
from modelyard.kserve.v2 import grpc_service_pb2_grpc as kpb_grpc
from modelyard.kserve.v2 import model_config_pb2 as config_pb
from modelyard.service.runtime.status import VersionState
from modelyard.service.server import Service, build_service
from modelyard.service.settings import Settings
from modelyard.tensors import to_array, to_tensor
from tests import hf_decoder
from tests.batching_fakes import RecordingRunner, Runners
from tests.support import eventually, metric

WIDTH = 8
TWO = {"instances": 2, "intra_op_threads": 1, "inter_op_threads": 1}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    demo_models.write_model(
        root, "scaled", 1, demo_models.scaled_identity(WIDTH, 2.0), {"max_batch_size": 4, "execution": TWO}
    )
    demo_models.write_model(
        root,
        "batched",
        1,
        demo_models.scaled_identity(WIDTH, 3.0),
        {"max_batch_size": 4, "dynamic_batching": {}, "execution": TWO},
    )
    demo_models.write_model(root, "single", 1, demo_models.scaled_identity(WIDTH, 5.0), {"max_batch_size": 4})
    return root


@pytest.fixture
def runners() -> Runners:
    return Runners()


@pytest.fixture
async def live(root: Path, runners: Runners) -> AsyncIterator[Service]:
    settings = Settings(
        repository=root,
        listen="127.0.0.1:0",
        metrics_listen="",
        control_mode="explicit",
        load_model=("*",),
        management_open=True,
    )
    service = build_service(settings, loader=runners.loader())
    await service.start()
    try:
        yield service
    finally:
        for loaded in runners.every.values():
            for runner in loaded:
                runner.gate.open()
        await service.stop(grace_s=1.0)


@pytest.fixture
async def stub(live: Service) -> AsyncIterator[pb_grpc.InferenceServiceAsyncStub]:
    async with grpc.aio.insecure_channel(live.address) as channel:
        yield pb_grpc.InferenceServiceStub(channel)  # an async stub on an aio channel


def row(value: float) -> np.ndarray:
    return np.full((1, WIDTH), value, np.float32)


def infer(
    stub: pb_grpc.InferenceServiceAsyncStub, model: str, value: float
) -> asyncio.Future[pb.InferResponse]:
    request = pb.InferRequest(model_name=model, inputs=[to_tensor("INPUT0", row(value))])
    return asyncio.ensure_future(stub.Infer(request))


def runs_on(service: Service, model: str, instance: str, version: str = "1") -> float | None:
    return metric(
        service.metrics.registry,
        "modelyard_instance_runs_total",
        model=model,
        version=version,
        instance=instance,
        device="cpu",
    )


def held(runners: Runners, model: str) -> list[RecordingRunner]:
    """The two instances of `model` version 1, their gates closed."""
    instances = runners.every[model, 1]
    assert len(instances) == 2  # both loaded before the version served
    for runner in instances:
        runner.gate.close()
    return instances


async def test_concurrent_requests_run_side_by_side_on_the_two_instances(
    live: Service, runners: Runners, stub: pb_grpc.InferenceServiceAsyncStub
) -> None:
    first, second = held(runners, "scaled")
    calls = [infer(stub, "scaled", 1.0), infer(stub, "scaled", 2.0)]
    # One instance alone would hold the second request behind the first: both entered means both
    # instances were running at once, one request each.
    await eventually(lambda: first.gate.entered == 1 and second.gate.entered == 1, "a run on each instance")
    assert metric(live.metrics.registry, "modelyard_instance_in_flight", model="scaled", version="1",
                  instance="1", device="cpu") == 1  # fmt: skip
    first.gate.open()
    second.gate.open()
    answers = [to_array((await call).outputs[0]) for call in calls]
    assert [float(a[0, 0]) for a in answers] == [2.0, 4.0]
    assert (runs_on(live, "scaled", "0"), runs_on(live, "scaled", "1")) == (1, 1)
    # With both free, ties go to instance 0.
    await infer(stub, "scaled", 3.0)
    assert (runs_on(live, "scaled", "0"), runs_on(live, "scaled", "1")) == (2, 1)


async def test_batching_with_two_instances_runs_two_batches_at_once_and_keeps_results(
    live: Service, runners: Runners, stub: pb_grpc.InferenceServiceAsyncStub
) -> None:
    first, second = held(runners, "batched")
    calls = [infer(stub, "batched", 1.0), infer(stub, "batched", 2.0)]
    await eventually(lambda: first.gate.entered == 1 and second.gate.entered == 1, "a batch on each instance")
    served = live.manager.served("batched")
    assert served is not None and live.batching is not None
    batcher = live.batching.batcher(served.versions[1])
    assert batcher is not None
    for value in range(3, 9):
        calls.append(infer(stub, "batched", float(value)))
        await eventually(
            functools.partial(lambda n: batcher.queued == n, value - 2), f"request {value} queued"
        )
    first.gate.open()
    second.gate.open()
    answers = [float(to_array((await call).outputs[0])[0, 0]) for call in calls]
    assert answers == [3.0 * v for v in range(1, 9)]
    ran = [[float(v) for v in x[:, 0]] for runner in (first, second) for x in runner.runs]
    assert sorted(v for batch in ran for v in batch) == [float(v) for v in range(1, 9)]
    assert any(len(batch) > 1 for batch in ran)  # the queued ones ran batched
    assert runs_on(live, "batched", "0") and runs_on(live, "batched", "1")


async def test_a_decoder_asking_for_two_instances_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "models"
    tokenizer = hf_decoder.tiny_tokenizer()
    decoder = hf_decoder.gpt2_like(tokenizer.get_vocab_size())
    hf_decoder.write_decoder(root, "lm", decoder, tokenizer, "execution: {instances: 2}\n")
    demo_models.write_model(root, "other", 1, demo_models.scaled_identity(WIDTH, 2.0), {"max_batch_size": 4})
    service = build_service(Settings(repository=root, listen="127.0.0.1:0", metrics_listen=""))
    await service.start()
    try:
        status = service.manager.status("lm").versions[1]
        assert status.state == VersionState.FAILED
        assert "serves Generate from one session" in status.reason
        assert "instances: 1" in status.reason
        assert service.manager.status("other").versions[1].state == VersionState.READY
    finally:
        await service.stop(grace_s=1.0)


async def test_kserve_load_with_instance_group_count_two_is_served_and_reported(live: Service) -> None:
    async with grpc.aio.insecure_channel(live.address) as channel:
        kserve = kpb_grpc.GRPCInferenceServiceStub(channel)

        async def load(group: dict[str, object]) -> kpb.RepositoryModelLoadResponse:
            config = json.dumps({"max_batch_size": 4, "instance_group": [group]})
            parameters = {"config": kpb.ModelRepositoryParameter(string_param=config)}
            return await kserve.RepositoryModelLoad(
                kpb.RepositoryModelLoadRequest(model_name="single", parameters=parameters)
            )

        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await load({"kind": "KIND_CPU", "count": 99})
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "execution.instances: 99" in str(refused.value.details())
        await load({"kind": "KIND_CPU", "count": 2})
        config = (await kserve.ModelConfig(kpb.ModelConfigRequest(name="single"))).config
        (group,) = config.instance_group
        assert (group.kind, group.count) == (config_pb.ModelInstanceGroup.KIND_CPU, 2)
        request = kpb.ModelInferRequest(model_name="single")
        tensor = request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, WIDTH])
        tensor.contents.fp32_contents.extend(row(1.0).reshape(-1).tolist())
        reply = await kserve.ModelInfer(request)
        raw = reply.raw_output_contents
        out = np.frombuffer(raw[0], np.float32) if raw else np.array(reply.outputs[0].contents.fp32_contents)
        assert out.tolist() == [5.0] * WIDTH
        assert runs_on(live, "single", "0") == 1
        assert runs_on(live, "single", "1") == 0  # the second instance is there, idle


async def test_hot_swaps_with_two_instances_under_load_drop_nothing(tmp_path: Path) -> None:
    root = tmp_path / "models"
    config = {"max_batch_size": 4, "execution": TWO}
    demo_models.write_model(root, "m", 1, demo_models.scaled_identity(WIDTH, 1.0), config)
    settings = Settings(repository=root, listen="127.0.0.1:0", metrics_listen="", watch_quiet_s=0.1)
    service = build_service(settings)
    await service.start()
    answers: list[tuple[int, float]] = []
    failures: list[str] = []
    stop = asyncio.Event()
    newest = 1

    async def client(stub: pb_grpc.InferenceServiceAsyncStub) -> None:
        nonlocal newest
        while not stop.is_set():
            try:
                reply = await stub.Infer(
                    pb.InferRequest(model_name="m", inputs=[to_tensor("INPUT0", row(1.0))])
                )
            except grpc.aio.AioRpcError as exc:
                failures.append(f"{exc.code()}: {exc.details()}")
                continue
            answers.append((int(reply.model_version), float(to_array(reply.outputs[0])[0, 0])))
            newest = max(newest, int(reply.model_version))

    try:
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            clients = [asyncio.ensure_future(client(stub)) for _ in range(4)]
            try:
                for version in range(2, 7):
                    staging = tmp_path / "staging" / f"{version}-{time.monotonic_ns()}"
                    demo_models.write_model(
                        staging, "m", version, demo_models.scaled_identity(WIDTH, version)
                    )
                    os.rename(staging / "m" / str(version), root / "m" / str(version))
                    await eventually(functools.partial(lambda v: newest >= v, version), f"version {version}")
            finally:
                stop.set()
                await asyncio.gather(*clients)
        assert failures == []
        assert all(version == scale for version, scale in answers)  # each answered by its own version
        await eventually(lambda: not service.manager.retiring, "the old versions to retire")
        # The retired versions' instances left the metrics; the newest has both.
        assert runs_on(service, "m", "0", version="1") is None
        assert runs_on(service, "m", "1", version="5") is None
        assert runs_on(service, "m", "0", version="6") is not None
        assert runs_on(service, "m", "1", version="6") is not None
    finally:
        await service.stop(grace_s=1.0)
