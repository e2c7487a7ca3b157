"""Version dyeing through a real sidecar in front of a real service serving scaler v1 and v2:
canary share, stickiness, monotonic weight changes, pins, header weight, live config changes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from modelyard.kserve.v2 import grpc_service_pb2 as kserve
from modelyard.kserve.v2 import grpc_service_pb2_grpc as kserve_grpc
from modelyard.service.server import Service
from modelyard.sidecar.server import Sidecar
from tests.sidecar_support import admin_async, infer, known_versions, pairs, running_sidecar
from tests.support import eventually

USERS = [f"user-{i}" for i in range(300)]


def write_config(path: Path, doc: dict[str, object] | str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    tmp.replace(path)


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "routes.yaml"
    write_config(path, {"models": {"scaler": {"canary_weight": 30}}})
    return path


@pytest.fixture
async def sidecar(service: Service, config: Path) -> AsyncIterator[Sidecar]:
    async with running_sidecar([service.address], config=config, admin_open=True) as running:
        await known_versions(running, "scaler", {"1", "2"})
        yield running


@pytest.fixture
async def through(sidecar: Sidecar) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(sidecar.address) as channel:
        yield channel


async def versions_by_user(channel: grpc.aio.Channel, **kwargs) -> dict[str, str]:
    seen = {}
    for user in USERS:
        answer = await infer(channel, user=user, **kwargs)
        assert answer.dye == ("canary" if answer.version == "2" else "stable")
        seen[user] = answer.version
    return seen


async def test_canary_share_is_the_weight_and_users_keep_their_version(through) -> None:
    first = await versions_by_user(through)
    share = sum(v == "2" for v in first.values()) / len(first)
    assert abs(share - 0.30) < 0.07, share
    # The canary really answered: scaler v2 multiplies by 3, v1 by 2.
    canary_user = next(u for u, v in first.items() if v == "2")
    answer = await infer(through, user=canary_user)
    assert answer.response.outputs[0].raw_data[:4] == b"\x00\x00\x40\x40"  # 3.0f
    assert await versions_by_user(through) == first  # sticky


async def test_raising_the_weight_by_admin_moves_users_only_to_the_canary(sidecar, through) -> None:
    before = await versions_by_user(through)
    answer = await admin_async(sidecar, "/canary/scaler", "PUT", {"canary_weight": 60})
    assert answer["canary_weight"] == 60
    after = await versions_by_user(through)
    assert all(after[u] == "2" for u in USERS if before[u] == "2")
    moved = sum(after[u] != before[u] for u in USERS) / len(USERS)
    assert 0.2 < moved < 0.4, moved
    listing = await admin_async(sidecar, "/canary")
    assert listing["models"]["scaler"]["canary_weight"] == 60
    refused = await admin_async(sidecar, "/canary/scaler", "PUT", {"canary_weight": 101})
    assert "0 to 100" in refused["error"]


async def test_a_pin_by_header_or_by_field_chooses_the_version(through) -> None:
    for user in USERS[:40]:
        by_header = await infer(
            through, user=user, metadata=[("x-model-version", "1"), ("x-canary-weight", "100")]
        )
        assert (by_header.version, by_header.dye) == ("1", "pinned")
        by_field = await infer(through, user=user, version="2", metadata=[("x-canary-weight", "0")])
        assert (by_field.version, by_field.dye) == ("2", "pinned")


async def test_the_header_weight_overrides_the_config(through) -> None:
    assert set((await versions_by_user(through, metadata=[("x-canary-weight", "100")])).values()) == {"2"}
    assert set((await versions_by_user(through, metadata=[("x-canary-weight", "0")])).values()) == {"1"}
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await infer(through, user="u", metadata=[("x-canary-weight", "half")])
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "x-canary-weight" in caught.value.details()
    assert ("x-error-reason", "invalid_argument") in pairs(caught.value.trailing_metadata())


async def test_a_config_file_change_applies_without_a_restart(sidecar, through, config: Path) -> None:
    write_config(config, {"models": {"scaler": {"canary_weight": 100}}})

    async def all_canary() -> bool:
        return {(await infer(through, user=u)).version for u in USERS[:20]} == {"2"}

    await eventually(all_canary, what="weight 100 from the file")
    # The versions can be set by the file too: v1 becomes the canary.
    write_config(config, {"models": {"scaler": {"canary_weight": 100, "stable": "2", "canary": "1"}}})

    async def swapped() -> bool:
        return {(await infer(through, user=u)).version for u in USERS[:20]} == {"1"}

    await eventually(swapped, what="canary v1 from the file")
    # A broken file keeps the current routes.
    write_config(config, "models: [")
    await eventually(lambda: sidecar.routes.reload_if_changed() is False)
    assert {(await infer(through, user=u)).version for u in USERS[:20]} == {"1"}


async def test_a_model_with_one_version_is_all_stable(through) -> None:
    answer = await infer(through, "classifier", user="u", features=64, metadata=[("x-canary-weight", "100")])
    assert answer.dye == "stable"


async def test_errors_pass_through_with_code_message_and_trailers(through) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await infer(through, "no-such-model", user="u")
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert "no-such-model" in caught.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await infer(through, user="u", features=5)  # wrong shape
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_kserve_bidi_stream_is_dyed_per_message(through) -> None:
    stub = kserve_grpc.GRPCInferenceServiceStub(through)
    data = np.ones((1, 16), np.float32).tobytes()

    def request(i: int, version: str = "") -> kserve.ModelInferRequest:
        tensor = kserve.ModelInferRequest.InferInputTensor(name="INPUT0", datatype="FP32", shape=[1, 16])
        return kserve.ModelInferRequest(
            model_name="scaler", model_version=version, id=str(i), inputs=[tensor], raw_input_contents=[data]
        )

    async def requests():
        for i in range(4):
            yield request(i)
        yield request(4, version="1")  # a pinned message keeps its own version

    call = stub.ModelStreamInfer(requests(), metadata=[("x-canary-weight", "100"), ("x-user-id", "u")])
    answers = [a async for a in call]
    assert [a.infer_response.id for a in answers] == ["0", "1", "2", "3", "4"]
    assert [a.infer_response.model_version for a in answers] == ["2", "2", "2", "2", "1"]
    assert dict(pairs(await call.initial_metadata()))["x-model-dye"] == "canary"


async def test_reflection_of_the_upstream_answers_through_the_sidecar(through) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(through)

    async def ask():
        yield reflection_pb2.ServerReflectionRequest(list_services="")

    (answer,) = [a async for a in stub.ServerReflectionInfo(ask())]
    names = {s.name for s in answer.list_services_response.service}
    assert "modelyard.inference.v1.InferenceService" in names and "inference.GRPCInferenceService" in names


async def test_shadow_mirrors_stable_calls_to_the_canary_and_compares(sidecar, through, config: Path) -> None:
    write_config(
        config, {"models": {"scaler": {"canary_weight": 0}}, "shadow": {"share": 100, "max_in_flight": 64}}
    )
    await eventually(lambda: sidecar.routes.table.shadow.share == 100)

    def sample(name: str, **labels: str) -> float:
        return sidecar.metrics.registry.get_sample_value(name, {"model": "scaler", **labels}) or 0.0

    for user in USERS[:20]:
        answer = await infer(through, user=user, rows=2)
        assert (answer.version, answer.dye) == ("1", "stable")  # the client gets the stable answer
    await eventually(
        lambda: (
            sample("modelyard_sidecar_shadow_calls_total", outcome="compared")
            + sample("modelyard_sidecar_shadow_calls_total", outcome="dropped")
            == 20
        )
    )
    compared = sample("modelyard_sidecar_shadow_calls_total", outcome="compared")
    assert compared >= 1
    # v1 doubles, v2 triples: on ones the outputs differ by exactly 1.0, the argmax agrees.
    assert sample("modelyard_sidecar_shadow_max_abs_diff_bucket", le="0.1") == 0
    assert sample("modelyard_sidecar_shadow_max_abs_diff_bucket", le="1.0") == compared
    assert sample("modelyard_sidecar_shadow_rows_total") == 2 * compared
    assert sample("modelyard_sidecar_shadow_rows_agreeing_total") == 2 * compared
