"""A Generate cancelled while its sequence is paused (the client stopped reading, so the handler's
write waits on flow control) is a cancel, not an error: the service and the sidecar end it as
CANCELLED and log no ERROR and no traceback for it (gRPC's own "ExecuteBatchError raised in core"
was logged once per such cancel), at most one INFO line."""

from __future__ import annotations

import logging
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import pytest
import pytest_asyncio

from models import demo_models
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.service.server import Service, build_service
from modelyard.service.settings import Settings
from tests.sidecar_support import start_sidecar_process
from tests.support import eventually

pytestmark = pytest.mark.asyncio(loop_scope="module")

# A 4-token stream buffer: a reader that stops pauses the sequence after a few tokens.
CONFIG = "generation:\n  max_concurrent_sequences: 4\n  max_tokens: 256\n  stream_buffer: 4\n"
# A one-byte window: the client holds a message or two, so the server's next write waits.
PAUSING = [("grpc.http2.lookahead_bytes", 1), ("grpc.http2.bdp_probe", 0)]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def service(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Service]:
    root = tmp_path_factory.mktemp("cancel") / "models"
    for name in ("direct", "proxied"):
        shutil.copytree(demo_models.COMMITTED_ROOT / "codelm" / "1", root / name / "1")
        (root / name / "config.yaml").write_text(CONFIG)
    running = build_service(Settings(repository=Path(root), listen="127.0.0.1:0", metrics_listen=""))
    await running.start()
    try:
        yield running
    finally:
        await running.stop(grace_s=1.0)


def sample(service: Service, name: str, **labels: str) -> float:
    return service.metrics.registry.get_sample_value(name, labels) or 0.0


async def cancel_paused(service: Service, address: str, model: str) -> None:
    """A Generate through `address` whose reader reads one message, then stops; cancelled once
    the service has produced past what the stream buffer and the client hold (its write waits)."""
    async with grpc.aio.insecure_channel(address, options=PAUSING) as channel:
        call = pb_grpc.InferenceServiceStub(channel).Generate(
            pb.GenerateRequest(model_name=model, prompt="def main():", max_tokens=256)
        )
        await call.read()
        tokens = {"model": model, "version": "1"}
        await eventually(
            lambda: sample(service, "modelyard_generation_tokens_total", **tokens) >= 6, "the pause"
        )
        call.cancel()
    await eventually(
        lambda: (
            sample(service, "modelyard_generation_cancellations_total", **tokens, cause="cancelled") == 1
            and sample(service, "modelyard_generation_active_sequences", **tokens) == 0
        ),
        "the cancellation",
    )


async def test_the_service_logs_a_cancelled_paused_generate_as_no_error(
    service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    await cancel_paused(service, service.address, "direct")
    # The handler has ended (its status recorded) by the time its end is counted as CANCELLED.
    labels = {"method": "Generate", "model": "direct", "version": "1", "code": "CANCELLED"}
    await eventually(lambda: sample(service, "modelyard_requests_total", **labels) == 1, "the call's end")
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not loud, [(r.name, r.getMessage()) for r in loud]
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    assert len([r for r in caplog.records if r.levelno == logging.INFO]) <= 1


async def test_the_sidecar_logs_a_cancelled_paused_generate_as_no_error(service: Service) -> None:
    sidecar = start_sidecar_process("--upstream", service.address)
    try:
        assert sidecar.admin_url is not None
        await eventually(lambda: any("is serving" in line for line in sidecar.log), "the sidecar's upstream")
        logged = len(sidecar.log)
        await cancel_paused(service, sidecar.address, "proxied")

        async def ended() -> bool:
            async with httpx.AsyncClient() as http:
                text = (await http.get(f"{sidecar.admin_url.rstrip('/')}/metrics")).text
            lines = text.splitlines()
            return any('code="CANCELLED"' in line and 'method="Generate"' in line for line in lines)

        await eventually(ended, "the sidecar's CANCELLED answer")
        lines = sidecar.log[logged:]
    finally:
        sidecar.stop()
    assert not [line for line in lines if " ERROR " in line or "Traceback" in line], lines
    assert len([line for line in lines if " INFO " in line]) <= 1, lines
