"""Each unary inference answer to a proxy's call (one that carries `x-model-dye`, as the sidecar's
do) carries the service's own measurement of its run (issue 34): how long it waited from
admission to the start of its run (`x-queue-us`) and how long the run took (`x-run-us`), in its
trailing metadata beside `x-served-version`, on our Infer, InferFlat and KServe's ModelInfer: what
a sidecar judges a version's latency by, which another version's runs sharing the service cannot
inflate the way they inflate the call's duration. A direct client's answers go without.

A real service in this process; its versions load as real ONNX Runtime runners that the loader
seam wraps so that a run can be held at a gate (tests/batching_fakes.py). No timing asserts: a run
held while the test looks is at least as long as the span the test saw it held, and a call queued
behind it waited at least as long as the test saw it queued.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from models.demo_models import scaled_identity, write_model
from modelyard import flat
from modelyard.common import headers
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.kserve.v2 import grpc_service_pb2 as kpb
from modelyard.kserve.v2 import grpc_service_pb2_grpc as kgrpc
from modelyard.service.runtime.session import load_runner
from modelyard.service.server import Service, build_service
from modelyard.service.settings import Settings
from modelyard.tensors import to_tensor
from tests.batching_fakes import Runners
from tests.support import eventually

WIDTH = 8
DYED = ((headers.MODEL_DYE, headers.DYE_STABLE),)  # as the sidecar sends a stable-dyed call
ONE_AT_A_TIME = {"max_batch_size": 4, "dynamic_batching": {"max_concurrent_batches": 1}}


@pytest.fixture
def runners() -> Runners:
    return Runners(held={("batched", 1), ("plain", 1)})


@pytest.fixture
async def service(tmp_path: Path, runners: Runners) -> AsyncIterator[Service]:
    root = tmp_path / "models"
    write_model(root, "batched", 1, scaled_identity(WIDTH, 2.0), ONE_AT_A_TIME)
    write_model(root, "plain", 1, scaled_identity(WIDTH, 2.0), {"max_batch_size": 4})
    write_model(root, "cheap", 1, scaled_identity(WIDTH, 2.0), {"max_batch_size": 4})
    recording = runners.loader()

    def load(model_file: Path, config: Any, providers: Any) -> Any:
        if model_file.parent.parent.name == "cheap":  # a plain session: runs inline
            return load_runner(model_file, config, providers)
        return recording(model_file, config, providers)

    settings = Settings(repository=root, listen="127.0.0.1:0", metrics_listen="", inference_threads=2)
    running = build_service(settings, loader=load)
    await running.start()
    try:
        yield running
    finally:
        for runner in runners.loaded.values():
            runner.gate.open()
        await running.stop(grace_s=1.0)


@pytest.fixture
async def channel(service: Service) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(service.address) as channel:
        yield channel


def request(model: str) -> pb.InferRequest:
    return pb.InferRequest(model_name=model, inputs=[to_tensor("INPUT0", np.ones((1, WIDTH), np.float32))])


def timing(metadata: Any) -> tuple[int, int]:
    """(x-queue-us, x-run-us) of an answer's trailing metadata: decimal microseconds."""
    found = dict(metadata or ())
    queue, run = found[headers.QUEUE_US], found[headers.RUN_US]
    assert queue.isdigit() and run.isdigit(), (queue, run)
    assert found[headers.SERVED_VERSION] == "1"  # beside it, in the same trailers
    return int(queue), int(run)


async def test_a_held_run_and_a_call_queued_behind_it_say_so(
    service: Service, channel: grpc.aio.Channel, runners: Runners
) -> None:
    stub: Any = pb_grpc.InferenceServiceStub(channel)
    gate = runners[("batched", 1)].gate
    batcher = service.batching.batcher(service.manager.resolve("batched", "1")) if service.batching else None
    assert batcher is not None
    first = stub.Infer(request("batched"), metadata=DYED, timeout=30)
    await eventually(lambda: gate.entered == 1, "the first run held at its gate")
    second = stub.Infer(request("batched"), metadata=DYED, timeout=30)  # one batch at a time: queued
    await eventually(lambda: batcher.queued == 1, "the second call queued behind it")
    held_at = time.perf_counter()
    gate.open()
    opened_at = time.perf_counter()
    await first
    await second
    first_queue, first_run = timing(await first.trailing_metadata())
    second_queue, _ = timing(await second.trailing_metadata())
    assert first_run >= (opened_at - held_at) * 1e6  # it was held at least that long
    assert second_queue >= (opened_at - held_at) * 1e6  # it was seen waiting at least that long
    assert first_queue < second_queue


async def test_every_unary_inference_answer_carries_its_timing(
    channel: grpc.aio.Channel, runners: Runners
) -> None:
    runners[("plain", 1)].gate.open()
    stub: Any = pb_grpc.InferenceServiceStub(channel)
    kserve: Any = kgrpc.GRPCInferenceServiceStub(channel)
    for model in ("cheap", "plain"):  # inline on the loop, and on the executor
        call = stub.Infer(request(model), metadata=DYED, timeout=10)
        await call
        timing(await call.trailing_metadata())
        direct = stub.Infer(request(model), timeout=10)  # no dye: a direct client's call
        await direct
        assert headers.RUN_US not in dict(await direct.trailing_metadata())
        k_request = kpb.ModelInferRequest(model_name=model)
        k_request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, WIDTH])
        k_request.raw_input_contents.append(np.ones((1, WIDTH), np.float32).tobytes())
        k_call = kserve.ModelInfer(k_request, metadata=DYED, timeout=10)
        await k_call
        timing(await k_call.trailing_metadata())
        method = channel.unary_unary(flat.METHOD, None, None)
        x = np.ones((1, WIDTH), np.float32)
        f_call = method(flat.encode_request(model, {"INPUT0": x}), metadata=DYED, timeout=10)
        await f_call
        timing(await f_call.trailing_metadata())
    # Errors carry their reason, not a timing.
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Infer(pb.InferRequest(model_name="cheap"), metadata=DYED, timeout=10)
    assert headers.RUN_US not in dict(refused.value.trailing_metadata() or ())  # type: ignore[arg-type]
