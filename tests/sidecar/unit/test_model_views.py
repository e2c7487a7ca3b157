"""The models' views (sidecar/model_views.py): kept across calls, and dropped by every change they
follow, so that the next call sees a route reload, a change of the versions served, a breaker
made anew and a breaker's state at once. Through the sidecar's own ModelInfer handler, with an
upstream call faked at the channel (nothing is sent)."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Generator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast

from modelyard.kserve.v2 import grpc_service_pb2 as kpb
from modelyard.sidecar.breaker_policy import State
from modelyard.sidecar.server import Sidecar, build_sidecar
from modelyard.sidecar.settings import Settings
from tests.support import eventually

PATH = "/inference.GRPCInferenceService/ModelInfer"
ANSWER = b"\x0a\x01m"


class Answered:
    """An upstream call that has answered OK."""

    def __await__(self) -> Generator[Any, None, bytes]:
        yield from ()
        return ANSWER

    async def initial_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    async def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    def done(self) -> bool:
        return True

    def cancel(self) -> bool:
        return False


class Context:
    """What the unary path asks of grpc.aio's servicer context."""

    def __init__(self, user: str) -> None:
        self._md = (("x-user-id", user),)

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._md

    def time_remaining(self) -> float:
        return 10.0

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def set_trailing_metadata(self, md: Any) -> None:
        pass

    def add_done_callback(self, callback: Any) -> None:
        pass

    async def abort(self, code: Any, details: str = "", md: Any = ()) -> None:
        raise AssertionError(f"refused: {code} {details}")


class _Details:
    method = PATH
    invocation_metadata = None


@asynccontextmanager
async def _started(routes: Path) -> AsyncIterator[Sidecar]:
    """A sidecar on the route file whose one upstream (127.0.0.1:1) the test stands in for."""
    settings = Settings(listen="127.0.0.1:0", upstream=("127.0.0.1:1",), admin_listen="", config=str(routes))
    sidecar: Sidecar = build_sidecar(settings)
    await sidecar.start()
    try:
        yield sidecar
    finally:
        await sidecar.stop(grace_s=0.1)


def _routes(path: Path, weight: int, at: float) -> None:
    path.write_text(f"models:\n  m: {{canary_weight: {weight}}}\n")
    os.utime(path, (at, at))  # a reload sees a newer file


async def test_a_route_reload_a_served_change_and_the_breakers_reach_the_next_call(tmp_path: Path) -> None:
    routes, now = tmp_path / "routes.yaml", time.time()
    _routes(routes, 100, now)
    async with _started(routes) as sidecar:
        upstream = sidecar.upstreams.all[0]
        sent: list[dict[str, Any]] = []

        def method(path: str, kind: str) -> Any:
            def call(request: bytes, metadata: Any = None, timeout: Any = None) -> Answered:
                sent.append(dict(metadata))
                return Answered()

            return call

        upstream.method = method  # type: ignore[method-assign]

        def serve(*versions: str) -> None:  # as WatchModels would tell
            upstream.served = {"m": frozenset(versions)}
            upstream.watched = upstream.serving = True
            sidecar.upstreams_changed()

        handler: Any = sidecar.proxy.service(cast(Any, _Details())).unary_unary
        request = kpb.ModelInferRequest(model_name="m").SerializeToString()
        calls = 0

        async def call() -> tuple[str, str]:
            nonlocal calls
            calls += 1
            assert await handler(request, Context(f"u{calls}")) == ANSWER
            return sent[-1]["x-model-version"], sent[-1]["x-model-dye"]

        serve("1", "2")
        assert await call() == ("2", "canary")
        assert sidecar.proxy.views.of("m").canary == "2"  # kept: the same view for the next call
        assert sidecar.proxy.views.of("m") is sidecar.proxy.views.of("m")

        _routes(routes, 0, now + 10)  # the route file's reload
        assert sidecar.routes.reload_if_changed()
        assert await call() == ("1", "stable")
        _routes(routes, 100, now + 20)
        assert sidecar.routes.reload_if_changed()
        assert await call() == ("2", "canary")

        serve("1", "2", "3")  # a newer version served: the canary
        assert await call() == ("3", "canary")

        # Version 3 gone and back: its breaker is dropped and made anew; calls report to the new one.
        address = upstream.address
        old = sidecar.breakers.find(address, "m", "3")
        assert old is not None
        serve("1", "2")
        assert await call() == ("2", "canary")
        await eventually(lambda: sidecar.breakers.find(address, "m", "3") is None, "the breaker dropped")
        serve("1", "2", "3")
        await eventually(lambda: sidecar.breakers.find(address, "m", "3") is not None, "the breaker made")
        new = sidecar.breakers.find(address, "m", "3")
        assert new is not None and new is not old
        assert await call() == ("3", "canary")
        assert len(new.adaptive.window) == 1 and len(old.adaptive.window) == 1

        # The breaker opens (its state is read per call, not held): the canary's weight is 0.
        for caller in range(1000):
            permit = new.allow()
            if permit is None:
                break
            new.report(permit, True, None, caller)
        assert new.state is State.OPEN
        assert await call() == ("2", "stable")


async def test_a_shadow_share_set_or_dropped_by_a_reload_reaches_the_next_call(tmp_path: Path) -> None:
    """A stable answer is offered to the mirror only while the route table mirrors a share (the
    view holds whether it does): a reload that turns shadowing on, or off, applies at once."""
    routes, now = tmp_path / "routes.yaml", time.time()
    _routes(routes, 0, now)
    async with _started(routes) as sidecar:
        upstream = sidecar.upstreams.all[0]
        dyes: list[str] = []

        def method(path: str, kind: str) -> Any:
            def call(request: bytes, metadata: Any = None, timeout: Any = None) -> Answered:
                dyes.append(dict(metadata)["x-model-dye"])
                return Answered()

            return call

        upstream.method = method  # type: ignore[method-assign]
        upstream.served = {"m": frozenset({"1", "2"})}
        upstream.watched = upstream.serving = True
        sidecar.upstreams_changed()
        handler: Any = sidecar.proxy.service(cast(Any, _Details())).unary_unary
        request = kpb.ModelInferRequest(model_name="m").SerializeToString()

        assert await handler(request, Context("u1")) == ANSWER
        assert dyes == ["stable"]  # no shadow share: not mirrored
        routes.write_text("models:\n  m: {canary_weight: 0}\nshadow: {share: 100}\n")
        os.utime(routes, (now + 10, now + 10))
        assert sidecar.routes.reload_if_changed()
        assert await handler(request, Context("u2")) == ANSWER
        await eventually(lambda: dyes == ["stable", "stable", "shadow"], "the answer mirrored to the canary")
        _routes(routes, 0, now + 20)
        assert sidecar.routes.reload_if_changed()
        assert await handler(request, Context("u3")) == ANSWER
        await eventually(lambda: not sidecar.proxy._mirror._shadows._in_flight, "the shadow call ended")
        assert dyes == ["stable", "stable", "shadow", "stable"]  # shadowing off again
