"""Every request path leases its version the one way (DataPlane.open / hold: a Call, a
runtime/served.py Lease) and lets go of it exactly once, whatever the end: an answer, an error, a
client that cancels, a stream abandoned mid-way. A version with no request in it has nothing in
flight (`in_flight` 0), so that it can retire; a live sequence holds its version until it ends.

Paths: KServe ModelInfer, our Infer, the flat Infer, our InferStream, KServe ModelStreamInfer (plain
and decoupled), a sequence's steps, an ensemble's steps, Generate."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from models import demo_models
from modelyard import flat
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.kserve.v2 import grpc_service_pb2 as kpb
from modelyard.kserve.v2 import grpc_service_pb2_grpc as kgrpc
from modelyard.service.runtime.served import ServedVersion
from modelyard.service.server import Service, build_service
from modelyard.service.settings import Settings
from modelyard.tensors import to_tensor
from tests import hf_decoder, triton_models
from tests.sequence_models import write_triton_models
from tests.service.integration.test_decoupled import repeat
from tests.service.integration.test_ensembles import chain, picky
from tests.service.integration.test_sequences import step
from tests.support import eventually

# A request waits in this model's batcher for company (up to a minute), so it can be cancelled there.
WAITING = {
    "max_batch_size": 8,
    "dynamic_batching": {"max_queue_delay_us": 60_000_000, "preferred_batch_sizes": [8]},
}


@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[Service]:
    root = write_triton_models(tmp_path / "models")  # repeat_int32 (decoupled), the sequence models
    demo_models.write_model(root, "m", 1, demo_models.scaled_identity(4, 2.0), {"max_batch_size": 8})
    demo_models.write_model(root, "waiting", 1, demo_models.scaled_identity(4, 2.0), WAITING)
    demo_models.write_model(root, "picky", 1, picky())
    triton_models.write_ensemble(root, "a_chain", chain("m"))
    triton_models.write_ensemble(root, "b_picky", chain("picky", steps=1))
    tokenizer = hf_decoder.tiny_tokenizer()
    hf_decoder.write_decoder(root, "gpt2ish", hf_decoder.gpt2_like(tokenizer.get_vocab_size()), tokenizer)
    live = build_service(Settings(repository=root, listen="127.0.0.1:0", metrics_listen=""))
    await live.start()
    try:
        yield live
    finally:
        await live.stop(grace_s=1)


@pytest.fixture
async def channel(service: Service) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(service.address) as channel:
        yield channel


def _kserve(features: int, extra: bool = False, model: str = "m") -> kpb.ModelInferRequest:
    request = kpb.ModelInferRequest(model_name=model)
    for name in ("INPUT0", "EXTRA")[: 2 if extra else 1]:
        request.inputs.add(name=name, datatype="FP32", shape=[1, features])
        request.raw_input_contents.append(np.ones((1, features), np.float32).tobytes())
    return request


def _chain_request(model: str, rows: int = 1) -> kpb.ModelInferRequest:
    request = kpb.ModelInferRequest(model_name=model)
    request.inputs.add(name="X", datatype="FP32", shape=[rows, 4])
    request.raw_input_contents.append(np.ones((rows, 4), np.float32).tobytes())
    return request


async def _released(*versions: ServedVersion) -> None:
    """Every one of `versions` has no lease left (a cancelled call's ends on the server's side a
    moment after the client's)."""
    await eventually(lambda: all(v.in_flight == 0 for v in versions), "every lease released")


async def test_unary_calls_let_go_of_their_version_whether_they_answer_or_fail(
    service: Service, channel: grpc.aio.Channel
) -> None:
    served = service.manager.resolve("m")
    kserve, ours = kgrpc.GRPCInferenceServiceStub(channel), pb_grpc.InferenceServiceStub(channel)
    flat_infer = channel.unary_unary(flat.METHOD, None, None)
    await kserve.ModelInfer(_kserve(4))
    await ours.Infer(
        pb.InferRequest(model_name="m", inputs=[to_tensor("INPUT0", np.ones((1, 4), np.float32))])
    )
    flat.decode_response(await flat_infer(flat.encode_request("m", {"INPUT0": np.ones((1, 4), np.float32)})))
    for refused in (_kserve(3), _kserve(4, extra=True)):  # refused after the version was leased
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await kserve.ModelInfer(refused)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        wrong = to_tensor("INPUT0", np.ones((1, 3), np.float32))
        await ours.Infer(pb.InferRequest(model_name="m", inputs=[wrong]))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await flat_infer(flat.encode_request("m", {"INPUT0": np.ones((1, 3), np.float32)}))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert served.stats.success_count == 3 and served.stats.fail_count >= 3
    assert served.in_flight == 0


async def test_a_unary_call_cancelled_while_it_waits_in_a_batcher_lets_go(
    service: Service, channel: grpc.aio.Channel
) -> None:
    served = service.manager.resolve("waiting")
    assert service.batching is not None
    batcher = service.batching.batcher(served)
    assert batcher is not None
    call = kgrpc.GRPCInferenceServiceStub(channel).ModelInfer(_kserve(4, model="waiting"))
    await eventually(lambda: batcher.queued == 1, "the request waits in the batcher's queue")
    assert served.in_flight == 1  # leased while it waits
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await _released(served)
    await eventually(lambda: batcher.queued == 0, "the cancelled request left the queue")


async def test_streams_let_go_whether_they_end_fail_or_are_abandoned(
    service: Service, channel: grpc.aio.Channel
) -> None:
    served = service.manager.resolve("m")
    ours, kserve = pb_grpc.InferenceServiceStub(channel), kgrpc.GRPCInferenceServiceStub(channel)
    batch = to_tensor("INPUT0", np.ones((8, 4), np.float32))
    chunks = [
        r async for r in ours.InferStream(pb.InferStreamRequest(model_name="m", inputs=[batch], chunk_size=1))
    ]
    assert len(chunks) == 8 and served.in_flight == 0
    # Abandoned after its first chunk.
    stream = ours.InferStream(pb.InferStreamRequest(model_name="m", inputs=[batch], chunk_size=1))
    await stream.read()
    stream.cancel()
    await _released(served)

    async def requests() -> AsyncIterator[kpb.ModelInferRequest]:
        yield _kserve(4)
        yield _kserve(3)  # answered in-band
        yield _kserve(4)

    answers = [r async for r in kserve.ModelStreamInfer(requests())]
    assert [bool(a.error_message) for a in answers] == [False, True, False]
    assert served.in_flight == 0


async def test_a_decoupled_request_lets_go_when_its_responses_end_or_its_client_leaves(
    service: Service, channel: grpc.aio.Channel
) -> None:
    served = service.manager.resolve("repeat_int32")
    kserve = kgrpc.GRPCInferenceServiceStub(channel)

    async def one(request: kpb.ModelInferRequest) -> AsyncIterator[kpb.ModelInferRequest]:
        yield request

    answers = [r async for r in kserve.ModelStreamInfer(one(repeat([1, 2, 3], final=True)))]
    assert len(answers) == 4 and served.in_flight == 0
    # The client leaves after the first of many slow responses.
    stream = kserve.ModelStreamInfer(one(repeat(list(range(20)), delays_ms=[200] * 20)))
    first = await stream.read()
    assert isinstance(first, kpb.ModelStreamInferResponse) and not first.error_message
    assert served.in_flight >= 1  # its responses hold the version
    stream.cancel()
    await _released(served)


async def test_a_sequence_holds_its_version_from_start_to_end(
    service: Service, channel: grpc.aio.Channel
) -> None:
    served = service.manager.resolve("simple_sequence")
    kserve = kgrpc.GRPCInferenceServiceStub(channel)
    await kserve.ModelInfer(step("simple_sequence", 1, sequence_id=7, start=True))
    assert served.in_flight == 1  # the live sequence's lease (not the step's: that one ended)
    await kserve.ModelInfer(step("simple_sequence", 2, sequence_id=7))
    assert served.in_flight == 1
    await kserve.ModelInfer(step("simple_sequence", 3, sequence_id=7, end=True))
    assert served.in_flight == 0


async def test_an_ensemble_lets_go_of_every_step_whether_it_answers_or_a_step_fails(
    service: Service, channel: grpc.aio.Channel
) -> None:
    kserve = kgrpc.GRPCInferenceServiceStub(channel)
    ensemble, step_model = service.manager.resolve("a_chain"), service.manager.resolve("m")
    await kserve.ModelInfer(_chain_request("a_chain"))
    picky_ensemble, picky_model = service.manager.resolve("b_picky"), service.manager.resolve("picky")
    with pytest.raises(grpc.aio.AioRpcError):  # two rows: refused inside the step's graph
        await kserve.ModelInfer(_chain_request("b_picky", rows=2))
    await _released(ensemble, step_model, picky_ensemble, picky_model)
    assert picky_model.stats.fail_count >= 1  # the step really ran, and failed


async def test_generate_lets_go_when_it_finishes_or_is_cancelled(
    service: Service, channel: grpc.aio.Channel
) -> None:
    served = service.manager.resolve("gpt2ish")
    ours = pb_grpc.InferenceServiceStub(channel)
    done = [
        r async for r in ours.Generate(pb.GenerateRequest(model_name="gpt2ish", prompt="ab", max_tokens=4))
    ]
    assert done and served.in_flight == 0
    stream = ours.Generate(pb.GenerateRequest(model_name="gpt2ish", prompt="ab", max_tokens=100))
    await stream.read()
    stream.cancel()
    await _released(served)


async def test_an_unload_waits_for_a_leased_version(service: Service, channel: grpc.aio.Channel) -> None:
    """A request's lease keeps its version until the request ends: an unload meanwhile drains it
    (the version answers what it admitted) and releases it only then."""
    served = service.manager.resolve("waiting")
    call = kgrpc.GRPCInferenceServiceStub(channel).ModelInfer(_kserve(4, model="waiting"))
    assert service.batching is not None
    batcher = service.batching.batcher(served)
    assert batcher is not None
    await eventually(lambda: batcher.queued == 1, "the request waits in the batcher's queue")
    unload = asyncio.ensure_future(service.manager.unload("waiting"))
    await eventually(lambda: service.manager.served("waiting") is None, "out of the served table")
    assert not unload.done() and served.in_flight == 1  # draining: the request still holds it
    call.cancel()
    await unload
    assert served.in_flight == 0
