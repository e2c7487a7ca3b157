"""Ensembles through the service (KServe gRPC): a two-step chain and a fan-out that joins, versions
pinned for a whole request while another version swaps in, a missing or failing step answered
naming the step, and the statistics of the ensemble and of each step's model."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator, Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from models import demo_models
from models.demo_models import write_model
from modelyard.kserve.v2 import grpc_service_pb2 as kpb
from modelyard.kserve.v2 import grpc_service_pb2_grpc as kgrpc
from modelyard.service.runtime.status import VersionState
from modelyard.service.scheduling.queue import DEFAULT_SCHEDULING
from modelyard.service.server import Service, build_service
from modelyard.service.settings import Settings
from modelyard.tensors import encode_bytes
from tests import triton_models
from tests.support import eventually

FEATURES = 4


def chain(model: str, steps: int = 2, version: int = -1, max_batch_size: int = 8) -> dict[str, Any]:
    """X -> model -> model ... -> Y (each step the same model, fed the previous step's output)."""
    tensors = ["X"] + [f"t{i}" for i in range(1, steps)] + ["Y"]
    return {
        "platform": "ensemble",
        "max_batch_size": max_batch_size,
        "inputs": [{"name": "X", "datatype": "FP32", "shape": [-1, FEATURES]}],
        "outputs": [{"name": "Y", "datatype": "FP32", "shape": [-1, FEATURES]}],
        "ensemble_scheduling": {
            "step": [
                {
                    "model_name": model,
                    "model_version": version,
                    "input_map": {"INPUT0": tensors[i]},
                    "output_map": {"OUTPUT0": tensors[i + 1]},
                }
                for i in range(steps)
            ]
        },
    }


# X, Z -> (twice = X + X; diff = X - Z, side by side) -> SUM = twice + diff, DIFF = twice - diff
FAN_OUT: dict[str, Any] = {
    "platform": "ensemble",
    "max_batch_size": 8,
    "inputs": [
        {"name": "X", "datatype": "INT32", "shape": [-1, 16]},
        {"name": "Z", "datatype": "INT32", "shape": [-1, 16]},
    ],
    "outputs": [
        {"name": "SUM", "datatype": "INT32", "shape": [-1, 16]},
        {"name": "DIFF", "datatype": "INT32", "shape": [-1, 16]},
    ],
    "ensemble_scheduling": {
        "step": [
            {
                "model_name": "simple",
                "input_map": {"INPUT0": "twice", "INPUT1": "diff"},
                "output_map": {"OUTPUT0": "SUM", "OUTPUT1": "DIFF"},
            },
            {
                "model_name": "simple",
                "input_map": {"INPUT0": "X", "INPUT1": "X"},
                "output_map": {"OUTPUT0": "twice"},
            },
            {
                "model_name": "simple",
                "input_map": {"INPUT0": "X", "INPUT1": "Z"},
                "output_map": {"OUTPUT1": "diff"},
            },
        ]
    },
}


def picky() -> Any:
    """FP32 [n, 4] -> a Reshape to [1, 4] (no batch dimension): two rows are refused inside the graph."""
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("Reshape", ["INPUT0", "shape"], ["OUTPUT0"])],
        "picky",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", FEATURES])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", FEATURES])],
        initializer=[numpy_helper.from_array(np.array([1, FEATURES], np.int64), "shape")],
    )
    return demo_models.make_model(graph)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    write_model(root, "scale", 1, demo_models.scaled_identity(FEATURES, 2.0), {"max_batch_size": 8})
    write_model(root, "simple", 1, triton_models.simple(), triton_models.SIMPLE_CONFIG)
    write_model(root, "picky", 1, picky())
    # Sorted before its steps' models: ensembles load after the models they run all the same.
    triton_models.write_ensemble(root, "a_chain", chain("scale"))
    triton_models.write_ensemble(root, "fan_out", FAN_OUT)
    triton_models.write_ensemble(root, "picky_chain", chain("picky", steps=1, max_batch_size=0))
    triton_models.write_ensemble(root, "absent_chain", chain("absent"))
    return root


@pytest.fixture
async def service(root: Path) -> AsyncIterator[Service]:
    running = build_service(
        Settings(
            repository=root, listen="127.0.0.1:0", metrics_listen="", management_open=True, watch_quiet_s=0.05
        )
    )
    await running.start()
    try:
        yield running
    finally:
        await running.stop(grace_s=1.0)


@pytest.fixture
async def stub(service: Service) -> AsyncIterator[kgrpc.GRPCInferenceServiceStub]:
    async with grpc.aio.insecure_channel(service.address) as channel:
        yield kgrpc.GRPCInferenceServiceStub(channel)


def serving(service: Service, version: int) -> Callable[[], bool]:
    return lambda: service.manager.resolve("scale").version == version


def reason(error: grpc.aio.AioRpcError) -> str:
    metadata: Any = error.trailing_metadata() or ()
    return str(dict(metadata)["x-error-reason"])


def request(model: str, **inputs: np.ndarray) -> kpb.ModelInferRequest:
    req = kpb.ModelInferRequest(model_name=model)
    for name, array in inputs.items():
        datatype = {"float32": "FP32", "int32": "INT32", "object": "BYTES"}[str(array.dtype)]
        req.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
        req.raw_input_contents.append(encode_bytes(array) if datatype == "BYTES" else array.tobytes())
    return req


def output(response: kpb.ModelInferResponse, name: str, dtype: Any) -> np.ndarray:
    index = [o.name for o in response.outputs].index(name)
    shape = tuple(response.outputs[index].shape)
    return np.frombuffer(response.raw_output_contents[index], dtype=dtype).reshape(shape)


def statistics(stats: kpb.ModelStatisticsResponse) -> dict[str, tuple[int, int]]:
    return {
        m.name: (m.inference_stats.success.count, m.inference_stats.fail.count) for m in stats.model_stats
    }


async def test_a_two_step_chain(service: Service, stub: Any) -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, FEATURES)
    before = statistics(await stub.ModelStatistics(kpb.ModelStatisticsRequest()))
    response = await stub.ModelInfer(request("a_chain", X=x))
    np.testing.assert_array_equal(output(response, "Y", np.float32), x * 4)
    assert (response.model_name, response.model_version) == ("a_chain", "1")
    after = statistics(await stub.ModelStatistics(kpb.ModelStatisticsRequest()))
    # The ensemble counts one request; its steps' model one for each step.
    assert after["a_chain"][0] == before["a_chain"][0] + 1
    assert after["scale"][0] == before["scale"][0] + 2
    metadata = await stub.ModelMetadata(kpb.ModelMetadataRequest(name="a_chain"))
    assert metadata.platform == "ensemble" and [i.name for i in metadata.inputs] == ["X"]
    config = (await stub.ModelConfig(kpb.ModelConfigRequest(name="a_chain"))).config
    assert (config.platform, config.backend, list(config.instance_group)) == ("ensemble", "", [])
    assert [s.model_name for s in config.ensemble_scheduling.step] == ["scale", "scale"]
    assert dict(config.ensemble_scheduling.step[1].input_map) == {"INPUT0": "t1"}


async def test_a_fan_out_that_joins(stub: Any) -> None:
    rng = np.random.default_rng(1)
    x = rng.integers(-100, 100, size=(2, 16), dtype=np.int32)
    z = rng.integers(-100, 100, size=(2, 16), dtype=np.int32)
    response = await stub.ModelInfer(request("fan_out", X=x, Z=z))
    twice, diff = x + x, x - z
    np.testing.assert_array_equal(output(response, "SUM", np.int32), twice + diff)
    np.testing.assert_array_equal(output(response, "DIFF", np.int32), twice - diff)


async def test_a_swap_mid_request_never_mixes_versions(service: Service, root: Path, tmp_path: Path) -> None:
    plan = service.manager.resolve("a_chain").instances.plan  # type: ignore[attr-defined]
    leases = ExitStack()
    calls = plan._open(leases)  # what a request does first: every step's version pinned and leased
    pinned = calls[0].served
    staging = tmp_path / "staging"
    write_model(staging, "scale", 2, demo_models.scaled_identity(FEATURES, 3.0))
    shutil.move(str(staging / "scale" / "2"), str(root / "scale" / "2"))
    await eventually(lambda: service.manager.resolve("scale").version == 2, "scale version 2 serving")
    assert pinned.in_flight >= 2  # still leased by the request: not released under it
    x = np.ones((1, FEATURES), np.float32)
    with leases:
        made = await plan._flow(calls, {"X": x}, DEFAULT_SCHEDULING)
    assert pinned.in_flight == 0  # the request's leases all released, once
    np.testing.assert_array_equal(made["Y"], x * 4)  # v1 twice, not v1 then v2
    # New requests run on version 2, both steps.
    async with grpc.aio.insecure_channel(service.address) as channel:
        response = await kgrpc.GRPCInferenceServiceStub(channel).ModelInfer(request("a_chain", X=x))
    np.testing.assert_array_equal(output(response, "Y", np.float32), x * 9)


async def test_answers_under_swaps_are_each_of_one_version(
    service: Service, root: Path, tmp_path: Path
) -> None:
    x = np.ones((1, FEATURES), np.float32)
    answers: set[float] = set()

    async def calls(stub: Any) -> None:
        for _ in range(30):
            response = await stub.ModelInfer(request("a_chain", X=x))
            answers.add(float(output(response, "Y", np.float32)[0, 0]))

    async with grpc.aio.insecure_channel(service.address) as channel:
        stub = kgrpc.GRPCInferenceServiceStub(channel)
        clients = [asyncio.ensure_future(calls(stub)) for _ in range(4)]
        for version, scale in ((2, 3.0), (3, 5.0)):
            staging = tmp_path / f"staging{version}"
            write_model(staging, "scale", version, demo_models.scaled_identity(FEATURES, scale))
            shutil.move(str(staging / "scale" / str(version)), str(root / "scale" / str(version)))
            await eventually(serving(service, version), f"version {version}")
        await asyncio.gather(*clients)
    # 2*2, 3*3 or 5*5: never one step on one version and the next on another (6, 10, 15).
    assert answers <= {4.0, 9.0, 25.0}, answers


async def test_a_step_whose_model_is_not_served_is_unavailable_naming_it(service: Service, stub: Any) -> None:
    status = service.manager.status("absent_chain").versions[1]
    assert status.state == VersionState.READY
    assert "step 0: Request for unknown model: 'absent' is not found" in status.reason
    x = np.ones((1, FEATURES), np.float32)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.ModelInfer(request("absent_chain", X=x))
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert reason(caught.value) == "draining"
    assert "ensemble absent_chain version 1: step 0 (model 'absent')" in (caught.value.details() or "")
    # A step model unloaded later: the same answer, until it is back.
    await stub.RepositoryModelUnload(kpb.RepositoryModelUnloadRequest(model_name="scale"))
    with pytest.raises(grpc.aio.AioRpcError) as unloaded:
        await stub.ModelInfer(request("a_chain", X=x))
    assert unloaded.value.code() == grpc.StatusCode.UNAVAILABLE and "step 0 (model 'scale')" in (
        unloaded.value.details() or ""
    )
    await stub.RepositoryModelLoad(kpb.RepositoryModelLoadRequest(model_name="scale"))
    response = await stub.ModelInfer(request("a_chain", X=x))
    np.testing.assert_array_equal(output(response, "Y", np.float32), x * 4)


async def test_a_failing_step_keeps_its_kind_and_names_the_step(stub: Any) -> None:
    before = statistics(await stub.ModelStatistics(kpb.ModelStatisticsRequest()))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.ModelInfer(request("picky_chain", X=np.ones((2, FEATURES), np.float32)))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert reason(caught.value) == "model_rejected"
    assert (caught.value.details() or "").startswith(
        "ensemble picky_chain version 1: step 0 (model 'picky' version 1)"
    )
    after = statistics(await stub.ModelStatistics(kpb.ModelStatisticsRequest()))
    assert after["picky_chain"][1] == before["picky_chain"][1] + 1  # a failure of the ensemble
    assert after["picky"][1] == before["picky"][1] + 1  # and of its step's model
    # The ensemble's own inputs are checked as any model's: INVALID_ARGUMENT naming the tensor.
    with pytest.raises(grpc.aio.AioRpcError) as wrong:
        await stub.ModelInfer(request("picky_chain", X=np.ones((1, 3), np.float32)))
    assert wrong.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'X'" in (wrong.value.details() or "")
    ok = await stub.ModelInfer(request("picky_chain", X=np.ones((1, FEATURES), np.float32)))
    assert output(ok, "Y", np.float32).shape == (1, FEATURES)


async def test_steps_that_do_not_fit_their_models_fail_the_load(service: Service, root: Path) -> None:
    wrong_type = chain("scale")
    wrong_type["inputs"][0]["datatype"] = "INT32"
    unmapped = chain("simple", steps=1)
    unmapped["inputs"][0]["datatype"] = "INT32"
    unmapped["outputs"][0]["datatype"] = "INT32"
    for name, config, words in (
        ("wrong_type", wrong_type, "input 'INPUT0' is FP32, the tensor 'X' fed to it is INT32"),
        ("unmapped", unmapped, "input_map names ['INPUT0'], the model's inputs are ['INPUT0', 'INPUT1']"),
        ("selfish", chain("selfish"), "a step of the ensemble runs the ensemble itself"),
    ):
        triton_models.write_ensemble(root, name, config)
        await service.manager.reconcile(name)
        status = service.manager.status(name).versions[1]
        assert status.state == VersionState.FAILED and words in status.reason, status.reason


async def test_unload_dependents_unloads_the_ensembles_of_a_model(service: Service, stub: Any) -> None:
    unload = kpb.RepositoryModelUnloadRequest(model_name="simple")
    unload.parameters["unload_dependents"].bool_param = True
    await stub.RepositoryModelUnload(unload)
    assert service.manager.served("simple") is None and service.manager.served("fan_out") is None
    assert service.manager.served("a_chain") is not None  # it runs another model
    # Without it (tritonclient sends false), the ensembles stay; their requests wait for the step.
    await stub.RepositoryModelLoad(kpb.RepositoryModelLoadRequest(model_name="simple"))
    await stub.RepositoryModelLoad(kpb.RepositoryModelLoadRequest(model_name="fan_out"))
    plain = kpb.RepositoryModelUnloadRequest(model_name="scale")
    plain.parameters["unload_dependents"].bool_param = False
    await stub.RepositoryModelUnload(plain)
    assert service.manager.served("a_chain") is not None
    wrong = kpb.RepositoryModelUnloadRequest(model_name="scale")
    wrong.parameters["unload_dependents"].string_param = "yes"
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.RepositoryModelUnload(wrong)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
