"""Hot reload: versions published on disk swap in atomically under load; bad ones never replace good."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import os
import shutil
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from onnx import TensorProto, helper

from models import demo_models
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.inference.v1 import model_service_pb2 as mpb
from modelyard.inference.v1 import model_service_pb2_grpc as mpb_grpc
from modelyard.kserve.v2 import grpc_service_pb2 as kpb
from modelyard.kserve.v2 import grpc_service_pb2_grpc as kgrpc
from modelyard.service.runtime.status import VersionState
from modelyard.service.server import Service, build_service
from modelyard.service.settings import Settings
from modelyard.tensors import to_array, to_tensor
from tests.support import eventually, metric

FEATURES = 4
CONFIG = {"max_batch_size": 8, "version_policy": {"latest": 1}}


def model_bytes(version: int, features: int = FEATURES) -> bytes:
    """Version N multiplies by N, so every answer says which version computed it."""
    return demo_models.serialize(demo_models.scaled_identity(features, float(version)))


def publish_by_rename(
    root: Path, staging: Path, version: int, data: bytes, checksum: str | None = None
) -> None:
    """The recommended way: write the whole version elsewhere on the same file system, then rename."""
    folder = staging / f"{version}-{time.monotonic_ns()}"
    folder.mkdir(parents=True)
    (folder / "model.onnx").write_bytes(data)
    if checksum is not None:
        (folder / "model.onnx.sha256").write_text(f"{checksum}  model.onnx\n")
    os.rename(folder, root / "m" / str(version))


async def publish_by_copy(root: Path, version: int, data: bytes, pieces: int = 4) -> None:
    """A slow file-by-file copy straight into the repository: the file grows in pieces."""
    folder = root / "m" / f"v{version}"
    folder.mkdir()
    step = len(data) // pieces + 1
    with (folder / "model.onnx").open("wb") as f:
        for i in range(0, len(data), step):
            f.write(data[i : i + step])
            f.flush()
            await asyncio.sleep(0.02)  # the pace of the copy, not a wait for the service


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    (root / "m" / "1").mkdir(parents=True)
    (root / "m" / "1" / "model.onnx").write_bytes(model_bytes(1))
    demo_models.write_model(root, "m", 1, demo_models.scaled_identity(FEATURES, 1.0), CONFIG)
    return root


async def started(root: Path, **overrides: Any) -> Service:
    settings = Settings(repository=root, listen="127.0.0.1:0", metrics_listen="", watch_quiet_s=0.1)
    service = build_service(replace(settings, **overrides))
    await service.start()
    return service


@pytest.fixture
async def live(root: Path) -> AsyncIterator[Service]:
    service = await started(root)
    try:
        yield service
    finally:
        await service.stop(grace_s=1.0)


def request(version: str = "") -> pb.InferRequest:
    x = np.arange(FEATURES, dtype=np.float32).reshape(1, FEATURES) + 1
    return pb.InferRequest(model_name="m", model_version=version, inputs=[to_tensor("INPUT0", x)])


async def test_versions_swap_under_load_without_a_failed_request(
    live: Service, root: Path, tmp_path: Path
) -> None:
    answers: list[tuple[int, float]] = []
    failures: list[str] = []
    stop = asyncio.Event()
    newest_seen = 1

    async def client(stub: Any) -> None:
        nonlocal newest_seen
        x = np.arange(FEATURES, dtype=np.float32) + 1
        while not stop.is_set():
            try:
                reply = await stub.Infer(request())
            except grpc.aio.AioRpcError as exc:
                failures.append(f"{exc.code()}: {exc.details()}")
                continue
            version = int(reply.model_version)
            scale = float(to_array(reply.outputs[0])[0, 0] / x[0])
            answers.append((version, scale))
            newest_seen = max(newest_seen, version)

    def seen(version: int) -> bool:
        return newest_seen >= version

    delays = []
    async with grpc.aio.insecure_channel(live.address) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        clients = [asyncio.ensure_future(client(stub)) for _ in range(4)]
        try:
            for version in range(2, 24):  # 22 swaps, alternating the two ways files arrive
                if version % 2:
                    await publish_by_copy(root, version, model_bytes(version))
                else:
                    publish_by_rename(root, tmp_path / "staging", version, model_bytes(version))
                published = time.perf_counter()
                await eventually(functools.partial(seen, version), f"version {version} answers", within_s=5)
                delays.append(time.perf_counter() - published)
                old = root / "m" / str(version - 2)
                for folder in (old, root / "m" / f"v{version - 2}"):
                    if folder.exists():
                        shutil.rmtree(folder)  # deleting an old version is part of a rollout
        finally:
            stop.set()
            await asyncio.gather(*clients)
    assert failures == []
    assert len(answers) > 200
    # Every response is labelled with exactly the version whose output it carries.
    assert all(version == scale for version, scale in answers)
    print(
        f"\n{len(answers)} requests over 22 swaps; publish -> first response by new version: "
        f"max {max(delays) * 1e3:.0f} ms, median {sorted(delays)[len(delays) // 2] * 1e3:.0f} ms"
    )
    assert max(delays) < 1.0
    status = live.manager.status("m")
    assert status.default_version == 23
    await eventually(lambda: not live.manager.retiring)
    versions = live.manager.status("m").versions
    assert versions[23].state == VersionState.READY
    assert all(v.state == VersionState.UNLOADED for n, v in versions.items() if n != 23)


def _warmup_fails() -> bytes:
    """Loads fine, but one row of 4 cannot be reshaped to [-1, 3]: the warm-up run fails."""
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["INPUT0", "shape"], ["OUTPUT0"])],
        "bad_warmup",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", FEATURES])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["rows", 3])],
        [helper.make_tensor("shape", TensorProto.INT64, [2], [-1, 3])],
    )
    return demo_models.serialize(demo_models.make_model(graph))


@pytest.mark.parametrize(
    ("kind", "data", "checksum", "words"),
    [
        ("load", b"\x08\x07garbage that is not a model", None, "onnxruntime cannot load it"),
        ("load", model_bytes(2)[: len(model_bytes(2)) // 2], None, "onnxruntime cannot load it"),
        ("checksum", model_bytes(2), "0" * 64, "does not match"),
        ("incompatible", model_bytes(2, features=FEATURES * 2), None, "schema differs from served version 1"),
        ("warmup", _warmup_fails(), None, "warm-up run failed"),
    ],
)
async def test_a_bad_version_never_replaces_a_good_one(
    live: Service, root: Path, tmp_path: Path, kind: str, data: bytes, checksum: str | None, words: str
) -> None:
    async with grpc.aio.insecure_channel(live.address) as channel:
        models = mpb_grpc.ModelServiceStub(channel)
        events: Any = models.WatchModels(mpb.WatchModelsRequest(names=["m"], send_initial_state=True))
        initial = await events.read()  # the watch is subscribed: no later change escapes it
        assert (initial.version, initial.state) == ("1", mpb.MODEL_STATE_READY)
        publish_by_rename(root, tmp_path / "staging", 2, data, checksum)
        while (change := await events.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
            if change.version == "2" and change.state == mpb.MODEL_STATE_FAILED:
                assert words in change.reason and "m/2/model.onnx" in change.reason
                break
        else:
            raise AssertionError("the watch ended before version 2 failed")
        events.cancel()
        reply = await pb_grpc.InferenceServiceStub(channel).Infer(request())
        assert reply.model_version == "1"
        model = (await models.GetModel(mpb.GetModelRequest(name="m"))).model
        assert model.default_version == "1"
        states = {v.version: (v.state, v.reason) for v in model.versions}
        assert states["1"][0] == mpb.MODEL_STATE_READY
        assert states["2"][0] == mpb.MODEL_STATE_FAILED and words in states["2"][1]
    failures = live.metrics.load_failures.labels("m", kind)._value.get()
    assert failures == 1
    # Fixing the version on disk brings it in.
    shutil.rmtree(root / "m" / "2")
    publish_by_rename(
        root, tmp_path / "staging", 2, model_bytes(2), hashlib.sha256(model_bytes(2)).hexdigest()
    )
    await eventually(lambda: live.manager.status("m").default_version == 2)


async def test_schema_change_allowed_by_config(live: Service, root: Path, tmp_path: Path) -> None:
    demo_models.write_model(
        root,
        "m",
        1,
        demo_models.scaled_identity(FEATURES, 1.0),
        {**CONFIG, "reload": {"allow_schema_change": True}},
    )
    # Version 1 reloads with the new config before version 2 comes.
    await eventually(lambda: live.manager.resolve("m").config.reload.allow_schema_change, "the new config")
    publish_by_rename(root, tmp_path / "staging", 2, model_bytes(2, features=FEATURES * 2))
    await eventually(lambda: live.manager.status("m").default_version == 2)
    served = live.manager.resolve("m")
    assert served.runner.signature.inputs[0].shape == (-1, FEATURES * 2)


async def test_a_stream_that_spans_a_swap_finishes_on_its_version(
    live: Service, root: Path, tmp_path: Path
) -> None:
    wide = 65536  # 256 KiB per row: the stream outgrows flow-control windows and waits for the reader
    demo_models.write_model(root, "w", 1, demo_models.scaled_identity(wide, 1.0), {"max_batch_size": 64})
    await eventually(lambda: live.manager.served("w") is not None)
    x = np.ones((64, wide), np.float32)
    async with grpc.aio.insecure_channel(live.address) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        stream = stub.InferStream(
            pb.InferStreamRequest(model_name="w", inputs=[to_tensor("INPUT0", x)], chunk_size=1)
        )
        first: Any = await stream.read()
        assert first.model_version == "1"
        demo_models.write_model(root, "w", 2, demo_models.scaled_identity(wide, 2.0))
        await eventually(lambda: live.manager.status("w").default_version == 2)
        # v1 is out of the table but waits for this stream before its session is released.
        await eventually(lambda: live.manager.status("w").versions[1].state == VersionState.DRAINING)
        # The rest of the stream runs on v1's session: had it been released, these runs would fail.
        rest: list[Any] = []
        while (reply := await stream.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
            rest.append(reply)
        assert len(rest) == 63 and {r.model_version for r in rest} == {"1"}
        assert all(float(to_array(r.outputs[0])[0, 0]) == 1.0 for r in rest)
    await eventually(lambda: live.manager.status("w").versions[1].state == VersionState.UNLOADED)


async def test_deleting_and_adding_models(live: Service, root: Path) -> None:
    demo_models.write_model(root, "extra", 3, demo_models.scaled_identity(2, 5.0))
    await eventually(lambda: live.manager.served("extra") is not None)
    registry = live.metrics.registry
    await eventually(lambda: metric(registry, "modelyard_model_versions_ready", model="extra") == 1)
    assert metric(registry, "modelyard_model_loads_total", model="extra", result="ready") == 1
    async with grpc.aio.insecure_channel(live.address) as channel:
        x = to_tensor("INPUT0", np.ones((1, 2), np.float32))
        await pb_grpc.InferenceServiceStub(channel).Infer(pb.InferRequest(model_name="extra", inputs=[x]))
    ok = {"method": "Infer", "version": "3", "code": "OK"}
    assert metric(registry, "modelyard_requests_total", model="extra", **ok) == 1
    shutil.rmtree(root / "extra")
    await eventually(lambda: "extra" not in {s.name for s in live.manager.statuses()})
    with pytest.raises(Exception, match="Request for unknown model: 'extra' is not found"):
        live.manager.resolve("extra")
    # Its series left with it, and its name no longer labels requests.
    await eventually(lambda: not live.manager.retiring)
    assert metric(registry, "modelyard_model_versions_ready", model="extra") is None
    assert metric(registry, "modelyard_model_loads_total", model="extra", result="ready") is None
    assert metric(registry, "modelyard_requests_total", model="extra", **ok) is None
    assert "extra" not in live.metrics.known_models


async def test_kubernetes_style_symlink_swap(tmp_path: Path) -> None:
    root = tmp_path / "volume"
    demo_models.write_model(root / "..2026_01", "m", 1, demo_models.scaled_identity(FEATURES, 1.0))
    (root / "..data").symlink_to("..2026_01")
    (root / "m").symlink_to("..data/m")
    service = await started(root)
    try:
        assert service.manager.status("m").default_version == 1
        demo_models.write_model(root / "..2026_02", "m", 2, demo_models.scaled_identity(FEATURES, 2.0))
        (root / "..data_tmp").symlink_to("..2026_02")
        os.rename(root / "..data_tmp", root / "..data")  # the atomic swap the kubelet does
        await eventually(lambda: service.manager.status("m").default_version == 2)
    finally:
        await service.stop(grace_s=1.0)


async def test_explicit_mode_loads_only_when_asked(root: Path, tmp_path: Path) -> None:
    service = await started(root, control_mode="explicit", load_model=("m",), management_open=True)
    try:
        publish_by_rename(root, tmp_path / "staging", 2, model_bytes(2))
        assert service.watcher is None  # nothing follows the disk: only LoadModel brings v2 in
        assert service.manager.status("m").default_version == 1
        async with grpc.aio.insecure_channel(service.address) as channel:
            models = mpb_grpc.ModelServiceStub(channel)
            loaded = (await models.LoadModel(mpb.LoadModelRequest(name="m"))).model
            assert loaded.default_version == "2"
    finally:
        await service.stop(grace_s=1.0)


async def test_unloaded_model_stays_unloaded_until_loaded(live: Service, root: Path, tmp_path: Path) -> None:
    await live.manager.unload("m")
    publish_by_rename(root, tmp_path / "staging", 2, model_bytes(2))
    # What the watcher does on this change and on its periodic resync, done here, so that the
    # check does not depend on when the watcher's turn comes.
    await live.manager.reconcile("m")
    await live.manager.reconcile_all()
    assert live.manager.served("m") is None
    status = await live.manager.load("m")
    assert status.default_version == 2


@pytest.mark.parametrize("when", ["fail", "drain_first"])
async def test_memory_budget(root: Path, tmp_path: Path, when: str) -> None:
    """A 1 MB budget holds one version (model plus 700 KiB of external data), not two."""
    reload = {"memory_budget_mb": 1, "when_over_budget": when}
    demo_models.write_model(
        root, "m", 1, demo_models.scaled_identity(FEATURES, 1.0), {**CONFIG, "reload": reload}
    )
    (root / "m" / "1" / "pad.bin").write_bytes(b"\0" * (700 * 1024))
    service = await started(root)
    try:
        folder = tmp_path / "staging" / "2"
        folder.mkdir(parents=True)
        (folder / "model.onnx").write_bytes(model_bytes(2))
        (folder / "pad.bin").write_bytes(b"\0" * (700 * 1024))
        os.rename(folder, root / "m" / "2")
        status = service.manager.status
        if when == "fail":
            await eventually(
                lambda: 2 in status("m").versions and status("m").versions[2].state == VersionState.FAILED
            )
            assert "memory budget is 1.0 MB" in status("m").versions[2].reason
            assert status("m").default_version == 1
        else:
            await eventually(lambda: status("m").default_version == 2)
            assert status("m").versions[1].state == VersionState.UNLOADED
    finally:
        await service.stop(grace_s=1.0)


async def test_repeated_load_unload_keeps_memory_bounded(service_process, root: Path) -> None:
    demo_models.write_model(
        root, "big", 1, demo_models.dense_stack(layers=4, width=512, seed=0), {"max_batch_size": 8}
    )  # 4 MiB of weights per load
    process = service_process(root, "--management-open")

    def rss_mb() -> float:
        for line in Path(f"/proc/{process.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    async with grpc.aio.insecure_channel(process.address) as channel:
        models = mpb_grpc.ModelServiceStub(channel)

        async def cycles(n: int) -> None:
            for _ in range(n):
                await models.UnloadModel(mpb.UnloadModelRequest(name="big"))
                await models.LoadModel(mpb.LoadModelRequest(name="big"))

        await cycles(5)  # allocator and arena warm-up
        before = rss_mb()
        await cycles(50)
        after = rss_mb()
    print(
        f"\nRSS after 5 load/unload cycles {before:.1f} MB, after 50 more {after:.1f} MB "
        f"(+{after - before:.1f} MB; each load holds 4 MiB of weights)"
    )
    assert after - before < 16
    assert process.stop() == 0


async def test_a_changed_or_added_label_file_reloads_the_version(tmp_path: Path) -> None:
    # Labels are read when a version loads: a label file rewritten beside config.yaml must reach
    # the answers, and a version that failed for want of its label file must load once it appears.
    root = tmp_path / "models"
    output = {"name": "OUTPUT0", "datatype": "FP32", "shape": [-1, 4], "label_filename": "labels.txt"}
    config = {"max_batch_size": 8, "outputs": [output]}
    demo_models.write_model(root, "c", 1, demo_models.dense_classifier(8, 8, 4, seed=3), config)
    labels = root / "c" / "labels.txt"
    service = await started(root)
    try:
        async with grpc.aio.insecure_channel(service.address) as channel:
            models = mpb_grpc.ModelServiceStub(channel)
            kserve = kgrpc.GRPCInferenceServiceStub(channel)

            async def state() -> int:
                got = await models.GetModel(mpb.GetModelRequest(name="c"))
                return got.model.versions[0].state if got.model.versions else mpb.MODEL_STATE_UNSPECIFIED

            async def top_label() -> str:
                request = kpb.ModelInferRequest(model_name="c")
                request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 8])
                request.raw_input_contents.append(np.ones((1, 8), np.float32).tobytes())
                request.outputs.add(name="OUTPUT0").parameters["classification"].int64_param = 1
                reply = await kserve.ModelInfer(request)
                return reply.raw_output_contents[0][4:].decode().rpartition(":")[2]

            await eventually(
                lambda: state_is(state, mpb.MODEL_STATE_FAILED), "the version failing for want of labels"
            )
            labels.write_text("a\nb\nc\nd\n")
            await eventually(
                lambda: state_is(state, mpb.MODEL_STATE_READY), "the version loading with labels"
            )
            first = await top_label()
            assert first in "abcd"
            labels.write_text("w\nx\ny\nz\n")
            renamed = dict(zip("abcd", "wxyz", strict=True))[first]

            async def relabelled() -> bool:
                return await top_label() == renamed

            await eventually(relabelled, "answers with the rewritten labels")
    finally:
        await service.stop(grace_s=1.0)


async def state_is(read: Any, wanted: int) -> bool:
    return bool(await read() == wanted)
