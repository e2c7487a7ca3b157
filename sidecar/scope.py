"""The per-call scope: what one proxied call holds from its first byte to its answer.

A call's server span (tracing.CallSpan), its place among the calls in flight (so that shutdown
can end it with an answer), its tenant slot (tenant_limits.py), who it came from (layers.read.caller_key),
its current attempt (a frozen layers.attempt.Attempt) and what became of it (its verdict to its
breaker, given once: `verdict`; a canary attempt replayed on stable, whose verdict waits for the
replay's: `replay_ended`), and its metrics. The layers are pure; this is the call's state. Made
once per call and closed exactly once, whichever way the call ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import grpc

from modelyard.common import headers
from modelyard.common.reasons import ErrorReason
from modelyard.process import calls
from modelyard.sidecar.layers.attempt import Attempt, replayed_unanswered
from modelyard.sidecar.layers.read import OTHER, Metadata, Refused
from modelyard.sidecar.layers.retry import is_fault, settle_replay, verdict
from modelyard.sidecar.metrics import SidecarMetrics
from modelyard.sidecar.tenant_limits import ANY_TENANT, TenantLimit, TenantLimits
from modelyard.sidecar.tracing import UNTRACED, Tracing

# A status code's name: the enum's `name` is a property, read several times per call.
CODE_NAMES = {code: code.name for code in grpc.StatusCode}
_OK, _CANCELLED = grpc.StatusCode.OK, grpc.StatusCode.CANCELLED


@dataclass(eq=False, slots=True)
class Flight:
    """One call being served; `drained` once shutdown ended its upstream call."""

    call: Any = None
    drained: bool = False

    def follow(self, call: Any) -> None:
        self.call = call
        if self.drained:
            call.cancel()


class Flights:
    """The calls in flight, so that shutdown can end them with an answer. A scope enters and
    leaves by itself, inline in Scope.__init__ and Scope.close (no method call of its own on
    every call's path)."""

    def __init__(self) -> None:
        self.flights: set[Flight] = set()
        # Made only while a drain waits for the last call to leave: an Event cleared and set on
        # every call would cost each call two Python calls for what only shutdown asks.
        self.emptied: asyncio.Event | None = None
        self.draining = False

    async def _until_empty(self, within_s: float) -> None:
        if not self.flights:
            return
        emptied = self.emptied = self.emptied or asyncio.Event()
        try:
            await asyncio.wait_for(emptied.wait(), max(0.0, within_s))
        finally:
            if not self.flights:
                self.emptied = None

    async def drain(self, within_s: float) -> None:
        try:
            await self._until_empty(within_s)
            return
        except TimeoutError:
            pass
        self.draining = True
        for flight in list(self.flights):
            flight.drained = True
            if flight.call is not None:
                flight.call.cancel()
        # The handlers answer at once (their upstream call raised); a moment for them to do so.
        with contextlib.suppress(TimeoutError):
            await self._until_empty(0.5)


class Scope(Flight):
    """One call, and its place among the calls in flight (a Flight itself: no object of its
    own per call). `code` is the status the client gets (set as the call goes), `reason` its
    x-error-reason where known; `current` the current attempt (None until there is one, and for
    a call refused before it had one), `settled` whether its verdict was given."""

    __slots__ = (
        "_closed",
        "_scopes",
        "_started",
        "_tenant",
        "caller",
        "charged",
        "code",
        "current",
        "metadata",
        "path",
        "pending",
        "reason",
        "replayed",
        "settled",
        "span",
    )

    def __init__(self, scopes: Scopes, path: str, md: Metadata) -> None:
        self._scopes = scopes
        self._started = time.perf_counter()
        self._tenant = ""
        self._closed = False
        self.path = path
        self.metadata = md  # the call's request metadata, read once
        self.code = _OK
        self.reason = ""
        self.current: Attempt[Any] | None = None
        self.settled = False
        # A canary attempt replayed on stable (retry.after_failure) and the code it failed with:
        # counted once the replay settled whose fault it was (close); `pending` while it waits,
        # `charged` once settled: whether it counted as the canary's fault.
        self.replayed: tuple[Attempt[Any], str] | None = None
        self.pending: Attempt[Any] | None = None
        self.charged = False
        self.caller: int | None = None
        tracing = scopes.tracing
        self.span = tracing.server_span(path, md) if tracing.enabled else UNTRACED
        self.call = None
        flights = scopes.flights  # Flights.enter, inline
        self.drained = flights.draining
        flights.flights.add(self)

    def __enter__(self) -> Scope:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def admit(self, tenant: str, limits: Mapping[str, TenantLimit]) -> None:
        """Take a slot in the tenant's bucket for this call (held until it closes), or refuse."""
        refusal = self._scopes.limits.acquire(tenant, limits)
        if refusal is not None:
            self._scopes.metrics.tenant_refusals.labels(tenant if tenant != ANY_TENANT else OTHER).inc()
            retry_ms = str(max(1, round(refusal.retry_after_s * 1000)))
            raise Refused(
                "RESOURCE_EXHAUSTED",
                refusal.message,
                ErrorReason.TENANT_LIMIT,
                ((headers.RETRY_PUSHBACK_MS, retry_ms),),
            )
        self._tenant = tenant

    def begin(self, attempt: Attempt[Any]) -> None:
        """The call's attempt is now `attempt` (a fallback to stable is counted here, once). A
        new attempt follows only a fault of the one before (its upstream unreachable, or a
        canary's fault), which is counted against that one's version: a canary failure that
        stable then answered is still a canary fault in the metrics."""
        previous = self.current
        if previous is not None:
            if attempt.replay_of is previous:  # a fault or not: the replay will tell (close)
                self.replayed = (previous, CODE_NAMES[self.code])
                self.pending = previous
            else:
                self._scopes.metrics.attempted(
                    previous.label, version_label(previous), previous.dye, CODE_NAMES[self.code], True
                )
            self.code, self.reason = grpc.StatusCode.OK, ""  # the new attempt's, from here on
        self.current = attempt
        self.settled = False
        calls.note_model(attempt.model, attempt.version)  # for its log lines and access line
        if attempt.fell_back and attempt.label != OTHER:
            self._scopes.metrics.fallbacks.labels(attempt.model, attempt.fallback).inc()

    def verdict(self, code: str, reason: str, latency: float | None, gone: bool = False) -> None:
        """The current attempt's outcome to its breaker, once (retry.verdict)."""
        attempt = self.current
        if self.settled or attempt is None:
            return
        self.settled = True
        if attempt.breaker is not None:
            verdict(attempt, code, reason, latency, gone)

    def replay_ended(self, answered: bool) -> None:
        """The replay of a canary attempt ended (`answered`: stable served it), if one waits: the
        canary's verdict (retry.settle_replay); unanswered, the answer says `replayed`."""
        canary = self.pending
        if canary is None:
            return
        self.pending = None
        self.charged = answered
        settle_replay(canary, answered)
        if not answered and self.current is not None:
            self.current = replayed_unanswered(self.current)

    def failed(self, code: str, reason: str, latency: float | None, following: Attempt[Any] | None) -> None:
        """The current attempt failed before anything reached the caller, and `following` (the
        retry policy's: retry.after_failure) comes next, or None: the failure is the answer. Its
        verdict goes to its breaker now, unless `following` replays it (whose outcome will tell);
        with none to follow, a replay's canary is settled unanswered (the request's fault)."""
        if following is None or following.replay_of is not self.current:
            self.verdict(code, reason, latency)
        if following is None:
            self.replay_ended(False)

    def report(self, code: str, reason: str, latency: float | None, gone: bool = False) -> None:
        """The current attempt's outcome is the call's: a replay it is settles its canary, and its
        own verdict goes to its breaker (each once)."""
        attempt = self.current
        if self.settled or attempt is None:
            return
        if self.pending is not None:
            self.replay_ended(code == "OK" and not gone)
        self.settled = True
        if attempt.breaker is not None:  # `verdict`, inline: on every call's path
            verdict(attempt, code, reason, latency, gone)

    def refused(self, refused: Refused) -> grpc.StatusCode:
        """The sidecar answers the call itself; the status code it answers with."""
        self.code = grpc.StatusCode[refused.code]
        self.reason = refused.reason
        self.span.refused(refused.reason)
        return self.code

    def ended_by_drain(self) -> bool:
        """Whether a CancelledError came from the drain (it cancelled the upstream call), not from
        the client's cancel (which cancels the handler's task)."""
        task = asyncio.current_task()
        return self.drained and (task is None or not task.cancelling())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        scopes, code = self._scopes, self.code
        flights = scopes.flights  # leaving, inline
        flights.flights.discard(self)
        if flights.emptied is not None and not flights.flights:
            flights.emptied.set()
        reason = self.reason
        if not reason and self.drained and code == grpc.StatusCode.UNAVAILABLE:
            reason = ErrorReason.DRAINING.value  # the sidecar's shutdown: no server fault
        self.span.end(self.current, code, reason)
        ok = code is _OK  # nearly every call: no look-up of its name (an Enum's hash is Python)
        name = "OK" if ok else CODE_NAMES[code]
        cancelled = code is _CANCELLED
        if self.current is not None and not self.settled:
            self.report(name, "", None, gone=cancelled)
        attempt = self.current  # read now: a replay settled unanswered says so
        if self.replayed is not None and attempt is not None:
            self._settled(*self.replayed, attempt)
            attempt = self.current
        if self._tenant:
            scopes.limits.release(self._tenant)
        took = time.perf_counter() - self._started
        if attempt is None:
            scopes.metrics.answered(self.path, "", "", "", name, "", took)
            return
        # The caller's cancel, or the sidecar's drain, is no verdict on the upstream.
        fault = not (ok or cancelled or self.drained) and is_fault(name, reason)
        version = attempt.version
        if version and attempt.breaker is None:  # version_label, inline
            version = OTHER
        scopes.metrics.answered(
            self.path, attempt.label, version, attempt.dye, name, attempt.fallback, took, fault
        )

    def _settled(self, canary: Attempt[Any], code: str, answer: Attempt[Any]) -> None:
        """The canary attempt a replay settled: a fault when stable answered it (`charged`), and
        the call's fallback (`canary-fault`, or `replayed`: the request's fault), counted now."""
        self.replay_ended(False)  # the call ended with its replay unsettled (no verdict)
        answer = self.current or answer
        metrics = self._scopes.metrics
        metrics.attempted(canary.label, version_label(canary), canary.dye, code, self.charged)
        if answer.label != OTHER:
            metrics.fallbacks.labels(answer.model, answer.fallback).inc()


def version_label(attempt: Attempt[Any]) -> str:
    """The version's metric label: only one that has a breaker (a version the upstreams serve, or
    that the route names) has its own; a pinned version a client made up is `_other`."""
    if not attempt.version:
        return ""
    return attempt.version if attempt.breaker is not None else OTHER


class Scopes:
    """Opens the scope of each call; what every scope shares."""

    def __init__(self, limits: TenantLimits, metrics: SidecarMetrics, tracing: Tracing) -> None:
        self.limits = limits
        self.metrics = metrics
        self.tracing = tracing
        self.flights = Flights()

    def open(self, path: str, md: Metadata) -> Scope:
        return Scope(self, path, md)

    async def drain(self, within_s: float) -> None:
        await self.flights.drain(within_s)
