"""The service on a real CUDA device (marked `cuda`: they run where CUDA works, and skip cleanly
elsewhere, so `make test` stays green on CPU-only CI; bench/gpu_check.sh runs them on a GPU host).

One service serves each model twice, once per provider, so each answer is compared with the CPU's:
Infer outputs within tolerance, Generate's greedy tokens equal. A swap of a CUDA version under load
fails no request, and the retired version's device memory comes back."""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnxruntime as ort
import pytest
import pytest_asyncio
from tokenizers import Tokenizer

from models import demo_models
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.inference.v1 import model_service_pb2 as mpb
from modelyard.inference.v1 import model_service_pb2_grpc as mpb_grpc
from modelyard.service.config import Settings
from modelyard.service.generation.decoder import StepRunner
from modelyard.service.gpu_memory import used_mib
from modelyard.service.runtime.providers import CPU, CUDA, detect_providers
from modelyard.service.server import Service, build_service
from modelyard.tensors import to_array, to_tensor
from tests.support import eventually

CHOICE = detect_providers()
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not CHOICE.cuda_usable, reason=f"CUDA not usable here: {CHOICE.reason}"),
    pytest.mark.asyncio(loop_scope="module"),
]
PROVIDERS = ("cpu", "cuda")
GENERATION = """generation:
  max_concurrent_sequences: 8
  max_tokens: 64
  context_length: 256
  eos_token: "<|endoftext|>"
execution: {{provider: {provider}}}
"""


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cuda") / "models"
    for provider in PROVIDERS:
        execution = {"execution": {"provider": provider}}
        demo_models.write_model(
            root, f"mlp_{provider}", 1, demo_models.dense_stack(8, 256), {"max_batch_size": 64, **execution}
        )
        demo_models.write_model(
            root, f"encoder_{provider}", 1, demo_models.encoder(layers=2), {"max_batch_size": 8, **execution}
        )
        shutil.copytree(demo_models.COMMITTED_ROOT / "codelm" / "1", root / f"codelm_{provider}" / "1")
        (root / f"codelm_{provider}" / "config.yaml").write_text(GENERATION.format(provider=provider))
    return root


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def service(repository: Path) -> AsyncIterator[Service]:
    served = build_service(Settings(repository=repository, listen="127.0.0.1:0", metrics_listen=""))
    await served.start()
    try:
        yield served
    finally:
        await served.stop(grace_s=2.0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def channel(service: Service) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(service.address) as chan:
        yield chan


async def test_each_version_runs_where_its_config_says(channel: grpc.aio.Channel) -> None:
    models = mpb_grpc.ModelServiceStub(channel)
    for name, expected in (
        ("mlp_cuda", CUDA),
        ("mlp_cpu", CPU),
        ("encoder_cuda", CUDA),
        ("codelm_cuda", CUDA),
    ):
        version = (await models.GetModel(mpb.GetModelRequest(name=name))).model.versions[0]
        assert version.state == mpb.MODEL_STATE_READY, version.reason
        assert version.execution_provider == expected and not version.reason


@pytest.mark.parametrize(
    ("model", "row", "batch"), [("mlp", (256,), 1), ("mlp", (256,), 64), ("encoder", (128, 384), 4)]
)
async def test_cuda_answers_equal_the_cpu_within_tolerance(
    channel: grpc.aio.Channel, model: str, row: tuple[int, ...], batch: int
) -> None:
    stub: Any = pb_grpc.InferenceServiceStub(channel)
    x = np.random.default_rng(batch).standard_normal((batch, *row), dtype=np.float32)
    answers = {}
    for provider in PROVIDERS:
        reply = await stub.Infer(
            pb.InferRequest(model_name=f"{model}_{provider}", inputs=[to_tensor("INPUT0", x)])
        )
        answers[provider] = to_array(reply.outputs[0])
    np.testing.assert_allclose(answers["cuda"], answers["cpu"], rtol=1e-3, atol=1e-4)


async def test_generate_on_cuda_equals_the_cpu_greedy(channel: grpc.aio.Channel) -> None:
    stub: Any = pb_grpc.InferenceServiceStub(channel)
    tokens = {}
    for provider in PROVIDERS:
        request = pb.GenerateRequest(
            model_name=f"codelm_{provider}", prompt="def parse(self, text):", max_tokens=32
        )
        tokens[provider] = [t for r in [r async for r in stub.Generate(request)] for t in r.token_ids]
    assert tokens["cuda"] and tokens["cuda"] == tokens["cpu"]


def used_mb() -> float:
    used = used_mib()
    assert used is not None, "NVML reads no device on a CUDA host"
    return used


async def test_a_swap_under_load_fails_nothing_and_gives_the_device_memory_back(
    channel: grpc.aio.Channel, repository: Path
) -> None:
    stub: Any = pb_grpc.InferenceServiceStub(channel)
    models = mpb_grpc.ModelServiceStub(channel)
    x = np.ones((1, 256), np.float32)
    request = pb.InferRequest(model_name="mlp_cuda", inputs=[to_tensor("INPUT0", x)])
    failures: list[str] = []
    answered: set[str] = set()
    stop = asyncio.Event()

    async def client() -> None:
        while not stop.is_set():
            try:
                answered.add((await stub.Infer(request)).model_version)
            except grpc.aio.AioRpcError as exc:
                failures.append(f"{exc.code().name}: {exc.details()}")

    before = used_mb()
    clients = [asyncio.ensure_future(client()) for _ in range(8)]
    # A much bigger version 2 (512 layers: 128 MiB of weights on the device), published the
    # recommended way, then retired by publishing version 3 at version 1's size and removing 2.
    staging = repository.parent / "staging"
    for version, layers in ((2, 512), (3, 8)):
        folder = staging / str(version)
        folder.mkdir(parents=True)
        (folder / "model.onnx").write_bytes(
            demo_models.serialize(demo_models.dense_stack(layers, 256, seed=version))
        )
        os.rename(folder, repository / "mlp_cuda" / str(version))
        await eventually(
            functools.partial(set.__contains__, answered, str(version)), what=f"version {version}"
        )
        if version == 2:
            peak = used_mb()
    shutil.rmtree(repository / "mlp_cuda" / "1")
    shutil.rmtree(repository / "mlp_cuda" / "2")

    async def only_three() -> bool:
        described = (await models.GetModel(mpb.GetModelRequest(name="mlp_cuda"))).model
        return [v.version for v in described.versions if v.state == mpb.MODEL_STATE_READY] == ["3"]

    await eventually(only_three, what="versions 1 and 2 retired", within_s=60)
    stop.set()
    await asyncio.gather(*clients)
    assert not failures
    # Versions 1 and 2 released: what the device holds is back near the start (version 3 is version
    # 1's size), well under the peak with version 2 loaded beside them.
    await eventually(
        lambda: used_mb() < before + 64, what="device memory back after the retirement", within_s=30
    )
    assert peak > before


# --- generation: the KV cache on the device ------------------------------------------------------


def test_the_decode_cache_stays_on_the_device_through_joins_pauses_and_leaves() -> None:
    """The decoder's own loop on a CUDA session: every cache tensor (a prefill's, the batch's after
    each step, join and leave, a paused row's) is an OrtValue on the GPU, never host memory, and
    the greedy tokens equal the CPU's numpy path row for row."""
    from tests.unit import test_decoder as unit  # the scripted joins and leaves, and their prompts

    codelm = demo_models.COMMITTED_ROOT / "codelm" / "1"
    tokenizer = Tokenizer.from_file(str(codelm / "tokenizer.json"))
    prompts = {name: list(tokenizer.encode(text).ids) for name, text in unit.CODE_PROMPTS.items()}
    tokens = {}
    for provider in (CUDA, CPU):
        # TF32 off: full FP32 matrix products, so a near tie cannot tip the greedy choice.
        options = {"use_tf32": "0"} if provider == CUDA else {}
        session = ort.InferenceSession(str(codelm / "model.onnx"), providers=[(provider, options)])
        layout = unit.layout_of(session)
        device = "cuda" if provider == CUDA else ""
        runner = StepRunner(session, layout, device or "cpu", 0)
        assert runner.bound == (provider == CUDA)
        tokens[provider] = unit.scripted(runner, layout, prompts, 24, device)
    assert tokens[CUDA] == tokens[CPU]


async def test_concurrent_generations_on_cuda_equal_the_cpu_greedy(channel: grpc.aio.Channel) -> None:
    """Streams that join and leave one CUDA decode batch mid-decode (staggered starts, different
    lengths) give each the tokens the CPU gives it."""
    stub: Any = pb_grpc.InferenceServiceStub(channel)
    prompts = ["def __init__(self", "import os\n", "    for i in range(", "class Parser:\n"]

    async def one(
        model: str, prompt: str, max_tokens: int, started: asyncio.Event | None = None
    ) -> list[int]:
        request = pb.GenerateRequest(model_name=model, prompt=prompt, max_tokens=max_tokens)
        tokens: list[int] = []
        async for response in stub.Generate(request):
            tokens += response.token_ids
            if started is not None:
                started.set()
        return tokens

    results = {}
    for provider in PROVIDERS:
        model = f"codelm_{provider}"
        started = asyncio.Event()
        first = asyncio.ensure_future(one(model, prompts[0], 48, started))
        await started.wait()  # the others join the first's batch while it decodes
        rest = await asyncio.gather(*(one(model, p, 8 + 12 * i) for i, p in enumerate(prompts[1:])))
        results[provider] = [await first, *rest]
    assert all(results["cuda"]) and results["cuda"] == results["cpu"]
