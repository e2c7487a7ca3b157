"""Versions in one service do not disturb each other, and shadows take only spare capacity
(issue 34): each version that runs on the service's run threads has its own bound on them (by
default its share), so a busy version queues its own runs and never another's; a call dyed
`x-model-dye: shadow` runs only on spare capacity and is dropped, not queued, while real calls
wait.

A real service in this process with two run threads, and one real model `m` whose two versions
are the same CPU-bound graph, a Loop that counts to its input (models/value_models.py spin): v1's
calls ask for a thousand iterations (about a millisecond), v2's for FOREVER (a core for a quarter
of an hour, until its caller leaves and the run is stopped). Checked by the versions' own state
(runs going, runs waiting), never by timing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from models import value_models
from models.demo_models import write_model
from models.value_models import FOREVER
from modelyard.common import headers
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.service.runtime.instances import Instances
from modelyard.service.server import Service, build_service
from modelyard.service.settings import Settings
from modelyard.tensors import to_array, to_tensor
from tests.support import eventually, metric

SHADOW = ((headers.MODEL_DYE, headers.DYE_SHADOW),)
QUEUED = 3  # execution.max_queued_runs of m


@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[Service]:
    root = tmp_path / "models"
    config = {"version_policy": {"all": {}}, "execution": {"max_queued_runs": QUEUED}}
    write_model(root, "m", 1, value_models.spin(), config)
    write_model(root, "m", 2, value_models.spin(), config)
    settings = Settings(repository=root, listen="127.0.0.1:0", metrics_listen="", inference_threads=2)
    running = build_service(settings)
    await running.start()
    try:
        yield running
    finally:
        await running.stop(grace_s=1.0)


@pytest.fixture
async def stub(service: Service) -> AsyncIterator[Any]:
    async with grpc.aio.insecure_channel(service.address) as channel:
        yield pb_grpc.InferenceServiceStub(channel)


def spin(version: str, count: int) -> pb.InferRequest:
    return pb.InferRequest(
        model_name="m", model_version=version, inputs=[to_tensor("N", np.array([count], np.int64))]
    )


def runs_of(service: Service, version: str) -> Instances:
    return service.manager.resolve("m", version).instances


def reason(error: grpc.aio.AioRpcError) -> str:
    metadata: Any = error.trailing_metadata() or ()
    return next((str(value) for key, value in metadata if key == "x-error-reason"), "")


async def test_a_busy_version_queues_its_own_runs_and_never_another_versions(
    service: Service, stub: Any
) -> None:
    v1, v2 = runs_of(service, "1"), runs_of(service, "2")
    assert v1.limit == v2.limit == 1  # two versions on two threads: one each
    busy = [stub.Infer(spin("2", FOREVER)) for _ in range(3)]  # until cancelled
    try:
        await eventually(lambda: v2.busy == 1 and v2.waiting == 2, "v2 at its bound, two runs waiting")
        started = v2.all[0].runs
        # A call that waits past its deadline is answered so, and never runs.
        late = stub.Infer(spin("2", 10), timeout=5)  # generous: seen waiting before it passes
        await eventually(lambda: v2.waiting == QUEUED, "the late call waiting too")
        # The queue is bounded: one more is shed at once.
        with pytest.raises(grpc.aio.AioRpcError) as shed:
            await stub.Infer(spin("2", 10), timeout=30)
        assert shed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert reason(shed.value) == "queue_full"
        with pytest.raises(grpc.aio.AioRpcError) as expired:
            await late
        assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await eventually(lambda: v2.waiting == 2, "the late call gone from the queue")
        assert v2.all[0].runs == started  # it never ran
        # v1 answers, again and again, while v2's bound is full and its queue holds calls: its
        # runs take the thread v2 may not.
        for _ in range(3):
            answer = await stub.Infer(spin("1", 1000), timeout=30)
            assert to_array(answer.outputs[0]).tolist() == [1000.0]
        assert (v2.busy, v2.waiting, v1.busy, v1.waiting) == (1, 2, 0, 0)
    finally:
        for call in busy:
            call.cancel()
    # The callers left: the run is stopped, the waiting ones never start, the bound comes back.
    await eventually(lambda: v2.busy == 0 and v2.waiting == 0, "v2's runs stopped")
    answer = await stub.Infer(spin("2", 10), timeout=30)
    assert to_array(answer.outputs[0]).tolist() == [10.0]


async def test_shadows_are_dropped_not_queued_while_real_calls_wait(service: Service, stub: Any) -> None:
    v1, v2 = runs_of(service, "1"), runs_of(service, "2")
    registry = service.metrics.registry

    def shadows(outcome: str) -> float:
        return metric(registry, "modelyard_shadow_calls_total", model="m", outcome=outcome) or 0.0

    # Idle: a shadow runs (on the shadows' own idle-priority thread) and answers.
    answer = await stub.Infer(spin("2", 100), metadata=SHADOW, timeout=30)
    assert to_array(answer.outputs[0]).tolist() == [100.0]
    assert shadows("run") == 1
    busy = [stub.Infer(spin("2", FOREVER)) for _ in range(2)]  # one runs, one waits
    try:
        await eventually(lambda: v2.busy == 1 and v2.waiting == 1, "v2 at its bound, a call waiting")
        for version in ("2", "1"):  # its own version's calls wait; another's would wait behind it
            with pytest.raises(grpc.aio.AioRpcError) as dropped:
                await stub.Infer(spin(version, 100), metadata=SHADOW, timeout=30)
            assert dropped.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert reason(dropped.value) == "shadow_dropped"
            assert "spare capacity" in (dropped.value.details() or "")
            trailing: Any = dropped.value.trailing_metadata() or ()
            assert dict(trailing)[headers.RETRY_PUSHBACK_MS] == "100"  # the mirror is asked to wait
        assert shadows("dropped") == 2
        assert (v2.busy, v2.waiting) == (1, 1)  # the shadows did not queue
        # The dye only ever lowers a call's priority: the same call undyed is a real call, and
        # v1's thread is free for it.
        answer = await stub.Infer(spin("1", 100), timeout=30)
        assert to_array(answer.outputs[0]).tolist() == [100.0]
        assert v1.capacity.shadows == 0
    finally:
        for call in busy:
            call.cancel()
    await eventually(lambda: v2.busy == 0 and v2.waiting == 0, "v2's runs stopped")
    answer = await stub.Infer(spin("1", 100), metadata=SHADOW, timeout=30)  # spare again
    assert to_array(answer.outputs[0]).tolist() == [100.0]
    assert shadows("run") == 2
