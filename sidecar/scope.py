"""The per-call scope: what one proxied call holds from its first byte to its answer.

A call's server span (tracing.py), its place among the calls in flight (so that shutdown can end
it with an answer), its tenant slot (limits.py), who it came from (plan.caller_key), its current
attempt (a Plan: its breaker permit is settled when the call ends, if no failed attempt settled
it before), and its metrics. Entered once per call (`Scopes.open`, a `with` block) and closed
exactly once, whichever way the call ends.
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
from modelyard.sidecar.limits import ANY_TENANT, TenantLimit, TenantLimits
from modelyard.sidecar.metrics import SidecarMetrics
from modelyard.sidecar.plan import OTHER, Metadata, Plan, Refused, is_fault
from modelyard.sidecar.tracing import Tracing

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
    leaves by itself (Scope.__init__ and Scope.close: two calls a call fewer)."""

    def __init__(self) -> None:
        self.flights: set[Flight] = set()
        # Made only while a drain waits for the last call to leave: an Event cleared and set
        # per call would be two Python calls per call for what only shutdown asks.
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
    x-error-reason where known; `plan` the current attempt (None until planned, and for a call
    refused before it had one)."""

    __slots__ = (
        "_closed",
        "_scopes",
        "_started",
        "_tenant",
        "caller",
        "code",
        "metadata",
        "path",
        "plan",
        "reason",
        "replayed",
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
        self.plan: Plan[Any] | None = None
        # A canary attempt replayed on stable (plan.after_failure) and the code it failed with:
        # counted once the replay settled whose fault it was (close).
        self.replayed: tuple[Plan[Any], str] | None = None
        self.caller: int | None = None
        tracing = scopes.tracing
        self.span = tracing.server_span(path, md) if tracing.enabled else None  # no call untraced
        self.call = None
        flights = scopes.flights  # Flights.enter, inline: one call a call fewer
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

    def attempt(self, plan: Plan[Any]) -> None:
        """The call's attempt is now `plan` (a fallback to stable is counted here, once). A new
        attempt follows only a fault of the one before (its upstream unreachable, or a canary's
        fault), which is counted against that one's version: a canary failure that stable then
        answered is still a canary fault in the metrics."""
        previous = self.plan
        if previous is not None:
            if plan.replay_of is previous:  # a fault or not: the replay will tell (close)
                self.replayed = (previous, CODE_NAMES[self.code])
            else:
                self._scopes.metrics.attempted(
                    previous.label, version_label(previous), previous.dye, CODE_NAMES[self.code], True
                )
            self.code, self.reason = grpc.StatusCode.OK, ""  # the new attempt's, from here on
        self.plan = plan
        calls.note_model(plan.model, plan.version)  # for its log lines and access line
        if plan.fell_back and plan.label != OTHER:
            self._scopes.metrics.fallbacks.labels(plan.model, plan.fallback).inc()

    def refused(self, refused: Refused) -> grpc.StatusCode:
        """The sidecar answers the call itself; the status code it answers with."""
        self.code = grpc.StatusCode[refused.code]
        self.reason = refused.reason
        self._scopes.tracing.refused(self.span, refused.reason)
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
        scopes, plan, code = self._scopes, self.plan, self.code
        flights = scopes.flights  # leaving, inline
        flights.flights.discard(self)
        if flights.emptied is not None and not flights.flights:
            flights.emptied.set()
        reason = self.reason
        if not reason and self.drained and code == grpc.StatusCode.UNAVAILABLE:
            reason = ErrorReason.DRAINING.value  # the sidecar's shutdown: no server fault
        span = self.span
        if span is not None and not isinstance(span, str):  # unsampled: its traceparent (tracing.py)
            scopes.tracing.end(span, plan, code, reason)
        ok = code is _OK  # nearly every call: no look-up of its name (an Enum's hash is Python)
        name = "OK" if ok else CODE_NAMES[code]
        cancelled = code is _CANCELLED
        if plan is not None and not plan.reported:
            plan.report(name, "", None, gone=cancelled)
        if self.replayed is not None and plan is not None:
            self._settled(*self.replayed, plan)
        if self._tenant:
            scopes.limits.release(self._tenant)
        took = time.perf_counter() - self._started
        if plan is None:
            scopes.metrics.answered(self.path, "", "", "", name, "", took)
            return
        # The caller's cancel, or the sidecar's drain, is no verdict on the upstream.
        fault = not (ok or cancelled or self.drained) and is_fault(name, reason)
        version = plan.version
        if version and plan.breaker is None:  # version_label, inline
            version = OTHER
        scopes.metrics.answered(self.path, plan.label, version, plan.dye, name, plan.fallback, took, fault)

    def _settled(self, canary: Plan[Any], code: str, answer: Plan[Any]) -> None:
        """The canary attempt a replay settled: a fault when stable answered it (`charged`), and
        the call's fallback (`canary-fault`, or `replayed`: the request's fault), counted now."""
        if answer.replay_of is not None:  # the call ended with its replay unsettled (no verdict)
            answer.replayed(False)
        metrics = self._scopes.metrics
        metrics.attempted(canary.label, version_label(canary), canary.dye, code, canary.charged)
        if answer.label != OTHER:
            metrics.fallbacks.labels(answer.model, answer.fallback).inc()


def version_label(plan: Plan[Any]) -> str:
    """The version's metric label: only one that has a breaker (a version the upstreams serve, or
    that the route names) has its own; a pinned version a client made up is `_other`."""
    if not plan.version:
        return ""
    return plan.version if plan.breaker is not None else OTHER


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
