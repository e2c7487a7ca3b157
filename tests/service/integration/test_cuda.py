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
from modelyard.service.generation.decoder import StepRunner
from modelyard.service.gpu_memory import memory_of, used_mib
from modelyard.service.runtime.iobinding import DeviceBinding
from modelyard.service.runtime.manager import ModelManager
from modelyard.service.runtime.providers import CPU, CUDA, detect_providers
from modelyard.service.runtime.status import VersionState
from modelyard.service.server import Service, build_service
from modelyard.service.settings import Settings
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
BATCHED = {
    "execution": {"provider": "cuda"},
    "dynamic_batching": {"max_queue_delay_us": 20000, "max_concurrent_batches": 1},
}


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
        demo_models.write_model(
            root, f"multi_{provider}", 1, demo_models.multi_io(64), {"max_batch_size": 64, **execution}
        )
    # The MLP again on CUDA: batched (several requests to one run), and on session.run (no binding).
    demo_models.write_model(
        root, "batched_cuda", 1, demo_models.dense_stack(8, 256), {"max_batch_size": 64, **BATCHED}
    )
    demo_models.write_model(
        root,
        "unbound_cuda",
        1,
        demo_models.dense_stack(8, 256),
        {"max_batch_size": 64, "execution": {"provider": "cuda", "io_binding": False}},
    )
    demo_models.write_model(
        root,
        "pair_cuda",
        1,
        demo_models.dense_stack(8, 256),
        {"max_batch_size": 64, "execution": {"provider": "cuda", "instances": 2}},
    )
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


# -- IO binding: CUDA runs bind their inputs and outputs (service/runtime/iobinding.py) ----------


def test_cuda_versions_bind_their_tensors_and_the_others_run_plainly(service: Service) -> None:
    for name in ("mlp_cuda", "encoder_cuda", "multi_cuda", "batched_cuda", "pair_cuda"):
        runner = service.manager.resolve(name).runner
        assert runner.provider == CUDA and runner.binding == DeviceBinding("cuda", 0), name
    assert service.manager.resolve("unbound_cuda").runner.binding is None  # execution.io_binding: false
    assert service.manager.resolve("mlp_cpu").runner.binding is None  # the CPU path: session.run


def test_a_cuda_runner_gives_its_arenas_unused_chunks_back(service: Service) -> None:
    """The shrinking run after a slow or failed one names the CUDA session's arenas ("cpu:0;gpu:0",
    session.py): ONNX Runtime refuses the run (INVALID_ARGUMENT) if one of them is not found, so
    this fails if the device string is wrong for the device's arena (1.31.1 matches type and id)."""
    runner = service.manager.resolve("mlp_cuda").runner
    assert runner.shrink_options is not None
    runner.give_back_memory()
    (out,) = runner.run({"INPUT0": np.ones((2, 256), np.float32)}, ["OUTPUT0"])
    assert out.shape == (2, 256)


@pytest.mark.parametrize("batch", [1, 64])
async def test_bound_outputs_equal_the_cpu_for_several_outputs_and_types(
    channel: grpc.aio.Channel, batch: int
) -> None:
    stub: Any = pb_grpc.InferenceServiceStub(channel)
    rng = np.random.default_rng(batch)
    a = rng.standard_normal((batch, 64), dtype=np.float32)
    b = rng.integers(-100, 100, (batch, 64), dtype=np.int64)
    answers = {}
    for provider in PROVIDERS:
        reply = await stub.Infer(
            pb.InferRequest(model_name=f"multi_{provider}", inputs=[to_tensor("a", a), to_tensor("b", b)])
        )
        answers[provider] = {o.name: to_array(o) for o in reply.outputs}
    assert set(answers["cuda"]) == {"sum", "argmax"}
    np.testing.assert_allclose(answers["cuda"]["sum"], answers["cpu"]["sum"], rtol=1e-6, atol=1e-6)
    assert answers["cuda"]["argmax"].dtype == np.int64
    np.testing.assert_array_equal(answers["cuda"]["argmax"], answers["cpu"]["argmax"])


async def test_dynamic_batches_on_cuda_answer_each_request_as_the_cpu_does(
    channel: grpc.aio.Channel, service: Service
) -> None:
    stub: Any = pb_grpc.InferenceServiceStub(channel)
    rng = np.random.default_rng(7)
    rows = [rng.standard_normal((n, 256), dtype=np.float32) for n in (1, 3, 8, 2, 5, 1, 16, 4)]
    served = service.manager.resolve("batched_cuda")
    runs_before = served.stats.execution_count

    async def infer(model: str, x: np.ndarray) -> np.ndarray:
        reply = await stub.Infer(pb.InferRequest(model_name=model, inputs=[to_tensor("INPUT0", x)]))
        return to_array(reply.outputs[0])

    batched = await asyncio.gather(*(infer("batched_cuda", x) for x in rows))
    # Fewer runs than requests: some ran together, in one bound run, and were split back.
    assert served.stats.execution_count - runs_before < len(rows)
    for x, got in zip(rows, batched, strict=True):
        np.testing.assert_allclose(got, await infer("mlp_cpu", x), rtol=1e-3, atol=1e-4)
        # The same weights through session.run on CUDA (execution.io_binding: false).
        np.testing.assert_allclose(got, await infer("unbound_cuda", x), rtol=1e-5, atol=1e-6)


async def test_two_instances_on_the_device_take_runs_by_fewest_pending(
    channel: grpc.aio.Channel, service: Service
) -> None:
    stub: Any = pb_grpc.InferenceServiceStub(channel)
    x = np.random.default_rng(3).standard_normal((4, 256), dtype=np.float32)

    async def infer(model: str) -> np.ndarray:
        reply = await stub.Infer(pb.InferRequest(model_name=model, inputs=[to_tensor("INPUT0", x)]))
        return to_array(reply.outputs[0])

    instances = service.manager.resolve("pair_cuda").instances
    first, second = instances.all
    assert first.device == second.device == "cuda:0" and first.runner is not second.runner
    expected = await infer("mlp_cpu")
    # A run counted on instance 0 (as one in progress there): the next goes to instance 1's session.
    busy = instances.start()
    assert busy is first
    try:
        np.testing.assert_allclose(await infer("pair_cuda"), expected, rtol=1e-3, atol=1e-4)
    finally:
        instances.finish(busy)
    assert (first.runs, second.runs) == (1, 1) and (first.pending, second.pending) == (0, 0)
    # Both idle: the tie goes to the lowest index.
    np.testing.assert_allclose(await infer("pair_cuda"), expected, rtol=1e-3, atol=1e-4)
    assert (first.runs, second.runs) == (2, 1)


# -- device memory in the version budget (service/runtime/loader.py, device_budget.py) ---------

MIB = 2**20
WEIGHTS_MIB = 128  # dense_stack(512, 256): 512 x 256 x 256 float32
ON_CUDA = {"max_batch_size": 8, "execution": {"provider": "cuda"}}


def free_mib() -> float:
    """Free memory of CUDA device 0 as the driver reports it (what the loader reads)."""
    memory = memory_of([0])
    assert memory, "NVML reads no device 0 on a CUDA host"
    return (memory[0].total - memory[0].used) / MIB


def run_once(manager: ModelManager, name: str) -> np.ndarray:
    served = manager.resolve(name)
    (out,) = served.runner.run({"INPUT0": np.ones((2, 256), np.float32)}, ["OUTPUT0"])
    return out


@pytest.mark.parametrize("when", ["fail", "drain_first"])
async def test_the_budget_refuses_a_version_its_device_has_no_room_for(tmp_path: Path, when: str) -> None:
    root = tmp_path / "models"
    config = {**ON_CUDA, "reload": {"when_over_budget": when}}
    demo_models.write_model(root, "m", 1, demo_models.dense_stack(8, 256), config)
    manager = ModelManager(root, CHOICE)
    try:
        await manager.load_all()
        assert manager.resolve("m").runner.provider == CUDA
        expected = run_once(manager, "m")
        before = used_mb()
        # Version 2's sessions may grow to 1 GiB more than the device has free: refused before it
        # loads, even with drain_first (releasing version 1 would not make that room).
        oversized = {**config, "execution": {"provider": "cuda", "gpu_mem_limit_mb": int(free_mib()) + 1024}}
        demo_models.write_model(root, "m", 2, demo_models.dense_stack(8, 256, seed=2), oversized)
        await manager.reconcile("m")
        status = manager.status("m")
        assert status.versions[2].state == VersionState.FAILED
        assert "does not fit on its device" in status.versions[2].reason
        assert status.default_version == 1 and status.versions[1].state == VersionState.READY
        np.testing.assert_allclose(run_once(manager, "m"), expected, rtol=1e-6)  # version 1 still serves
        assert used_mb() < before + 32  # no session of version 2 took the device
    finally:
        await manager.close()


async def test_drain_first_releases_the_served_version_to_make_room_on_the_device(tmp_path: Path) -> None:
    root = tmp_path / "models"
    config = {**ON_CUDA, "reload": {"when_over_budget": "drain_first"}}
    demo_models.write_model(root, "m", 1, demo_models.dense_stack(512, 256), config)
    manager = ModelManager(root, CHOICE)
    try:
        await manager.load_all()
        took = manager.resolve("m").device_bytes[0] / MIB
        assert took >= WEIGHTS_MIB  # measured after its warm-up: at least its weights
        # Version 2 may grow to half of what version 1 took more than is free: it fits only once
        # version 1 is released, which drain_first does first.
        limit = int(free_mib() + took / 2)
        bounded = {**config, "execution": {"provider": "cuda", "gpu_mem_limit_mb": limit}}
        demo_models.write_model(root, "m", 2, demo_models.dense_stack(8, 256, seed=2), bounded)
        await manager.reconcile("m")
        status = manager.status("m")
        assert status.versions[2].state == VersionState.READY, status.versions[2].reason
        assert status.default_version == 2 and manager.resolve("m").runner.provider == CUDA
        assert status.versions[1].state == VersionState.UNLOADED
    finally:
        await manager.close()


async def test_a_retired_versions_device_memory_comes_back(tmp_path: Path) -> None:
    root = tmp_path / "models"
    demo_models.write_model(root, "big", 1, demo_models.dense_stack(512, 256), ON_CUDA)
    manager = ModelManager(root, CHOICE)
    try:
        before = used_mb()
        await manager.load_all()
        served = manager.resolve("big")
        loaded = used_mb()
        assert loaded >= before + WEIGHTS_MIB
        # What the loader measured is what the device shows, and what the model's budget counts.
        assert WEIGHTS_MIB * MIB <= served.device_bytes[0] <= (loaded - before + 1) * MIB
        assert served.memory_bytes >= served.device_bytes[0]
        del served
        await manager.unload("big")
        await eventually(
            lambda: used_mb() < before + 64, what="the device memory of the retired version back", within_s=30
        )
    finally:
        await manager.close()


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
    from tests.service.unit import test_decoder as unit  # the scripted joins and leaves, and their prompts

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
