"""The admin HTTP endpoint: /metrics, GET /breakers, GET /canary, PUT /canary/<model>, and the
rollouts: GET /rollouts, GET|POST /rollouts/<model>, POST /rollouts/<model>/pause|resume|abort.

An asyncio server on the sidecar's event loop (plain asyncio streams: the sidecar host needs no
web framework), HTTP/1.1 with keep-alive, over HTTPS (and mTLS) when TLS files are given: each
handshake takes the current certificate (modelyard.process.tls.HttpTls, swapped in by the
listening context's server-name callback, which OpenSSL runs on every handshake, with or without
a name: a renewal is served without a restart). The listener does TLS from the first byte: a
handshake started on the plain stream after accepting lost a client's ClientHello whenever it
arrived before the switch (it hung until the timeout). What one connection may cost is bounded (AdminLimits):
the request head must arrive within `header_timeout_s` and be at most `max_header_bytes`, the
body within `body_timeout_s` and at most `max_body_bytes` (413 beyond, before it is read; a
chunked body is refused 411), an idle keep-alive connection is closed after `idle_timeout_s`,
and at most `max_connections` are open at once (more are answered 503 and closed). Reads and
changes of the sidecar's state run on the loop between awaits; rendering /metrics runs in a
thread.

Who may change the sidecar's state (every method but GET and HEAD): with a tokens file
(modelyard.process.auth, the service's format) a client whose `Authorization: Bearer <token>`
holds the management scope, and with `auth_reads` every read needs one too; a missing or wrong
token is answered 401 with the same body whatever was wrong, a token without the scope 403. Without
a tokens file changes are off (403 `permission_denied`, naming --admin-tokens-file and
--admin-open) unless the operator opened them to everyone (`open_writes`: --admin-open; a worker's
private socket). Before any of that, a change a browser could send cross-site without a CORS
preflight is refused (403): one carrying `Origin`, or `Sec-Fetch-Site` other than `same-origin` or
`none`, must be `Content-Type: application/json`, which a browser sends cross-site only after a
preflight, and the endpoint grants none (it sends no Access-Control-* header). Every refusal is
counted by outcome.

A change is answered once it is in the state file when there is one (`durable`): a 2xx means
written (fsynced); a write that fails is a 500 `internal` saying the change applies but is not kept.

Every number read from a JSON body must be finite (`NaN`, `Infinity` and `1e999` are a 400 naming
the key), and nothing the endpoint writes can hold one (`allow_nan=False`).

Every error is JSON `{"error": message, "reason": x-error-reason word}` with a 4xx status (a JSON
body that is not an object, nested too deeply or not JSON at all is a 400 `invalid_argument`).

PUT /canary/<model> for a model neither the route table nor the upstreams know is a 404 (a 503
`unavailable`, with Retry-After, while an upstream has not reported its models yet: the model may
be one it serves); one whose weight an active rollout sets is a 409 (pause or abort it first), and
so is one whose weight a fleet rollout controller owns (`owner`, `lease_s` in its PUT; GET /canary
shows the owner: sidecar/fleet/ownership.py), unless the PUT names the same owner.
Every accepted change is one audit line (sidecar/routes/state_file.py: who, what, when) and is kept in the
state file when there is one.

    curl -X PUT localhost:9101/canary/scaler -H "authorization: Bearer $TOKEN" -d '{"canary_weight": 25}'
    curl -X POST localhost:9101/rollouts/scaler -H "authorization: Bearer $TOKEN" \
        -d '{"steps": [1, 5, 25, 50, 100], "dwell_s": 60, "min_calls": 100}'
    curl localhost:9101/breakers
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.exposition import choose_encoder

from modelyard.common.names import InvalidName, check_name, echo
from modelyard.common.reasons import ErrorReason
from modelyard.process.auth import Authorizer, Decision
from modelyard.process.documents import DocumentError, load
from modelyard.process.throttle import LogThrottle
from modelyard.process.tls import HttpTls, TlsFiles, is_loopback, warn_if_plaintext
from modelyard.sidecar.fleet.ownership import WeightOwners, check_claim
from modelyard.sidecar.rollout.driver import RolloutDriver, RolloutError
from modelyard.sidecar.rollout.policy import RolloutSpec
from modelyard.sidecar.routes.file import RolloutDoc
from modelyard.sidecar.routes.route_table import (
    ConfigError,
    RouteSource,
    parse_model_route,
    route_change,
    route_doc,
)
from modelyard.sidecar.routes.state_file import StateWriteError, audit, who

log = logging.getLogger(__name__)

READS = frozenset({"GET", "HEAD"})
ADMIT = "/_worker/admit"  # on a worker's private socket: the supervisor lets it take calls
# On a worker's private socket only (sidecar/workers/supervisor.py): a change the first worker
# already accepted (or a replay), so this worker does not refuse a model it has not heard of yet.
FOLLOW = "x-modelyard-follow"
MAX_ROUTES = 1024  # models with their own route (file and admin together) that PUT may add up to
ADMIN_OFF = (
    "admin changes are off on this sidecar: give it a credential (--admin-tokens-file, then send "
    "authorization: Bearer <token>) or open them to every client that reaches it (--admin-open); "
    "see docs/security.md"
)
CROSS_SITE = (
    "a cross-site admin change must be sent with Content-Type: application/json (this request came "
    "from a web page: Origin or Sec-Fetch-Site)"
)
SAME_SITE = frozenset({"same-origin", "none"})  # Sec-Fetch-Site values of no other site's page
_PHRASES = {
    200: "OK",
    201: "Created",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    408: "Request Timeout",
    409: "Conflict",
    411: "Length Required",
    413: "Content Too Large",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


@dataclass(frozen=True)
class AdminLimits:
    header_timeout_s: float = 10.0  # the request line and headers (and the TLS handshake)
    body_timeout_s: float = 10.0
    idle_timeout_s: float = 30.0  # a keep-alive connection between requests
    max_body_bytes: int = 64 * 1024
    max_header_bytes: int = 16 * 1024
    max_connections: int = 64


@dataclass
class Request:
    method: str
    path: str
    version: str
    headers: dict[str, str]
    body: bytes = b""
    peer: str = ""  # host:port of the client (for the audit line)

    @property
    def keep_alive(self) -> bool:
        connection = self.headers.get("connection", "").lower()
        if self.version == "HTTP/1.0":
            return connection == "keep-alive"
        return connection != "close"


@dataclass
class Response:
    status: int
    body: bytes
    content_type: str = "application/json"
    headers: list[tuple[str, str]] = field(default_factory=list)
    close: bool = False


class HttpError(Exception):
    """A request answered with a 4xx: after one found while reading the request the connection is
    closed; after one about a request read whole it serves the next (unless `close`)."""

    def __init__(
        self,
        status: int,
        reason: ErrorReason,
        message: str,
        close: bool = False,
        headers: Iterable[tuple[str, str]] = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.close = close
        self.headers = list(headers)

    def response(self) -> Response:
        return _json(self.status, {"error": str(self), "reason": self.reason.value}, self.headers, self.close)


class AdminServer:
    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        routes: RouteSource,
        breakers: Callable[[], list[dict[str, object]]],
        *,
        canaries: Callable[[], Iterable[Any]] = list,  # canary_status.CanaryStatus of each model
        tls: TlsFiles | None = None,
        authorizer: Authorizer | None = None,  # None or unconfigured: no credential asked
        auth_reads: bool = False,
        denials: Counter | None = None,  # labelled by outcome
        limits: AdminLimits | None = None,
        known: Callable[[str], bool] | None = None,  # whether a model exists (None: any name)
        pending: Callable[[], bool] = lambda: False,  # whether an upstream has not reported yet
        rollouts: RolloutDriver | None = None,
        open_writes: bool = False,  # without a tokens file: changes from anyone (else refused)
        durable: Callable[[], Awaitable[None]] | None = None,  # a change is on disk (StateWriteError)
        clock: Callable[[], float] = time.time,  # the audit lines' time
        unix_path: str = "",  # serve on this unix socket instead (a worker's, for its supervisor)
        on_admit: Callable[[], None] | None = None,  # a worker's: POST ADMIT on its socket
        owners: WeightOwners | None = None,  # the fleet controllers' leases on weights
        what: str = "the sidecar's admin endpoint",  # in the warnings (the fleet controller's API)
    ) -> None:
        if not unix_path:
            warn_if_plaintext(host, what, tls)
        self._host, self._port = host, port
        self._registry = registry
        self._routes = routes
        self._breakers = breakers
        self._canaries = canaries
        self._tls = HttpTls(tls) if tls is not None else None
        self._authorizer = authorizer if authorizer is not None and authorizer.configured else None
        self._auth_reads = auth_reads
        self._denials = denials
        self._limits = limits or AdminLimits()
        self._known = known
        self._pending = pending
        self._rollouts = rollouts
        self._open_writes = open_writes or bool(unix_path)  # a worker's: the supervisor checked
        self._durable = durable
        self._clock = clock
        self._throttle = LogThrottle(log)
        self._unix_path = unix_path
        self._on_admit = on_admit
        self.owners = owners or WeightOwners(time.monotonic)
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        assert self._server is not None and self._server.sockets
        if self._unix_path:
            return 0
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        if self._unix_path:
            self._server = await asyncio.start_unix_server(
                self._connection, self._unix_path, limit=self._limits.max_header_bytes
            )
            return
        self._server = await asyncio.start_server(
            self._connection,
            self._host or None,
            self._port,
            limit=self._limits.max_header_bytes,
            ssl=_listening(self._tls) if self._tls is not None else None,
            ssl_handshake_timeout=self._limits.header_timeout_s if self._tls is not None else None,
        )

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        await self._server.wait_closed()

    # --- connections --------------------------------------------------------------------

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            if len(self._connections) > self._limits.max_connections:
                refused = HttpError(503, ErrorReason.QUEUE_FULL, "too many admin connections", close=True)
                await _write(writer, refused.response(), head_only=False)
                return
            await self._serve(reader, writer)
        except (OSError, ssl.SSLError, TimeoutError, asyncio.IncompleteReadError) as exc:
            log.debug("admin connection ended: %r", exc)  # the client's business, not a log flood
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(OSError, ssl.SSLError, TimeoutError):
                await asyncio.wait_for(writer.wait_closed(), 1.0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                request = await self._read(reader)
                if request is not None:
                    request.peer = _peer(writer)
            except HttpError as exc:  # the request was not read whole: answer, then close
                refused = exc.response()
                refused.close = True
                await _write(writer, refused, head_only=False)
                return
            if request is None:
                return  # closed, or idle for too long
            try:
                response = await self._respond(request)
            except HttpError as exc:  # read whole: the connection may serve the next one
                response = exc.response()
            except Exception:  # a bug of ours: 500, logged, and the connection closed
                log.exception("admin: the request failed")
                response = _json(500, {"error": "internal error", "reason": "internal"}, close=True)
            response.close = response.close or not request.keep_alive
            await _write(writer, response, head_only=request.method == "HEAD")
            if response.close:
                return

    async def _read(self, reader: asyncio.StreamReader) -> Request | None:
        limits = self._limits
        try:  # the first byte of the next request: an idle connection is closed
            first = await asyncio.wait_for(reader.read(1), limits.idle_timeout_s)
        except TimeoutError:
            return None
        if not first:
            return None
        try:
            head = first + await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), limits.header_timeout_s)
        except TimeoutError as exc:
            raise HttpError(408, ErrorReason.DEADLINE, "the request head took too long") from exc
        except asyncio.LimitOverrunError as exc:
            raise HttpError(
                431, ErrorReason.TOO_LARGE, f"the request head is over {limits.max_header_bytes} bytes"
            ) from exc
        except asyncio.IncompleteReadError:
            return None
        request = _parse_head(head)
        if "transfer-encoding" in request.headers:
            raise HttpError(411, ErrorReason.INVALID_ARGUMENT, "send the body with a Content-Length")
        try:
            size = int(request.headers.get("content-length", "0"))
        except ValueError:
            size = -1
        if size < 0:
            raise HttpError(400, ErrorReason.INVALID_ARGUMENT, "Content-Length is not a byte count")
        if size > limits.max_body_bytes:
            raise HttpError(413, ErrorReason.TOO_LARGE, f"the body is over {limits.max_body_bytes} bytes")
        if size:
            try:
                request.body = await asyncio.wait_for(reader.readexactly(size), limits.body_timeout_s)
            except TimeoutError as exc:
                raise HttpError(408, ErrorReason.DEADLINE, "the request body took too long") from exc
        return request

    # --- requests -----------------------------------------------------------------------

    def _refusal(self, request: Request) -> str | None:
        """None when the request may go on; otherwise why not (the denials' outcome label)."""
        write = request.method not in READS
        if write and _cross_site(request):
            outcome: str | None = "cross_site"
        elif self._authorizer is None:
            outcome = "off" if write and not self._open_writes else None
        elif write and self._open_writes:
            outcome = None  # the operator's explicit choice, as the service's management_open
        elif not write and not self._auth_reads:
            outcome = None
        else:
            presented = [("authorization", request.headers.get("authorization", ""))]
            decision = self._authorizer.check(presented, {})  # the management scope
            outcome = None if decision is Decision.ALLOW else decision.value
        if outcome is None:
            return None
        if self._denials is not None:
            self._denials.labels(outcome).inc()
        self._throttle.log(
            logging.INFO, "admin: denied %s %s (%s)", request.method, echo(request.path), outcome
        )
        return outcome

    async def _respond(self, request: Request) -> Response:
        refusal = self._refusal(request)
        if refusal == "cross_site":
            raise HttpError(403, ErrorReason.PERMISSION_DENIED, CROSS_SITE)
        if refusal == "off":
            raise HttpError(403, ErrorReason.PERMISSION_DENIED, ADMIN_OFF)
        if refusal == Decision.DENIED.value:
            raise HttpError(403, ErrorReason.PERMISSION_DENIED, "this client may not make this request")
        if refusal is not None:  # the same words whether the token was missing, malformed or wrong
            raise HttpError(
                401,
                ErrorReason.UNAUTHENTICATED,
                "this request needs valid credentials",
                headers=[("WWW-Authenticate", "Bearer")],
            )
        response = await self._route(request)
        if request.method not in READS and response.status < 300 and self._durable is not None:
            try:  # an acknowledgement means written: answered once the change is on disk
                await self._durable()
            except StateWriteError as exc:
                message = f"the change applies but is not kept across a restart: {exc}"
                raise HttpError(500, ErrorReason.INTERNAL, _capped(message)) from exc
        return response

    async def _route(self, request: Request) -> Response:
        """A request that may be made (its credential checked): its answer."""
        path, method = request.path, request.method
        if path == ADMIT and method == "POST" and self._unix_path and self._on_admit is not None:
            self._on_admit()
            return _json(200, {})
        if path == "/metrics" and method in READS:
            encoder, content_type = choose_encoder(request.headers.get("accept", ""))
            body = await asyncio.to_thread(encoder, self._registry)  # the rendering is CPU work
            return Response(200, body, content_type)
        if path == "/breakers" and method in READS:
            return _json(200, self._breakers())
        if path == "/canary" and method in READS:
            return _json(200, self._canary_view())
        if path.startswith("/canary/") and method == "PUT":
            model = unquote(path[len("/canary/") :])
            return self._put_route(model, request.body, _author(request), self._following(request))
        if path == "/rollouts" or path.startswith("/rollouts/"):
            return self._rollout_request(request)
        raise HttpError(404, ErrorReason.UNSUPPORTED, f"no {echo(method)} {echo(path)}")

    def _following(self, request: Request) -> bool:
        return bool(self._unix_path) and request.headers.get(FOLLOW) == "1"

    def _model(self, model: str, follow: bool = False) -> str:
        """A model named in a path: 400 for a bad name, 404 for one nobody knows (503 while an
        upstream has not said what it serves: that it is unknown is not known yet)."""
        try:
            check_name(model, "model")
        except InvalidName as exc:
            raise HttpError(400, ErrorReason.INVALID_ARGUMENT, str(exc)) from exc
        if (
            not follow
            and self._known is not None
            and model not in self._routes.table.models
            and not self._known(model)
        ):
            if self._pending():
                raise HttpError(
                    503,
                    ErrorReason.UNAVAILABLE,
                    f"the upstreams have not reported their models yet (no {echo(model)} so far); retry",
                    headers=[("Retry-After", "1")],
                )
            raise HttpError(404, ErrorReason.MODEL_NOT_FOUND, f"no model {echo(model)}")
        return model

    def _put_route(self, model: str, raw: bytes, by: str = "", follow: bool = False) -> Response:
        self._model(model, follow)
        if self._rollouts is not None and self._rollouts.steering(model):
            raise HttpError(
                409,
                ErrorReason.FAILED_PRECONDITION,
                f"a rollout sets the weight of {echo(model)}: pause or abort it first",
            )
        body = _json_object(raw)
        claim = None
        if "owner" in body or "lease_s" in body:
            try:
                claim = check_claim(body.pop("owner", None), body.pop("lease_s", None))
            except ValueError as exc:
                raise HttpError(400, ErrorReason.INVALID_ARGUMENT, str(exc)) from exc
        held = self.owners.holder(model)
        if held is not None and (claim is None or claim[0] != held.owner):
            raise HttpError(
                409,
                ErrorReason.FAILED_PRECONDITION,
                f"{echo(held.owner)} owns the weight of {echo(model)} (a fleet rollout): change it "
                "there, or abort that rollout",
            )
        table = self._routes.table
        if model not in table.models and len(table.models) >= MAX_ROUTES:
            raise HttpError(
                409, ErrorReason.FAILED_PRECONDITION, f"the route table already holds {MAX_ROUTES} models"
            )
        current = table.route(model)
        base = {"canary_weight": current.canary_weight, "stable": current.stable, "canary": current.canary}
        try:
            route = parse_model_route({**base, **body}, f"canary/{model}")
        except (ValueError, ConfigError, RecursionError) as exc:
            raise HttpError(400, ErrorReason.INVALID_ARGUMENT, _capped(str(exc))) from exc
        if claim is not None:
            self.owners.claim(model, *claim)
            if held is not None and route == current:  # a renewal: nothing to write or audit
                return _json(200, {"model": model, **route_doc(route), **self.owners.view(model)})
        old = self._routes.set_route(model, route, by=by)
        audit(f"model={model} {route_change(old.route, route)}", by, self._clock())
        return _json(200, {"model": model, **route_doc(route), **self.owners.view(model)})

    def _canary_view(self) -> dict[str, object]:
        """The routes, and beside each served model's configured weight the weight routing applies
        (`effective_weight`: 0 while its canary's breakers are open) and the breaker's state."""
        table = self._routes.table
        models = {name: self._model_view(name) for name in table.models}
        for status in self._canaries():
            route = models.get(status.model) or self._model_view(status.model)
            models[status.model] = {**route, **status.doc()}
        return {
            "stickiness_header": table.stickiness_header,
            "sticky_cohort": "shared" if table.shared_cohort else "model",
            "canary_weight": table.canary_weight,
            "models": models,
        }

    def _model_view(self, model: str) -> dict[str, object]:
        """One model in GET /canary: its route, and where it came from."""
        view = route_doc(self._routes.table.route(model))
        change = self._routes.sources.get(model)
        if change is not None:
            view.update(source=change.source, changed_at=change.at, changed_by=change.by or None)
        view.update(self.owners.view(model))  # a fleet controller's lease on the weight
        return view

    # --- rollouts -------------------------------------------------------------------------

    def _rollout_request(self, request: Request) -> Response:
        if self._rollouts is None:
            raise HttpError(404, ErrorReason.UNSUPPORTED, "rollouts are not enabled here")
        parts = request.path.split("/")[2:]  # "/rollouts/<model>[/<action>]"
        method = request.method
        if not parts and method in READS:
            return _json(200, self._rollouts.views())
        if len(parts) not in (1, 2) or (len(parts) == 2 and method != "POST"):
            raise HttpError(404, ErrorReason.UNSUPPORTED, f"no {echo(method)} {echo(request.path)}")
        model = self._model(unquote(parts[0]), self._following(request))
        try:
            if len(parts) == 2:
                if parts[1] not in ("pause", "resume", "abort"):
                    raise HttpError(404, ErrorReason.UNSUPPORTED, f"no rollout action {echo(parts[1])}")
                return _json(200, self._rollouts.control(model, parts[1], _author(request)).view())
            if method in READS:
                found = self._rollouts.rollouts.get(model)
                if found is None:
                    message = f"model {echo(model)} has no rollout"
                    raise HttpError(404, ErrorReason.FAILED_PRECONDITION, message)
                return _json(200, found.view())
            if method != "POST":
                raise HttpError(404, ErrorReason.UNSUPPORTED, f"no {echo(method)} {echo(request.path)}")
            spec = _rollout_spec(request.body)
            held = self.owners.holder(model)
            if held is not None:
                message = f"{echo(held.owner)} owns the weight of {echo(model)}: start the rollout there"
                raise HttpError(409, ErrorReason.FAILED_PRECONDITION, message)
            return _json(201, self._rollouts.start(model, spec, _author(request)).view())
        except RolloutError as exc:
            reason = ErrorReason.FAILED_PRECONDITION
            raise HttpError(exc.status, reason, str(exc)) from exc


def _listening(contexts: HttpTls) -> ssl.SSLContext:
    """The listener's context: the first one serves until the files change; every handshake
    swaps in the current one (its certificate and CA store; the verify mode stays the same)."""

    def swap(connection: ssl.SSLObject, server_name: str | None, listening: ssl.SSLContext) -> None:
        connection.context = contexts.current()

    listening = contexts.current()
    listening.sni_callback = swap
    return listening


def _parse_head(head: bytes) -> Request:
    try:
        text = head.decode("ascii")
    except UnicodeDecodeError as exc:
        raise HttpError(400, ErrorReason.INVALID_ARGUMENT, "the request head is not ASCII") from exc
    lines = text[:-4].split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise HttpError(400, ErrorReason.INVALID_ARGUMENT, "not an HTTP/1.1 request line")
    method, target, version = parts
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            raise HttpError(400, ErrorReason.INVALID_ARGUMENT, "a malformed header line")
        headers[name.lower()] = value.strip()
    return Request(method, target.partition("?")[0], version, headers)


def _cross_site(request: Request) -> bool:
    """A change a browser may have sent from another site's page without a preflight: it carries
    Origin (or a Sec-Fetch-Site naming another site) and is not JSON (text/plain, a form)."""
    site = request.headers.get("sec-fetch-site", "").lower()
    if "origin" not in request.headers and site in ("", *SAME_SITE):
        return False
    media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    return media != "application/json"


def _json_object(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        return {}
    try:
        doc = json.loads(raw)  # NaN, Infinity and 1e999 (inf) are kept, to be named by key below
    except RecursionError as exc:
        raise HttpError(400, ErrorReason.INVALID_ARGUMENT, "the JSON body is nested too deeply") from exc
    except ValueError as exc:  # UnicodeDecodeError included
        raise HttpError(
            400, ErrorReason.INVALID_ARGUMENT, f"the body is not JSON: {_capped(str(exc))}"
        ) from exc
    if not isinstance(doc, dict):
        raise HttpError(400, ErrorReason.INVALID_ARGUMENT, "the body must be a JSON object")
    where = _non_finite(doc)
    if where is not None:
        raise HttpError(400, ErrorReason.INVALID_ARGUMENT, _capped(f"{where}: expected a finite number"))
    return doc


def _non_finite(doc: object) -> str | None:
    """The key path of the first NaN or infinite number in a decoded body (None: there is none).
    Iterative: json.loads' nesting limit is deeper than the interpreter's."""
    pending: list[tuple[str, object]] = [("body", doc)]
    while pending:
        path, value = pending.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return path
        if isinstance(value, dict):
            pending.extend((f"{path}.{echo(k, 64)[1:-1]}", v) for k, v in value.items())
        elif isinstance(value, list):
            pending.extend((f"{path}[{i}]", v) for i, v in enumerate(value))
    return None


def _capped(text: str, limit: int = 512) -> str:
    """A message that may quote the body (its keys), cut to a bounded length."""
    return text if len(text) <= limit else text[:limit] + "..."


def _rollout_spec(raw: bytes) -> RolloutSpec:
    try:
        doc = load(_json_object(raw), RolloutDoc, "body")
        return RolloutSpec(**{k: getattr(doc, k) for k in RolloutDoc.__struct_fields__})
    except (DocumentError, ValueError) as exc:
        raise HttpError(400, ErrorReason.INVALID_ARGUMENT, _capped(str(exc))) from exc


def _peer(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else ""


def _author(request: Request) -> str:
    """Who made a change (sidecar/routes/state_file.py: the token's fingerprint and the peer)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return who(token.strip() if scheme.lower() == "bearer" else None, request.peer)


def _json(status: int, doc: object, headers: Iterable[tuple[str, str]] = (), close: bool = False) -> Response:
    # Strict JSON out: a NaN or infinity is a bug of ours (a 500), never a bare `Infinity`.
    body = json.dumps(doc, allow_nan=False).encode()
    return Response(status, body, "application/json", list(headers), close)


def admin_warnings(host: str, open_writes: bool, configured: bool) -> None:
    """What start-up says about who may use the admin endpoint."""
    if open_writes:
        log.warning(
            "the sidecar's admin endpoint on %s is open (admin_open): any client that reaches it may "
            "change canary weights and rollouts without a credential (docs/security.md)",
            host or "all addresses",
        )
    elif not configured:
        log.info("the sidecar's admin changes are off (no admin_tokens_file, not admin_open); reads are open")
    if not configured and not is_loopback(host):
        log.warning(
            "the sidecar's admin endpoint on %s serves /metrics, /breakers and /canary to any client "
            "(configure admin_tokens_file and admin_auth_reads, see docs/security.md)",
            host or "all addresses",
        )


async def _write(writer: asyncio.StreamWriter, response: Response, head_only: bool) -> None:
    head = [
        f"HTTP/1.1 {response.status} {_PHRASES.get(response.status, '')}",
        f"Content-Type: {response.content_type}",
        f"Content-Length: {len(response.body)}",
        *(f"{name}: {value}" for name, value in response.headers),
    ]
    if response.close:
        head.append("Connection: close")
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
    if not head_only:
        writer.write(response.body)
    await writer.drain()
