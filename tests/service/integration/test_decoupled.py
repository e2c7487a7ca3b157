"""A decoupled model over KServe ModelStreamInfer, in the real service (this process): the repeat
model (Triton's repeat_int32 as a plain ONNX graph run once per element) sends 0..N responses per
request, with Triton's final-response flag; its WAIT holds the model's one instance as Triton's
repeat backend does; unary ModelInfer is refused; bad requests answer in-band and leave the stream
serving; a client that goes away mid-way releases what its request held."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from modelyard.kserve.v2 import grpc_service_pb2 as pb
from modelyard.kserve.v2 import grpc_service_pb2_grpc as pb_grpc
from modelyard.service.server import build_service
from modelyard.service.settings import Settings
from tests.sequence_models import write_triton_models

FINAL = "triton_final_response"


def repeat(
    values: list[int],
    delays_ms: list[int] | None = None,
    wait_ms: int = 0,
    final: bool = False,
    rid: str = "r",
) -> pb.ModelInferRequest:
    delays = delays_ms if delays_ms is not None else [0] * len(values)
    request = pb.ModelInferRequest(model_name="repeat_int32", id=rid)
    request.inputs.add(name="IN", datatype="INT32", shape=[len(values)])
    request.raw_input_contents.append(np.array(values, np.int32).tobytes())
    request.inputs.add(name="DELAY", datatype="UINT32", shape=[len(delays)])
    request.raw_input_contents.append(np.array(delays, np.uint32).tobytes())
    request.inputs.add(name="WAIT", datatype="UINT32", shape=[1])
    request.raw_input_contents.append(np.array([wait_ms], np.uint32).tobytes())
    if final:
        request.parameters["triton_enable_empty_final_response"].bool_param = True
    return request


def shown(message: pb.ModelStreamInferResponse) -> tuple[Any, ...]:
    """(id, OUT, IDX, final) of a data response; (id, error) of an in-band error; (id, final) of
    an empty final response."""
    response = message.infer_response
    final = response.parameters[FINAL].bool_param if FINAL in response.parameters else None
    if message.error_message:
        return (response.id, "error", final)
    if not response.outputs:
        return (response.id, final)
    values = {
        o.name: np.frombuffer(raw, np.int32 if o.datatype == "INT32" else np.uint32).tolist()
        for o, raw in zip(response.outputs, response.raw_output_contents, strict=True)
    }
    return (response.id, values["OUT"][0], values["IDX"][0], final)


async def each(*requests: pb.ModelInferRequest) -> AsyncIterator[pb.ModelInferRequest]:
    for request in requests:
        yield request


@pytest.fixture
async def stub(tmp_path: Path) -> AsyncIterator[Any]:
    service = build_service(
        Settings(repository=write_triton_models(tmp_path / "models"), listen="127.0.0.1:0", metrics_listen="")
    )
    await service.start()
    try:
        async with grpc.aio.insecure_channel(service.address) as channel:
            yield pb_grpc.GRPCInferenceServiceStub(channel)
    finally:
        await service.stop(grace_s=1.0)


async def test_one_request_many_responses_then_the_final_flag(stub: Any) -> None:
    stream = stub.ModelStreamInfer(
        each(repeat([100, 101, 102], final=True, rid="a"), repeat([], final=True, rid="b"))
    )
    seen = [shown(m) async for m in stream]
    assert seen == [
        ("a", 100, 0, False),
        ("a", 101, 1, False),
        ("a", 102, 2, False),
        ("a", True),  # the empty final response, asked for
        ("b", True),  # no element: no response, only the final flag
    ]
    # Without the flag asked for, no empty response (a request with no element gets nothing).
    stream = stub.ModelStreamInfer(each(repeat([7], rid="c"), repeat([], rid="d"), repeat([8], rid="e")))
    assert [shown(m) async for m in stream] == [("c", 7, 0, False), ("e", 8, 0, False)]


async def test_unary_model_infer_is_refused(stub: Any) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.ModelInfer(repeat([1]))
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert (caught.value.details() or "").startswith(
        "ModelInfer RPC doesn't support models with decoupled transaction policy"
    )


async def test_bad_requests_answer_in_band_and_the_stream_goes_on(stub: Any) -> None:
    mismatched = repeat([1, 2], delays_ms=[0], rid="bad")
    too_long = repeat([1], delays_ms=[3_600_000], rid="slow")
    stream = stub.ModelStreamInfer(each(mismatched, too_long, repeat([5], rid="ok")))
    messages = [m async for m in stream]
    assert [shown(m) for m in messages] == [
        # The request's last response, so final (Triton sets the flag on every decoupled response).
        ("bad", "error", True),
        ("slow", "error", True),
        ("ok", 5, 0, False),
    ]
    assert "expected IN and DELAY shape to match, got [2] and [1]" in messages[0].error_message
    assert "allows at most 60000" in messages[1].error_message
    assert messages[0].infer_response.parameters["error_reason"].string_param == "invalid_argument"


async def test_wait_holds_the_instance_as_triton_repeat_does(stub: Any) -> None:
    """One instance: a request holds it for its WAIT (or until its last response); a second
    request on another stream starts only when the first lets go."""

    async def order(wait_ms: int) -> list[str]:
        events: list[str] = []
        second_sent = asyncio.Event()

        async def first() -> None:
            async for message in stub.ModelStreamInfer(
                each(repeat([1, 2], delays_ms=[0, 1500], wait_ms=wait_ms))
            ):
                events.append(f"a{shown(message)[2]}")
                second_sent.set()

        async def second() -> None:
            await second_sent.wait()
            async for _ in stub.ModelStreamInfer(each(repeat([3]))):
                events.append("b0")

        await asyncio.gather(first(), second())
        return events

    # WAIT longer than the responses take: held until the last one, so b comes after.
    assert await order(60_000) == ["a0", "a1", "b0"]
    # WAIT 0: let go at once, so b runs while a waits out its second delay (1.5 s).
    assert await order(0) == ["a0", "b0", "a1"]


async def test_a_client_that_leaves_mid_way_lets_go_of_the_instance(stub: Any) -> None:
    call = stub.ModelStreamInfer(each(repeat([1, 2, 3], delays_ms=[0, 30_000, 0], wait_ms=60_000)))
    async for message in call:
        assert shown(message)[1] == 1
        break
    call.cancel()
    # Its hold (60 s) ended with it: the next request is served at once.
    got = [shown(m) async for m in stub.ModelStreamInfer(each(repeat([9], rid="next")))]
    assert got == [("next", 9, 0, False)]
