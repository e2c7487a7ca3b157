"""Stateful models through the real service (in this process), over KServe gRPC: the sequence
batcher's controls and implicit state, both strategies, idle expiry, the bounds and every refusal
(each checked not to have disturbed the sequences it did not belong to), the Triton ModelConfig and
metadata of a sequence model, and a live sequence across a reload of its model."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from models.demo_models import write_model
from modelyard.kserve.v2 import grpc_service_pb2 as pb
from modelyard.kserve.v2 import grpc_service_pb2_grpc as pb_grpc
from modelyard.kserve.v2 import model_config_pb2 as config_pb
from modelyard.service.sequences.batcher import SequenceBatcher
from modelyard.service.server import Service, build_service
from modelyard.service.settings import Settings
from tests.sequence_models import (
    ACCUMULATOR_STATE,
    _int32_controls,
    accumulator,
    counter,
    sequence_config,
    write_triton_models,
)
from tests.support import eventually

VALUES = [0, 11, 7, 5, 3, 2, 0, 1]


def step(
    model: str,
    value: int,
    sequence_id: int | str = 0,
    start: bool = False,
    end: bool = False,
    rows: int = 1,
    version: str = "",
) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, model_version=version, id=f"{sequence_id}")
    request.inputs.add(name="INPUT", datatype="INT32", shape=[rows, 1])
    request.raw_input_contents.append(np.full((rows, 1), value, np.int32).tobytes())
    if sequence_id != 0:
        if isinstance(sequence_id, str):
            request.parameters["sequence_id"].string_param = sequence_id
        else:
            request.parameters["sequence_id"].int64_param = sequence_id
        request.parameters["sequence_start"].bool_param = start
        request.parameters["sequence_end"].bool_param = end
    return request


def value_of(response: pb.ModelInferResponse, name: str = "OUTPUT") -> int:
    index = [o.name for o in response.outputs].index(name)
    return int(np.frombuffer(response.raw_output_contents[index], np.int32)[0])


async def refused(call: Any) -> tuple[grpc.StatusCode, str, str]:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    error = caught.value
    trailing: Any = error.trailing_metadata() or ()
    return error.code(), error.details() or "", dict(trailing).get("x-error-reason", "")


async def run_sequence(stub: Any, model: str, sequence_id: int | str, values: list[int]) -> list[int]:
    outputs = []
    for index, value in enumerate(values):
        answer = await stub.ModelInfer(step(model, value, sequence_id, index == 0, index == len(values) - 1))
        outputs.append(value_of(answer))
    return outputs


def batcher_of(service: Service, model: str) -> SequenceBatcher:
    assert service.batching is not None
    served = service.manager.table.resolve(model, "")
    found = service.batching.runner_of(served)
    assert isinstance(found, SequenceBatcher)
    return found


@pytest.fixture
def sequence_repository(tmp_path: Path) -> Path:
    root = write_triton_models(tmp_path / "models")
    # Three sequences share a direct batch when their steps wait for one another (a delay).
    write_model(
        root,
        "batched_accumulator",
        1,
        accumulator(),
        sequence_config(
            _int32_controls("START", "READY"),
            max_batch_size=4,
            states=[ACCUMULATOR_STATE],
            max_queue_delay_us=5_000_000,
        ),
    )
    # Released after 200 ms idle; two slots only (max_batch_size 2).
    write_model(
        root,
        "short_lived",
        1,
        accumulator(),
        sequence_config(
            _int32_controls("START", "READY"), idle_us=200_000, max_batch_size=2, states=[ACCUMULATOR_STATE]
        ),
    )
    # No batch dimension, no controls, an initial state from a file: OUTPUT = 100 + the inputs.
    write_model(
        root,
        "counter",
        1,
        counter(),
        {
            "sequence_batching": {
                "states": [
                    {
                        "input_name": "STATE_IN",
                        "output_name": "STATE_OUT",
                        "datatype": "FP32",
                        "shape": [2],
                        "initial_state": {"shape": [2], "data_file": "hundreds"},
                    }
                ]
            }
        },
    )
    (root / "counter" / "initial_state").mkdir()
    (root / "counter" / "initial_state" / "hundreds").write_bytes(np.array([100, 200], "<f4").tobytes())
    return root


@pytest.fixture
async def stub(sequence_repository: Path) -> AsyncIterator[Any]:
    service = build_service(
        Settings(repository=sequence_repository, listen="127.0.0.1:0", metrics_listen="", watch_quiet_s=0.1)
    )
    await service.start()
    try:
        async with grpc.aio.insecure_channel(service.address) as channel:
            client = pb_grpc.GRPCInferenceServiceStub(channel)
            client.service = service  # type: ignore[attr-defined]
            yield client
    finally:
        await service.stop(grace_s=1.0)


async def test_controls_reach_the_model_as_triton_sends_them(stub: Any) -> None:
    # simple_sequence is (INPUT + START) * READY: START is 1 on the first step only, READY on all.
    assert await run_sequence(stub, "simple_sequence", 7, VALUES) == [1, 11, 7, 5, 3, 2, 0, 1]
    # simple_dyna_sequence (oldest) adds END * CORRID: the id on the last step.
    assert await run_sequence(stub, "simple_dyna_sequence", 12, VALUES) == [1, 11, 7, 5, 3, 2, 0, 13]


async def test_implicit_state_carries_a_running_sum_per_sequence(stub: Any) -> None:
    # Two sequences stepped in turn: each keeps its own state.
    a, b = 1001, "b-7f3e"
    sums: dict[int | str, list[int]] = {a: [], b: []}
    for index in range(4):
        for sequence_id, scale in ((a, 1), (b, 10)):
            answer = await stub.ModelInfer(
                step("accumulator", scale * (index + 1), sequence_id, index == 0, index == 3)
            )
            sums[sequence_id].append(value_of(answer))
    assert sums == {a: [1, 3, 6, 10], b: [10, 30, 60, 100]}
    # The state is the service's: it asks for OUTPUT_STATE nowhere, and clients see no such output.
    metadata = await stub.ModelMetadata(pb.ModelMetadataRequest(name="accumulator"))
    assert [t.name for t in metadata.inputs] == ["INPUT"]
    assert [t.name for t in metadata.outputs] == ["OUTPUT"]


async def test_initial_state_from_a_file_without_a_batch_dimension(stub: Any) -> None:
    def counted(value: float, sequence_id: int, start: bool, end: bool) -> pb.ModelInferRequest:
        request = pb.ModelInferRequest(model_name="counter")
        request.inputs.add(name="INPUT", datatype="FP32", shape=[2])
        request.raw_input_contents.append(np.full(2, value, np.float32).tobytes())
        request.parameters["sequence_id"].uint64_param = sequence_id
        request.parameters["sequence_start"].bool_param = start
        request.parameters["sequence_end"].bool_param = end
        return request

    seen = []
    for index in range(3):
        answer = await stub.ModelInfer(counted(1.5, 2**64 - 5, index == 0, index == 2))
        seen.append(np.frombuffer(answer.raw_output_contents[0], np.float32).tolist())
    assert seen == [[101.5, 201.5], [103.0, 203.0], [104.5, 204.5]]


async def test_direct_strategy_batches_the_slots_of_concurrent_sequences(stub: Any) -> None:
    ids = [501, 502, 503]
    await asyncio.gather(*(stub.ModelInfer(step("batched_accumulator", 1, i, start=True)) for i in ids))
    before = await stub.ModelStatistics(pb.ModelStatisticsRequest(name="batched_accumulator"))
    # One step each, at once: the batch waits (max_queue_delay) until every live sequence's slot
    # holds a step, then runs them as one batch.
    answers = await asyncio.gather(
        *(stub.ModelInfer(step("batched_accumulator", 10 * n, i, end=True)) for n, i in enumerate(ids, 1))
    )
    assert [value_of(a) for a in answers] == [11, 21, 31]
    after = await stub.ModelStatistics(pb.ModelStatisticsRequest(name="batched_accumulator"))
    (was,), (now,) = before.model_stats, after.model_stats
    assert now.inference_stats.success.count - was.inference_stats.success.count == 3
    assert now.execution_count - was.execution_count == 1


async def test_a_stream_carries_interleaved_sequences(stub: Any) -> None:
    async def requests() -> AsyncIterator[pb.ModelInferRequest]:
        for index in range(3):
            for sequence_id in ("s-1", "s-2"):
                request = step("accumulator", index + 1, sequence_id, index == 0, index == 2)
                request.id = f"{sequence_id}_{index}"
                yield request

    seen = [
        (m.infer_response.id, value_of(m.infer_response)) async for m in stub.ModelStreamInfer(requests())
    ]
    assert seen == [("s-1_0", 1), ("s-2_0", 1), ("s-1_1", 3), ("s-2_1", 3), ("s-1_2", 6), ("s-2_2", 6)]


async def test_refusals_name_the_problem_and_leave_live_sequences_alone(stub: Any) -> None:
    first = await stub.ModelInfer(step("accumulator", 5, 77, start=True))
    assert value_of(first) == 5
    # No sequence id on a sequence model: Triton's words.
    code, message, reason = await refused(stub.ModelInfer(step("accumulator", 1)))
    assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument")
    assert message.startswith(
        "inference request to model 'accumulator' must specify a non-zero or non-empty correlation ID"
    )
    # A step of a sequence that never started.
    code, message, reason = await refused(stub.ModelInfer(step("accumulator", 1, 78)))
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "failed_precondition")
    assert message.startswith(
        "inference request for sequence 78 to model 'accumulator' must specify the START flag on the first "
        "request of the sequence"
    )
    # A START for the live one is refused, and does not reset it.
    code, message, reason = await refused(stub.ModelInfer(step("accumulator", 1000, 77, start=True)))
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "failed_precondition")
    assert "is live" in message
    # A batch of two rows in one step.
    code, message, _ = await refused(stub.ModelInfer(step("accumulator", 1, 77, rows=2)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "must specify batch-size 1 due to requirements of sequence batcher" in message
    # A bad id.
    bad = step("accumulator", 1, 77)
    bad.parameters["sequence_id"].double_param = 1.5
    code, message, _ = await refused(stub.ModelInfer(bad))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "sequence_id" in message
    # The live sequence went on as if none of that happened: 5 + 2.
    last = await stub.ModelInfer(step("accumulator", 2, 77, end=True))
    assert value_of(last) == 7
    # Ended: its id is free again, and a later step of the ended one is refused.
    code, _, _ = await refused(stub.ModelInfer(step("accumulator", 1, 77)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert value_of(await stub.ModelInfer(step("accumulator", 9, 77, start=True, end=True))) == 9


async def test_live_sequences_are_bounded_by_the_slots(stub: Any) -> None:
    # short_lived: one instance, max_batch_size 2: two slots (strategy direct).
    for sequence_id in (1, 2):
        await stub.ModelInfer(step("short_lived", 1, sequence_id, start=True))
    code, message, reason = await refused(stub.ModelInfer(step("short_lived", 1, 3, start=True)))
    assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue_full")
    assert "2 live sequences" in message
    # The two live ones are intact; once one ends, a new one starts.
    assert value_of(await stub.ModelInfer(step("short_lived", 2, 1, end=True))) == 3
    assert value_of(await stub.ModelInfer(step("short_lived", 4, 3, start=True))) == 4


async def test_an_idle_sequence_is_released_and_its_late_step_says_so(stub: Any) -> None:
    batcher = batcher_of(stub.service, "short_lived")
    await stub.ModelInfer(step("short_lived", 3, 900, start=True))
    # Live while it is stepped: each step keeps it (idle 200 ms at most between steps).
    assert value_of(await stub.ModelInfer(step("short_lived", 4, 900))) == 7
    assert batcher.live == 1
    await eventually(lambda: batcher.live == 0, "the idle sequence released")
    code, message, reason = await refused(stub.ModelInfer(step("short_lived", 1, 900)))
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "failed_precondition")
    assert "must specify the START flag" in message and "released after idling" in message
    # Its slot is free again (both slots usable).
    for sequence_id in (901, 902):
        assert value_of(await stub.ModelInfer(step("short_lived", 1, sequence_id, start=True))) == 1


async def test_triton_model_config_of_a_sequence_model(stub: Any) -> None:
    dyna = (await stub.ModelConfig(pb.ModelConfigRequest(name="simple_dyna_sequence"))).config
    assert dyna.sequence_batching.WhichOneof("strategy_choice") == "oldest"
    assert dyna.sequence_batching.oldest.max_candidate_sequences == 64
    controls = {c.name: c.control[0] for c in dyna.sequence_batching.control_input}
    assert controls["START"].kind == config_pb.ModelSequenceBatching.Control.CONTROL_SEQUENCE_START
    assert list(controls["START"].int32_false_true) == [0, 1]
    assert controls["CORRID"].data_type == config_pb.TYPE_UINT64
    assert [t.name for t in dyna.input] == ["INPUT"]
    acc = (await stub.ModelConfig(pb.ModelConfigRequest(name="accumulator"))).config
    (state,) = acc.sequence_batching.state
    assert (state.input_name, state.output_name, list(state.dims)) == ("INPUT_STATE", "OUTPUT_STATE", [1])
    repeat = (await stub.ModelConfig(pb.ModelConfigRequest(name="repeat_int32"))).config
    assert repeat.model_transaction_policy.decoupled
    server = await stub.ServerMetadata(pb.ServerMetadataRequest())
    assert "sequence" in server.extensions


async def test_a_live_sequence_stays_on_its_version_across_a_reload(
    stub: Any, sequence_repository: Path
) -> None:
    old = batcher_of(stub.service, "accumulator")
    first = await stub.ModelInfer(step("accumulator", 5, 4242, start=True))
    assert (first.model_version, value_of(first)) == ("1", 5)
    write_model(
        sequence_repository,
        "accumulator",
        2,
        accumulator(),
        sequence_config(_int32_controls("START", "READY"), states=[ACCUMULATOR_STATE]),
    )

    async def v2_serves() -> bool:
        answer = await stub.ModelReady(pb.ModelReadyRequest(name="accumulator", version="2"))
        return bool(answer.ready)

    await eventually(v2_serves, "version 2 serving")
    # New sequences start on the new version; the live one goes on where it started, state intact.
    fresh = await stub.ModelInfer(step("accumulator", 1, 4343, start=True, end=True))
    assert fresh.model_version == "2"
    assert not old.closed  # version 1 drains: its live sequence holds it
    later = await stub.ModelInfer(step("accumulator", 2, 4242, end=True))
    assert (later.model_version, value_of(later)) == ("1", 7)
    await eventually(lambda: old.closed, "version 1 released once its sequence ended")
