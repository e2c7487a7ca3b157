"""Large messages and credentials: with --auth-tokens-file/--auth-inference a caller without a
credential gets UNAUTHENTICATED before its message is read or parsed, and a large message of a
caller with one does not hold the event loop while another caller's trivial calls wait."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from models import demo_models
from modelyard.common.headers import ERROR_REASON
from modelyard.inference.v1 import inference_service_pb2 as ipb
from modelyard.inference.v1 import inference_service_pb2_grpc as ipb_grpc
from modelyard.inference.v1 import tensor_pb2
from modelyard.kserve.v2 import grpc_service_pb2 as kpb
from modelyard.service.api import guards
from modelyard.service.server import Service
from tests.support import serving

TOKEN = "large-messages-token"
INFER = "/inference.GRPCInferenceService/ModelInfer"


def _many_inputs(count: int) -> bytes:
    """A ModelInferRequest of `count` small typed-contents inputs (the bytes of one, repeated:
    a repeated field's elements are concatenated on the wire)."""
    head = kpb.ModelInferRequest(model_name="scaler").SerializeToString()
    one = kpb.ModelInferRequest()
    one.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 4]).contents.fp32_contents.extend([1.0] * 4)
    return head + one.SerializeToString() * count


@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[Service]:
    root = tmp_path / "models"
    demo_models.write_model(root, "scaler", 1, demo_models.scaled_identity(4, 2.0))
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKEN + "\n")
    async with serving(
        root,
        auth_tokens_file=str(tokens),
        auth_inference=True,
    ) as running:
        yield running


@pytest.fixture
def parsed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every request message the guarded handlers parse."""
    sizes: list[int] = []
    original = guards._Refuse.parse

    async def counting(self: Any, raw: Any) -> Any:
        sizes.append(len(raw))
        return await original(self, raw)

    monkeypatch.setattr(guards._Refuse, "parse", counting)
    return sizes


async def test_an_unauthenticated_large_message_is_refused_unparsed(
    service: Service, parsed: list[int]
) -> None:
    message = _many_inputs(100_000)  # about 2.6 MB
    options = [("grpc.max_send_message_length", -1)]
    async with grpc.aio.insecure_channel(service.address, options=options) as channel:
        infer = channel.unary_unary(INFER, None, None)
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await infer(message, timeout=30)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        trailers: Any = caught.value.trailing_metadata() or ()
        assert dict(trailers).get(ERROR_REASON) == "unauthenticated"
        assert parsed == []  # refused before its bytes were parsed (or read)
        print(f"unauthenticated {len(message)} bytes: refused in {time.monotonic() - started:.3f} s")
        # The same message with the credential is read (the hook sees it), then refused: no request
        # of ours has 100,000 top-level fields.
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await infer(message, metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=30)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "more than 16384 top-level fields" in (caught.value.details() or "")
        assert parsed == [len(message)]


_SENDER = """
import sys, grpc
data = open(sys.argv[2], "rb").read()
channel = grpc.insecure_channel(sys.argv[1], options=[("grpc.max_send_message_length", -1)])
try:
    channel.unary_unary("{infer}")(data, metadata=(("authorization", "Bearer {token}"),), timeout=60)
    print("OK")
except grpc.RpcError as exc:
    print(exc.code().name)
"""


async def test_a_large_message_does_not_hold_another_callers_calls(service: Service, tmp_path: Path) -> None:
    message_file = tmp_path / "message"
    message_file.write_bytes(_many_inputs(200_000))  # about 5 MB of 200,000 tensors
    async with grpc.aio.insecure_channel(service.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
        latencies: list[float] = []
        # The sender is another process: its own copying is not on this loop.
        sender = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _SENDER.format(infer=INFER, token=TOKEN),
            service.address,
            str(message_file),
            stdout=subprocess.PIPE,
        )
        answer = asyncio.get_running_loop().create_task(sender.communicate())
        last = time.perf_counter()
        while not answer.done():
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
            await asyncio.sleep(0.002)
            # From one probe's answer to the next: a held loop shows whether it held the call
            # or the pause between two calls.
            now = time.perf_counter()
            latencies.append(now - last)
            last = now
        out, _ = await answer
    assert out.decode().strip() == "INVALID_ARGUMENT"
    worst = max(latencies)
    print(f"200,000-tensor message: {len(latencies)} probes, worst gap {worst * 1e3:.0f} ms")
    assert worst < 0.5  # generous for a loaded machine; the loop was held for seconds before


async def test_many_more_tensors_than_the_model_has_are_refused_up_front(service: Service) -> None:
    tensor = tensor_pb2.Tensor(
        name="INPUT0", datatype=tensor_pb2.DATA_TYPE_FP32, shape=[1, 4], raw_data=bytes(16)
    )
    credential = (("authorization", f"Bearer {TOKEN}"),)
    async with grpc.aio.insecure_channel(service.address) as channel:
        stub = ipb_grpc.InferenceServiceStub(channel)
        for request, words in (
            (
                ipb.InferRequest(model_name="scaler", inputs=[tensor] * 5000),
                "5000 inputs; model 'scaler' has 1",
            ),
            (
                ipb.InferRequest(model_name="scaler", inputs=[tensor], output_names=["y"] * 5000),
                "5000 outputs",
            ),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Infer(request, metadata=credential, timeout=10)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert words in (caught.value.details() or "")


def _live_requests() -> int:
    gc.collect()
    return sum(1 for item in gc.get_objects() if isinstance(item, kpb.ModelInferRequest))


async def test_a_refused_large_message_is_not_kept(service: Service) -> None:
    message = kpb.ModelInferRequest(model_name="scaler")
    message.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 3_000_000])
    message.raw_input_contents.append(b"\x01" * 12_000_000)  # the wrong shape: refused by the model
    data = message.SerializeToString()
    del message
    assert _live_requests() == 0
    credential = (("authorization", f"Bearer {TOKEN}"),)
    options = [("grpc.max_send_message_length", -1)]
    async with grpc.aio.insecure_channel(service.address, options=options) as channel:
        infer = channel.unary_unary(INFER, None, None)
        for _ in range(3):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await infer(data, metadata=credential, timeout=30)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # grpc.aio keeps an aborted call's exception with the call's state: it must not keep the
    # request (through the traceback's frames) or its bytes (through gRPC's message iterator).
    assert _live_requests() == 0
    gc.collect()
    server_copies = [
        held
        for holder in gc.get_objects()
        if type(holder).__name__.startswith("__pyx_scope")
        for held in gc.get_referents(holder)
        if isinstance(held, bytes) and len(held) == len(data)
    ]
    assert server_copies == []
