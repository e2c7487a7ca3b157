"""The planner: where one proxied call goes, what a failed attempt means, and where the next goes.

Pure policy over what the sidecar knows (the route table, the versions the upstreams serve, the
breakers): no transport (no grpc, no channels: an upstream is anything with an `address`), no
I/O, no asyncio. Status codes are named by their gRPC names ("UNAVAILABLE"), so the forwarder
translates; refusals are `Refused` with such a name.

The path of a data call: `read` (names checked, modelyard.common.names; the dye, routing.choose,
kept in the call's Plan) -> the caller's tenant bucket (`tenant_bucket`; its slot is the
scope's) -> `first` (an upstream whose breaker gives a permit; a canary falls back to stable when
none does; while every breaker of the canary is open, the route's weight is effectively 0:
`effective_weight`) ->
after a failed attempt, `after_failure` (its verdict to the breaker; another upstream for an
unreachable one, stable for a canary fault, or None: the failure is the answer). A canary attempt
the graph refused (`model_rejected`) is replayed on stable, and its verdict waits for the replay's:
stable's answer makes it the canary's fault, stable's refusal the request's (no fault at all).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from modelyard.common import headers
from modelyard.common.names import InvalidName, check_name, check_version, echo
from modelyard.common.reasons import ErrorReason, is_server_fault
from modelyard.sidecar.breakers import Breaker, Breakers, Permit
from modelyard.sidecar.limits import ANY_TENANT, TenantLimit
from modelyard.sidecar.routes import RouteTable
from modelyard.sidecar.routing import (
    CANARY,
    PINNED,
    STABLE,
    ModelRoute,
    RoutingError,
    choose,
    stable_and_canary,
)
from modelyard.sidecar.wire import ModelFields, WireError, read_model_fields, with_version

Metadata = tuple[tuple[str, str | bytes], ...]
Read = tuple[bytes, ModelFields]  # a message and its fields 1 and 2 (wire.read_model_fields)

OTHER = "_other"  # the one metric label of every model or tenant the sidecar holds no state for
FALLBACK_BREAKER = "breaker-open"
FALLBACK_UNAVAILABLE = "unavailable"
FALLBACK_CANARY_FAULT = "canary-fault"
# A canary's `model_rejected` replayed on stable that stable did not answer either (it refused the
# request too, or the call ended first): the request's fault, charged to neither version.
FALLBACK_REPLAYED = "replayed"
# Request headers the sidecar sets itself (or that only make sense on one hop).
_DROP = frozenset({headers.MODEL_VERSION, headers.MODEL_DYE, "user-agent", "te", "content-type"})
# Status codes (by name) that count against an upstream when the answer carries no reason.
FAULT_CODES = frozenset({"UNAVAILABLE", "INTERNAL", "UNKNOWN", "DEADLINE_EXCEEDED"})
# Model names (from field 1) that passed the name rule: the same few on every call, so checked
# once each. Bounded, since a client may send any number of valid names: past it, each is checked.
VALID_NAMES_KEPT = 1024
_VALID_NAMES: set[str] = set()


class Target(Protocol):
    """An upstream as the planner sees it (upstreams.Upstream)."""

    @property
    def address(self) -> str: ...


U = TypeVar("U", bound=Target)
U_co = TypeVar("U_co", bound=Target, covariant=True)


class Pool(Protocol[U_co]):
    """The upstreams as the planner sees them (upstreams.Upstreams)."""

    def knows(self, model: str, version: str = "") -> bool: ...

    def versions(self, model: str) -> Iterable[str]: ...

    def candidates(self, model: str, version: str) -> Sequence[U_co]: ...

    def serving(self, model: str, version: str) -> Sequence[U_co]: ...

    def any(self) -> Sequence[U_co]: ...


class Refused(Exception):
    """The call is answered by the sidecar itself: `code` is a gRPC status code's name."""

    def __init__(self, code: str, message: str, reason: str, extra: Metadata = ()) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.extra = extra

    @property
    def metadata(self) -> Metadata:
        """The trailing metadata of the refusal."""
        return ((headers.ERROR_REASON, self.reason), *self.extra)


@dataclass(slots=True, eq=False)
class Served(Generic[U]):
    """One version of a model as `take` finds it while its view stands: whether it gets state
    (is_stateful), the upstream serving it when exactly one does, with its breaker (None: none,
    or several, whose turn and reachability `take` asks of the pool per call), and the headers
    an attempt at it carries, by dye."""

    stateful: bool
    only: U | None
    breaker: Breaker | None
    headers: Mapping[str, Metadata]


@dataclass(slots=True, eq=False)
class ModelView(Generic[U]):
    """A model as a dyed call reads it: what changes only when the route table, the versions the
    upstreams serve or the breakers do (views.ModelViews keeps one per served model, and drops
    them all on each such change), read per call in one look instead of a dozen."""

    model: str
    known: bool
    label: str
    route: ModelRoute
    stable: str
    canary: str
    table: RouteTable
    # The table mirrors a share of stable answers to the canary (its shadow policy's share > 0):
    # only then is an answer offered to the mirror (mirror.py), which decides per call.
    mirrored: bool = False
    versions: dict[str, Served[U]] = field(default_factory=dict)  # filled by `take` (stateful only)


def model_view(model: str, table: RouteTable, pool: Pool[U]) -> ModelView[U]:
    """The view of a model under this table and what the pool serves now."""
    known = bool(model) and pool.knows(model)
    route = table.route(model)
    stable, canary = stable_and_canary(route, pool.versions(model) if known else ())
    mirrored = table.shadow.share > 0
    return ModelView(model, known, model if known else OTHER, route, stable, canary, table, mirrored)


Views = Callable[[str], ModelView[Any]]  # model -> its view (views.ModelViews.of)


# What a Plan made for a retry holds of the call's model (after_failure is given its view now).
_NO_VIEW: ModelView[Any] = ModelView("", False, OTHER, ModelRoute(), "", "", RouteTable())


# Not frozen (a value all the same): a frozen dataclass's __init__ costs ~0.2 us a field, per call.
# Made with positional arguments only on a call's path: keywords cost ~1.5k instructions.
@dataclass(slots=True)
class Plan(Generic[U]):
    """One attempt: where it goes and what it holds. A retry is a new Plan. A call's first one is
    made by `read` (`asked`: what the call asks for, its upstream not chosen yet), then `first`
    (or `unrouted`) plans the attempt in it: one object a call, not a request and a plan."""

    model: str
    version: str
    dye: str
    fallback: str
    stable: str
    upstream: U
    breaker: Breaker | None  # None: a model (or version) the upstreams do not serve: no state
    permit: Permit | None
    forward: Metadata  # request metadata for the upstream
    caller: int | None = None  # caller_key: who made the call (the breakers' leave-one-out)
    label: str = OTHER  # the model's metric label: its name when the upstreams serve it
    fell_back: bool = False  # this attempt is the fallback to stable (counted once)
    reported: bool = False
    read: Read | None = None  # the call's first message and its fields, as read (once)
    # The call as asked (`read`; a retry's plan keeps none of it):
    pin: str = ""  # the version it pinned (field 2 or x-model-version); empty: none
    received: Mapping[str, str] = field(default_factory=dict)  # its string-valued request headers
    view: ModelView[Any] = _NO_VIEW  # its model as the sidecar knew it (model_view)
    # What the client's response metadata gets from the sidecar (`answer_metadata` of the dye and
    # fallback), set with them by `first` and `_next`: a field, not a property (a call a call).
    answer_metadata: Metadata = ()
    # A replay on stable of a canary attempt that the canary's graph refused (model_rejected): that
    # attempt, whose verdict waits for this one's outcome (`report`: answered, the canary's fault).
    replay_of: Plan[Any] | None = None
    charged: bool = False  # a canary attempt a replay settled: whether it counted as a fault

    @property
    def known(self) -> bool:
        """The upstreams serve the model (WatchModels): it earns state and a label."""
        return self.view.known

    def body(self, message: bytes) -> bytes:
        """The message with the chosen version in field 2, unless it carries one already."""
        if not self.version or not self.dye:
            return message
        read = self.read
        if read is not None and read[0] is message:
            fields = read[1]  # the first message, read by the planner already
        else:
            try:
                fields = read_model_fields(message)
            except WireError:
                return message  # the upstream answers INVALID_ARGUMENT for it
        if not fields.complete or fields.version or (fields.name and fields.name != self.model):
            return message
        return with_version(message, self.version)

    def report(self, code: str, reason: str, latency: float | None, *, gone: bool = False) -> None:
        """The attempt's outcome to its breaker, once; `gone`: the caller cancelled (or the
        sidecar is shutting down), so there is no verdict on the upstream. A replay's outcome
        settles the canary attempt it replayed (`replayed`)."""
        if self.replay_of is not None:
            self.replayed(code == "OK" and not gone)
        if self.reported or self.breaker is None or self.permit is None:
            return
        self.reported = True
        if gone:
            self.breaker.release(self.permit)
            return
        has_fallback = self.dye == CANARY and bool(self.stable)  # its callers get stable when it opens
        self.breaker.report(
            self.permit,
            code != "OK" and is_fault(code, reason),
            latency,
            self.caller,
            has_fallback,
            self.stable if has_fallback else "",  # stable: a canary is judged against it
        )

    def replayed(self, answered: bool) -> None:
        """This replay on stable ended: `answered`, stable served what the canary's graph refused,
        so the refusal was the canary's fault (charged: its breaker, the rollout's error gate);
        else it was the request's, and neither version is charged (the answer says `replayed`)."""
        canary, self.replay_of = self.replay_of, None
        if canary is None:
            return
        canary.charged = answered
        if not answered:
            self.fallback = FALLBACK_REPLAYED
            self.answer_metadata = answer_metadata(self.dye, FALLBACK_REPLAYED)
        breaker, permit = canary.breaker, canary.permit
        if canary.reported or breaker is None or permit is None:
            return
        canary.reported = True
        if answered:  # a canary attempt, judged against stable as any (its latency: none, it failed)
            breaker.report(permit, True, None, canary.caller, True, canary.stable)
        else:
            breaker.release(permit)  # no verdict on the canary


Found = tuple[U, Breaker | None, Permit | None]


_ANSWERS: dict[str, Metadata] = {"": (), **{d: ((headers.MODEL_DYE, d),) for d in (STABLE, CANARY, PINNED)}}


def answer_metadata(dye: str, fallback: str) -> Metadata:
    """What the client's response metadata gets from the sidecar for an attempt so dyed: its dye
    (none without one) and the fallback, if any."""
    md = _ANSWERS.get(dye) or ((headers.MODEL_DYE, dye),) if dye else ()
    return (*md, (headers.DYE_FALLBACK, fallback)) if fallback and dye else md


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


def caller_key(received: Mapping[str, str], stickiness_header: str, peer: str | Callable[[], str]) -> int:
    """Who a call is, as far as the sidecar can tell: its tenant, else its user's sticky key, else
    its connection (`peer`, or what gives it: gRPC's context.peer builds a string per call, asked
    only when needed). Only a hash is kept (in the breakers' windows)."""
    tenant = received.get(headers.TENANT_ID)
    if tenant:
        return hash(("tenant", tenant))
    user = received.get(stickiness_header)
    if user:
        return hash(("user", user))
    return hash(("peer", peer if isinstance(peer, str) else peer()))


def tenant_bucket(tenants: Mapping[str, TenantLimit], received: Mapping[str, str]) -> str:
    """The tenant-limit bucket of a call, or empty when no tenant is configured. A configured
    tenant has its own bucket and label; every other one (and a call without x-tenant-id) shares
    the `*` bucket and one label: rotating ids buys no new state."""
    if not tenants:
        return ""
    named = received.get(headers.TENANT_ID) or ""
    return named if named in tenants and named != ANY_TENANT else ANY_TENANT


def asked(
    model: str,
    pin: str,
    received: Mapping[str, str],
    forward: Metadata,
    view: ModelView[Any],
    read: Read | None = None,
    version: str = "",
    dye: str = "",
    stable: str = "",
) -> Plan[Any]:
    """A call as asked (what `read` finds): a Plan whose attempt `first` or `unrouted` plans.
    `version`, `dye` and `stable`: a data call's routing decision (routing.choose)."""
    upstream: Any = None  # chosen by `first` or `unrouted`
    return Plan(
        model,
        version,
        dye,
        "",
        stable,
        upstream,
        None,
        None,
        forward,
        None,
        view.label,
        False,
        False,
        read,
        pin,
        received,
        view,
    )


def read(
    request: bytes | None, md: Metadata, views: Views, model_addressed: bool, routed: bool = False
) -> Plan[Any]:
    """The model and pinned version a call names (its fields 1 and 2, else its headers), checked
    by the one name rule before they reach any state, label or message; for a data call
    (`routed`), its version and dye (routing.choose; a bad routing header is refused)."""
    received: dict[str, str] = {}
    kept: list[tuple[str, str | bytes]] = []
    for item in md:  # one pass over the call's metadata
        key, value = item
        if isinstance(value, str):
            received[key] = value
        if key not in _DROP and key[:1] != ":":
            kept.append(item)  # the pair itself, not a copy
    forward = tuple(kept)
    model = pin = ""
    read: Read | None = None
    if model_addressed:
        message = request or b""
        try:
            fields = read_model_fields(message)
        except WireError as exc:
            raise Refused(
                "INVALID_ARGUMENT", f"the request is not a valid message: {exc}", ErrorReason.INVALID_ARGUMENT
            ) from exc
        try:
            model = fields.name
            if model not in _VALID_NAMES:  # a name seen valid before is not checked again
                model = _checked(check_name, model, "model_name", received, headers.MODEL_NAME)
                if model and len(_VALID_NAMES) < VALID_NAMES_KEPT:
                    _VALID_NAMES.add(model)
            if fields.version or headers.MODEL_VERSION in received:  # most calls pin none
                pin = _checked(
                    check_version, fields.version, "model_version", received, headers.MODEL_VERSION
                )
        except InvalidName as exc:
            raise Refused("INVALID_ARGUMENT", str(exc), ErrorReason.INVALID_ARGUMENT) from exc
        read = (message, fields)
    view = views(model)
    if not routed:
        return asked(model, pin, received, forward, view, read)
    sticky = received.get(view.table.stickiness_header) or received.get(headers.REQUEST_ID)
    try:
        version, dye, stable = choose(
            view.route, view.stable, view.canary, pin, sticky, received.get(headers.CANARY_WEIGHT)
        )
    except RoutingError as exc:
        raise Refused("INVALID_ARGUMENT", str(exc), ErrorReason.INVALID_ARGUMENT) from exc
    return asked(model, pin, received, forward, view, read, version, dye, stable)


def unrouted(request: Plan[Any], pool: Pool[U], *, model_addressed: bool) -> Plan[U]:
    """A call that is not dyed (`read`, not routed): to an upstream serving the model it names,
    else to any; no state. Its plan is the request itself."""
    candidates = pool.candidates(request.model, request.pin) if model_addressed else []
    request.upstream = (candidates or pool.any())[0]
    request.version = request.pin
    plan: Plan[U] = request
    return plan


def first(
    request: Plan[Any], caller: int, pool: Pool[U], breakers: Breakers, exclude: Sequence[U] = ()
) -> Plan[U]:
    """The first attempt of a data call (`read` with `routed`), planned in the call's own Plan (a
    refused call's is left as it was): an upstream for the version it decided whose breaker lets
    the call through; a canary with none falls back to stable (`breaker-open` when a breaker
    refused, else `unavailable`); with none for the version either, the call is refused. While
    every breaker of the canary is open (`Breakers.shut`), a call dyed canary by the route's weight
    is dyed stable (the effective weight is 0: no new user is sent there, and none is told of a
    fallback); one that asked for the canary with `x-canary-weight` falls back as above.
    `exclude`: upstreams it may not go to (a sequence's step goes to its sequence's: sequences.py)."""
    dye, version, stable, fallback = request.dye, request.version, request.stable, ""
    if (
        dye == CANARY
        and stable
        and headers.CANARY_WEIGHT not in request.received
        and breakers.shut(request.model, version)
    ):
        dye, version = STABLE, stable
    view = request.view
    found, blocked, served = take(view, version, exclude, pool, breakers)
    if found is None and dye == CANARY and stable:
        fallback = FALLBACK_BREAKER if blocked else FALLBACK_UNAVAILABLE
        dye, version = STABLE, stable
        found, _, served = take(view, version, (), pool, breakers)
    if found is None:
        if blocked:
            raise Refused(
                "UNAVAILABLE",
                f"model {echo(request.model)} version {echo(version)}: circuit breaker open",
                ErrorReason.BREAKER_OPEN,
            )
        raise Refused(
            "UNAVAILABLE",
            f"model {echo(request.model)} version {echo(version or '(default)')}: no upstream left to try",
            ErrorReason.UNAVAILABLE,
        )
    upstream, breaker, permit = found
    plan: Plan[U] = request  # the attempt, planned in the call's own object
    if version:
        plan.forward = (*request.forward, *served.headers[dye])
    plan.version, plan.dye, plan.fallback, plan.fell_back = version, dye, fallback, bool(fallback)
    plan.answer_metadata = _ANSWERS[dye] if not fallback else answer_metadata(dye, fallback)
    plan.upstream, plan.breaker, plan.permit, plan.caller = upstream, breaker, permit, caller
    return plan


def after_failure(
    plan: Plan[U],
    code: str,
    reason: str,
    latency: float | None,
    tried: list[U],
    view: ModelView[U],
    pool: Pool[U],
    breakers: Breakers,
) -> Plan[U] | None:
    """An attempt failed before any answer reached the client: its verdict goes to its breaker,
    and the next attempt is returned (another upstream for an unreachable one, stable for a
    canary fault: a canary's faults count against its breaker, never against a user), or None
    when the failure is the answer. `tried` gathers the upstreams tried so far; `view`: the
    model's view now (ModelViews.of).

    A canary attempt its graph refused (`model_rejected`: the request passed every declared check
    of the version) is replayed on stable, with its verdict held (`Plan.replay_of`): whose fault
    it was, the canary's graph or the request's values, only stable's answer to the same request
    tells (Plan.replayed). A replay that fails goes to another stable upstream only when
    unreachable, its canary still waiting; otherwise the canary is charged nothing."""
    if plan.dye == CANARY and plan.stable and reason == ErrorReason.MODEL_REJECTED:
        found, _, _ = take(view, plan.stable, (), pool, breakers)
        if found is not None:
            tried.append(plan.upstream)
            replay = _next(plan, plan.stable, STABLE, FALLBACK_CANARY_FAULT, found, _strip(plan.forward))
            replay.replay_of = plan
            return replay
    pending, plan.replay_of = plan.replay_of, None  # a replay's canary waits for its last attempt
    plan.report(code, reason, latency)
    unreachable = is_unreachable(code, reason)
    if unreachable or (plan.dye == CANARY and is_fault(code, reason)):
        tried.append(plan.upstream)
        forward = _strip(plan.forward)
        if unreachable:
            found, _, _ = take(view, plan.version, tried, pool, breakers, fallback_to_any=False)
            if found is not None:
                retry = _next(plan, plan.version, plan.dye, plan.fallback, found, forward)
                retry.replay_of = pending
                return retry
        if plan.dye == CANARY and plan.stable:
            found, _, _ = take(view, plan.stable, tried if unreachable else (), pool, breakers)
            if found is not None:
                reason = FALLBACK_UNAVAILABLE if unreachable else FALLBACK_CANARY_FAULT
                return _next(plan, plan.stable, STABLE, reason, found, forward, fell_back=True)
    if pending is not None:
        plan.replay_of = pending
        plan.replayed(False)  # stable did not answer it either: the request's fault
    return None


def shadow_target(
    plan: Plan[U], table: RouteTable, pool: Pool[U], breakers: Breakers
) -> tuple[str, U, Metadata] | None:
    """Where a stable answer's request is mirrored: the canary version, an upstream whose breaker
    would let a call through (no permit is taken), and the metadata; None when there is none."""
    if not plan.version:
        return None  # the model's versions are not known (yet): nothing to compare against
    _, canary = stable_and_canary(table.route(plan.model), pool.versions(plan.model))
    if not canary or canary == plan.version:
        return None
    for upstream in pool.candidates(plan.model, canary):
        if breakers.get(upstream.address, plan.model, canary).would_allow():
            md = (
                *_strip(plan.forward),
                (headers.MODEL_VERSION, canary),
                (headers.MODEL_DYE, headers.DYE_SHADOW),
            )
            return canary, upstream, md
    return None


@dataclass(frozen=True, slots=True)
class CanaryStatus:
    """A model's canary as routing sees it now: `weight` the route's (configured), and
    `effective_weight` what routing applies (0 while the canary's breakers are all open, or when
    there is no canary); `breaker` the worst state of the canary's breakers (None: no call yet)."""

    model: str
    stable: str
    canary: str
    weight: float
    effective_weight: float
    breaker: str | None

    def doc(self) -> dict[str, object]:
        return {
            "effective_weight": self.effective_weight,
            "breaker": self.breaker,
            "stable_version": self.stable,
            "canary_version": self.canary,
        }


def canary_status(model: str, table: RouteTable, pool: Pool[Target], breakers: Breakers) -> CanaryStatus:
    """The canary of a model: its versions, configured and effective weight, breaker state. Reads
    only (no breaker is made): the metrics collector calls it from its own thread."""
    route = table.route(model)
    stable, canary = stable_and_canary(route, pool.versions(model) if pool.knows(model) else ())
    if not canary or canary == stable:
        return CanaryStatus(model, stable, "", route.canary_weight, 0.0, None)
    state = breakers.state_of(model, canary)
    shut = breakers.shut(model, canary)
    return CanaryStatus(
        model,
        stable,
        canary,
        route.canary_weight,
        0.0 if shut else route.canary_weight,
        state.value if state is not None else None,
    )


def is_stateful(model: str, version: str, table: RouteTable, pool: Pool[Target]) -> bool:
    """Whether a (model, version) gets a breaker: only what the upstreams serve (WatchModels),
    or a version the route names for a served model. Anything a client makes up is forwarded
    without state, and answered by the upstream (NOT_FOUND)."""
    if not model:
        return False
    if version and pool.knows(model, version):  # the usual answer, in one look
        return True
    if not pool.knows(model):
        return False
    if not version:
        return True
    route = table.models.get(model)
    return route is not None and version in (route.stable, route.canary)


def take(
    view: ModelView[U],
    version: str,
    exclude: Sequence[U],
    pool: Pool[U],
    breakers: Breakers,
    fallback_to_any: bool = True,
) -> tuple[Found[U] | None, bool, Served[U]]:
    """The first upstream for the version whose breaker lets a call through (its permit taken);
    whether a breaker refused; and the version as the view holds it. With no upstream known to
    serve it, any (it answers NOT_FOUND itself), unless `fallback_to_any` is off."""
    served = view.versions.get(version)
    if served is None:
        served = _served(view, version, pool, breakers)
    only = served.only
    if only is not None:  # the usual pod: one upstream serves it, its breaker at hand
        if only in exclude:
            return None, False, served
        breaker = served.breaker
        if breaker is None:
            return (only, None, None), False, served
        permit = breaker.allow()
        return ((only, breaker, permit), False, served) if permit is not None else (None, True, served)
    blocked = False
    model = view.model
    candidates = pool.candidates(model, version)  # several in turn, reachable ones first; or none
    if not candidates and fallback_to_any:
        candidates = pool.any()
    for upstream in candidates:
        if upstream in exclude:
            continue
        if not served.stateful:
            return (upstream, None, None), blocked, served
        breaker = breakers.get(upstream.address, model, version)
        permit = breaker.allow()
        if permit is not None:
            return (upstream, breaker, permit), blocked, served
        blocked = True
    return None, blocked, served


def _served(view: ModelView[U], version: str, pool: Pool[U], breakers: Breakers) -> Served[U]:
    """A version of the view's model, kept in the view when it gets state (a version the
    upstreams serve or the route names: a bounded few; a pin a client made up is not kept)."""
    model = view.model
    stateful = is_stateful(model, version, view.table, pool)
    serving = pool.serving(model, version)
    only = serving[0] if len(serving) == 1 else None
    breaker = breakers.get(only.address, model, version) if only is not None and stateful else None
    sent = {d: ((headers.MODEL_VERSION, version), (headers.MODEL_DYE, d)) for d in (STABLE, CANARY, PINNED)}
    served = Served(stateful, only, breaker, sent)
    if stateful:
        view.versions[version] = served
    return served


def _next(
    plan: Plan[U],
    version: str,
    dye: str,
    fallback: str,
    found: Found[U],
    forward: Metadata,
    *,
    fell_back: bool = False,
) -> Plan[U]:
    upstream, breaker, permit = found
    forward = (*forward, (headers.MODEL_VERSION, version), (headers.MODEL_DYE, dye))
    return Plan(
        plan.model,
        version,
        dye,
        fallback,
        plan.stable,
        upstream,
        breaker,
        permit,
        forward,
        plan.caller,
        plan.label,
        fell_back=fell_back,
        read=plan.read,
        answer_metadata=answer_metadata(dye, fallback),
    )


def _strip(forward: Metadata) -> Metadata:
    return tuple((k, v) for k, v in forward if k not in (headers.MODEL_VERSION, headers.MODEL_DYE))


def _checked(
    check: Callable[[str, str], str], field_value: str, field: str, received: Mapping[str, str], header: str
) -> str:
    """The name or version from the message's field, else from its header, through `check`."""
    if field_value:
        return str(check(field_value, field))
    from_header = received.get(header, "")
    return str(check(from_header, header)) if from_header else ""
