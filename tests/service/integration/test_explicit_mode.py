"""Explicit model control as Triton's: nothing loads at start unless `--load-model NAME` (repeatable,
`*` for every model) names it; the repository's other models are listed, unloaded, until a load."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from models import demo_models
from modelyard.kserve.v2 import grpc_service_pb2 as kpb
from modelyard.kserve.v2 import grpc_service_pb2_grpc as kgrpc
from modelyard.service.runtime.reconciler import NOT_LOADED
from modelyard.service.server import Service, build_service
from modelyard.service.settings import Settings, parse_settings
from tests.support import start_service_process


@pytest.fixture
async def start(repository: Path) -> AsyncIterator[Any]:
    started: list[Service] = []

    async def start(**overrides: Any) -> Service:
        settings = Settings(
            repository=repository,
            listen="127.0.0.1:0",
            metrics_listen="",
            control_mode="explicit",
            management_open=True,
            **overrides,
        )
        service = build_service(settings)
        started.append(service)
        await service.start()
        return service

    yield start
    for service in started:
        await service.stop(grace_s=1.0)


def served(service: Service) -> set[str]:
    return {s.name for s in service.manager.statuses() if s.default_version is not None}


async def infer_scaler(stub: Any) -> kpb.ModelInferResponse:
    request = kpb.ModelInferRequest(model_name="scaler")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16])
    request.raw_input_contents.append(np.ones((1, 16), np.float32).tobytes())
    response: kpb.ModelInferResponse = await stub.ModelInfer(request)
    return response


async def test_nothing_loads_at_start_but_every_model_is_listed(start: Any) -> None:
    service = await start()
    assert served(service) == set()
    async with grpc.aio.insecure_channel(service.address) as channel:
        stub: Any = kgrpc.GRPCInferenceServiceStub(channel)
        # The server is ready (its start is done); no model is.
        assert (await stub.ServerReady(kpb.ServerReadyRequest())).ready
        assert not (await stub.ModelReady(kpb.ModelReadyRequest(name="scaler"))).ready
        index = await stub.RepositoryIndex(kpb.RepositoryIndexRequest())
        assert {(m.name, m.state, m.reason) for m in index.models} == {
            (name, "UNAVAILABLE", NOT_LOADED) for name in ("classifier", "mixed", "scaler")
        }
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await infer_scaler(stub)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "not loaded" in (refused.value.details() or "")
        # A load brings it in, and only it.
        await stub.RepositoryModelLoad(kpb.RepositoryModelLoadRequest(model_name="scaler"))
        assert served(service) == {"scaler"}
        assert (await infer_scaler(stub)).model_version == "2"
        # Nothing follows the disk in explicit mode: the others stay unloaded.
        await service.manager.reconcile_all()
        assert served(service) == {"scaler"}


async def test_load_model_names_what_loads_at_start(start: Any, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR):
        service = await start(load_model=("scaler", "mixed", "nope", "scaler"))
    assert served(service) == {"scaler", "mixed"}
    assert service.manager.status("classifier").reason == NOT_LOADED
    # A name with no model folder is said, and the start goes on.
    assert any("--load-model 'nope'" in r.getMessage() for r in caplog.records)
    everything = await start(load_model=("*",))
    assert served(everything) == {"classifier", "scaler", "mixed"}


async def test_watch_mode_still_loads_everything(repository: Path) -> None:
    service = build_service(
        Settings(repository=repository, listen="127.0.0.1:0", metrics_listen="", load_model=("scaler",))
    )
    await service.start()
    try:
        assert served(service) == {"classifier", "scaler", "mixed"}
    finally:
        await service.stop(grace_s=1.0)


def test_load_model_flag_is_repeatable_and_checked(tmp_path: Path) -> None:
    settings = parse_settings(["--control-mode", "explicit", "--load-model", "a", "--load-model", "*"])
    assert settings.load_model == ("a", "*")
    assert parse_settings([], {"MODELYARD_SERVICE_LOAD_MODEL": "a,b"}).load_model == ("a", "b")
    with pytest.raises(SystemExit):
        parse_settings(["--load-model", "../etc"])


def test_the_process_loads_what_the_flag_names(tmp_path: Path) -> None:
    root = tmp_path / "models"
    demo_models.build_demo_repository(root)
    process = start_service_process(root, "--control-mode", "explicit", "--load-model", "scaler")
    try:
        assert "models ready: scaler" in process.ready.string
    finally:
        process.stop()
