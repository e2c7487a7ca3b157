"""A decoder language model as a decoupled model over KServe ModelStreamInfer, as Triton's LLM
backends (vLLM, TensorRT-LLM) serve one: `text_input` in, one `text_output` response per token
(or one with the whole text for `stream: false`), `triton_final_response` on the last one. The
real service in this process, on the committed codelm and on a Hugging Face layout built here
(tests/hf_decoder.py); tritonclient (in a child process: it cannot share a process with our
generated code) through the sidecar.

Each test uses its own prompts and reads metrics of its own model, so that tests do not see each
other's streams.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import pytest_asyncio

from models import demo_models
from modelyard.inference.v1 import inference_service_pb2 as ipb
from modelyard.inference.v1 import inference_service_pb2_grpc as ipb_grpc
from modelyard.kserve.v2 import grpc_service_pb2 as pb
from modelyard.kserve.v2 import grpc_service_pb2_grpc as pb_grpc
from modelyard.kserve.v2 import model_config_pb2 as config_pb
from modelyard.service.server import Service, build_service
from modelyard.service.settings import Settings
from tests import hf_decoder
from tests.sidecar_support import known_versions, running_sidecar
from tests.support import REPO_ROOT, eventually, metric

pytestmark = pytest.mark.asyncio(loop_scope="module")

FINAL = "triton_final_response"
# One slot, a 2-token stream buffer, no preemption: a stream nobody reads holds the one slot.
TIGHT = """generation:
  max_concurrent_sequences: 1
  max_tokens: 256
  stream_buffer: 2
  max_preempted: 0
"""


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("decoupled_decoder") / "models"
    assert demo_models.copy_trained_models(demo_models.COMMITTED_ROOT, root) == ["codelm"]
    shutil.copytree(demo_models.COMMITTED_ROOT / "codelm" / "1", root / "tight" / "1")
    (root / "tight" / "config.yaml").write_text(TIGHT)
    tokenizer = hf_decoder.tiny_tokenizer()
    hf_decoder.write_decoder(root, "gpt2ish", hf_decoder.gpt2_like(tokenizer.get_vocab_size()), tokenizer)
    return root


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def service(repository: Path) -> AsyncIterator[Service]:
    running = build_service(Settings(repository=repository, listen="127.0.0.1:0", metrics_listen=""))
    await running.start()
    try:
        yield running
    finally:
        await running.stop(grace_s=1.0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def channel(service: Service) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(service.address) as chan:
        yield chan


@pytest.fixture
def kserve(channel: grpc.aio.Channel) -> Any:
    return pb_grpc.GRPCInferenceServiceStub(channel)


@pytest.fixture
def ours(channel: grpc.aio.Channel) -> Any:
    return ipb_grpc.InferenceServiceStub(channel)


def _bytes_element(text: str) -> bytes:
    data = text.encode()
    return len(data).to_bytes(4, "little") + data


def llm_request(
    text: str,
    model: str = "codelm",
    rid: str = "r",
    inputs: dict[str, Any] | None = None,
    params: dict[str, Any] | None = None,
    **parameters: Any,
) -> pb.ModelInferRequest:
    """`text_input`, `inputs` as tensors (bool, int, float, str or a list of str) and request
    parameters, `params` and `parameters` (as tritonclient writes them: str, bool or int)."""
    request = pb.ModelInferRequest(model_name=model, id=rid)
    request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(_bytes_element(text))
    for name, value in (inputs or {}).items():
        if isinstance(value, bool):
            datatype, raw = "BOOL", np.array([value], np.bool_).tobytes()
        elif isinstance(value, int):
            datatype, raw = "INT32", np.array([value], np.int32).tobytes()
        elif isinstance(value, float):
            datatype, raw = "FP32", np.array([value], np.float32).tobytes()
        else:
            items = [value] if isinstance(value, str) else list(value)
            datatype, raw = "BYTES", b"".join(_bytes_element(v) for v in items)
            request.inputs.add(name=name, datatype=datatype, shape=[len(items)])
            request.raw_input_contents.append(raw)
            continue
        request.inputs.add(name=name, datatype=datatype, shape=[1])
        request.raw_input_contents.append(raw)
    for key, value in {**(params or {}), **parameters}.items():
        if isinstance(value, bool):
            request.parameters[key].bool_param = value
        elif isinstance(value, int):
            request.parameters[key].int64_param = value
        else:
            request.parameters[key].string_param = value
    return request


async def each(*requests: pb.ModelInferRequest) -> AsyncIterator[pb.ModelInferRequest]:
    for request in requests:
        yield request


def shown(message: pb.ModelStreamInferResponse) -> tuple[Any, ...]:
    """(id, text, final) of a response; (id, "error", final) of an in-band error."""
    response = message.infer_response
    final = response.parameters[FINAL].bool_param if FINAL in response.parameters else None
    if message.error_message:
        return (response.id, "error", final)
    assert [(o.name, o.datatype, list(o.shape)) for o in response.outputs] == [("text_output", "BYTES", [1])]
    raw = response.raw_output_contents[0]
    assert int.from_bytes(raw[:4], "little") == len(raw) - 4
    return (response.id, raw[4:].decode(), final)


async def streamed(kserve: Any, *requests: pb.ModelInferRequest) -> list[pb.ModelStreamInferResponse]:
    return [m async for m in kserve.ModelStreamInfer(each(*requests))]


async def generated(ours: Any, model: str, prompt: str, **fields: Any) -> str:
    """Generate's text for the same request (our own API)."""
    request = ipb.GenerateRequest(model_name=model, prompt=prompt, **fields)
    return "".join([event.text async for event in ours.Generate(request)])


def gauge(service: Service, name: str, model: str, **labels: str) -> float | None:
    return metric(service.metrics.registry, name, model=model, version="1", **labels)


# --- the text ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "prompt"), [("codelm", "def __init__(self"), ("gpt2ish", "the quick brown")]
)
async def test_streamed_text_is_generates_for_the_same_greedy_request(kserve, ours, model, prompt) -> None:
    messages = await streamed(kserve, llm_request(prompt, model, "s1", max_tokens=12, stream=True))
    seen = [shown(m) for m in messages]
    # One response per token as they come (tokens that pile up behind a slow reader come
    # together, as Generate's events do): more than one, each its own new text.
    assert len(seen) > 1 and all(rid == "s1" for rid, _, _ in seen)
    assert "".join(text for _, text, _ in seen) == await generated(ours, model, prompt, max_tokens=12)
    # triton_final_response on every response: true on the last one only.
    assert [final for _, _, final in seen] == [False] * (len(seen) - 1) + [True]
    assert {m.infer_response.model_name for m in messages} == {model}
    assert {m.infer_response.model_version for m in messages} == {"1"}


async def test_stream_false_answers_once_with_the_whole_text(kserve, ours) -> None:
    prompt = "import os\n"
    want = await generated(ours, "codelm", prompt, max_tokens=10)
    # vLLM's default is one response, led by the prompt; exclude_input_in_output leaves it out.
    default, excluded, as_inputs = await streamed(
        kserve,
        llm_request(prompt, rid="whole", max_tokens=10),
        llm_request(prompt, rid="bare", max_tokens=10, exclude_input_in_output=True),
        llm_request(
            prompt, rid="tensors", inputs={"stream": False, "exclude_input_in_output": True, "max_tokens": 10}
        ),
    )
    assert shown(default) == ("whole", prompt + want, True)
    assert shown(excluded) == ("bare", want, True)
    assert shown(as_inputs) == ("tensors", want, True)


async def test_the_last_text_carries_the_final_flag_and_no_empty_response_follows(kserve) -> None:
    """As vLLM's and TensorRT-LLM's: the final flag comes with the last text, so a client that asks
    for the empty final response gets none (Triton sends one only for a flag without data). A
    stream's requests are answered in order."""
    asked = {"triton_enable_empty_final_response": True}
    messages = await streamed(
        kserve,
        llm_request("class Parser:", rid="a", params=asked, max_tokens=5, stream=True),
        llm_request("class Parser:", rid="b", params=asked, max_tokens=5),
        llm_request("class Parser:", rid="c", max_tokens=5, stream=True),
    )
    seen = [shown(m) for m in messages]
    assert [rid for rid, _, _ in seen] == sorted(rid for rid, _, _ in seen)  # a's, then b's, then c's
    for rid in "abc":
        mine = [(text, final) for r, text, final in seen if r == rid]
        assert mine and all(text for text, _ in mine), (rid, mine)  # no empty response
        assert [final for _, final in mine] == [False] * (len(mine) - 1) + [True]
    assert len([s for s in seen if s[0] == "b"]) == 1
    assert "".join(t for r, t, _ in seen if r == "a") == "".join(t for r, t, _ in seen if r == "c")


async def test_sampling_fields_as_inputs_json_or_parameters(kserve, ours) -> None:
    """Seeded sampling and a stop sequence, given three ways: tensors (TensorRT-LLM's), vLLM's
    `sampling_parameters` JSON, and request parameters as tritonclient sends them (a float as a
    string). Each is the same generation as Generate's with those fields."""
    prompt = "    for i in range("
    fields = {"max_tokens": 12, "temperature": 0.75, "top_k": 20, "top_p": 0.875, "seed": 7}  # exact in FP32
    want = await generated(ours, "codelm", prompt, **fields)
    stop = want[len(want) // 2 :][:2]  # a stop sequence that the text reaches
    cut = await generated(ours, "codelm", prompt, stop=[stop], **fields)
    assert len(cut) < len(want)
    json_fields = json.dumps({**{k: str(v) for k, v in fields.items()}, "stop": [stop]})
    as_strings = {k: str(v) for k, v in fields.items()}
    messages = await streamed(
        kserve,
        llm_request(prompt, rid="tensors", inputs={**fields, "stop": [stop]}, exclude_input_in_output=True),
        llm_request(
            prompt, rid="json", inputs={"sampling_parameters": json_fields, "exclude_input_in_output": True}
        ),
        llm_request(prompt, rid="parameters", params=as_strings, stop=stop, exclude_input_in_output=True),
        # vLLM's top_k -1: no top-k cut; the seed still makes it the same sampling as Generate's.
        llm_request(prompt, rid="all", params={**as_strings, "top_k": "-1"}, exclude_input_in_output=True),
    )
    by_id = {m.infer_response.id: shown(m)[1] for m in messages}
    assert not [m.error_message for m in messages if m.error_message]
    unlimited = await generated(ours, "codelm", prompt, **{**fields, "top_k": 0})
    assert by_id == {"tensors": cut, "json": cut, "parameters": cut, "all": unlimited}


# --- refusals and the slot -----------------------------------------------------------------------


async def test_bad_requests_answer_in_band_and_the_stream_goes_on(kserve, ours) -> None:
    long_prompt = "x = 1\n" * 30  # well inside the 256-token context, not with 250 more
    bad = [
        llm_request(long_prompt, rid="long", max_tokens=250, stream=True),
        llm_request("y", rid="n", n=2),
        llm_request("y", rid="echo", stream=True, exclude_input_in_output=False),
        llm_request("y", rid="temp", temperature="warm"),
        llm_request("y", rid="input", inputs={"beam_width": 2}),
        llm_request("", rid="empty"),
        # Hostile values: JSON nested 50,000 deep, a number of 5,000 digits.
        llm_request("y", rid="deep", inputs={"sampling_parameters": "[" * 50_000}),
        llm_request("y", rid="digits", max_tokens="9" * 5_000),
    ]
    messages = await streamed(kserve, *bad, llm_request("def main(", rid="ok", max_tokens=3))
    errors = {m.infer_response.id: m.error_message for m in messages if m.error_message}
    assert errors.keys() == {"long", "n", "echo", "temp", "input", "empty", "deep", "digits"}
    assert errors["long"].startswith("max_tokens: the model's context is 256 tokens, but ")
    assert "request parameter 'n' is not supported" in errors["n"]
    assert errors["echo"] == "When streaming, `exclude_input_in_output` = False is not allowed."
    assert "request parameter 'temperature': expected a number, got 'warm'" in errors["temp"]
    assert "input 'beam_width' is not an input of a decoder model" in errors["input"]
    assert "'text_input' is empty" in errors["empty"]
    assert errors["deep"] == "input 'sampling_parameters': not JSON"
    assert errors["digits"].startswith("request parameter 'max_tokens': expected an integer, got '9999")
    for message in messages:
        if message.error_message:  # the request's last response: final, with its reason
            response = message.infer_response
            assert response.parameters["error_reason"].string_param == "invalid_argument"
            assert response.parameters[FINAL].bool_param
    ok = [shown(m) for m in messages if m.infer_response.id == "ok"]
    assert ok == [("ok", "def main(" + await generated(ours, "codelm", "def main(", max_tokens=3), True)]


async def test_unary_model_infer_is_refused_as_for_a_decoupled_model(kserve) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await kserve.ModelInfer(llm_request("def f("))
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert (caught.value.details() or "").startswith(
        "ModelInfer RPC doesn't support models with decoupled transaction policy"
    )
    trailing: Any = caught.value.trailing_metadata() or ()
    assert dict(trailing)["x-error-reason"] == "unsupported"
    assert (await kserve.ModelReady(pb.ModelReadyRequest(name="codelm"))).ready


async def test_a_cancel_frees_the_slot(service, kserve) -> None:
    before = gauge(service, "modelyard_generation_cancellations_total", "tight", cause="cancelled") or 0.0
    # A client that reads slowly (the smallest HTTP/2 window): the stream pauses on the one slot.
    options = [("grpc.http2.lookahead_bytes", 1), ("grpc.http2.bdp_probe", 0)]
    async with grpc.aio.insecure_channel(service.address, options=options) as slow:
        stub = pb_grpc.GRPCInferenceServiceStub(slow)
        call = stub.ModelStreamInfer(each(llm_request("import sys\n", "tight", max_tokens=200, stream=True)))
        await call.read()
        await call.read()
        assert gauge(service, "modelyard_generation_active_sequences", "tight") == 1
        call.cancel()
        await eventually(
            lambda: gauge(service, "modelyard_generation_active_sequences", "tight") == 0,
            "the cancelled stream's sequence to leave its slot",
        )
    cancelled = gauge(service, "modelyard_generation_cancellations_total", "tight", cause="cancelled")
    assert cancelled == before + 1
    # The one slot is free: the next request is served.
    (answer,) = await streamed(kserve, llm_request("y", "tight", "next", max_tokens=3))
    assert shown(answer)[0::2] == ("next", True) and not answer.error_message


# --- what the model says of itself ---------------------------------------------------------------


async def test_metadata_and_config_say_decoupled_with_the_text_tensors(kserve) -> None:
    metadata = await kserve.ModelMetadata(pb.ModelMetadataRequest(name="gpt2ish"))
    inputs = {t.name: (t.datatype, list(t.shape)) for t in metadata.inputs}
    assert inputs["text_input"] == ("BYTES", [1])
    assert inputs["stream"] == ("BOOL", [1]) and inputs["sampling_parameters"] == ("BYTES", [1])
    assert inputs["max_tokens"] == ("INT32", [1]) and inputs["stop"] == ("BYTES", [-1])
    assert not any(name.startswith("past_key_values") for name in inputs)  # the graph's are not shown
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.outputs] == [("text_output", "BYTES", [1])]
    config = (await kserve.ModelConfig(pb.ModelConfigRequest(name="gpt2ish"))).config
    assert config.model_transaction_policy.decoupled and config.max_batch_size == 0
    assert {i.name: i.optional for i in config.input} == {name: name != "text_input" for name in inputs}
    assert [(o.name, o.data_type) for o in config.output] == [("text_output", config_pb.TYPE_STRING)]


# --- tritonclient, through the sidecar -----------------------------------------------------------

# Runs in a child process (`python -c CLIENT ADDRESS`): tritonclient's streaming client as vLLM's
# own tests drive it (ci/common/test_util.py): text_input, stream, exclude_input_in_output and
# sampling_parameters as tensors, the sampling fields as request parameters too (strings).
CLIENT = r"""
import json, queue, sys

import numpy as np
import tritonclient.grpc as grpcclient

def request(prompt, rid, stream, sampling, exclude=None):
    inputs = [grpcclient.InferInput("text_input", [1], "BYTES"), grpcclient.InferInput("stream", [1], "BOOL")]
    inputs[0].set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    inputs[1].set_data_from_numpy(np.array([stream], dtype=bool))
    inputs.append(grpcclient.InferInput("sampling_parameters", [1], "BYTES"))
    inputs[-1].set_data_from_numpy(np.array([json.dumps(sampling).encode()], dtype=np.object_))
    if exclude is not None:
        inputs.append(grpcclient.InferInput("exclude_input_in_output", [1], "BOOL"))
        inputs[-1].set_data_from_numpy(np.array([exclude], dtype=bool))
    return {"model_name": "codelm", "inputs": inputs, "request_id": rid, "parameters": sampling,
            "outputs": [grpcclient.InferRequestedOutput("text_output")]}

answers = queue.Queue()
client = grpcclient.InferenceServerClient(url=sys.argv[1])
client.start_stream(callback=lambda result, error: answers.put((result, error)))
sampling = {"max_tokens": "8", "temperature": "0"}
client.async_stream_infer(**request("def f(", "streamed", True, sampling), enable_empty_final_response=True)
client.async_stream_infer(**request("def f(", "whole", False, sampling, exclude=False))
client.async_stream_infer(**request("def f(", "bad", True, {"max_tokens": "999"}))
seen, finals = [], 0
while finals < 3:
    result, error = answers.get(timeout=60)
    if error is not None:
        seen.append(["error", str(error)])
        finals += 1
        continue
    response = result.get_response()
    final = response.parameters["triton_final_response"].bool_param
    finals += final
    seen.append([response.id, result.as_numpy("text_output")[0].decode(), final])
client.stop_stream()
print(json.dumps(seen))
"""


@pytest.mark.skipif(importlib.util.find_spec("tritonclient") is None, reason="tritonclient is not installed")
async def test_tritonclient_streams_through_the_sidecar(service, ours) -> None:
    want = await generated(ours, "codelm", "def f(", max_tokens=8)
    async with running_sidecar([service.address]) as sidecar:
        await known_versions(sidecar, "codelm", {"1"})
        child = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            CLIENT,
            sidecar.address,
            cwd=REPO_ROOT,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            out, err = await asyncio.wait_for(child.communicate(), timeout=120)
        finally:
            if child.returncode is None:
                child.kill()
                await child.wait()
    assert child.returncode == 0, err.decode()
    seen = json.loads(out)
    streamed_ = [(text, final) for rid, text, final in (s for s in seen if s[0] == "streamed")]
    assert len(streamed_) > 1 and "".join(text for text, _ in streamed_) == want
    assert [final for _, final in streamed_] == [False] * (len(streamed_) - 1) + [True]
    assert [s for s in seen if s[0] == "whole"] == [["whole", "def f(" + want, True]]
    (error,) = [s for s in seen if s[0] == "error"]
    assert "max_tokens: 999 exceeds this model's limit of 256" in error[1]
