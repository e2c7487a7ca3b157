"""Log lines join traces: with tracing on, the JSON lines a process writes while it handles a call
(the service's error line and access line, the sidecar's breaker line and access line) carry that
call's `trace_id` and `span_id`, the ids of the span it exported; lines outside a call carry none,
and with tracing off no line does.

Real processes with `--log-format json --access-log`, exporting over OTLP/gRPC to a receiver in
this process (test_sidecar_tracing's); the calls that log are real failures: a model whose run
fails for large inputs (an INTERNAL with an error id), and a canary of it that trips its breaker.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from models import demo_models
from tests.sidecar.integration.test_breakers import SCALER, fails_on_large_values, routes
from tests.sidecar.integration.test_traces import Receiver
from tests.sidecar.integration.test_traces import receiver as receiver  # the fixture
from tests.sidecar_support import SidecarProcess, infer
from tests.support import ChildProcess, ServiceProcess, eventually

TRACE = "7bf92f3577b34da6a3ce929d0e0e4739"
CLIENT_SPAN = "00f067aa0ba902b7"
JSON_ACCESS = ("--log-format", "json", "--access-log")


def _otel(endpoint: str) -> dict[str, str]:
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{endpoint}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
    }


def _lines(child: ChildProcess) -> list[dict[str, Any]]:
    out = []
    for line in list(child.log):
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def _traceparent(trace_id: str) -> list[tuple[str, str]]:
    return [("traceparent", f"00-{trace_id}-{CLIENT_SPAN}-01")]


def _server_span(receiver: Receiver, service: str, trace_id: str) -> Any | None:
    for name, span in list(receiver.spans):
        if name == service and span.trace_id.hex() == trace_id and span.kind == span.SPAN_KIND_SERVER:
            return span
    return None


@pytest.fixture
def failing(tmp_path: Path) -> Path:
    root = tmp_path / "failing"
    demo_models.write_model(root, "scaler", 2, fails_on_large_values(), SCALER)
    return root


async def test_the_services_error_and_access_lines_carry_the_calls_ids(
    receiver: tuple[Receiver, str],
    failing: Path,
    service_process: Callable[..., ServiceProcess],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    collected, endpoint = receiver
    for key, value in _otel(endpoint).items():
        monkeypatch.setenv(key, value)  # the child inherits them
    service = service_process(failing, *JSON_ACCESS)
    async with grpc.aio.insecure_channel(service.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await infer(channel, value=100.0, metadata=_traceparent(TRACE))
        assert failed.value.code() == grpc.StatusCode.INTERNAL
        assert "error id" in (failed.value.details() or "")
        await infer(channel, value=1.0)  # a root call: a trace of its own
    await eventually(lambda: _server_span(collected, "modelyard-service", TRACE) is not None, "the span")
    await eventually(lambda: len([e for e in _lines(service) if e["logger"] == "modelyard.access"]) == 2)

    server = _server_span(collected, "modelyard-service", TRACE)
    assert server is not None and server.parent_span_id.hex() == CLIENT_SPAN
    ids = (TRACE, server.span_id.hex())
    lines = _lines(service)
    (error,) = [e for e in lines if e["level"] == "ERROR" and "error id" in e["msg"]]
    assert (error["trace_id"], error["span_id"]) == ids
    failed_access, root_access = [e for e in lines if e["logger"] == "modelyard.access"]
    assert failed_access["code"] == "INTERNAL"
    assert (failed_access["trace_id"], failed_access["span_id"]) == ids  # written after the span ended
    # The root call's line names the trace the service began for it.
    assert root_access["code"] == "OK" and root_access["trace_id"] != TRACE
    await eventually(
        lambda: _server_span(collected, "modelyard-service", root_access["trace_id"]) is not None,
        "the root call's span",
    )
    root_span = _server_span(collected, "modelyard-service", root_access["trace_id"])
    assert root_span is not None and root_span.span_id.hex() == root_access["span_id"]
    (serving,) = [e for e in lines if e["msg"].startswith("serving gRPC on")]
    assert "trace_id" not in serving  # no call: no ids


async def test_the_sidecars_breaker_line_carries_the_ids_of_the_call_that_opened_it(
    receiver: tuple[Receiver, str],
    tmp_path: Path,
    failing: Path,
    service_process: Callable[..., ServiceProcess],
    sidecar_process: Callable[..., SidecarProcess],
) -> None:
    collected, endpoint = receiver
    stable_root = tmp_path / "stable"
    demo_models.write_model(stable_root, "scaler", 1, demo_models.scaled_identity(16, 2.0), SCALER)
    stable, canary = service_process(stable_root), service_process(failing)
    config = routes(tmp_path / "routes.yaml", backoff_s=60, backoff_max_s=60, latency_floor_s=5)
    sidecar = sidecar_process(
        "--upstream",
        stable.address,
        "--upstream",
        canary.address,
        "--config",
        str(config),
        *JSON_ACCESS,
        env=_otel(endpoint),
    )

    assert sidecar.admin_url is not None
    canary_url = f"{sidecar.admin_url}/canary"

    def routed() -> bool:  # both versions known: a canary fault is answered by stable
        with urllib.request.urlopen(canary_url, timeout=10) as answer:
            scaler = json.load(answer)["models"]["scaler"]
        return (scaler.get("stable_version"), scaler.get("canary_version")) == ("1", "2")

    await eventually(lambda: asyncio.to_thread(routed), "the sidecar to know both versions")

    def opened() -> list[dict[str, Any]]:
        return [e for e in _lines(sidecar) if e["msg"].startswith("breaker ") and "-> open" in e["msg"]]

    sent: list[str] = []
    async with grpc.aio.insecure_channel(sidecar.address) as channel:
        for i in range(400):  # the canary's faults (answered by stable) open its breaker
            trace_id = f"{TRACE[:-4]}{i:04x}"
            sent.append(trace_id)
            answer = await infer(channel, user=f"user-{i}", value=100.0, metadata=_traceparent(trace_id))
            assert answer.version == "1"  # never an error: stable answers for the canary
            if opened():
                break
    await eventually(lambda: bool(opened()), "the breaker's line")
    (line,) = opened()
    assert line["level"] == "WARNING" and line["trace_id"] in sent
    await eventually(lambda: _server_span(collected, "modelyard-sidecar", line["trace_id"]) is not None)
    span = _server_span(collected, "modelyard-sidecar", line["trace_id"])
    assert span is not None and line["span_id"] == span.span_id.hex()

    # That call's access line is of the same span.
    def access() -> list[dict[str, Any]]:
        lines = [e for e in _lines(sidecar) if e["logger"] == "modelyard.access"]
        return [e for e in lines if e.get("trace_id") == line["trace_id"]]

    await eventually(lambda: bool(access()), "the call's access line")
    assert [e["span_id"] for e in access()] == [line["span_id"]]


async def test_with_tracing_off_no_line_carries_ids(
    failing: Path, service_process: Callable[..., ServiceProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    service = service_process(failing, *JSON_ACCESS)
    async with grpc.aio.insecure_channel(service.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError):
            await infer(channel, value=100.0, metadata=_traceparent(TRACE))
    await eventually(lambda: any(e["logger"] == "modelyard.access" for e in _lines(service)))
    assert not [e for e in _lines(service) if "trace_id" in e]
