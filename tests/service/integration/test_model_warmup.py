"""Model warm-up as Triton's `model_warmup`: samples given as zeros, random values or a file in the
model's `warmup` folder (confined to the repository), run before a version serves; and a model
that refuses the synthetic warm-up (a string model casting "" to a number) loads without one,
saying so, instead of failing."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from models.demo_models import write_model
from modelyard.kserve.v2 import grpc_service_pb2 as kpb
from modelyard.kserve.v2 import grpc_service_pb2_grpc as kgrpc
from modelyard.service.runtime.status import VersionState
from modelyard.service.server import Service, build_service
from modelyard.service.settings import Settings
from modelyard.tensors import decode_bytes, encode_bytes
from tests import triton_models


@pytest.fixture
async def started() -> AsyncIterator[Any]:
    services: list[Service] = []

    async def start(root: Path) -> Service:
        service = build_service(
            Settings(repository=root, listen="127.0.0.1:0", metrics_listen="", management_open=True)
        )
        services.append(service)
        await service.start()
        return service

    yield start
    for service in services:
        await service.stop(grace_s=1.0)


def numbers(*rows: list[int]) -> np.ndarray:
    array = np.empty((len(rows), 16), dtype=object)
    for i, row in enumerate(rows):
        array[i, :] = [str(v).encode() for v in row]
    return array


async def add_strings(service: Service, a: np.ndarray, b: np.ndarray) -> list[list[bytes]]:
    request = kpb.ModelInferRequest(model_name="simple_string")
    for name, array in (("INPUT0", a), ("INPUT1", b)):
        request.inputs.add(name=name, datatype="BYTES", shape=list(array.shape))
        request.raw_input_contents.append(encode_bytes(array))
    async with grpc.aio.insecure_channel(service.address) as channel:
        response = await kgrpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
    out = decode_bytes(response.raw_output_contents[0], tuple(response.outputs[0].shape), "OUTPUT0")
    return [list(row) for row in out.tolist()]


def version_status(service: Service, name: str) -> Any:
    return service.manager.status(name).versions[1]


async def test_a_string_model_loads_without_a_synthetic_warmup_and_says_so(
    started: Any, tmp_path: Path
) -> None:
    root = tmp_path / "models"
    triton_models.write_simple_string(root, warm_up=False)
    service = await started(root)
    status = version_status(service, "simple_string")
    assert status.state == VersionState.READY
    assert status.reason.startswith("warm-up skipped: the graph refused a synthetic input")
    assert "model_warmup" in status.reason
    served = service.manager.resolve("simple_string")
    # Its cost was never measured: it runs on the executor, never inline on the event loop.
    assert not served.instances.runs_inline and not served.runner.sample_feeds
    row = list(range(16))
    assert await add_strings(service, numbers(row), numbers(row)) == [[str(2 * v).encode() for v in row]]


async def test_model_warmup_from_a_file_warms_it_up(started: Any, tmp_path: Path) -> None:
    root = tmp_path / "models"
    triton_models.write_simple_string(root, warm_up=True)
    service = await started(root)
    status = version_status(service, "simple_string")
    assert status.state == VersionState.READY and status.reason == ""
    served = service.manager.resolve("simple_string")
    assert served.runner.warmup_run_s < float("inf")
    assert served.runner.sample_feeds["INPUT0"].tolist() == [[str(v).encode() for v in range(16)]]
    assert await add_strings(service, numbers([1] * 16), numbers([2] * 16)) == [[b"3"] * 16]
    # ModelConfig says the sample back, as Triton's JSON.
    async with grpc.aio.insecure_channel(service.address) as channel:
        config = (
            await kgrpc.GRPCInferenceServiceStub(channel).ModelConfig(
                kpb.ModelConfigRequest(name="simple_string")
            )
        ).config
    (sample,) = config.model_warmup
    assert sample.name == "numbers" and sample.batch_size == 1
    assert sample.inputs["INPUT0"].input_data_file == "numbers.bin" and list(
        sample.inputs["INPUT0"].dims
    ) == [16]


@pytest.mark.parametrize(
    ("change", "words"),
    [
        # A configured sample must run, as Triton's: "" is no number.
        (
            {"INPUT0": {"datatype": "BYTES", "dims": [16], "zero_data": True}},
            "warm-up run (model_warmup sample 'numbers') failed",
        ),
        (
            {"INPUT0": {"datatype": "BYTES", "dims": [16], "input_data_file": "missing.bin"}},
            "simple_string/warmup/missing.bin: cannot read",
        ),
        (
            {"INPUT0": {"datatype": "BYTES", "dims": [8], "input_data_file": "numbers.bin"}},
            "dims [8] do not fit [-1, 16]",
        ),
        (
            {"INPUT0": {"datatype": "INT32", "dims": [16], "zero_data": True}},
            "input 'INPUT0' is BYTES, not INT32",
        ),
        (
            {"INPUT0": {"datatype": "BYTES", "dims": [16], "input_data_file": "short.bin"}},
            "needs 16 BYTES elements",
        ),
    ],
)
async def test_a_sample_that_does_not_fit_fails_the_load_saying_why(
    started: Any, tmp_path: Path, change: dict[str, Any], words: str
) -> None:
    root = tmp_path / "models"
    triton_models.write_simple_string(root, warm_up=True)
    (root / "simple_string" / "warmup" / "short.bin").write_bytes(triton_models.string_numbers([1, 2]))
    warmup = json.loads(json.dumps(triton_models.STRING_WARMUP))
    warmup[0]["inputs"].update(change)
    write_model(
        root, "simple_string", 1, triton_models.simple_string(), {"max_batch_size": 8, "model_warmup": warmup}
    )
    service = await started(root)
    status = version_status(service, "simple_string")
    assert status.state == VersionState.FAILED
    assert words in status.reason, status.reason
    assert str(root) not in status.reason  # files named relative to the repository


async def test_a_warmup_file_outside_the_repository_is_refused_unread(started: Any, tmp_path: Path) -> None:
    root = tmp_path / "models"
    triton_models.write_simple_string(root, warm_up=True)
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"hunter2" * 16)
    target = root / "simple_string" / "warmup" / "numbers.bin"
    target.unlink()
    os.symlink(secret, target)
    service = await started(root)
    status = version_status(service, "simple_string")
    assert status.state == VersionState.FAILED
    assert "simple_string/warmup/numbers.bin: resolves outside the model repository" in status.reason
    assert "hunter2" not in status.reason


async def test_zero_and_random_samples_of_a_numeric_model(started: Any, tmp_path: Path) -> None:
    root = tmp_path / "models"
    warmup = [
        {
            "name": "zeros",
            "batch_size": 4,
            "count": 3,
            "inputs": {
                "INPUT0": {"datatype": "INT32", "dims": [16], "zero_data": True},
                "INPUT1": {"datatype": "INT32", "dims": [16], "random_data": True},
            },
        },
        {
            "name": "skipped",
            "batch_size": 0,
            "inputs": {"INPUT0": {"datatype": "INT32", "dims": [16], "zero_data": True}},
        },
    ]
    write_model(
        root, "simple", 1, triton_models.simple(), {**triton_models.SIMPLE_CONFIG, "model_warmup": warmup}
    )
    service = await started(root)
    assert version_status(service, "simple").state == VersionState.READY
    feeds = service.manager.resolve("simple").runner.sample_feeds
    assert feeds["INPUT0"].shape == (4, 16) and not feeds["INPUT0"].any()
    assert feeds["INPUT1"].dtype == np.int32 and feeds["INPUT1"].any()  # random, the same each row
    assert (feeds["INPUT1"] == feeds["INPUT1"][0]).all()


async def test_a_triton_config_load_carries_model_warmup(started: Any, tmp_path: Path) -> None:
    root = tmp_path / "models"
    triton_models.write_simple_string(root, warm_up=True)
    (root / "simple_string" / "config.yaml").unlink()
    service = await started(root)
    assert version_status(service, "simple_string").reason.startswith("warm-up skipped")
    config = {
        "max_batch_size": 8,
        "model_warmup": [
            {
                "name": "numbers",
                "batch_size": 1,
                "inputs": {
                    name: {"data_type": "TYPE_STRING", "dims": [16], "input_data_file": "numbers.bin"}
                    for name in ("INPUT0", "INPUT1")
                },
            }
        ],
    }
    request = kpb.RepositoryModelLoadRequest(model_name="simple_string")
    request.parameters["config"].string_param = json.dumps(config)
    async with grpc.aio.insecure_channel(service.address) as channel:
        await kgrpc.GRPCInferenceServiceStub(channel).RepositoryModelLoad(request)
    status = version_status(service, "simple_string")
    assert status.state == VersionState.READY and status.reason == ""
