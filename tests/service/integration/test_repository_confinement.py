"""Reading only what is ours: files that resolve outside the repository are refused unopened, and
what clients see (GetModel reasons) names files relative to the repository and quotes no content."""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from models import demo_models
from modelyard.common import headers
from modelyard.inference.v1 import model_service_pb2 as pb
from modelyard.inference.v1 import model_service_pb2_grpc as pb_grpc
from modelyard.kserve.v2 import grpc_service_pb2 as kpb
from modelyard.kserve.v2 import grpc_service_pb2_grpc as kgrpc
from modelyard.service.generation.tokenizer import TextCodec, TokenizerError, find_tokenizer
from modelyard.service.server import build_service
from modelyard.service.settings import Settings

SECRET = "root:x: [hunter2"  # a first line that YAML refuses, so a parser error would quote it


async def _reasons(root: Path) -> dict[str, str]:
    """Every model's reasons (model level and version level) as GetModel gives them to a client."""
    service = build_service(Settings(repository=root, listen="127.0.0.1:0", metrics_listen=""))
    await service.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{service.port}") as channel:
            stub = pb_grpc.ModelServiceStub(channel)
            listing = await stub.ListModels(pb.ListModelsRequest())
            out = {}
            for model in listing.models:
                got = (await stub.GetModel(pb.GetModelRequest(name=model.name))).model
                out[model.name] = " | ".join([got.reason, *(v.reason for v in got.versions)])
            return out
    finally:
        await service.stop(grace_s=1.0)


async def test_files_resolving_outside_are_refused_and_nothing_leaks(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET + "\n")
    root = tmp_path / "models"
    # config.yaml -> a file outside the repository.
    demo_models.write_model(root, "cfg", 1, demo_models.scaled_identity(4, 2.0))
    (root / "cfg" / "config.yaml").symlink_to(secret)
    # model.onnx.sha256 -> a file outside the repository.
    demo_models.write_model(root, "sums", 1, demo_models.scaled_identity(4, 2.0))
    (root / "sums" / "1" / "model.onnx.sha256").symlink_to(secret)
    # A broken config.yaml inside the repository: its parser error names the line, not the text.
    demo_models.write_model(root, "broken", 1, demo_models.scaled_identity(4, 2.0))
    (root / "broken" / "config.yaml").write_text(SECRET + "\n")
    # A corrupt model file: ONNX Runtime's own message names the absolute path; we must not.
    (root / "corrupt" / "1").mkdir(parents=True)
    (root / "corrupt" / "1" / "model.onnx").write_bytes(b"not a model")
    # A good model beside them keeps serving.
    demo_models.write_model(root, "good", 1, demo_models.scaled_identity(4, 2.0))
    good = root / "good" / "1" / "model.onnx"
    (root / "good" / "1" / "model.onnx.sha256").write_text(hashlib.sha256(good.read_bytes()).hexdigest())

    reasons = await _reasons(root)

    assert reasons["cfg"].startswith("cfg/config.yaml: resolves outside the model repository")
    assert "sums/1/model.onnx.sha256: resolves outside the model repository" in reasons["sums"]
    assert reasons["broken"].startswith("broken/config.yaml: not valid YAML (line ")
    assert "corrupt/1/model.onnx" in reasons["corrupt"]
    assert reasons["good"] == " | "
    for name, text in reasons.items():
        assert "hunter2" not in text and "root:x" not in text, name
        assert str(tmp_path) not in text, name


async def test_external_data_symlinked_outside_is_refused(tmp_path: Path) -> None:
    """External data named inside the version folder, but a symlink to a file outside it: ONNX
    Runtime checks the name only, so the service refuses the version before loading it."""
    from onnx import TensorProto, helper

    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.full(4, 7.0, np.float32).tobytes())
    root = tmp_path / "models"
    weight = TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[4], data_location=TensorProto.EXTERNAL)
    for key, value in (("location", "weights.bin"), ("offset", "0"), ("length", "16")):
        weight.external_data.add(key=key, value=value)
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "W"], ["y"])],
        "leak",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", demo_models.OPSET)])
    model.ir_version = demo_models.IR_VERSION
    (root / "leak" / "1").mkdir(parents=True)
    (root / "leak" / "1" / "model.onnx").write_bytes(model.SerializeToString())
    (root / "leak" / "1" / "weights.bin").symlink_to(secret)
    reasons = await _reasons(root)
    assert "leak/1/weights.bin: resolves outside the model repository" in reasons["leak"]


def test_tokenizer_resolving_outside_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "models"
    model_file = demo_models.write_model(root, "lm", 1, demo_models.scaled_identity(4, 2.0))
    (tmp_path / "tokenizer.json").write_text(SECRET)
    (model_file.parent / "tokenizer.json").symlink_to(tmp_path / "tokenizer.json")
    with pytest.raises(TokenizerError) as caught:
        find_tokenizer(model_file)
    assert str(caught.value) == "lm/1/tokenizer.json: resolves outside the model repository"
    # Read directly (not found by find_tokenizer), it is refused the same way, before opening.
    with pytest.raises(TokenizerError) as caught:
        TextCodec.from_file(model_file.parent / "tokenizer.json")
    assert "resolves outside" in str(caught.value) and "hunter2" not in str(caught.value)


async def test_uploaded_model_files_share_a_bounded_space(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every model name can hold one upload: without a bound, one client with the management
    # credential fills the disk by loading many names. Unloading gives the space back.
    uploads = tmp_path / "tmp"
    uploads.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(uploads))
    root = tmp_path / "models"
    demo_models.build_demo_repository(root)
    model = (root / "scaler" / "1" / "model.onnx").read_bytes()
    settings = Settings(
        repository=root,
        listen="127.0.0.1:0",
        metrics_listen="",
        max_upload_bytes=int(len(model) * 1.5),
        management_open=True,
    )
    service = build_service(settings)
    await service.start()
    config = '{"max_batch_size": 8, "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [16]}]}'

    def load(name: str) -> kpb.RepositoryModelLoadRequest:
        request = kpb.RepositoryModelLoadRequest(model_name=name)
        request.parameters["config"].string_param = config
        request.parameters["file:1/model.onnx"].bytes_param = model
        return request

    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{service.port}") as channel:
            stub = kgrpc.GRPCInferenceServiceStub(channel)
            await stub.RepositoryModelLoad(load("first"))
            assert len(list(uploads.iterdir())) == 1
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.RepositoryModelLoad(load("second"))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            metadata: Any = refused.value.trailing_metadata() or ()
            trailing = [(str(k), str(v)) for k, v in metadata]
            assert (headers.ERROR_REASON, "too_large") in trailing
            assert "--max-upload-bytes" in (refused.value.details() or "")
            assert len(list(uploads.iterdir())) == 1
            await stub.RepositoryModelUnload(kpb.RepositoryModelUnloadRequest(model_name="first"))
            assert list(uploads.iterdir()) == []
            await stub.RepositoryModelLoad(load("second"))
            ready = await stub.ModelReady(kpb.ModelReadyRequest(name="second"))
            assert ready.ready
    finally:
        await service.stop(grace_s=1.0)
