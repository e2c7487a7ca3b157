"""The composition root: settings -> a running service (gRPC server, models, health, metrics)."""

from __future__ import annotations

import asyncio
import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import _async as reflection_aio
from grpc_reflection.v1alpha import reflection, reflection_pb2

from modelyard import flat as flat_contract
from modelyard.common import health as health_names
from modelyard.inference.v1 import inference_service_pb2, model_service_pb2
from modelyard.kserve.v2 import grpc_service_pb2
from modelyard.process import access_log
from modelyard.process.auth import Authorizer, AuthSettings
from modelyard.process.cores import usable_cores
from modelyard.process.drain import Drain
from modelyard.process.grpc_server import connection_options
from modelyard.process.lifecycle import bound
from modelyard.process.metrics_http import MetricsServer
from modelyard.process.settings import split_address
from modelyard.process.throttle import LogThrottle
from modelyard.process.tls import TlsFiles, grpc_server_credentials, warn_if_plaintext
from modelyard.service.api.credentials import guards, identities
from modelyard.service.api.errors import set_served_by
from modelyard.service.api.flat_servicer import FlatInferenceServicer
from modelyard.service.api.guards import GuardFor, OnUndecodable, authorize, decode_guard
from modelyard.service.api.inference_servicer import InferenceServicer
from modelyard.service.api.kserve.servicer import KServeServicer
from modelyard.service.api.message_limits import size_limit, transport_limit
from modelyard.service.api.model_servicer import ModelServicer
from modelyard.service.api.pipeline import ServiceHandlers, Wrapper, register, service_of
from modelyard.service.batching.layer import BatchingLayer
from modelyard.service.dataplane import DataPlane
from modelyard.service.ensembles import loader as ensembles
from modelyard.service.generation.model import recognize_decoder
from modelyard.service.generation.plane import GenerationPlane
from modelyard.service.gpu_memory import GpuMemoryCollector
from modelyard.service.metrics import ServiceMetrics
from modelyard.service.repository.uploads import UploadSpace
from modelyard.service.repository.watcher import RepositoryWatcher
from modelyard.service.runtime.instances import Loader
from modelyard.service.runtime.manager import ModelManager
from modelyard.service.runtime.memory import usable_memory_bytes
from modelyard.service.runtime.providers import CUDA, detect_providers
from modelyard.service.runtime.reconciler import NOT_LOADED
from modelyard.service.runtime.runs import ActiveRuns, shut_down_executor
from modelyard.service.runtime.session import bound_run_memory, inline_run_limit_s, load_runner
from modelyard.service.runtime.status import ModelEvent, Watcher
from modelyard.service.scheduling.clock import Clock
from modelyard.service.settings import ENV_PREFIX, Settings
from modelyard.service.shm.files import FileRegionStore
from modelyard.service.shm.registry import RegionLimits, SharedMemoryRegistry
from modelyard.service.workers import protocol as workers
from modelyard.service.workers.member import WorkerLink, WorkerRole, fan_out, metrics_handler

log = logging.getLogger(__name__)

# How long before the grace ends the runs still going are stopped, at most.
RUNS_STOP_BEFORE_S = 0.5


@dataclass
class Service:
    """A built service. `start` serves and loads the repository; `stop` drains and exits cleanly."""

    settings: Settings
    server: grpc.aio.Server
    port: int
    manager: ModelManager
    metrics: ServiceMetrics
    health: health_names.HealthServicer
    executor: ThreadPoolExecutor
    generation: GenerationPlane | None = None
    batching: BatchingLayer | None = None
    metrics_server: MetricsServer | None = None
    watcher: RepositoryWatcher | None = None
    tls: TlsFiles | None = None  # of the gRPC and metrics listeners
    # One of several workers (service.workers): model control and health go through the
    # supervisor, and `internal` serves the supervisor on a unix socket.
    link: WorkerLink | None = None
    internal: grpc.aio.Server | None = None
    drain: Drain | None = None  # the calls in flight of both servers (modelyard.process.drain)
    _events: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        return f"{split_address(self.settings.listen)[0]}:{self.port}"

    async def start(self) -> None:
        # Serve at once (health says NOT_SERVING while loading), so orchestrators can probe.
        await self.health.set(health_names.SERVER, health_names.NOT_SERVING)
        # A worker takes its share of the port's traffic only once the supervisor admits it.
        await (self.server if self.internal is None else self.internal).start()
        if self.settings.metrics_listen:
            address = self.settings.metrics_listen
            self.metrics_server = bound(
                ENV_PREFIX,
                "metrics_listen",
                address,
                lambda: MetricsServer(self.metrics.registry, *split_address(address), tls=self.tls),
            )
        # Subscribed before loading starts, so that no model event escapes health and metrics.
        self._events = asyncio.get_running_loop().create_task(self._follow(self.manager.subscribe()))
        if self.settings.control_mode == "watch":
            self.watcher = RepositoryWatcher(
                self.settings.repository,
                self.manager.reconcile,
                self.manager.reconcile_all,
                poll=self.settings.watch_method == "poll",
                quiet_s=self.settings.watch_quiet_s,
                resync_s=self.settings.resync_s,
            )
            await self.watcher.start()  # before the first load, so that no change slips between
        if self.settings.control_mode == "explicit":
            await self.manager.load_listed(self.settings.load_model)
        else:
            if self.settings.load_model:
                log.warning("--load-model is for explicit mode; in watch mode every model loads")
            await self.manager.load_all()
        ready = [s.name for s in self.manager.statuses() if s.default_version is not None]
        failed = [
            s.name for s in self.manager.statuses() if s.default_version is None and s.reason != NOT_LOADED
        ]
        if self.link is not None:
            await self.health.set(workers.LOCAL, health_names.SERVING)
            await self.link.wait_admitted()
            await self.server.start()
            self.link.follow(self.health.set)
            log.info("worker %d took its share of the port; models ready: %s", self.link.role.index, ready)
            return
        await self.health.set(health_names.SERVER, health_names.SERVING)
        log.info(
            "serving gRPC on %s%s; models ready: %s%s",
            self.address,
            f", metrics on http://{self.metrics_address}/metrics" if self.metrics_server else "",
            ", ".join(ready) or "none",
            f"; failed: {', '.join(failed)}" if failed else "",
        )

    @property
    def metrics_address(self) -> str:
        assert self.metrics_server is not None
        return f"{split_address(self.settings.metrics_listen)[0]}:{self.metrics_server.port}"

    async def stop(self, grace_s: float | None = None) -> None:
        """New calls are refused (before health goes NOT_SERVING: who sees that is refused), running
        calls get the grace period."""
        if self.drain is not None:
            self.drain.close()
        await self.health.enter_graceful_shutdown()
        if self.watcher is not None:
            await self.watcher.stop()
        grace = self.settings.grace_s if grace_s is None else grace_s
        servers = [self.server] if self.internal is None else [self.server, self.internal]
        await stop_servers(servers, grace, self.manager.runs, self.drain, self.port)
        if self.link is not None:
            await self.link.close()
        if self._events is not None:
            self._events.cancel()
        if self.generation is not None:
            await self.generation.close()  # decode loops use the executor: stop them first
        if self.batching is not None:
            await self.batching.close_sequences()  # no step can come now: nothing to wait for
        await self.manager.close()
        await shut_down_executor(self.executor)
        shadows = self.manager.runs.capacity.close()
        if shadows is not None:
            await shut_down_executor(shadows)
        if self.metrics_server is not None:
            self.metrics_server.stop()

    async def _follow(self, watcher: Watcher) -> None:
        """Keep per-model health and model metrics in step with model state changes."""
        try:
            await self._apply_events(watcher)
        finally:
            self.manager.unsubscribe(watcher)

    async def _apply_events(self, watcher: Watcher) -> None:
        while True:
            event: ModelEvent = await watcher.get()
            served = self.manager.served(event.model)
            await self.health.set(
                health_names.model_service_name(event.model),
                health_names.SERVING if served else health_names.NOT_SERVING,
            )
            if not self.manager.knows(event.model):
                continue  # it left the repository, and its series with it
            versions = served.versions.values() if served else ()
            self.metrics.versions_ready.labels(event.model).set(len(versions))
            self.metrics.versions_degraded.labels(event.model).set(
                sum(bool(v.runner.degraded) for v in versions)
            )
            if served:
                self.metrics.known_models.add(event.model)


async def stop_servers(
    servers: list[grpc.aio.Server],
    grace: float,
    runs: ActiveRuns,
    drain: Drain | None = None,
    port: int = 0,
) -> None:
    """Stop the servers with `grace` for in-flight calls. Runs still going shortly before the
    grace ends are stopped (RunOptions.terminate), so that their calls answer UNAVAILABLE/draining
    themselves before the servers cancel them, and the executor's threads come back. With `drain`,
    the servers stop once every call ended and its answer reached its peer on `port`, or at the
    grace's end (modelyard.process.drain: gRPC's stop alone can cut a large answer short)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace

    async def drain_then_stop() -> None:
        if drain is not None:
            await drain.settle(port, deadline)
        left = max(0.0, deadline - loop.time())
        await asyncio.gather(*(server.stop(left) for server in servers))

    stopping = asyncio.ensure_future(drain_then_stop())
    done, _ = await asyncio.wait({stopping}, timeout=max(0.0, grace - min(RUNS_STOP_BEFORE_S, grace / 4)))
    if not done:
        stopped = runs.terminate_all()
        if stopped:
            log.warning(
                "stopped %d model run%s still going at the end of the grace", stopped, "s"[: stopped != 1]
            )
    await stopping
    runs.terminate_all()


def _undecodable_reporter(metrics: ServiceMetrics) -> OnUndecodable:
    throttle = LogThrottle(log)

    def report(method: str) -> None:
        metrics.observe_request(method.rsplit("/", 1)[-1], "", "", grpc.StatusCode.INVALID_ARGUMENT, 0.0)
        throttle.log(logging.WARNING, "refused an undecodable %s request", method)

    return report


def build_service(
    settings: Settings,
    *,
    loader: Loader | None = None,  # test seam: runners that count or hold their runs
    clock: Clock | None = None,  # test seam: the batching queues' clock, stepped by hand
    worker: WorkerRole | None = None,  # one of several worker processes (service.workers)
) -> Service:
    providers = detect_providers()
    log.info("execution provider: %s (%s)", providers.default, providers.summary())
    metrics = ServiceMetrics()
    if providers.default == CUDA:
        metrics.registry.register(GpuMemoryCollector())
    run_threads = settings.inference_threads or usable_cores()
    executor = ThreadPoolExecutor(max_workers=run_threads, thread_name_prefix="infer")
    # Before any session exists: sessions opt into the bounded arena as they are created. The
    # default shares half of the memory among the worker processes.
    processes = worker.count if worker is not None else 1
    bound_run_memory((settings.max_run_memory_mb << 20) or usable_memory_bytes() // (2 * processes))
    manager = ModelManager(
        settings.repository,
        providers,
        metrics=metrics,
        drain_timeout_s=settings.drain_timeout_s,
        max_run_s=settings.max_run_s,
        run_threads=run_threads,  # each version's default bound is a share of them
        # Generation recognises decoder graphs as they load; the runtime knows nothing of them.
        loader=loader
        or functools.partial(
            load_runner,
            recognizers=[recognize_decoder],
            inline_limit_s=inline_run_limit_s(worker.count if worker is not None else 1),
        ),
    )
    # The layers above the runtime attach to each version as it loads and let go as it retires.
    batching = BatchingLayer(executor, metrics, clock)
    if worker is not None:
        # A sequence lives in the worker that took its START; workers share no sequence state.
        batching.sequence_note = (
            "; with --workers, a sequence lives in the worker process that took its START: send all "
            "of its steps on one connection (one channel), or serve sequence models with one worker"
        )
    manager.on_load(batching.attach)
    dataplane = DataPlane(manager, executor, batching)
    # Ensembles' versions run their steps through the data plane (the runtime knows none).
    manager.add_platform(ensembles.PLATFORM, ensembles.EnsembleLoader(dataplane).load)
    generation = GenerationPlane(dataplane, executor, metrics)
    limits = [
        # Above the configured limit, which the handlers check so as to answer with a reason.
        ("grpc.max_receive_message_length", transport_limit(settings.max_message_bytes)),
        ("grpc.max_send_message_length", settings.max_message_bytes),
    ]
    # A taken port must fail loudly, not be shared; workers share it (the supervisor holds it).
    server = grpc.aio.server(
        interceptors=access_log.interceptors(settings.access_log, settings.log_format),
        options=[
            *limits,
            *connection_options(settings),
            ("grpc.so_reuseport", 0 if worker is None else 1),
        ],
    )
    tls, authorizer = _security(settings)
    guard_for = guards(authorizer, settings.auth_inference, metrics, settings.management_open)
    reporter = _undecodable_reporter(metrics)
    link = WorkerLink(worker) if worker is not None else None
    shm = SharedMemoryRegistry(
        FileRegionStore(worker.folder.regions) if worker is not None else None,
        limits=RegionLimits(settings.shm_max_regions, settings.shm_max_bytes),
    )
    apis = [
        service_of(
            inference_service_pb2.DESCRIPTOR.services_by_name["InferenceService"],
            InferenceServicer(dataplane, generation, metrics),
        ),
        service_of(
            model_service_pb2.DESCRIPTOR.services_by_name["ModelService"], ModelServicer(manager, metrics)
        ),
        service_of(
            grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"],
            KServeServicer(
                manager,
                dataplane,
                metrics,
                shm=shm,
                whole_service_ready=(lambda: link.service_serving) if link is not None else None,
                uploads=UploadSpace(settings.max_upload_bytes),
                identify=identities(authorizer),
                server_name=settings.server_name,
                sequences=batching.sequences,
                generation=generation,
            ),
        ),
        # The FlatBuffers method (no protobuf): its servicer gives its handler (bytes in and out).
        ServiceHandlers(flat_contract.SERVICE, FlatInferenceServicer(dataplane, metrics).handlers()),
    ]
    health_servicer = health_names.new_servicer()
    drain = Drain()
    _add_apis(server, apis, health_servicer, settings, metrics, reporter, guard_for, link, drain)
    listen = settings.listen
    if tls is None:
        port = bound(ENV_PREFIX, "listen", listen, lambda: server.add_insecure_port(listen))
    else:
        credentials = grpc_server_credentials(tls)
        port = bound(ENV_PREFIX, "listen", listen, lambda: server.add_secure_port(listen, credentials))
    internal = None
    if worker is not None:
        # The supervisor's way in, on a unix socket in its private folder (no credentials): the
        # same servicers, answering for this worker alone, and this worker's scrape.
        internal = grpc.aio.server(options=limits)
        _add_apis(internal, apis, health_servicer, settings, metrics, reporter, None, None, drain)
        internal.add_generic_rpc_handlers((metrics_handler(metrics.registry),))
        internal.add_insecure_port(worker.folder.worker(worker.index))
        set_served_by(f"worker-{worker.index}")
    return Service(
        settings,
        server,
        port,
        manager,
        metrics,
        health_servicer,
        executor,
        generation,
        batching,
        tls=tls,
        link=link,
        internal=internal,
        drain=drain,
    )


@dataclass(frozen=True)
class Pipelines:
    apis: list[Wrapper]  # the APIs' methods
    open: list[Wrapper]  # health and reflection


def request_pipelines(
    max_message_bytes: int,
    metrics: ServiceMetrics,
    reporter: OnUndecodable,
    guard_for: GuardFor | None,
    link: WorkerLink | None,
    noted: bool = False,
) -> Pipelines:
    """The request pipeline (service/api/pipeline.py) of the APIs and of health and reflection;
    `noted`: with the call context of JSON logs and the access log (access_log.interceptors)."""
    decode, access = decode_guard(reporter), authorize(guard_for)
    # The pipeline, innermost first (the last one listed is the one gRPC calls):
    # - fan_out (in a worker): model control and reads go to every worker through the supervisor.
    #   Innermost, so that those calls pass every check below like any other call.
    # - noting (modelyard.process.access): the model and version of the parsed request, for the
    #   call's log lines and access line; only where the call context is kept (no cost otherwise).
    # - decode (service/api/guards.py): the request parsed, undecodable bytes refused with
    #   INVALID_ARGUMENT (and one rate-limited log line), not UNKNOWN with a traceback per
    #   request. It hands on its handlers without a deserializer: the wrappers outside it see
    #   the message as bytes, and nothing is parsed before they pass it.
    # - size_limit (service/api/message_limits.py): the message's size checked before it is parsed.
    # - authorize (service/api/guards.py, the guards of service/api/credentials.py): outermost, so that
    #   a caller without credentials is refused before anything else; a guarded unary method is
    #   registered as request-streaming, so that its message is read only after the guard.
    apis = [
        *([fan_out(link)] if link is not None else []),
        *([access_log.noting] if noted else []),
        decode,
        size_limit(max_message_bytes, metrics),
        access,
    ]
    # Health and reflection are not size-checked (their requests are small, and a probe must not
    # be refused); they pass the rest. Health's Watch
    # writes with context.write, which the size check's stream wrapper does not take.
    return Pipelines(apis, [decode, access])


def _add_apis(
    server: grpc.aio.Server,
    apis: list[ServiceHandlers],
    health_servicer: health_names.HealthServicer,
    settings: Settings,
    metrics: ServiceMetrics,
    reporter: OnUndecodable,
    guard_for: GuardFor | None,
    link: WorkerLink | None,
    drain: Drain,
) -> None:
    """Register the APIs, health and reflection on `server` through the request pipeline (the
    APIs' calls outermost counted and, once shutting down, refused by `drain`)."""
    noted = bool(access_log.interceptors(settings.access_log, settings.log_format))
    pipelines = request_pipelines(settings.max_message_bytes, metrics, reporter, guard_for, link, noted)
    register(server, apis, [*pipelines.apis, drain.wrap])
    open_services = [
        service_of(health_pb2.DESCRIPTOR.services_by_name["Health"], health_servicer),
        # What reflection.enable_server_reflection does for an aio server, through the pipeline.
        service_of(
            reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"],
            reflection_aio.ReflectionServicer(
                [
                    inference_service_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name,
                    model_service_pb2.DESCRIPTOR.services_by_name["ModelService"].full_name,
                    grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name,
                    health.SERVICE_NAME,
                    reflection.SERVICE_NAME,
                ]
            ),
        ),
    ]
    register(server, open_services, pipelines.open)


def _security(settings: Settings) -> tuple[TlsFiles | None, Authorizer]:
    """TLS files and the authorizer from the settings; ValueError for a combination that cannot
    work (half a key pair, client identities without mTLS, auth_inference without credentials)."""
    tls = TlsFiles.from_settings(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
    tokens = Path(settings.auth_tokens_file) if settings.auth_tokens_file else None
    authorizer = Authorizer(AuthSettings(tokens, settings.auth_client_names))
    if settings.auth_client_names and (tls is None or tls.client_ca is None):
        raise ValueError("auth_client_names names mTLS client identities: it needs tls_client_ca")
    if settings.auth_inference and not authorizer.configured:
        raise ValueError("auth_inference needs auth_tokens_file or auth_client_names")
    host = split_address(settings.listen)[0]
    warn_if_plaintext(host, "the gRPC listener", tls)
    if settings.management_open:
        log.warning(
            "management is open: the gRPC listener on %s takes LoadModel/UnloadModel, repository, "
            "shared-memory, log and trace calls from any client that reaches it (docs/security.md)",
            host or "all addresses",
        )
    elif not authorizer.configured:
        log.info("management calls are off (no credential configured: auth_tokens_file, auth_client_names)")
    return tls, authorizer
