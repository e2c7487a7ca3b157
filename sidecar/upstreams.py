"""The service instances behind the sidecar: two pooled channels each (one for calls with a
response stream and the watches, one for calls with one response: STREAM_OPTIONS), what they
serve (followed with WatchModels) and whether they are up (followed with the health Watch).

An upstream may be labelled with the versions it serves (`HOST:PORT@2`, or `@1+2`), so that a
canary can live in another process or pod; without a label, what its WatchModels reports decides.
What an upstream served is kept while its watch is broken: a dropped connection is the breakers'
business, not a reason to re-dye every user.

An upstream has *reported* once its watch gave its whole initial state: the service says how many
events that is (x-initial-state-count, in the watch's initial metadata; 0 for an empty repository,
which sends no event), and the state is taken whole once they all arrived. An older service sends
no count: it has reported at its first event. One that will never say (its WatchModels is
unimplemented, or an older service with no models that says nothing for REPORT_WAIT_S while its
health serves) counts as reported too, with what it serves unknown (its label decides what goes
there; without one, any call may). Until every upstream reported, the sidecar cannot tell a model
nobody serves from one not reported yet (the admin endpoint's 503), and it is not ready (sidecar/server.py).

Over TLS (modelyard.process.tls.ClientTls), a change of the CA or client certificate files (a
renewal) is picked up without a restart: every upstream gets new channels made with them, its
watches start again on them, and the old channels are closed once their calls had time to finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from modelyard.common import headers
from modelyard.inference.v1 import model_service_pb2, model_service_pb2_grpc
from modelyard.process.tls import ClientTls, Renewals
from modelyard.sidecar.dyeing import normalize_version
from modelyard.sidecar.settings import check_upstream

log = logging.getLogger(__name__)

READY = model_service_pb2.MODEL_STATE_READY
_RETRY_MIN_S, _RETRY_MAX_S = 0.1, 2.0
RECHECK_S = 1.0  # how often the upstream TLS files are looked at again (stat)
RETIRED_GRACE_S = 30.0  # calls on a replaced channel get this long to finish
# How long a watch that says nothing (no initial metadata, no event) while its upstream's health
# serves is waited for: an older service with no models never says anything.
REPORT_WAIT_S = 3.0

# Reconnect quickly once an upstream comes back (gRPC's default backoff grows to two minutes).
CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.enable_retries", 0),  # the sidecar decides about retries itself
)
# The channel of response streams: a one-byte lookahead, BDP probing off, so that a response
# stream the caller stops reading (a closed browser tab behind the gateway) pauses the service's
# sequence within a few tokens, instead of after gRPC's 64 KiB+ window of them (the whole
# generation, for short ones). A large message still gets the window it needs once it is read.
# Not for calls with one response: there the tiny window costs a round trip per call (the
# service sends a byte, the sidecar a window update for the rest: one more sendmsg and two more
# recvmsg per call in each process, measured), and a single response is read at once anyway.
STREAM_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.http2.lookahead_bytes", 1),
    ("grpc.http2.bdp_probe", 0),
)
_ONE_RESPONSE = frozenset({"unary_unary", "stream_unary"})
# How long an upstream whose health is back waits for its one-response channel to connect before
# it counts as serving anyway (more than the channels' reconnect backoff, max_reconnect_backoff_ms).
UNARY_READY_S = 2.0


@dataclass(frozen=True)
class UpstreamSpec:
    address: str
    versions: frozenset[str] | None = None  # a label: the only versions sent there

    @classmethod
    def parse(cls, text: str) -> UpstreamSpec:
        address, label = check_upstream(text)  # the setting's own check (settings.py)
        versions = frozenset(normalize_version(v) for v in label) if label else None
        return cls(address, versions)


class Upstream:
    def __init__(
        self,
        spec: UpstreamSpec,
        options: Iterable[tuple[str, Any]],
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self.address = spec.address
        self.labels = spec.versions
        self._options = [*CHANNEL_OPTIONS, *options]
        self.channel = self._channel(credentials, STREAM_OPTIONS)  # response streams, the watches
        self.unary_channel = self._channel(credentials)  # calls with one response
        self.served: dict[str, frozenset[str]] = {}  # model -> READY versions; rebound whole
        self.watched = False  # WatchModels gave its whole initial state: `served` is what it serves
        self.silent = False  # it will not say (see the module's doc): reported, `served` unknown
        self.serving = False  # the upstream's own health ("" service)
        self._methods: dict[tuple[str, str], Any] = {}

    def _channel(
        self, credentials: grpc.ChannelCredentials | None, extra: tuple[tuple[str, Any], ...] = ()
    ) -> grpc.aio.Channel:
        options = [*self._options, *extra]
        if credentials is None:
            return grpc.aio.insecure_channel(self.address, options=options)
        return grpc.aio.secure_channel(self.address, credentials, options=options)

    def reconnect(self, credentials: grpc.ChannelCredentials) -> list[grpc.aio.Channel]:
        """New channels for new calls; the old ones are returned for the caller to close."""
        old = [self.channel, self.unary_channel]
        self.channel = self._channel(credentials, STREAM_OPTIONS)
        self.unary_channel = self._channel(credentials)
        self._methods = {}
        return old

    async def close(self, grace: float | None = None) -> None:
        await self.channel.close(grace)
        await self.unary_channel.close(grace)

    @property
    def reported(self) -> bool:
        return self.watched or self.silent

    def versions(self, model: str) -> frozenset[str]:
        served = self.served.get(model, frozenset())
        if self.labels is None:
            return served
        return self.labels & served if self.watched else self.labels

    def serves(self, model: str, version: str) -> bool:
        if not version:
            return not self.watched or model in self.served
        if self.labels is not None and version not in self.labels:
            return False
        return not self.watched or version in self.served.get(model, ())

    async def unary_ready(self) -> None:
        """Wait (bounded) for the channel of calls with one response to connect. When an upstream
        comes back, the watches' channel has connected, while that one may still be waiting out its
        reconnect backoff: a call sent now would fail and count against the upstream's breakers."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.unary_channel.channel_ready(), UNARY_READY_S)

    def reachable(self) -> bool:
        return self.channel.get_state(try_to_connect=False) is not grpc.ChannelConnectivity.TRANSIENT_FAILURE

    def method(self, path: str, kind: str) -> Any:
        """The channel's multicallable for a method, bytes in and out (no (de)serializers)."""
        found = self._methods.get((path, kind))
        if found is None:
            channel = self.unary_channel if kind in _ONE_RESPONSE else self.channel
            make = {
                "unary_unary": channel.unary_unary,
                "unary_stream": channel.unary_stream,
                "stream_unary": channel.stream_unary,
                "stream_stream": channel.stream_stream,
            }[kind]
            found = self._methods[(path, kind)] = make(path, None, None)
        return found


class Upstreams:
    """All upstreams, and the tasks that follow their models and health."""

    def __init__(
        self,
        specs: Iterable[UpstreamSpec],
        options: Iterable[tuple[str, Any]] = (),
        on_change: Callable[[], None] = lambda: None,  # models or health changed somewhere
        tls: ClientTls | None = None,
    ) -> None:
        options = [*options, *(tls.options() if tls is not None else ())]
        self._renewals = Renewals(tls) if tls is not None else None
        credentials = tls.credentials() if tls is not None else None
        self.all = [Upstream(spec, options, credentials) for spec in specs]
        if not self.all:
            raise ValueError("at least one upstream is needed")
        self._on_change = on_change
        self._tasks: list[asyncio.Task[None]] = []
        self._watches: dict[int, list[asyncio.Task[None]]] = {}  # per upstream (its index)
        self._retired: set[asyncio.Task[None]] = set()
        self._turn = 0

    def start(self) -> None:
        for index in range(len(self.all)):
            self._watch(index)
        if self._renewals is not None:
            self._tasks.append(asyncio.get_running_loop().create_task(self._follow_tls()))

    def _watch(self, index: int) -> None:
        loop, upstream = asyncio.get_running_loop(), self.all[index]
        for task in self._watches.get(index, ()):
            task.cancel()
        self._watches[index] = [
            loop.create_task(self._follow_models(upstream)),
            loop.create_task(self._follow_health(upstream)),
        ]

    async def close(self) -> None:
        tasks = [*self._tasks, *(t for watches in self._watches.values() for t in watches), *self._retired]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for upstream in self.all:
            await upstream.close(None)

    async def _follow_tls(self) -> None:
        renewals = self._renewals
        assert renewals is not None
        while True:
            await asyncio.sleep(RECHECK_S)
            credentials = renewals.renewed()
            if credentials is None:
                continue
            for index, upstream in enumerate(self.all):
                olds = upstream.reconnect(credentials)
                self._watch(index)
                for old in olds:
                    retiring = asyncio.get_running_loop().create_task(old.close(RETIRED_GRACE_S))
                    self._retired.add(retiring)
                    retiring.add_done_callback(self._retired.discard)
            log.info("upstream TLS files reloaded; new calls use new channels")

    def versions(self, model: str) -> frozenset[str]:
        if len(self.all) == 1:  # the usual pod: its upstream's own set, no copy (asked per call)
            return self.all[0].versions(model)
        found: set[str] = set()
        for upstream in self.all:
            found |= upstream.versions(model)
        return frozenset(found)

    def knows(self, model: str, version: str = "") -> bool:
        """Whether an upstream's WatchModels reported the model (and the version, when given) as
        served: what earns a model state in the sidecar (breakers, metric labels)."""
        for upstream in self.all:
            served = upstream.served.get(model)
            if served is not None and (not version or version in served):
                return True
        return False

    def pending(self) -> bool:
        """Whether an upstream has not reported its initial state yet: a model `knows` denies may
        still be one it serves."""
        return not all(upstream.reported for upstream in self.all)

    def models(self) -> set[str]:
        return {model for upstream in self.all for model in upstream.served}

    def serving(self, model: str, version: str) -> list[Upstream]:
        """Upstreams that serve the version, in their order (no turn taken)."""
        return [u for u in self.all if u.serves(model, version)]

    def candidates(self, model: str, version: str) -> list[Upstream]:
        """Upstreams that serve the version, reachable ones first, in turn."""
        serving = self.serving(model, version)
        if len(serving) > 1:
            self._turn += 1
            shift = self._turn % len(serving)
            serving = serving[shift:] + serving[:shift]
            serving.sort(key=lambda u: not u.reachable())  # stable: keeps the turn among equals
        return serving

    def any(self) -> list[Upstream]:
        """Every upstream, serving and reachable ones first (for calls that name no model)."""
        return sorted(self.all, key=lambda u: (not u.serving, not u.reachable()))

    async def _follow_models(self, upstream: Upstream) -> None:
        delay = _RETRY_MIN_S
        while True:
            stub = model_service_pb2_grpc.ModelServiceStub(upstream.channel)
            try:
                call = stub.WatchModels(model_service_pb2.WatchModelsRequest(send_initial_state=True))
                remaining = _initial_count(upstream, await self._initial_metadata(upstream, call))
                if remaining is not None:  # (a failed call's metadata is empty: it keeps backing off)
                    delay = _RETRY_MIN_S
                # A fresh watch starts from its initial state, not from what we knew: gathered
                # whole when its size is known, else from the first event on.
                served: dict[str, frozenset[str]] | None = None
                gathering: dict[str, frozenset[str]] = {}
                if remaining == 0:
                    served = self._report(upstream, {})
                async for event in call:
                    delay = _RETRY_MIN_S
                    if remaining:  # the initial state, taken whole with its last event
                        _apply(gathering, event)
                        remaining -= 1
                        if remaining == 0:
                            served = self._report(upstream, gathering)
                        continue
                    served = dict(upstream.served) if served is not None else {}
                    served = self._report(upstream, _apply(served, event))
            except grpc.aio.AioRpcError as exc:
                log.debug("model watch on %s ended: %s", upstream.address, exc.code())
                if exc.code() is grpc.StatusCode.UNIMPLEMENTED and not upstream.reported:
                    log.info("upstream %s has no WatchModels: what it serves is not known", upstream.address)
                    upstream.silent = True
                    self._on_change()
            await asyncio.sleep(delay)
            delay = min(_RETRY_MAX_S, delay * 2)

    async def _initial_metadata(self, upstream: Upstream, call: Any) -> Any:
        """The watch's initial metadata (a service sends it with the count, an older one with its
        first event); one that says nothing for REPORT_WAIT_S while the upstream's health serves
        has reported nothing (an older service with no models)."""
        waiting = asyncio.ensure_future(call.initial_metadata())
        try:
            while not (await asyncio.wait({waiting}, timeout=REPORT_WAIT_S))[0]:
                if upstream.serving and not upstream.reported:
                    log.warning(
                        "upstream %s has not reported its models in %g s (an older service with none?)",
                        upstream.address,
                        REPORT_WAIT_S,
                    )
                    upstream.silent = True
                    self._on_change()
            return waiting.result()
        finally:
            waiting.cancel()

    def _report(self, upstream: Upstream, served: dict[str, frozenset[str]]) -> dict[str, frozenset[str]]:
        upstream.served = served  # rebound whole: readers per call see one state or the other
        upstream.watched = True
        self._on_change()
        return served

    async def _follow_health(self, upstream: Upstream) -> None:
        delay = _RETRY_MIN_S
        while True:
            stub = health_pb2_grpc.HealthStub(upstream.channel)
            try:
                async for answer in stub.Watch(health_pb2.HealthCheckRequest(service="")):
                    serving = answer.status == health_pb2.HealthCheckResponse.SERVING
                    if serving and not upstream.serving:
                        await upstream.unary_ready()
                    if serving != upstream.serving:
                        log.info(
                            "upstream %s is %s", upstream.address, "serving" if serving else "not serving"
                        )
                    upstream.serving = serving
                    delay = _RETRY_MIN_S
                    self._on_change()
            except grpc.aio.AioRpcError as exc:
                log.debug("health watch on %s ended: %s", upstream.address, exc.code())
            if upstream.serving:
                log.warning("upstream %s is unreachable", upstream.address)
                upstream.serving = False
                self._on_change()
            await asyncio.sleep(delay)
            delay = min(_RETRY_MAX_S, delay * 2)


def _initial_count(upstream: Upstream, metadata: Any) -> int | None:
    """The initial state's number of events, from the watch's initial metadata; None from an
    older service (or a value that is not a count)."""
    value = metadata.get(headers.INITIAL_STATE_COUNT) if metadata is not None else None
    if value is None:
        return None
    try:
        count = int(value)
    except ValueError:
        count = -1
    if count < 0:
        log.warning(
            "upstream %s sent %s %r: not a count", upstream.address, headers.INITIAL_STATE_COUNT, value
        )
        return None
    return count


def _apply(served: dict[str, frozenset[str]], event: Any) -> dict[str, frozenset[str]]:
    """One WatchModels event applied to what is served (in place)."""
    versions = set(served.get(event.model_name, ()))
    version = normalize_version(event.version)
    if event.state == READY:
        versions.add(version)
    else:
        versions.discard(version)
    if versions:
        served[event.model_name] = frozenset(versions)
    else:
        served.pop(event.model_name, None)
    return served
