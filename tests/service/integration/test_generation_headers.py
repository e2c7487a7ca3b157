"""A Generate stream's headers (x-served-version) go out once the request is accepted, while its
prompt runs, not behind its first token; a request refused before that is answered as before (a
status and its x-error-reason, no headers), and one that fails after them ends as a stream failing
mid-way does, read so by the sidecar and the gateway.

The prefill is held by a gate the test opens (engine.prefill patched), so "before the first token"
is a fact of the test, not a race. One in-process service for the module.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import pytest_asyncio
import yaml

from models import demo_models
from modelyard.common import headers
from modelyard.gateway.app import Gateway
from modelyard.gateway.settings import Settings as GatewaySettings
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.service.generation import decoder, engine
from modelyard.service.server import Service
from tests.sidecar_support import known_versions, running_sidecar
from tests.support import eventually, metric, serving

pytestmark = pytest.mark.asyncio(loop_scope="module")

CODELM = demo_models.COMMITTED_ROOT / "codelm"
# One slot and one queue place: with the slot's prefill held, a second request waits, a third is shed.
TIGHT = "generation:\n  max_concurrent_sequences: 1\n  max_waiting: 1\n  max_tokens: 256\n"
PROMPT = "def __init__(self"
# How long the headers may take while the prefill is held (they take milliseconds; on a tree that
# sends them behind the first token they never come while it is held).
HEADERS_WAIT_S = 10.0
REAL_PREFILL = decoder.prefill


class Gate:
    """engine.prefill, held until the test opens it (it runs on the executor: a threading.Event),
    then the real one, or a fault of the model's run (`fail`: every prefill, or that many)."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.fail: bool | int = False

    def __call__(self, runner: Any, layout: Any, prompt: Any) -> Any:
        if not self.opened.wait(60):  # bounded: a failing test must not hang the executor
            raise RuntimeError("the test never opened the prefill")
        if self.fail is True or self.fail > 0:
            if self.fail is not True:
                self.fail -= 1
            raise RuntimeError("the prefill failed (a test's fault)")
        return REAL_PREFILL(runner, layout, prompt)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    held = Gate()
    monkeypatch.setattr(engine, "prefill", held)
    try:
        yield held
    finally:
        held.opened.set()  # whatever the test did: no prefill stays held


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("headers") / "models"
    shutil.copytree(CODELM / "1", root / "codelm" / "1")
    shutil.copy(CODELM / "config.yaml", root / "codelm" / "config.yaml")
    shutil.copytree(CODELM / "1", root / "tight" / "1")
    (root / "tight" / "config.yaml").write_text(TIGHT)
    demo_models.write_model(root, "classifier", 1, demo_models.dense_classifier(4, 4, 2, seed=0))
    # Two versions: 1 stable, 2 the canary a sidecar's route gives a share of the calls.
    for version in ("1", "2"):
        shutil.copytree(CODELM / "1", root / "rolled" / version)
    config = yaml.safe_load((CODELM / "config.yaml").read_text())
    (root / "rolled" / "config.yaml").write_text(yaml.safe_dump({**config, "version_policy": {"latest": 2}}))
    return root


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def service(repository: Path) -> AsyncIterator[Service]:
    async with serving(repository) as running:
        yield running


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stub(service: Service) -> AsyncIterator[pb_grpc.InferenceServiceStub]:
    async with grpc.aio.insecure_channel(service.address) as channel:
        yield pb_grpc.InferenceServiceStub(channel)


def generate(stub: Any, model: str = "codelm", metadata: Any = (), **fields: Any) -> Any:
    fields.setdefault("max_tokens", 4)
    request = pb.GenerateRequest(model_name=model, prompt=PROMPT, **fields)
    return stub.Generate(request, metadata=metadata, timeout=60)


async def headers_while_held(call: Any) -> dict[str, str]:
    """The stream's initial metadata, which must come while its prefill is still held."""
    return dict(await asyncio.wait_for(call.initial_metadata(), HEADERS_WAIT_S))


async def refused(call: Any) -> tuple[grpc.StatusCode, dict[str, str], dict[str, str]]:
    """A call answered with an error: its code, initial metadata and trailers."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [r async for r in call]
    error = caught.value
    return error.code(), pairs(error.initial_metadata()), pairs(error.trailing_metadata())


def pairs(metadata: Any) -> dict[str, str]:
    return {key: value for key, value in metadata or ()}


async def test_the_headers_arrive_before_the_first_token_exists(stub, gate: Gate) -> None:
    call = generate(stub)
    served = await headers_while_held(call)  # the prefill has not run: no token exists yet
    assert served[headers.SERVED_VERSION] == "1"
    gate.opened.set()
    responses = [r async for r in call]
    assert sum(len(r.token_ids) for r in responses) == 4
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert {r.model_version for r in responses} == {"1"}


async def fails_after_its_headers(call: Any, gate: Gate) -> None:
    """`call` (its prefill set to fail) has its headers while the prefill is held, then ends with
    INTERNAL and model_failed, the headers' version kept."""
    assert (await headers_while_held(call))[headers.SERVED_VERSION] == "1"
    gate.opened.set()
    code, initial, trailing = await refused(call)
    assert code == grpc.StatusCode.INTERNAL
    assert initial[headers.SERVED_VERSION] == "1"
    assert trailing[headers.ERROR_REASON] == "model_failed"


async def test_a_fault_after_the_headers_ends_the_stream_with_its_status_and_reason(
    stub, gate: Gate, service: Service
) -> None:
    gate.fail = True
    labels = {"method": "Generate", "model": "codelm", "version": "1", "code": "INTERNAL"}
    before = metric(service.metrics.registry, "modelyard_requests_total", **labels) or 0.0
    await fails_after_its_headers(generate(stub), gate)
    # One terminal answer, counted once, under the version that had answered.
    await eventually(
        lambda: metric(service.metrics.registry, "modelyard_requests_total", **labels) == before + 1,
        "the failed call recorded",
    )


@pytest.mark.parametrize(
    ("model", "fields", "code", "reason"),
    [
        ("codelm", {"temperature": -1.0}, grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument"),
        ("codelm", {"priority": 7}, grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument"),
        ("classifier", {}, grpc.StatusCode.FAILED_PRECONDITION, "failed_precondition"),
        ("missing", {}, grpc.StatusCode.NOT_FOUND, "model_not_found"),
    ],
)
async def test_a_request_refused_before_it_is_accepted_gets_no_headers(
    stub, model: str, fields: dict[str, Any], code: grpc.StatusCode, reason: str
) -> None:
    got, initial, trailing = await refused(generate(stub, model, **fields))
    assert got == code
    assert headers.SERVED_VERSION not in initial
    assert trailing[headers.ERROR_REASON] == reason


async def test_a_queued_request_has_its_headers_and_a_shed_one_none(stub, gate: Gate) -> None:
    running = generate(stub, "tight")
    await headers_while_held(running)  # holds the one slot, its prefill held
    queued = generate(stub, "tight")
    assert (await headers_while_held(queued))[headers.SERVED_VERSION] == "1"  # accepted: it waits
    code, initial, trailing = await refused(generate(stub, "tight"))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert headers.SERVED_VERSION not in initial
    assert trailing[headers.ERROR_REASON] == "queue_full"
    gate.opened.set()
    for call in (running, queued):
        assert sum([len(r.token_ids) async for r in call]) == 4


async def test_the_sidecar_relays_a_fault_after_the_headers(service: Service, gate: Gate) -> None:
    gate.fail = True
    async with (
        running_sidecar([service.address]) as sidecar,
        grpc.aio.insecure_channel(sidecar.address) as channel,
    ):
        await known_versions(sidecar, "codelm", {"1"})
        await fails_after_its_headers(generate(pb_grpc.InferenceServiceStub(channel)), gate)


async def test_the_gateway_answers_a_fault_after_the_headers_with_its_http_status(
    service: Service, gate: Gate
) -> None:
    """The headers came, no token did: the gateway has sent nothing yet, so the fault is the
    answer's status, not an error event after a 200."""
    gate.fail = True
    gateway = Gateway(GatewaySettings(listen="127.0.0.1:0", upstream=service.address))
    await gateway.start()
    try:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as client:
            request = client.post("/v1/models/codelm/generate", json={"prompt": PROMPT, "max_tokens": 4})
            answer = asyncio.ensure_future(request)
            await eventually(lambda: active(service) == 1, "the stream accepted")
            gate.opened.set()
            response = await answer
    finally:
        await gateway.stop()
    assert response.status_code == 500, response.text
    assert response.json()["error"]["code"] == "INTERNAL"


def active(service: Service) -> float:
    registry = service.metrics.registry
    return metric(registry, "modelyard_generation_active_sequences", model="codelm", version="1") or 0.0


# --- a sidecar's canary attempt: its headers wait for its first token -------------------------------

CANARY_ATTEMPT = ((headers.MODEL_DYE, "canary"),)  # what a sidecar sends on one
ROUTES = {
    "models": {"rolled": {"canary_weight": 0}},
    # A breaker that stays closed: the canary is tried (and fails) first.
    "breaker": {"window_s": 600, "min_calls": 1000, "error_rate": 0.99, "canary_error_rate": 0.99},
}


async def test_a_canary_attempt_that_fails_before_its_first_token_has_no_headers(stub, gate: Gate) -> None:
    gate.fail = True
    gate.opened.set()
    code, initial, trailing = await refused(generate(stub, metadata=CANARY_ATTEMPT))
    assert code == grpc.StatusCode.INTERNAL
    assert headers.SERVED_VERSION not in initial  # a status-only answer: the sidecar may retry it
    assert trailing[headers.ERROR_REASON] == "model_failed"
    call = generate(stub, metadata=CANARY_ATTEMPT)
    gate.fail = False
    assert sum([len(r.token_ids) async for r in call]) == 4
    assert pairs(await call.initial_metadata())[headers.SERVED_VERSION] == "1"


async def test_a_canary_generation_that_fails_before_its_first_token_is_answered_by_stable(
    service: Service, gate: Gate, tmp_path: Path
) -> None:
    config = tmp_path / "routes.yaml"
    config.write_text(yaml.safe_dump(ROUTES))
    gate.fail = 1  # the canary's prefill; stable's runs
    gate.opened.set()
    async with running_sidecar([service.address], config=config) as sidecar:
        await known_versions(sidecar, "rolled", {"1", "2"})
        async with grpc.aio.insecure_channel(sidecar.address) as channel:
            call = generate(pb_grpc.InferenceServiceStub(channel), "rolled", [("x-canary-weight", "100")])
            responses = [r async for r in call]
            answered = pairs(await call.initial_metadata())
    assert {r.model_version for r in responses} == {"1"}
    assert sum(len(r.token_ids) for r in responses) == 4
    assert answered[headers.SERVED_VERSION] == "1"
    assert answered["x-dye-fallback"] == "canary-fault"
    assert gate.fail == 0  # the canary's attempt did fail first
