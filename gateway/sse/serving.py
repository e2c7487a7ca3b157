"""SSE generation: `POST /v1/models/{model}/generate` (JSON body) and `GET` with query parameters
(for EventSource), the fields and events of protocol.py. A request with `Last-Event-ID` (header,
or `last_event_id` query parameter) resumes the stream it names instead of starting a
generation, if it carries the credential that started it (streams.Registry.may_resume): with
another, or none, the stream is answered as unknown. A failure before the first event is an HTTP
error instead (errors.py).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from modelyard.common import headers, names
from modelyard.gateway import errors, http
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.gateway.settings import Settings
from modelyard.gateway.sse import protocol
from modelyard.gateway.sse.response import SSEResponse
from modelyard.gateway.streams import Caller, Evicted, Registry, Stream, parse_id
from modelyard.gateway.upstream import Metadata, Upstream, forward
from modelyard.inference.v1 import inference_service_pb2 as pb


class GenerateEndpoints:
    def __init__(
        self, upstream: Upstream, registry: Registry, settings: Settings, metrics: GatewayMetrics
    ) -> None:
        self.upstream = upstream
        self.registry = registry
        self.settings = settings
        self.metrics = metrics

    async def post(self, request: Request) -> Response:
        model = http.model_name(request.path_params["model"], "model")
        last = _last_event_id(request)
        if last is not None:
            return self._resume(model, last, self.caller(request))
        return await self.start(request, model, await http.read_json(request, self.settings.max_body_bytes))

    async def get(self, request: Request) -> Response:
        model = http.model_name(request.path_params["model"], "model")
        last = _last_event_id(request)
        if last is not None:
            return self._resume(model, last, self.caller(request))
        return await self.start(request, model, http.query_fields(request, protocol.QUERY_NUMBERS))

    def caller(self, request: Request) -> Caller:
        """Who sends `request`, for the registry: its credential, its tenant, its peer."""
        peer = request.client.host if request.client is not None else ""
        return self.registry.caller(
            request.headers.get(headers.AUTHORIZATION, ""), request.headers.get(headers.TENANT_ID, ""), peer
        )

    async def open_stream(self, generate: pb.GenerateRequest, metadata: Metadata, caller: Caller) -> Stream:
        """Start the upstream call and wait for its first event; the stream has one reader attached
        (the caller must detach it), or the call's failure is raised as an HttpError."""
        started = time.perf_counter()
        call = self.upstream.inference.Generate(generate, metadata=metadata, timeout=self.upstream.timeout_s)
        stream = self.registry.start(generate.model_name, call, caller)
        try:
            async with asyncio.timeout(self.settings.first_event_wait_s):
                await stream.started()
        except TimeoutError:
            pass  # still queued upstream: open the stream now, heartbeats keep it alive
        except BaseException:
            self.registry.drop(stream)
            raise
        stream.opened = True
        if stream.failure is not None:
            self.registry.drop(stream)
            raise stream.failure
        self.metrics.ttfb.labels("generate").observe(time.perf_counter() - started)
        return stream

    async def start(self, request: Request, model: str, body: dict[str, Any]) -> Response:
        metadata = forward(request.headers)  # 400 before anything starts when a header cannot travel
        generate = protocol.parse_generate(model, body, request.headers.get(headers.REQUEST_ID, "")).message()
        stream = await self.open_stream(generate, metadata, self.caller(request))
        return self._respond(stream, 0)

    def _resume(self, model: str, last: str, caller: Caller) -> Response:
        try:
            stream_id, seq = parse_id(last)
        except ValueError as exc:
            self.metrics.resumes.labels("invalid").inc()
            raise errors.bad_request(str(exc)) from None
        stream = self.registry.get(stream_id)
        # Another's stream is answered exactly as one that does not exist: nothing tells them apart.
        if stream is None or stream.model != model or not self.registry.may_resume(stream, caller):
            self.metrics.resumes.labels("unknown").inc()
            raise errors.not_found(
                f"stream {names.echo(stream_id)} is unknown or expired (streams are kept "
                f"{self.settings.resume_window_s:g} s after their client leaves); start a new generation",
                reason="stream_not_found",
            )
        if seq >= stream.next_seq:
            self.metrics.resumes.labels("invalid").inc()
            raise errors.bad_request(f"event {names.echo(last)} is ahead of its stream")
        event = stream.event(seq)
        if event is not None and event.terminal:
            # The client saw the end: 204 tells an EventSource to stop reconnecting.
            self.metrics.resumes.labels("ended").inc()
            return Response(status_code=204)
        try:
            stream.since(seq + 1)
        except Evicted:
            self.metrics.resumes.labels("evicted").inc()
            raise errors.HttpError(
                410,
                "OUT_OF_RANGE",
                "resume_too_old",
                f"event {names.echo(last)} has left the stream's resume buffer",
            ) from None
        self.metrics.resumes.labels("resumed").inc()
        self.registry.attach(stream)
        return self._respond(stream, seq + 1)

    def _respond(self, stream: Stream, start: int) -> Response:
        settings = self.settings
        return SSEResponse(
            stream, start, self.registry, self.metrics, settings.heartbeat_s, settings.retry_ms, {}
        )


def _last_event_id(request: Request) -> str | None:
    return request.headers.get("last-event-id") or request.query_params.get("last_event_id")
