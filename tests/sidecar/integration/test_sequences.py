"""Stateful sequences through the sidecar: a sequence's steps never change upstream or version
mid-way. Real services (in this process) hold the sequences' state; without the pin, the
upstreams' turn (two upstreams serving the same version) or a per-call canary dye would send a
step where its sequence is not, and the service there would refuse it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest

from models.demo_models import write_model
from modelyard.kserve.v2 import grpc_service_pb2 as pb
from modelyard.kserve.v2 import grpc_service_pb2_grpc as pb_grpc
from modelyard.service.server import Service, build_service
from modelyard.service.settings import Settings
from tests.sequence_models import ACCUMULATOR_STATE, _int32_controls, accumulator, sequence_config
from tests.service.integration.test_sequences import batcher_of, step, value_of
from tests.sidecar_support import known_versions, running_sidecar

STEPS = [3, 1, 4, 1, 5]
SUMS = [3, 4, 8, 9, 14]


def write_accumulator(root: Path, versions: tuple[int, ...], policy: dict[str, Any] | None = None) -> Path:
    config = sequence_config(_int32_controls("START", "READY"), states=[ACCUMULATOR_STATE], max_batch_size=16)
    if policy is not None:
        config["version_policy"] = policy
    for version in versions:
        write_model(root, "accumulator", version, accumulator(), config)
    return root


@asynccontextmanager
async def services(root: Path, count: int) -> AsyncIterator[list[Service]]:
    started = [
        build_service(Settings(repository=root, listen="127.0.0.1:0", metrics_listen=""))
        for _ in range(count)
    ]
    try:
        for service in started:
            await service.start()
        yield started
    finally:
        for service in started:
            await service.stop(grace_s=1.0)


async def stepped(
    stub: Any, sequence_id: int, metadata: tuple[tuple[str, str], ...] = ()
) -> list[tuple[str, int]]:
    """A sequence's steps, one by one, through `stub`: (served version, running sum) of each."""
    answers = []
    for index, value in enumerate(STEPS):
        request = step("accumulator", value, sequence_id, index == 0, index == len(STEPS) - 1)
        answer = await stub.ModelInfer(request, metadata=metadata)
        answers.append((answer.model_version, value_of(answer)))
    return answers


async def test_steps_stay_on_the_upstream_of_their_start(tmp_path: Path) -> None:
    root = write_accumulator(tmp_path / "models", (1,))
    async with services(root, 2) as (one, two), running_sidecar([one.address, two.address]) as sidecar:
        await known_versions(sidecar, "accumulator", {"1"})
        async with grpc.aio.insecure_channel(sidecar.address) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            # Started together, the sequences land on both upstreams (the upstreams' turn);
            # then each is stepped, interleaved with the others: an odd count, so that the
            # upstreams' turn would send each step to the other upstream than the one before.
            ids = list(range(7000, 7007))
            for sequence_id in ids:
                await stub.ModelInfer(step("accumulator", STEPS[0], sequence_id, start=True))
            assert batcher_of(one, "accumulator").live > 0 and batcher_of(two, "accumulator").live > 0
            sums: dict[int, list[int]] = {i: [STEPS[0]] for i in ids}
            for index, value in enumerate(STEPS[1:], 1):
                for sequence_id in ids:
                    last = index == len(STEPS) - 1
                    answer = await stub.ModelInfer(step("accumulator", value, sequence_id, end=last))
                    sums[sequence_id].append(value_of(answer))
            assert all(seen == SUMS for seen in sums.values()), sums
            assert batcher_of(one, "accumulator").live == batcher_of(two, "accumulator").live == 0


async def test_steps_keep_their_version_whatever_the_canary_weight_dyes(tmp_path: Path) -> None:
    root = write_accumulator(tmp_path / "models", (1, 2), {"latest": 2})
    async with services(root, 1) as (service,), running_sidecar([service.address]) as sidecar:
        await known_versions(sidecar, "accumulator", {"1", "2"})
        async with grpc.aio.insecure_channel(sidecar.address) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            # Half canary, no sticky key: every call is dyed afresh, at random.
            weight = (("x-canary-weight", "50"),)
            runs = await asyncio.gather(*(stepped(stub, 8000 + n, weight) for n in range(16)))
    for answers in runs:
        assert [total for _, total in answers] == SUMS
        assert len({version for version, _ in answers}) == 1, answers  # one version per sequence
    assert {answers[0][0] for answers in runs} == {"1", "2"}  # both versions took sequences


async def test_a_sequence_started_on_a_stream_goes_on_in_unary_calls(tmp_path: Path) -> None:
    root = write_accumulator(tmp_path / "models", (1,))
    async with services(root, 2) as upstreams, running_sidecar([u.address for u in upstreams]) as sidecar:
        await known_versions(sidecar, "accumulator", {"1"})
        async with grpc.aio.insecure_channel(sidecar.address) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)

            async def starts() -> AsyncIterator[pb.ModelInferRequest]:
                # The stream's first message is another sequence's: 9001 is pinned as it passes.
                yield step("accumulator", 100, 9000, start=True, end=True)
                yield step("accumulator", STEPS[0], 9001, start=True)

            answers = [m async for m in stub.ModelStreamInfer(starts())]
            assert [value_of(m.infer_response) for m in answers] == [100, STEPS[0]]
            sums = [STEPS[0]]
            for index, value in enumerate(STEPS[1:], 1):
                answer = await stub.ModelInfer(step("accumulator", value, 9001, end=index == len(STEPS) - 1))
                sums.append(value_of(answer))
            assert sums == SUMS


@pytest.mark.parametrize("start", [True, False])
async def test_a_step_the_service_refuses_is_answered_with_its_reason(tmp_path: Path, start: bool) -> None:
    root = write_accumulator(tmp_path / "models", (1,))
    async with services(root, 1) as (service,), running_sidecar([service.address]) as sidecar:
        await known_versions(sidecar, "accumulator", {"1"})
        async with grpc.aio.insecure_channel(sidecar.address) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            if start:
                await stub.ModelInfer(step("accumulator", 1, 31, start=True))
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.ModelInfer(step("accumulator", 1, 31, start=start))
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            trailing: Any = caught.value.trailing_metadata() or ()
            reason = dict(trailing).get("x-error-reason")
            assert reason == "failed_precondition"
