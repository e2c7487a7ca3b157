"""How the root application mounts an API: `Api` is one route of the root router that takes every
request whose path the API owns, into an application of the API's own: its routes and its error
handler (each API answers errors in its protocol's body: errors.py's, OpenAI's error object,
KServe's `{"error": ...}`), Starlette's own answers (no such route: 404, a method a route lacks:
405) included.

An API's routes keep their full paths (nothing is stripped, unlike starlette's Mount), so a
route's template is its full path and so its metrics label, and handlers see the request as it
came.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from starlette.exceptions import HTTPException
from starlette.middleware.exceptions import ExceptionMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Match, NoMatchFound, Router
from starlette.types import Receive, Scope, Send

from modelyard.common import names
from modelyard.common.reasons import ErrorReason
from modelyard.gateway import errors

ErrorResponse = Callable[[errors.HttpError], Response]
MODELS = "/v1/models/"


def below_a_model(path: str) -> bool:
    """/v1/models/<model>/...: the SSE API's paths (the collection /v1/models and one model,
    /v1/models/<model>, are OpenAI's). Both APIs divide /v1 by this one rule."""
    return path.startswith(MODELS) and "/" in path[len(MODELS) :].strip("/")


def error_body(exc: errors.HttpError) -> Response:
    """The error body of errors.py (the SSE API's, and the root's: /metrics, /healthz, unknown paths)."""
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())


def starlette_error(request: Request, exc: HTTPException) -> errors.HttpError:
    """Starlette's own answers (no such route, a method a route lacks) as an HttpError whose
    message names the request."""
    asked = f"{request.method} {names.echo(request.url.path, 200)}"
    if exc.status_code == 404:
        return errors.not_found(f"no such route: {asked}", ErrorReason.UNSUPPORTED)
    if exc.status_code == 405:
        message = f"method not allowed: {asked}"
        return errors.HttpError(405, "UNIMPLEMENTED", ErrorReason.UNSUPPORTED, message)
    if 400 <= exc.status_code < 500:
        reason = ErrorReason.INVALID_ARGUMENT
        return errors.HttpError(exc.status_code, "INVALID_ARGUMENT", reason, str(exc.detail))
    return errors.HttpError(exc.status_code, "INTERNAL", ErrorReason.INTERNAL, str(exc.detail))


def error_handlers(respond: ErrorResponse) -> dict[Any, Any]:
    """Exception handlers answering HttpError and Starlette's HTTPException with `respond`."""

    async def on_error(request: Request, exc: errors.HttpError) -> Response:
        return respond(exc)

    async def on_starlette(request: Request, exc: HTTPException) -> Response:
        return respond(starlette_error(request, exc))

    return {errors.HttpError: on_error, HTTPException: on_starlette}


class Api(BaseRoute):
    """One API mounted in the root router: the requests whose path `owns` accepts, answered by
    its `routes` (full paths) with `respond` for its errors."""

    def __init__(
        self, name: str, owns: Callable[[str], bool], routes: Sequence[BaseRoute], respond: ErrorResponse
    ) -> None:
        self.name = name  # no `path`: a request none of its routes takes is counted as "other"
        self.owns = owns
        self.routes = list(routes)
        self.app = ExceptionMiddleware(Router(routes=self.routes), handlers=error_handlers(respond))

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        # The whole path: the gateway runs without a root_path (uvicorn's default).
        if scope["type"] == "http" and self.owns(scope["path"]):
            return Match.FULL, {}
        return Match.NONE, {}

    def url_path_for(self, name: str, /, **path_params: Any) -> Any:
        raise NoMatchFound(name, path_params)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)
