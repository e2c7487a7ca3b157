"""Hostile model names, versions and upload paths on the service's two APIs: each field that
reaches a path, a lock, a metric label or a message meets the one name rule at the edge
(INVALID_ARGUMENT, `x-error-reason: invalid_argument`, the field named); nothing is written
outside an upload's folder nor served from there; unknown names leave no state; answers quote no
unbounded value and no absolute path."""

from __future__ import annotations

import asyncio
import logging
import tempfile
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from models import demo_models
from modelyard import flat
from modelyard.common import headers
from modelyard.inference.v1 import inference_service_pb2 as ipb
from modelyard.inference.v1 import inference_service_pb2_grpc as ipb_grpc
from modelyard.inference.v1 import model_service_pb2 as mpb
from modelyard.inference.v1 import model_service_pb2_grpc as mpb_grpc
from modelyard.kserve.v2 import grpc_service_pb2 as kpb
from modelyard.kserve.v2 import grpc_service_pb2_grpc as kpb_grpc
from modelyard.service.api.errors import MESSAGE_MAX_BYTES, client_message
from modelyard.service.server import Service, build_service
from modelyard.service.settings import Settings
from modelyard.tensors import to_tensor
from tests.support import eventually

X = np.ones((1, 4), np.float32)
CONFIG = '{"max_batch_size": 8, "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [4]}]}'
# Names that break the rule: empty, dot paths, NUL, too long, path separators, hidden or flag-like.
BAD_NAMES = ["", ".", "..", "a\x00b", "x" * 129, "../x", "/abs", "a/b", "a..b", "-flag", "bad name", "a\n"]


@dataclass
class Setup:
    service: Service
    root: Path  # the repository
    uploads: Path  # where uploads' private folders go
    channel: grpc.aio.Channel
    model: bytes  # a valid model.onnx for uploads

    @property
    def v1(self) -> Any:  # the generated stubs are typed as blocking calls
        return ipb_grpc.InferenceServiceStub(self.channel)

    @property
    def models(self) -> Any:
        return mpb_grpc.ModelServiceStub(self.channel)

    @property
    def kserve(self) -> Any:
        return kpb_grpc.GRPCInferenceServiceStub(self.channel)

    def metrics_text(self) -> str:
        url = f"http://{self.service.metrics_address}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            return str(reply.read().decode())


@pytest.fixture
async def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Setup]:
    uploads = tmp_path / "uploads"
    uploads.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(uploads))
    root = tmp_path / "models"
    model_file = demo_models.write_model(root, "scaler", 1, demo_models.scaled_identity(4, 2.0))
    settings = Settings(
        repository=root,
        listen="127.0.0.1:0",
        metrics_listen="127.0.0.1:0",
        watch_quiet_s=0.05,
        management_open=True,  # these tests are about what management calls do with names
    )
    service = build_service(settings)
    await service.start()
    try:
        async with grpc.aio.insecure_channel(service.address) as channel:
            yield Setup(service, root, uploads, channel, model_file.read_bytes())
    finally:
        await service.stop(grace_s=1.0)


async def refused(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


def reason_of(error: grpc.aio.AioRpcError) -> str | None:
    metadata: Any = error.trailing_metadata() or ()
    for key, value in metadata:
        if key == headers.ERROR_REASON:
            return str(value)
    return None


def assert_invalid(error: grpc.aio.AioRpcError, field: str, what: str) -> None:
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (what, error.code(), error.details())
    assert reason_of(error) == "invalid_argument", what
    assert field in (error.details() or ""), (what, error.details())


def upload(name: str, files: dict[str, bytes], config: str = CONFIG) -> kpb.RepositoryModelLoadRequest:
    request = kpb.RepositoryModelLoadRequest(model_name=name)
    request.parameters["config"].string_param = config
    for path, data in files.items():
        request.parameters[f"file:{path}"].bytes_param = data
    return request


def files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


# -- path traversal -------------------------------------------------------------------------


async def test_upload_names_cannot_write_outside_the_upload_folder(setup: Setup, tmp_path: Path) -> None:
    repository_before = files_under(setup.root)
    # Relative to an upload's folder (uploads/modelyard-load-XXX/<name>), "../../models/planted"
    # is the repository itself: watch mode would then load and serve what the upload planted.
    names = [
        "../../models/planted",
        "../escaped",
        str(setup.root / "absolute"),
        str(tmp_path / "elsewhere"),
        "",
        ".",
        "a\x00b",
        "x" * 300,
    ]
    for name in names:
        error = await refused(setup.kserve.RepositoryModelLoad(upload(name, {"1/model.onnx": setup.model})))
        assert_invalid(error, "model_name", repr(name))
    await setup.service.manager.reconcile_all()  # what watch mode does at its next resync
    assert files_under(setup.root) == repository_before
    assert files_under(setup.uploads) == []
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "elsewhere").exists()
    assert [s.name for s in setup.service.manager.statuses()] == ["scaler"]
    for name in ("planted", "absolute"):
        ready = await setup.kserve.ModelReady(kpb.ModelReadyRequest(name=name))
        assert not ready.ready


async def test_upload_file_paths_cannot_escape_the_upload_folder(setup: Setup, tmp_path: Path) -> None:
    repository_before = files_under(setup.root)
    paths = [
        "../../../models/planted/1/model.onnx",
        "../x/1/model.onnx",
        str(tmp_path / "abs" / "1" / "model.onnx"),
        "/1/model.onnx",
        "1/../../../escaped.onnx",
        "1/model.onnx\x00.txt",
        "1/model.onnx\n",
        "1/./model.onnx",
        "1//model.onnx",
        "1/.hidden",
    ]
    for path in paths:
        files = {path: setup.model, "1/model.onnx": setup.model}
        error = await refused(setup.kserve.RepositoryModelLoad(upload("ok", files)))
        assert_invalid(error, "file:", repr(path))
    await setup.service.manager.reconcile_all()
    assert files_under(setup.root) == repository_before
    assert files_under(setup.uploads) == []
    assert not (tmp_path / "abs").exists() and not (tmp_path / "escaped.onnx").exists()
    assert not setup.service.manager.knows("ok") and not setup.service.manager.knows("planted")


async def test_a_plain_upload_still_loads_and_serves(setup: Setup) -> None:
    # The control: the same request with a good name and path is served (so the refusals above
    # are the rule's, not a broken upload).
    await setup.kserve.RepositoryModelLoad(upload("uploaded", {"1/model.onnx": setup.model}))
    reply = await setup.v1.Infer(ipb.InferRequest(model_name="uploaded", inputs=[to_tensor("INPUT0", X)]))
    assert reply.model_version == "1"
    assert len(files_under(setup.uploads)) == 1


# -- every name field of both APIs ----------------------------------------------------------


def _kserve_infer(name: str, version: str = "") -> kpb.ModelInferRequest:
    request = kpb.ModelInferRequest(model_name=name, model_version=version)
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 4])
    request.raw_input_contents.append(X.tobytes())
    return request


def _name_calls(s: Setup) -> dict[str, tuple[str, Callable[[str], Awaitable[Any]]]]:
    """Each API call that names a model: (the field its refusal names, the call with a name)."""

    async def stream_first(call: Any) -> Any:
        async for reply in call:
            return reply
        return None

    async def flat_infer(name: str) -> Any:
        call = s.channel.unary_unary(flat.METHOD, None, None)
        return await call(flat.encode_request(name, {"INPUT0": X}))

    inputs = [to_tensor("INPUT0", X)]
    return {
        "Infer": ("model_name", lambda n: s.v1.Infer(ipb.InferRequest(model_name=n, inputs=inputs))),
        "InferStream": (
            "model_name",
            lambda n: stream_first(s.v1.InferStream(ipb.InferStreamRequest(model_name=n, inputs=inputs))),
        ),
        "Generate": (
            "model_name",
            lambda n: stream_first(s.v1.Generate(ipb.GenerateRequest(model_name=n, prompt="hi"))),
        ),
        "InferFlat": ("model_name", flat_infer),
        "GetModel": ("name", lambda n: s.models.GetModel(mpb.GetModelRequest(name=n))),
        "LoadModel": ("name", lambda n: s.models.LoadModel(mpb.LoadModelRequest(name=n))),
        "UnloadModel": ("name", lambda n: s.models.UnloadModel(mpb.UnloadModelRequest(name=n))),
        "WatchModels": (
            "names",
            lambda n: stream_first(s.models.WatchModels(mpb.WatchModelsRequest(names=["scaler", n]))),
        ),
        "ModelInfer": ("model_name", lambda n: s.kserve.ModelInfer(_kserve_infer(n))),
        "ModelReady": ("name", lambda n: s.kserve.ModelReady(kpb.ModelReadyRequest(name=n))),
        "ModelMetadata": ("name", lambda n: s.kserve.ModelMetadata(kpb.ModelMetadataRequest(name=n))),
        "ModelConfig": ("name", lambda n: s.kserve.ModelConfig(kpb.ModelConfigRequest(name=n))),
        "ModelStatistics": (
            "name",
            lambda n: s.kserve.ModelStatistics(kpb.ModelStatisticsRequest(name=n)),
        ),
        "RepositoryModelLoad": (
            "model_name",
            lambda n: s.kserve.RepositoryModelLoad(kpb.RepositoryModelLoadRequest(model_name=n)),
        ),
        "RepositoryModelUnload": (
            "model_name",
            lambda n: s.kserve.RepositoryModelUnload(kpb.RepositoryModelUnloadRequest(model_name=n)),
        ),
    }


# Where no name means "every model", an empty one is a valid request.
_EMPTY_MEANS_ALL = {"ModelStatistics"}


async def test_every_name_field_refuses_bad_names_as_invalid_argument(setup: Setup) -> None:
    for method, (field, call) in _name_calls(setup).items():
        for name in BAD_NAMES:
            if not name and method in _EMPTY_MEANS_ALL:
                continue
            assert_invalid(await refused(call(name)), field, f"{method}({name!r})")
    # The service is unharmed and still serves.
    reply = await setup.v1.Infer(ipb.InferRequest(model_name="scaler", inputs=[to_tensor("INPUT0", X)]))
    assert reply.model_version == "1"
    assert [s.name for s in setup.service.manager.statuses()] == ["scaler"]


async def test_a_kserve_stream_answers_a_bad_name_in_band_and_goes_on(setup: Setup) -> None:
    requests = [_kserve_infer("../x"), _kserve_infer("x" * 100_000), _kserve_infer("scaler")]
    replies = [r async for r in setup.kserve.ModelStreamInfer(iter(requests))]
    assert len(replies) == 3
    for bad in replies[:2]:
        assert "model_name" in bad.error_message and len(bad.error_message) < 300, bad.error_message
        assert bad.infer_response.parameters["error_reason"].string_param == "invalid_argument"
        assert bad.infer_response.model_name == ""  # no echo of a name that is none
    assert not replies[2].error_message and replies[2].infer_response.model_version == "1"


async def test_every_version_field_refuses_bad_versions(setup: Setup) -> None:
    inputs = [to_tensor("INPUT0", X)]
    for version in ["..", "a\x00", "x" * 200, "1/../2", "-1", "1\n"]:
        calls = {
            "Infer": setup.v1.Infer(
                ipb.InferRequest(model_name="scaler", model_version=version, inputs=inputs)
            ),
            "ModelInfer": setup.kserve.ModelInfer(_kserve_infer("scaler", version)),
            "ModelReady": setup.kserve.ModelReady(kpb.ModelReadyRequest(name="scaler", version=version)),
            "ModelMetadata": setup.kserve.ModelMetadata(
                kpb.ModelMetadataRequest(name="scaler", version=version)
            ),
            "ModelConfig": setup.kserve.ModelConfig(kpb.ModelConfigRequest(name="scaler", version=version)),
            "ModelStatistics": setup.kserve.ModelStatistics(
                kpb.ModelStatisticsRequest(name="scaler", version=version)
            ),
        }
        for method, call in calls.items():
            field = "version" if method.startswith("Model") and method != "ModelInfer" else "model_version"
            assert_invalid(await refused(call), field, f"{method} version {version!r}")
    # A version sent in the x-model-version header (proxies set it) meets the same rule.
    for version in ["..", "x" * 200]:
        call = setup.v1.Infer(
            ipb.InferRequest(model_name="scaler", inputs=inputs),
            metadata=((headers.MODEL_VERSION, version),),
        )
        assert_invalid(await refused(call), headers.MODEL_VERSION, f"header {version!r}")


async def test_model_control_through_workers_refuses_bad_names(
    service_process: Callable[..., Any], tmp_path: Path
) -> None:
    # With --workers, model control travels from the worker that took the call to the supervisor
    # (the name in gRPC metadata) and on to every worker: a bad name is refused before it travels.
    root = tmp_path / "models"
    model_file = demo_models.write_model(root, "scaler", 1, demo_models.scaled_identity(4, 2.0))
    process = service_process(root, "--workers", "2", "--management-open")
    async with grpc.aio.insecure_channel(process.address) as channel:
        models: Any = mpb_grpc.ModelServiceStub(channel)
        kserve: Any = kpb_grpc.GRPCInferenceServiceStub(channel)
        for name in ["a\x00b", "x" * (1 << 20), "../../models/planted", "", "caf\u00e9"]:
            for field, call in (
                ("name", models.LoadModel(mpb.LoadModelRequest(name=name))),
                ("name", models.GetModel(mpb.GetModelRequest(name=name))),
                ("name", kserve.ModelReady(kpb.ModelReadyRequest(name=name))),
                ("name", models.UnloadModel(mpb.UnloadModelRequest(name=name))),
                ("model_name", kserve.RepositoryModelLoad(upload(name, {"1/model.onnx": b"x"}))),
                (
                    "model_name",
                    kserve.RepositoryModelUnload(kpb.RepositoryModelUnloadRequest(model_name=name)),
                ),
            ):
                error = await refused(call)
                assert_invalid(error, field, repr(name[:20]))
                assert len(error.details() or "") < 400
        # Uploads under new names, loaded and unloaded, leave no state (nor replay entries).
        for i in range(3):
            await kserve.RepositoryModelLoad(upload(f"u{i}", {"1/model.onnx": model_file.read_bytes()}))
            await kserve.RepositoryModelUnload(kpb.RepositoryModelUnloadRequest(model_name=f"u{i}"))
        listing = await models.ListModels(mpb.ListModelsRequest())
        assert [m.name for m in listing.models] == ["scaler"]
    assert not (root / "planted").exists()


# -- names on disk ----------------------------------------------------------------------------


async def test_repository_folders_with_bad_names_are_skipped_and_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "models"
    model = demo_models.scaled_identity(4, 2.0)
    demo_models.write_model(root, "scaler", 1, model)
    for bad in ("bad name", "a..b", "-flag"):
        (root / bad / "1").mkdir(parents=True)
        (root / bad / "1" / "model.onnx").write_bytes(demo_models.serialize(model))
    (root / ".hidden" / "1").mkdir(parents=True)  # hidden folders are not models, and not news
    caplog.set_level(logging.WARNING, "modelyard.service.runtime.reconciler")
    settings = Settings(repository=root, listen="127.0.0.1:0", metrics_listen="", watch_quiet_s=0.05)
    service = build_service(settings)
    await service.start()
    try:
        assert [s.name for s in service.manager.statuses()] == ["scaler"]
        for bad in ("bad name", "a..b", "-flag"):
            assert sum("skipped: " in r.message and repr(bad) in r.message for r in caplog.records) == 1
        assert not any(".hidden" in r.message for r in caplog.records)
        # Watch mode: a bad folder added later is skipped too, while a good one beside it loads;
        # a resync does not report the same folder again.
        (root / "also bad" / "1").mkdir(parents=True)
        (root / "also bad" / "1" / "model.onnx").write_bytes(demo_models.serialize(model))
        demo_models.write_model(root, "late", 1, model)
        await eventually(lambda: service.manager.served("late") is not None, "the good folder served")
        await service.manager.reconcile_all()
        assert [s.name for s in service.manager.statuses()] == ["late", "scaler"]
        assert sum("'also bad'" in r.message for r in caplog.records) == 1
        assert sum("'bad name'" in r.message for r in caplog.records) == 1
    finally:
        await service.stop(grace_s=1.0)


# -- state per name ---------------------------------------------------------------------------


def _series(text: str) -> list[str]:
    return [line.rsplit(" ", 1)[0] for line in text.splitlines() if line and not line.startswith("#")]


async def test_unknown_names_leave_no_state(setup: Setup) -> None:
    inputs = [to_tensor("INPUT0", X)]
    calls: list[Callable[[str], Awaitable[Any]]] = [
        lambda n: setup.v1.Infer(ipb.InferRequest(model_name=n, inputs=inputs)),
        lambda n: setup.models.GetModel(mpb.GetModelRequest(name=n)),
        lambda n: setup.models.LoadModel(mpb.LoadModelRequest(name=n)),
        lambda n: setup.models.UnloadModel(mpb.UnloadModelRequest(name=n)),
        lambda n: setup.kserve.RepositoryModelLoad(kpb.RepositoryModelLoadRequest(model_name=n)),
        lambda n: setup.kserve.ModelInfer(_kserve_infer(n)),
        lambda n: setup.kserve.ModelStatistics(kpb.ModelStatisticsRequest(name=n)),
    ]

    async def unknown(i: int) -> None:
        error = await refused(calls[i % len(calls)](f"unknown-{i}"))
        assert error.code() == grpc.StatusCode.NOT_FOUND, error.details()

    for i in range(len(calls)):  # each method's one series for unknown models exists from now on
        await unknown(i)
    manager = setup.service.manager
    before = await asyncio.to_thread(setup.metrics_text)
    for start in range(0, 3000, 100):  # 100 at a time: the lock table is pruned under overlap too
        await asyncio.gather(*(unknown(i) for i in range(start, start + 100)))
    after = await asyncio.to_thread(setup.metrics_text)
    assert manager.lock_count == 0
    assert [s.name for s in manager.statuses()] == ["scaler"]
    assert "unknown-" not in after
    assert _series(after) == _series(before)
    assert len(after) < len(before) + 2048  # counts gain digits; no series is added


async def test_uploads_that_fail_to_load_leave_no_state(setup: Setup) -> None:
    manager = setup.service.manager
    await refused(setup.kserve.RepositoryModelLoad(upload("broken-0", {"1/model.onnx": b"not a model"})))
    before = await asyncio.to_thread(setup.metrics_text)
    for i in range(1, 20):
        error = await refused(
            setup.kserve.RepositoryModelLoad(upload(f"broken-{i}", {"1/model.onnx": b"not a model"}))
        )
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "broken-" in (error.details() or "")
    after = await asyncio.to_thread(setup.metrics_text)
    assert [s.name for s in manager.statuses()] == ["scaler"]
    assert files_under(setup.uploads) == []
    assert manager.lock_count == 0
    assert "broken-1" not in after and "broken-19" not in after
    assert len(_series(after)) <= len(_series(before))


async def test_uploaded_models_leave_no_state_once_unloaded(setup: Setup) -> None:
    manager = setup.service.manager
    before = await asyncio.to_thread(setup.metrics_text)
    for i in range(10):
        name = f"passing-{i}"
        await setup.kserve.RepositoryModelLoad(upload(name, {"1/model.onnx": setup.model}))
        assert manager.served(name) is not None
        await setup.kserve.RepositoryModelUnload(kpb.RepositoryModelUnloadRequest(model_name=name))
    await manager.reconcile_all()
    after = await asyncio.to_thread(setup.metrics_text)
    assert [s.name for s in manager.statuses()] == ["scaler"]
    assert files_under(setup.uploads) == [] and manager.lock_count == 0
    assert "passing-" not in after
    # The repository's own model keeps its status when unloaded (it can be loaded again).
    await setup.models.UnloadModel(mpb.UnloadModelRequest(name="scaler"))
    assert [s.name for s in manager.statuses()] == ["scaler"]
    assert "scaler" in before


# -- what answers quote -------------------------------------------------------------------------


def _quoted_at_most(error: grpc.aio.AioRpcError, chars: int = 400) -> None:
    details = error.details() or ""
    assert len(details) <= chars, len(details)


async def test_huge_values_are_not_echoed(setup: Setup) -> None:
    huge = "n" * (1 << 20)
    inputs = [to_tensor("INPUT0", X)]
    for call in (
        setup.v1.Infer(ipb.InferRequest(model_name=huge, inputs=inputs)),
        setup.kserve.ModelInfer(_kserve_infer(huge)),
        setup.kserve.RepositoryModelLoad(upload(huge, {"1/model.onnx": setup.model})),
        setup.v1.Infer(ipb.InferRequest(model_name="scaler", model_version=huge, inputs=inputs)),
    ):
        error = await refused(call)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert reason_of(error) == "invalid_argument"
        _quoted_at_most(error)
        assert "..." in (error.details() or "")
    # Client-chosen strings beside the name: a tensor name, a parameter key, a 5 MB config.
    request = _kserve_infer("scaler")
    request.inputs[0].name = huge
    big_key = kpb.RepositoryModelLoadRequest(model_name="m")
    big_key.parameters[huge].string_param = "x"
    five_mb = "c" * (5 << 20)
    configs = [
        '{"' + five_mb + '": 1}',  # the parser names the unknown field
        '{"name": "' + five_mb + '"}',  # not the model's name
        five_mb,  # not JSON at all
    ]
    calls = [
        setup.kserve.ModelInfer(request),
        setup.kserve.RepositoryModelLoad(big_key),
        setup.kserve.LogSettings(
            kpb.LogSettingsRequest(settings={huge: kpb.LogSettingsRequest.SettingValue()})
        ),
        *(setup.kserve.RepositoryModelLoad(upload("m", {}, config)) for config in configs),
    ]
    for call in calls:
        error = await refused(call)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert reason_of(error) == "invalid_argument"
        _quoted_at_most(error, 1000)


async def test_failed_upload_loads_quote_no_server_path(setup: Setup, tmp_path: Path) -> None:
    error = await refused(setup.kserve.RepositoryModelLoad(upload("corrupt", {"1/model.onnx": b"junk"})))
    details = error.details() or ""
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, details
    assert "corrupt/1/model.onnx" in details, details  # ONNX Runtime's message, path made relative
    assert str(tmp_path) not in details and "modelyard-load-" not in details, details
    # A schema that does not fit the served one: our own message names the file too.
    await setup.kserve.RepositoryModelLoad(upload("fits", {"1/model.onnx": setup.model}))
    other = demo_models.serialize(demo_models.scaled_identity(8, 2.0))
    wider = CONFIG.replace("[4]", "[8]")
    error = await refused(setup.kserve.RepositoryModelLoad(upload("fits", {"2/model.onnx": other}, wider)))
    details = error.details() or ""
    assert str(tmp_path) not in details and "modelyard-load-" not in details, details


def test_the_message_cap_is_the_last_net() -> None:
    assert client_message("short") == "short"
    long = client_message("é" * 10_000)
    assert len(long.encode()) <= MESSAGE_MAX_BYTES and long.endswith("...")
