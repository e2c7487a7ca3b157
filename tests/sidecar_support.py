"""Helpers for the sidecar tests: a sidecar in this process, its admin endpoint, polling."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2_grpc

from modelyard.common import health
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.inference.v1 import model_service_pb2 as mpb
from modelyard.sidecar.server import Sidecar, build_sidecar
from modelyard.sidecar.settings import Settings
from modelyard.sidecar.tracing import Tracing
from modelyard.tensors import to_tensor
from tests.support import ChildProcess, eventually, start_child


def upstream_server(
    watch_models: Callable[..., AsyncIterator[Any]], *handlers: grpc.GenericRpcHandler[Any, Any]
) -> tuple[grpc.aio.Server, Any]:
    """A fake upstream's grpc.aio server (not started, no port yet): gRPC health (its servicer
    returned, to set) and ModelService.WatchModels answered by `watch_models`, beside `handlers`."""
    server = grpc.aio.server()
    servicer = health.new_servicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    watch = grpc.unary_stream_rpc_method_handler(
        watch_models,
        request_deserializer=mpb.WatchModelsRequest.FromString,
        response_serializer=mpb.WatchModelsResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "modelyard.inference.v1.ModelService", {"WatchModels": watch}
            ),
            *handlers,
        )
    )
    return server, servicer


@asynccontextmanager
async def running_sidecar(
    upstreams: Sequence[str],
    config: Path | None = None,
    tracing: Tracing | None = None,
    clock: Callable[[], float] | None = None,
    **settings: Any,
) -> AsyncIterator[Sidecar]:
    """A sidecar in this process on ephemeral ports. Its admin changes are off, as by default: a
    test that makes them passes `admin_open=True` or an `admin_tokens_file` (and the token)."""
    sidecar = build_sidecar(
        Settings(
            listen="127.0.0.1:0",
            upstream=tuple(upstreams),
            admin_listen="127.0.0.1:0",
            config=str(config) if config else "",
            config_poll_s=0.05,
            **settings,
        ),
        tracing=tracing,
        clock=clock,
    )
    await sidecar.start()
    try:
        yield sidecar
    finally:
        await sidecar.stop(grace_s=1.0)


class SteppedClock:
    """The breakers' clock, moved by the test: backoffs end when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def known_versions(sidecar: Sidecar, model: str, versions: set[str]) -> None:
    await eventually(lambda: sidecar.upstreams.versions(model) == versions, f"{model} {versions}")


def admin(
    sidecar: Sidecar, path: str, method: str = "GET", body: object = None, token: str | None = None
) -> Any:
    """One admin request (JSON, as the CLI sends it; `token` as a bearer token): the answer's JSON
    (the text of /metrics), whatever its status."""
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    url = f"http://{sidecar.admin_address}{path}"
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            raw = answer.read()
    except urllib.error.HTTPError as exc:
        raw = exc.read()
    return raw.decode() if path == "/metrics" else json.loads(raw)


async def admin_async(
    sidecar: Sidecar, path: str, method: str = "GET", body: object = None, token: str | None = None
) -> Any:
    return await asyncio.to_thread(admin, sidecar, path, method, body, token)


def pairs(metadata: Any) -> list[tuple[str, Any]]:
    return [(key, value) for key, value in metadata or ()]


def breaker_state(sidecar: Sidecar, model: str, version: str) -> set[str]:
    return {
        str(b["state"])
        for b in sidecar.breakers.snapshot()
        if b["model"] == model and b["version"] == version
    }


class Answer:
    """One Infer through the sidecar: the response and the metadata the client saw."""

    def __init__(self, response: pb.InferResponse, initial: dict[str, str], trailing: dict[str, str]) -> None:
        self.response = response
        self.initial = initial
        self.trailing = trailing

    @property
    def version(self) -> str:
        # The service's x-served-version (a unary answer's trailing metadata) passes through the
        # sidecar, and says what the body says.
        assert self.trailing.get("x-served-version") == self.response.model_version
        return self.response.model_version

    @property
    def dye(self) -> str | None:
        # The sidecar's headers of a unary answer ride in its trailing metadata, never the initial.
        assert "x-model-dye" not in self.initial
        return self.trailing.get("x-model-dye")

    @property
    def fallback(self) -> str | None:
        assert "x-dye-fallback" not in self.initial
        return self.trailing.get("x-dye-fallback")


async def infer(
    channel: grpc.aio.Channel,
    model: str = "scaler",
    *,
    user: str | None = None,
    rows: int = 1,
    features: int = 16,
    value: float = 1.0,
    version: str = "",
    metadata: Sequence[tuple[str, str]] = (),
    deadline_s: float = 30.0,
) -> Answer:
    stub = pb_grpc.InferenceServiceStub(channel)
    md = [*metadata, *([("x-user-id", user)] if user else [])]
    x = np.full((rows, features), value, np.float32)
    call = stub.Infer(
        pb.InferRequest(model_name=model, model_version=version, inputs=[to_tensor("INPUT0", x)]),
        metadata=md,
        timeout=deadline_s,
    )
    response = await call
    initial = {k: v for k, v in (await call.initial_metadata() or ()) if isinstance(v, str)}
    trailing = {k: v for k, v in (await call.trailing_metadata() or ()) if isinstance(v, str)}
    return Answer(response, initial, trailing)


_SIDECAR_SERVING = re.compile(r"sidecar serving gRPC on (\S+?)(?:, admin on (http://\S+))?;")


class SidecarProcess(ChildProcess):
    """`python -m modelyard.sidecar` in a child process, as an operator runs it."""

    @property
    def address(self) -> str:
        return self.ready.group(1)

    @property
    def admin_url(self) -> str | None:
        return self.ready.group(2)


SIDECAR_MODULE = ("-m", "modelyard.sidecar")


def start_sidecar_process(
    *args: str,
    prefix: Sequence[str] = SIDECAR_MODULE,
    env: dict[str, str] | None = None,
    admin_open: bool = False,
) -> SidecarProcess:
    """`prefix` replaces `-m modelyard.sidecar` (e.g. with a runner that refuses some imports).
    Admin changes are off unless `admin_open` (--admin-open) or `args` give --admin-tokens-file."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MODELYARD_", "OTEL_"))}
    cmd = [sys.executable, *prefix, "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"]
    cmd += [*(["--admin-open"] if admin_open else []), *args]
    child = start_child(cmd, _SIDECAR_SERVING, "sidecar", env={**base, **(env or {})})
    return SidecarProcess(child.proc, child.ready, child.log)
