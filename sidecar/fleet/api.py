"""The controller's HTTP API, the sidecar's rollout API for the fleet: `POST /rollouts/<model>`
(201), `GET /rollouts[/<model>]`, `POST /rollouts/<model>/pause|resume|abort`, `GET /healthz`,
`GET /metrics`. The sidecar admin endpoint's transport, limits and credential rules
(sidecar/admin.py: a management token for every change, none asked only with `--open`; changes a
browser could send cross-site refused; bounded heads and bodies; JSON errors with a reason), with
the controller's routes. A change is answered once it is saved (the state file or ConfigMap).
A standby replica answers reads from the saved state and changes with 503 (retry: the leader).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, cast
from urllib.parse import unquote

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.exposition import choose_encoder

from modelyard.common.names import InvalidName, check_name, echo
from modelyard.common.reasons import ErrorReason
from modelyard.process.auth import Authorizer
from modelyard.process.tls import TlsFiles
from modelyard.sidecar.admin import (
    ADMIN_OFF,
    READS,
    AdminLimits,
    AdminServer,
    HttpError,
    Request,
    Response,
    _author,
    _json,
    _rollout_spec,
)
from modelyard.sidecar.fleet.controller import ControlError, Controller
from modelyard.sidecar.routes.route_table import RouteSource

CONTROLLER_OFF = (
    "changes are off on this rollout controller: give it a credential (--tokens-file, then send "
    "authorization: Bearer <token>) or open them to every client that reaches it (--open); "
    "see docs/fleet-rollouts.md"
)


class ControllerApi(AdminServer):
    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        controller: Controller,
        *,
        authorizer: Authorizer | None,
        open_writes: bool,
        auth_reads: bool = False,
        tls: TlsFiles | None = None,
        denials: Counter | None = None,
        limits: AdminLimits | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(
            host,
            port,
            registry,
            cast(RouteSource, None),  # no routes here: every request is this class's _route
            list,
            tls=tls,
            authorizer=authorizer,
            auth_reads=auth_reads,
            denials=denials,
            limits=limits,
            open_writes=open_writes,
            what="the rollout controller's API",
            clock=clock,
        )
        self.controller = controller

    async def _respond(self, request: Request) -> Response:
        try:
            return await super()._respond(request)
        except HttpError as exc:
            if str(exc) == ADMIN_OFF:  # the same refusal, in this process's flags
                raise HttpError(403, ErrorReason.PERMISSION_DENIED, CONTROLLER_OFF) from None
            raise

    async def _route(self, request: Request) -> Response:
        path, method = request.path, request.method
        if path == "/healthz" and method in READS:
            return _json(200, {"status": "ok", "leader": self.controller.leader})
        if path == "/metrics" and method in READS:
            encoder, content_type = choose_encoder(request.headers.get("accept", ""))
            body = await asyncio.to_thread(encoder, self._registry)
            return Response(200, body, content_type)
        if path == "/rollouts" and method in READS:
            return _json(200, await self.controller.views())
        parts = path.split("/")[1:]
        if parts[0] != "rollouts" or len(parts) not in (2, 3) or (len(parts) == 3 and method != "POST"):
            raise HttpError(404, ErrorReason.UNSUPPORTED, f"no {echo(method)} {echo(path)}")
        model = unquote(parts[1])
        try:
            check_name(model, "model")
        except InvalidName as exc:
            raise HttpError(400, ErrorReason.INVALID_ARGUMENT, str(exc)) from exc
        try:
            if len(parts) == 3:
                if parts[2] not in ("pause", "resume", "abort"):
                    raise HttpError(404, ErrorReason.UNSUPPORTED, f"no rollout action {echo(parts[2])}")
                return _json(200, await self.controller.control(model, parts[2], _author(request)))
            if method in READS:
                views: dict[str, Any] = await self.controller.views()
                if model not in views:
                    message = f"model {echo(model)} has no rollout"
                    raise HttpError(404, ErrorReason.FAILED_PRECONDITION, message)
                return _json(200, views[model])
            if method != "POST":
                raise HttpError(404, ErrorReason.UNSUPPORTED, f"no {echo(method)} {echo(path)}")
            spec = _rollout_spec(request.body)
            return _json(201, await self.controller.begin(model, spec, _author(request)))
        except ControlError as exc:
            reason = ErrorReason.UNAVAILABLE if exc.status == 503 else ErrorReason.FAILED_PRECONDITION
            headers = [("Retry-After", "1")] if exc.status == 503 else []
            raise HttpError(exc.status, reason, str(exc), headers=headers) from exc
        except OSError as exc:  # the save failed: the change applies here, but is not kept
            message = f"the change applies but is not kept across a restart: {exc}"
            raise HttpError(500, ErrorReason.INTERNAL, message[:512]) from exc
