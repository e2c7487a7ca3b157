"""The composition root: settings -> a running sidecar (proxy, breakers, routes, health, admin)."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from modelyard.common import health as health_names
from modelyard.process import access_log as access
from modelyard.process.auth import Authorizer, AuthSettings
from modelyard.process.drain import Drain
from modelyard.process.grpc_server import connection_options
from modelyard.process.lifecycle import BindError, bind_reason, bound
from modelyard.process.settings import split_address
from modelyard.process.tls import ClientTls, TlsFiles, grpc_server_credentials, warn_if_plaintext
from modelyard.sidecar.admin import AdminLimits, AdminServer, admin_warnings
from modelyard.sidecar.breaker_policy import Clock, State
from modelyard.sidecar.breakers import BreakerKey, Breakers
from modelyard.sidecar.canary_status import CanaryStatus, canary_status
from modelyard.sidecar.metrics import SidecarMetrics
from modelyard.sidecar.proxy import Proxy
from modelyard.sidecar.rollout.driver import RolloutDriver
from modelyard.sidecar.routes.route_table import RouteSource
from modelyard.sidecar.routes.saved import read_saved
from modelyard.sidecar.routes.state_file import StateFile, remove_stale
from modelyard.sidecar.settings import ENV_PREFIX, Settings
from modelyard.sidecar.shadow.compare import Shadows
from modelyard.sidecar.tenant_limits import TenantLimits
from modelyard.sidecar.tracing import Tracing, configure
from modelyard.sidecar.upstreams import Upstreams, UpstreamSpec
from modelyard.sidecar.workers.role import WorkerRole

log = logging.getLogger(__name__)


@dataclass
class Sidecar:
    settings: Settings
    server: grpc.aio.Server
    port: int
    upstreams: Upstreams
    breakers: Breakers
    routes: RouteSource
    metrics: SidecarMetrics
    health: health_names.HealthServicer
    tracing: Tracing
    shadows: Shadows
    proxy: Proxy
    drain: Drain  # the proxied calls in flight (modelyard.process.drain)
    rollouts: RolloutDriver
    state: StateFile
    tls: TlsFiles | None = None  # of the gRPC and admin listeners
    admin_auth: Authorizer | None = None
    admin: AdminServer | None = None
    worker: WorkerRole | None = None  # one of --workers N: admin on its unix socket, for the supervisor
    settle_heap: bool = False  # a process of its own (the CLI): start-up's objects frozen (start)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    _admitted: asyncio.Event = field(default_factory=asyncio.Event)  # a worker's, by its supervisor
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _models: set[str] = field(default_factory=set)
    _serving: set[str] = field(default_factory=set)  # upstream addresses last seen serving

    @property
    def address(self) -> str:
        return f"{split_address(self.settings.listen)[0]}:{self.port}"

    @property
    def admin_address(self) -> str:
        assert self.admin is not None
        if self.worker is not None:
            return str(self.worker.admin_socket)
        return f"{split_address(self.settings.admin_listen)[0]}:{self.admin.port}"

    async def start(self) -> None:
        await self.health.set(health_names.SERVER, health_names.NOT_SERVING)
        loop = asyncio.get_running_loop()
        self.upstreams.start()
        if self.worker is None:
            await self.server.start()
        if self.settings.admin_listen or self.worker is not None:
            # A worker's admin endpoint is its supervisor's private channel (a unix socket in a
            # 0700 folder): the supervisor's own endpoint checks TLS and tokens.
            host, port = split_address(self.settings.admin_listen) if self.worker is None else ("", 0)
            private = self.worker is not None
            if not private:
                configured = self.admin_auth is not None and self.admin_auth.configured
                admin_warnings(host, self.settings.admin_open, configured)
            self.admin = AdminServer(
                host,
                port,
                self.metrics.registry,
                self.routes,
                self.breakers.snapshot,
                canaries=self.canaries,
                tls=None if private else self.tls,
                authorizer=None if private else self.admin_auth,
                auth_reads=self.settings.admin_auth_reads,
                denials=self.metrics.admin_denials,
                limits=AdminLimits(
                    header_timeout_s=self.settings.admin_header_timeout_s,
                    body_timeout_s=self.settings.admin_body_timeout_s,
                    idle_timeout_s=self.settings.admin_idle_timeout_s,
                    max_body_bytes=self.settings.admin_max_body_bytes,
                    max_connections=self.settings.admin_max_connections,
                ),
                known=self.upstreams.knows,
                pending=self.upstreams.pending,
                rollouts=self.rollouts,
                open_writes=self.settings.admin_open,
                durable=self.state.durable,
                unix_path=str(self.worker.admin_socket) if self.worker is not None else "",
                on_admit=self._admitted.set,
            )
            try:
                await self.admin.start()
            except OSError as exc:
                reason = bind_reason(exc)
                raise BindError(ENV_PREFIX, "admin_listen", self.settings.admin_listen, reason) from exc
        if self.worker is not None:
            # Its port is bound (connections wait in its accept queue); it takes calls once the
            # supervisor replayed the admin changes to it, never with routes older than theirs.
            await self._admitted.wait()
            await self.server.start()
        self._tasks.append(loop.create_task(self._follow_upstreams()))
        self._tasks.append(loop.create_task(self.rollouts.run()))
        self.state.changed()  # what start-up made of the saved state and the route file, kept
        if self.settings.config:
            self._tasks.append(loop.create_task(self._watch_config()))
        if self.settle_heap:
            # What start-up made (modules, protobuf descriptors, the tracing SDK) lives as long
            # as the process: out of the collector's reach, so that its collections under load
            # walk only what calls made, not the whole heap of start-up each time.
            gc.collect()
            gc.freeze()
        if self.worker is not None:  # the supervisor says "sidecar serving" once all are up
            log.info("sidecar worker %d taking calls on %s", self.worker.index, self.address)
            return
        log.info(
            "sidecar serving gRPC on %s%s; upstreams: %s",
            self.address,
            f", admin on {'https' if self.tls else 'http'}://{self.admin_address}" if self.admin else "",
            ", ".join(u.address for u in self.upstreams.all),
        )

    async def stop(self, grace_s: float | None = None) -> None:
        await self.health.enter_graceful_shutdown()
        grace = self.settings.grace_s if grace_s is None else grace_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        # Calls still running near the grace's end are answered `draining`, not cancelled by gRPC.
        ending = asyncio.ensure_future(self.proxy.drain(grace - min(0.5, grace / 4)))
        # New calls are refused (UNAVAILABLE, draining) from here on. gRPC's stop(grace) alone shuts
        # a connection once its last call ended, and a slow reader's next window update then resets
        # it, losing the answer's tail: stop once the peers hold it.
        await self.drain.settle(self.port, deadline)
        await self.server.stop(max(0.0, deadline - loop.time()))
        await ending
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.shadows.close()
        await self.upstreams.close()
        if self.admin is not None:
            await self.admin.stop()
        await self.state.flush()  # after the last change can arrive
        await self.tracing.close()

    def upstreams_changed(self) -> None:
        self.proxy.views.clear()  # what a model's view holds may have changed (model_views.py)
        self._changed.set()

    async def _follow_upstreams(self) -> None:
        """The sidecar's health follows its upstreams': health_names.SERVING while one serves and
        has reported what it serves (before that, the sidecar would route undyed and could not
        tell an unknown model from one not reported yet: a readiness probe waits those few
        milliseconds); per model, while a serving upstream has a ready version of it."""
        while True:
            await self._changed.wait()
            self._changed.clear()
            serving = [u for u in self.upstreams.all if u.serving]
            ready = any(u.reported for u in serving)
            await self.health.set(
                health_names.SERVER, health_names.SERVING if ready else health_names.NOT_SERVING
            )
            pruned = self.breakers.prune(self._breaker_wanted)
            if pruned:
                self.proxy.views.clear()  # no view keeps a breaker the sidecar dropped
            for key in pruned:
                self.metrics.breaker_removed(key)
            # Breakers (and their state series) exist from the start; an upstream whose health is
            # back gets its breakers' backoff growth reset.
            ups = self.upstreams.all
            served = (BreakerKey(u.address, m, v) for u in ups for m in u.served for v in u.versions(m))
            self.breakers.ensure(served)
            for address in {u.address for u in serving} - self._serving:
                self.breakers.reachable(address)
            self._serving = {u.address for u in serving}
            models = {m for u in serving for m in u.served}
            for model in models | self._models:
                await self.health.set(
                    health_names.model_service_name(model),
                    health_names.SERVING if model in models else health_names.NOT_SERVING,
                )
            self._models |= models

    def _breaker_wanted(self, key: BreakerKey) -> bool:
        """A breaker lives while its model and version are served (or named by the model's route)."""
        if self.upstreams.knows(key.model, key.version):
            return True
        route = self.routes.table.models.get(key.model)
        return (
            self.upstreams.knows(key.model)
            and route is not None
            and key.version in (route.stable, route.canary)
        )

    def canaries(self) -> list[CanaryStatus]:
        """The canary of every served model (configured and effective weight, breaker state)."""
        models = sorted({m for u in self.upstreams.all for m in u.served})
        table = self.routes.table
        return [canary_status(m, table, self.upstreams, self.breakers) for m in models]

    async def _watch_config(self) -> None:
        while True:
            await asyncio.sleep(self.settings.config_poll_s)
            if self.routes.reload_if_changed():
                self.breakers.set_policy(self.routes.table.breaker)
                self.rollouts.from_file()


def build_sidecar(
    settings: Settings,
    *,
    clock: Clock | None = None,  # test seam: the breakers' clock
    tracing: Tracing | None = None,  # test seam: default from the OTEL_* environment
    wall_clock: Clock | None = None,  # test seam: the routes' and rollouts' clock (wall seconds)
    worker: WorkerRole | None = None,  # one of `--workers N` (its supervisor holds the port)
    settle_heap: bool = False,  # the process is the sidecar's own (the CLI): Sidecar.settle_heap
) -> Sidecar:
    tls, upstream_tls, admin_auth = _security(settings)
    state_path = Path(settings.state_file) if settings.state_file else None
    saved = read_saved(state_path)  # StateError (a ValueError): refuse to start
    if state_path is not None:
        remove_stale(state_path)  # a crash's temporary files (no write of this process yet)
    wall = wall_clock if wall_clock is not None else time.time
    routes = RouteSource(
        Path(settings.config) if settings.config else None, saved=saved.get("routes"), clock=wall
    )
    metrics = SidecarMetrics()

    sidecar_ref: list[Sidecar] = []

    def breaker_changed(key: BreakerKey, old: State, new: State, reason: str) -> None:
        weight = ""
        if sidecar_ref:  # a canary's line says what routing now applies
            status = canary_status(key.model, routes.table, sidecar_ref[0].upstreams, breakers)
            if status.canary == key.version:
                weight = f"; canary effective weight {status.effective_weight:g} (of {status.weight:g})"
        log.warning(
            "breaker %s/%s/%s: %s -> %s%s%s",
            key.upstream,
            key.model,
            key.version,
            old.value,
            new.value,
            f" ({reason})" if reason else "",
            weight,
        )
        metrics.breaker_changed(key, new)

    breakers = Breakers(
        routes.table.breaker,
        breaker_changed,
        time.monotonic if clock is None else clock,
        on_made=metrics.breaker_known,
    )
    message_limits = [
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_send_message_length", settings.max_message_bytes),
    ]
    upstreams = Upstreams(
        [UpstreamSpec.parse(text) for text in settings.upstream],
        message_limits,
        on_change=lambda: sidecar_ref[0].upstreams_changed() if sidecar_ref else None,
        tls=upstream_tls,
    )
    tracing = tracing if tracing is not None else configure("modelyard-sidecar")
    server = grpc.aio.server(
        interceptors=access.interceptors(settings.access_log, settings.log_format),
        options=[*message_limits, *connection_options(settings), ("grpc.so_reuseport", 1 if worker else 0)],
    )
    health_servicer = health_names.new_servicer()
    shadows = Shadows(metrics, tracing=tracing)
    rollouts = RolloutDriver(
        routes,
        lambda model: upstreams.versions(model) if upstreams.knows(model) else (),
        breakers.is_open,
        metrics.registry,
        saved=saved.get("rollouts"),
        clock=wall,
        tick_s=settings.rollout_tick_s,
    )
    outcomes = rollouts.outcomes

    def observe(watching: bool) -> None:
        breakers.observe = outcomes.record if watching else None

    outcomes.on_watch = observe
    observe(bool(outcomes.watched))
    state = StateFile(state_path, lambda: {"routes": routes.saved(), "rollouts": rollouts.saved()})
    routes.on_change = rollouts.on_change = state.changed
    drain = Drain()
    proxy = Proxy(upstreams, breakers, routes, TenantLimits(), metrics, tracing, shadows, drain)
    server.add_generic_rpc_handlers((proxy,))  # first: every proxied call's look-up
    server.add_generic_rpc_handlers(health_names.generic_handlers(health_servicer))
    listen = settings.listen
    if tls is None:
        port = bound(ENV_PREFIX, "listen", listen, lambda: server.add_insecure_port(listen))
    else:
        credentials = grpc_server_credentials(tls)
        port = bound(ENV_PREFIX, "listen", listen, lambda: server.add_secure_port(listen, credentials))
    sidecar = Sidecar(
        settings,
        server,
        port,
        upstreams,
        breakers,
        routes,
        metrics,
        health_servicer,
        tracing,
        shadows,
        proxy,
        drain,
        rollouts,
        state,
        tls=tls,
        admin_auth=admin_auth,
        worker=worker,
        settle_heap=settle_heap,
    )
    sidecar_ref.append(sidecar)
    metrics.canary_weights(
        lambda: [(c.model, c.weight, c.effective_weight) for c in sidecar.canaries() if c.canary]
    )
    return sidecar


def _security(settings: Settings) -> tuple[TlsFiles | None, ClientTls | None, Authorizer]:
    """The listeners' TLS files, the upstreams' TLS and the admin endpoint's authorizer; ValueError
    for half a key pair or admin_auth_reads without tokens. The caller's `authorization` metadata
    goes to the upstream untouched: the service decides about its own calls."""
    tls = TlsFiles.from_settings(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
    upstream_tls = ClientTls.from_settings(
        settings.upstream_tls,
        settings.upstream_ca,
        settings.upstream_cert,
        settings.upstream_key,
        settings.upstream_server_name,
    )
    tokens = Path(settings.admin_tokens_file) if settings.admin_tokens_file else None
    if settings.admin_auth_reads and tokens is None:
        raise ValueError("admin_auth_reads needs admin_tokens_file")
    warn_if_plaintext(split_address(settings.listen)[0], "the sidecar's gRPC listener", tls)
    return tls, upstream_tls, Authorizer(AuthSettings(tokens))
