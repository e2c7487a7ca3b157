"""Layer 5, the retry policy: what a failed attempt means and where the next one goes.

- Whether an answer counts against its upstream (`is_fault`: server faults, never client
  mistakes or load) and the verdict an attempt gives its breaker (`verdict`, given once per
  attempt by the call's scope).
- Which calls may be tried again at all, by method kind (`RULES`): an attempt is retried only
  while nothing of its answer has reached the caller and its request can be sent again. A call
  with one response is retried after any failure; a response stream only when it ended before
  its first message was relayed (a trailers-only answer); a call whose caller streams its
  requests never (the caller's stream is spent once sent).
- Where the retry goes (`after_failure`): another upstream for an unreachable one, stable for a
  canary's fault (a canary's faults count against its breaker, never against a user), and a
  canary attempt whose graph refused the request (`model_rejected`) replayed on stable with its
  verdict held until the replay ends (`settle_replay`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from modelyard.common.reasons import ErrorReason, is_server_fault
from modelyard.sidecar.breakers import Breakers
from modelyard.sidecar.dyeing import CANARY, STABLE
from modelyard.sidecar.layers.attempt import (
    FALLBACK_CANARY_FAULT,
    FALLBACK_UNAVAILABLE,
    Attempt,
    following,
    stripped,
)
from modelyard.sidecar.layers.balance import take
from modelyard.sidecar.layers.view import ModelView, Pool, U

# Status codes (by name) that count against an upstream when the answer carries no reason.
FAULT_CODES = frozenset({"UNAVAILABLE", "INTERNAL", "UNKNOWN", "DEADLINE_EXCEEDED"})


@dataclass(frozen=True, slots=True)
class Rule:
    """How the attempts of one kind of method are retried and judged."""

    retried: bool  # a failure before anything reached the caller goes to `after_failure`
    answer_timed: bool  # an answer's verdict carries its latency (one request, one response)
    deadline_timed: bool  # a deadline's verdict carries the attempt's duration


RULES: Mapping[str, Rule] = {
    "unary_unary": Rule(retried=True, answer_timed=True, deadline_timed=True),
    "stream_unary": Rule(retried=False, answer_timed=False, deadline_timed=True),
    "unary_stream": Rule(retried=True, answer_timed=False, deadline_timed=False),
    "stream_stream": Rule(retried=False, answer_timed=False, deadline_timed=False),
}


def is_fault(code: str, reason: str) -> bool:
    """Whether an answer counts against the upstream: server faults, never client mistakes or
    load. `x-error-reason` decides (modelyard.common.reasons: `deadline`, `invalid_argument`,
    `queue_full`... never count); without one, UNAVAILABLE, INTERNAL and UNKNOWN count, and a
    reason-less CANCELLED from the upstream (it went away mid-call: the proxy's caller did not
    cancel, see `forward.client_status`). A DEADLINE_EXCEEDED never counts: it is the caller's
    deadline (ours is the caller's) or the upstream's queue timeout; a slow upstream is the
    latency trip's business (its calls' durations are recorded)."""
    if code == "OK" or code == "DEADLINE_EXCEEDED":
        return False
    if reason:
        return is_server_fault(reason)
    return code in FAULT_CODES or code == "CANCELLED"


def is_unreachable(code: str, reason: str) -> bool:
    """An UNAVAILABLE without a reason: gRPC's own (no connection), not the service's answer."""
    return code == "UNAVAILABLE" and not reason


def verdict(attempt: Attempt[Any], code: str, reason: str, latency: float | None, gone: bool = False) -> None:
    """The attempt's outcome to its breaker (the caller gives it once); `gone`: the caller
    cancelled (or the sidecar is shutting down), so there is no verdict on the upstream, and its
    permit is only handed back. A canary attempt with a stable to fall back to is judged against
    stable, and its callers get stable when it opens."""
    breaker, permit = attempt.breaker, attempt.permit
    if breaker is None or permit is None:
        return
    if gone:
        breaker.release(permit)
        return
    has_fallback = attempt.dye == CANARY and bool(attempt.stable)
    breaker.report(
        permit,
        code != "OK" and is_fault(code, reason),
        latency,
        attempt.caller,
        has_fallback,
        attempt.stable if has_fallback else "",
    )


def settle_replay(canary: Attempt[Any], answered: bool) -> None:
    """The replay on stable of a canary attempt its graph refused ended: `answered`, stable served
    what the canary refused, so the refusal was the canary's fault (charged to its breaker, and
    so to the rollout's error gate, as any canary fault: no latency, it failed); else it was the
    request's, and the canary's permit is handed back with no verdict."""
    breaker, permit = canary.breaker, canary.permit
    if breaker is None or permit is None:
        return
    if answered:
        breaker.report(permit, True, None, canary.caller, True, canary.stable)
    else:
        breaker.release(permit)


def after_failure(
    attempt: Attempt[U],
    code: str,
    reason: str,
    tried: list[U],
    view: ModelView[U],
    pool: Pool[U],
    breakers: Breakers,
) -> Attempt[U] | None:
    """An attempt failed before any answer reached the client: the next attempt, or None when
    the failure is the answer. `tried` gathers the upstreams tried so far; `view`: the model's
    view now (views.ModelViews.of). Gives no verdict itself (the scope does: `verdict` for the
    failed attempt, unless the next one replays it: its `replay_of` is the failed attempt).

    A canary attempt its graph refused (`model_rejected`: the request passed every declared check
    of the version) is replayed on stable: whose fault it was, the canary's graph or the request's
    values, only stable's answer to the same request tells (`settle_replay`). A replay that fails
    goes to another stable upstream only when unreachable, its canary still waiting."""
    dye, stable = attempt.dye, attempt.stable
    if dye == CANARY and stable and reason == ErrorReason.MODEL_REJECTED:
        found, _, _ = take(view, stable, (), pool, breakers)
        if found is not None:
            tried.append(attempt.upstream)
            forward = stripped(attempt.forward)
            return following(
                attempt, stable, STABLE, FALLBACK_CANARY_FAULT, found, forward, replay_of=attempt
            )
    unreachable = is_unreachable(code, reason)
    if unreachable or (dye == CANARY and is_fault(code, reason)):
        tried.append(attempt.upstream)
        forward = stripped(attempt.forward)
        if unreachable:
            found, _, _ = take(view, attempt.version, tried, pool, breakers, fallback_to_any=False)
            if found is not None:
                fallback = attempt.fallback
                return following(
                    attempt, attempt.version, dye, fallback, found, forward, replay_of=attempt.replay_of
                )
        if dye == CANARY and stable:
            found, _, _ = take(view, stable, tried if unreachable else (), pool, breakers)
            if found is not None:
                why = FALLBACK_UNAVAILABLE if unreachable else FALLBACK_CANARY_FAULT
                return following(attempt, stable, STABLE, why, found, forward, fell_back=True)
    return None
