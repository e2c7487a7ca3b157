"""Bounds per request: the config's limits, a decoder's context length through Infer, and memory
taken by a large run given back."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from models import demo_models
from modelyard.inference.v1 import inference_service_pb2 as ipb
from modelyard.inference.v1 import inference_service_pb2_grpc as ipb_grpc
from modelyard.kserve.v2 import grpc_service_pb2 as kpb
from modelyard.kserve.v2 import grpc_service_pb2_grpc as kpb_grpc
from modelyard.service.server import Service
from modelyard.tensors import to_tensor
from tests import hf_decoder
from tests.support import serving

CONTEXT = 128  # the decoder's n_positions


def expander() -> onnx.ModelProto:
    """x [1, n] -> sum of x expanded to [n, n]: a small request whose run takes n*n*4 bytes."""
    one = helper.make_tensor("one", TensorProto.INT64, [1], [1])
    two = helper.make_tensor("two", TensorProto.INT64, [1], [2])
    graph = helper.make_graph(
        [
            helper.make_node("Shape", ["x"], ["shape"]),
            helper.make_node("Slice", ["shape", "one", "two"], ["n"]),
            helper.make_node("Concat", ["n", "n"], ["square"], axis=0),
            helper.make_node("Expand", ["x", "square"], ["big"]),
            helper.make_node("ReduceSum", ["big"], ["y"], keepdims=0),
        ],
        "expander",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
        [one, two],
    )
    return demo_models.make_model(graph)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bounds") / "models"
    tokenizer = hf_decoder.tiny_tokenizer()
    hf_decoder.write_decoder(
        root, "lm", hf_decoder.gpt2_like(tokenizer.get_vocab_size(), positions=CONTEXT), tokenizer
    )
    demo_models.write_model(
        root,
        "limited",
        1,
        demo_models.scaled_identity(4, 2.0, batch=True),
        {"max_batch_size": 0, "limits": {"max_elements": 64, "max_request_bytes": 512}},
    )
    demo_models.write_model(root, "expander", 1, expander())
    return root


@pytest.fixture
async def service(root: Path) -> AsyncIterator[Service]:
    async with serving(root) as running:
        yield running


@pytest.fixture
async def stub(service: Service) -> AsyncIterator[Any]:
    async with grpc.aio.insecure_channel(service.address) as channel:
        yield ipb_grpc.InferenceServiceStub(channel)


async def _refused(call: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call  # type: ignore[misc]
    return caught.value


async def test_config_limits_refuse_large_requests_naming_the_limit(service: Service, stub: Any) -> None:
    def request(rows: int) -> ipb.InferRequest:
        x = to_tensor("INPUT0", np.ones((rows, 4), np.float32))
        return ipb.InferRequest(model_name="limited", inputs=[x])

    await stub.Infer(request(16))  # 64 elements, 256 bytes: at the limits
    error = await _refused(stub.Infer(request(17)))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limits.max_elements" in (error.details() or "")
    async with grpc.aio.insecure_channel(service.address) as channel:
        kserve = kpb_grpc.GRPCInferenceServiceStub(channel)
        tensor = kpb.ModelInferRequest.InferInputTensor(name="INPUT0", datatype="FP32", shape=[16, 4])
        ok = kpb.ModelInferRequest(model_name="limited", inputs=[tensor], raw_input_contents=[bytes(256)])
        await kserve.ModelInfer(ok)
        big = kpb.ModelInferRequest(
            model_name="limited",
            inputs=[kpb.ModelInferRequest.InferInputTensor(name="INPUT0", datatype="FP32", shape=[17, 4])],
            raw_input_contents=[bytes(17 * 16)],
        )
        error = await _refused(kserve.ModelInfer(big))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_request_bytes_limit(stub: Any) -> None:
    # 64 elements (at max_elements) whose payload is over max_request_bytes: refused by the
    # limit before the decoder would find the payload's size wrong.
    x = to_tensor("INPUT0", np.ones((16, 4), np.float32))
    x.raw_data = bytes(600)
    error = await _refused(stub.Infer(ipb.InferRequest(model_name="limited", inputs=[x])))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limits.max_request_bytes" in (error.details() or "")


def _decoder_request(sequence: int, rows: int = 1) -> ipb.InferRequest:
    ids = np.ones((rows, sequence), np.int64)
    inputs = [to_tensor(name, ids) for name in ("input_ids", "attention_mask", "position_ids")]
    for layer in range(2):
        for kind in ("key", "value"):
            past = np.zeros((rows, 2, 0, 16), np.float32)
            inputs.append(to_tensor(f"past_key_values.{layer}.{kind}", past))
    return ipb.InferRequest(model_name="lm", inputs=inputs, output_names=["logits"])


async def test_decoder_through_infer_is_bounded_by_the_context_length(
    stub: Any,
) -> None:
    reply = await stub.Infer(_decoder_request(CONTEXT))
    assert list(reply.outputs[0].shape)[:2] == [1, CONTEXT]
    error = await _refused(stub.Infer(_decoder_request(CONTEXT + 1)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"beyond the context length {CONTEXT}" in (error.details() or "")
    error = await _refused(stub.Infer(_decoder_request(4, rows=17)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "generation.max_concurrent_sequences 16" in (error.details() or "")


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


async def test_memory_of_a_large_run_is_given_back(stub: Any) -> None:
    """8192 positions take a 256 MB intermediate; after the run the process is back near its size."""
    small = ipb.InferRequest(model_name="expander", inputs=[to_tensor("x", np.ones((1, 16), np.float32))])
    await stub.Infer(small)
    before = _rss_mb()
    n = 8192
    big = ipb.InferRequest(model_name="expander", inputs=[to_tensor("x", np.ones((1, n), np.float32))])
    reply = await stub.Infer(big)
    assert np.frombuffer(reply.outputs[0].raw_data, np.float32)[0] == pytest.approx(n * n, rel=1e-3)
    after = _rss_mb()
    await stub.Infer(small)
    assert after - before < 64, f"RSS {before:.0f} MB before, {after:.0f} MB after a 256 MB run"
