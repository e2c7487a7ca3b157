"""The parent of `--workers N` sidecar processes. The worker supervisor (modelyard.process.supervisor)
holds the gRPC port, starts N workers, restarts one that dies and drains them all on SIGTERM; here:
a worker takes calls once the admin changes were replayed to it, and the one admin endpoint.

The admin endpoint is the supervisor's (its TLS, tokens and limits: sidecar/admin.py's server,
with its own routing). Every change (PUT /canary/..., POST /rollouts/...) is forwarded to every
worker over its private admin socket, one change at a time, and kept (the last per model) to be
replayed to a worker that restarts. Reads are answered from the workers' views: /metrics summed,
/breakers and /canary merged (sidecar/workers/merge.py), the rest from the lowest worker serving.
Each worker owns its routes, breakers and rollouts; the supervisor holds no route state."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import Metric
from prometheus_client.exposition import choose_encoder

from modelyard.common.reasons import ErrorReason
from modelyard.process.auth import Authorizer, AuthSettings
from modelyard.process.lifecycle import BindError, bind_reason
from modelyard.process.metrics_sum import parse, per_worker, sum_families
from modelyard.process.settings import split_address
from modelyard.process.supervisor import WorkerFailed, WorkerKind, Workers, WorkerSlot
from modelyard.process.tls import TlsFiles
from modelyard.sidecar import admin as admin_http
from modelyard.sidecar.routes.route_table import RouteSource
from modelyard.sidecar.settings import ENV_PREFIX, Settings
from modelyard.sidecar.workers import client, merge, role

__all__ = ["Change", "Slot", "Supervisor", "WorkerFailed"]

log = logging.getLogger(__name__)

READY_POLL_S = 0.05  # how often a starting worker's admin socket is tried
SCRAPE_TIMEOUT_S = 5.0
# How long a change the first worker cannot judge yet (503 unavailable: its upstreams have not
# reported their models) is asked again before that 503 is the answer: a worker's upstreams
# report within milliseconds of its start, or count as reported after REPORT_WAIT_S.
CHANGE_WAIT_S = 5.0
KIND = WorkerKind(
    "modelyard.sidecar",
    ENV_PREFIX,
    "sidecar worker",
    stop_margin_s=10,
    restarts=("modelyard_sidecar_worker_restarts", "Sidecar worker processes restarted after they died."),
    serving=("modelyard_sidecar_workers_serving", "Sidecar worker processes taking calls."),
)

# serving: its admin socket answers and the changes were replayed to it; last_scrape: its latest
# /metrics, folded into the totals when it dies.
Slot = WorkerSlot


@dataclass(frozen=True)
class Change:
    method: str
    path: str
    body: bytes
    headers: tuple[tuple[str, str], ...]


class Supervisor:
    def __init__(self, settings: Settings, count: int) -> None:
        self.settings = settings
        self.count = count
        self.folder = Path()
        self._admin: _Admin | None = None
        # Accepted changes replayed to a worker that joins: per model, the last PUT /canary, and
        # the rollout's start with its last control (pause/resume/abort).
        self._changes: dict[str, list[Change]] = {}
        self._control = asyncio.Lock()  # one change at a time, and none while a worker joins
        self.registry = CollectorRegistry()
        self._workers = Workers(KIND, settings, count, self.registry, Slot, self, log)
        self._slots = self._workers.slots
        self.denials = Counter(
            "modelyard_sidecar_admin_denials",
            "Admin endpoint requests refused by outcome: unauthenticated, denied (a credential "
            "without the scope), off (changes with no credential configured), cross_site",
            ["outcome"],
            registry=self.registry,
        )

    @property
    def admin_address(self) -> str:
        assert self._admin is not None
        return f"{split_address(self.settings.admin_listen)[0]}:{self._admin.port}"

    def slots(self) -> list[Slot]:
        return list(self._slots)

    async def start(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="modelyard-sidecar-workers-"))  # mode 0700
        self._workers.reserve()
        if self.settings.admin_listen:
            await self._start_admin()
        await self._workers.start()
        scheme = "https" if self.settings.tls_cert else "http"
        log.info(
            "sidecar serving gRPC on %s%s; upstreams: %s; workers: %d",
            self._workers.address,
            f", admin on {scheme}://{self.admin_address}" if self._admin else "",
            ", ".join(self.settings.upstream),
            self.count,
        )

    async def _start_admin(self) -> None:
        s = self.settings
        host, port = split_address(s.admin_listen)
        tls = TlsFiles.from_settings(s.tls_cert, s.tls_key, s.tls_client_ca)
        tokens = Path(s.admin_tokens_file) if s.admin_tokens_file else None
        if s.admin_auth_reads and tokens is None:
            raise ValueError("admin_auth_reads needs admin_tokens_file")
        authorizer = Authorizer(AuthSettings(tokens))
        admin_http.admin_warnings(host, s.admin_open, authorizer.configured)
        self._admin = _Admin(
            self,
            host,
            port,
            self.registry,
            RouteSource(None),  # unused: the workers hold the routes
            list,
            tls=tls,
            authorizer=authorizer,
            auth_reads=s.admin_auth_reads,
            open_writes=s.admin_open,
            denials=self.denials,
            limits=admin_http.AdminLimits(
                header_timeout_s=s.admin_header_timeout_s,
                body_timeout_s=s.admin_body_timeout_s,
                idle_timeout_s=s.admin_idle_timeout_s,
                max_body_bytes=s.admin_max_body_bytes,
                max_connections=s.admin_max_connections,
            ),
        )
        try:
            await self._admin.start()
        except OSError as exc:
            raise BindError(ENV_PREFIX, "admin_listen", s.admin_listen, bind_reason(exc)) from exc

    async def stop(self) -> None:
        """Every worker drains (SIGTERM: its own graceful shutdown); one that outlives the grace
        period and a margin is killed."""
        await self._workers.stop()
        if self._admin is not None:
            await self._admin.stop()
        self._workers.release()
        if self.folder != Path():
            shutil.rmtree(self.folder, ignore_errors=True)

    # -- workers ---------------------------------------------------------------------------

    def worker_environment(self, index: int) -> dict[str, str]:
        return {
            ENV_PREFIX + "ADMIN_LISTEN": "",  # a worker's admin endpoint is its unix socket
            role.ENV_CONTROL: str(self.folder),
            role.ENV_INDEX: str(index),
            role.ENV_PARENT: str(os.getpid()),
        }

    async def worker_joins(self, slot: Slot) -> None:
        """Once the worker's admin socket answers: replay the changes to it, then let it take calls
        (it starts its gRPC server then) and count it in."""
        path = role.admin_socket(self.folder, slot.index)
        while True:
            try:
                answer = await client.ask(path, "GET", "/canary", timeout_s=2.0)
                if answer.status == 200:
                    break
            except OSError:
                pass
            await asyncio.sleep(READY_POLL_S)
        async with self._control:
            for change in [c for changes in self._changes.values() for c in changes]:
                try:
                    answer = await client.ask(path, change.method, change.path, change.body, _follow(change))
                    if answer.status >= 300:
                        log.warning(
                            "worker %d: replaying %s %s: %d %s",
                            slot.index,
                            change.method,
                            change.path,
                            answer.status,
                            answer.body[:200].decode(errors="replace"),
                        )
                except OSError as exc:
                    log.warning(
                        "worker %d: replaying %s %s failed: %s", slot.index, change.method, change.path, exc
                    )
            answer = await client.ask(path, "POST", admin_http.ADMIT)  # OSError: it is going
            if answer.status != 200:
                raise RuntimeError(f"worker {slot.index} refused admission: {answer.status}")
            self._workers.serves(slot)
        log.info("worker %d serving", slot.index)
        self._workers.update()

    async def worker_left(self, slot: Slot) -> None:
        """After its process exited (its scrape is folded into the totals already)."""
        self._workers.update()

    # -- the admin endpoint's work -----------------------------------------------------------

    def _ready(self) -> list[Slot]:
        return self._workers.serving_slots()

    async def gather(
        self, method: str, path: str, timeout_s: float = client.TIMEOUT_S
    ) -> list[tuple[Slot, client.Answer]]:
        """Ask every serving worker the same read; a worker that does not answer is left out."""
        slots = self._ready()
        folder = self.folder
        results = await asyncio.gather(
            *(
                client.ask(role.admin_socket(folder, s.index), method, path, timeout_s=timeout_s)
                for s in slots
            ),
            return_exceptions=True,
        )
        answers: list[tuple[Slot, client.Answer]] = []
        for slot, result in zip(slots, results, strict=True):
            if isinstance(result, client.Answer):
                answers.append((slot, result))
            else:
                log.warning("worker %d did not answer %s %s: %r", slot.index, method, path, result)
        return answers

    async def change(self, request: admin_http.Request) -> admin_http.Response:
        """A change to every worker, in turn; the answer is theirs when they agree."""
        headers = tuple(
            (name, request.headers[name])
            for name in ("authorization", "content-type")
            if name in request.headers
        )
        change = Change(request.method, request.path, request.body, headers)
        async with self._control:
            slots = self._ready()
            if not slots:
                raise admin_http.HttpError(503, ErrorReason.UNAVAILABLE, "no sidecar worker is serving")
            first, *others = slots
            answer = await self._judged(first, change)
            if answer.status >= 300:  # the first worker judges the change: refused, for all
                retry = [("Retry-After", "1")] if _not_yet(answer) else []
                return admin_http.Response(
                    answer.status, answer.body, answer.content_type or "application/json", retry
                )
            self._keep(change)  # replayed to any worker that did not take it, when it restarts
            # The others follow it (one that has not heard of the model from its upstreams yet
            # must not refuse it).
            differing = []
            for slot in others:
                other = await self._ask_change(slot, change, _follow(change))
                if other.status != answer.status:
                    differing.append(
                        f"worker {slot.index}: {other.status} {other.body[:200].decode(errors='replace')}"
                    )
            if differing:
                message = f"worker {first.index} took the change, but " + "; ".join(differing)
                raise admin_http.HttpError(500, ErrorReason.INTERNAL, message)
            return admin_http.Response(answer.status, answer.body, answer.content_type or "application/json")

    async def _judged(self, slot: Slot, change: Change) -> client.Answer:
        """The first worker's answer to a change, asked again (bounded) while it cannot judge it yet:
        an admin change right after start is taken, or one clear retryable 503."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CHANGE_WAIT_S
        while True:
            answer = await self._ask_change(slot, change, change.headers)
            if not _not_yet(answer) or loop.time() >= deadline:
                return answer
            await asyncio.sleep(READY_POLL_S)

    async def _ask_change(
        self, slot: Slot, change: Change, headers: tuple[tuple[str, str], ...]
    ) -> client.Answer:
        try:
            path = role.admin_socket(self.folder, slot.index)
            return await client.ask(path, change.method, change.path, change.body, headers)
        except OSError as exc:
            message = f"worker {slot.index} did not answer: {exc!r}"
            raise admin_http.HttpError(503, ErrorReason.UNAVAILABLE, message) from exc

    def _keep(self, change: Change) -> None:
        parts = change.path.split("/")  # "", "canary"|"rollouts", model[, action]
        if len(parts) < 3:
            return
        key = f"{parts[1]}/{parts[2]}"
        if parts[1] == "rollouts" and len(parts) == 4:  # a control: after the rollout's start
            self._changes[key] = [*self._changes.get(key, [])[:1], change]
        else:
            self._changes[key] = [change]

    async def metrics(self) -> list[Metric]:
        answers = await self.gather("GET", "/metrics", SCRAPE_TIMEOUT_S)
        for slot, answer in answers:
            if answer.status == 200:
                slot.last_scrape = answer.body.decode()
        texts = [(s.index, s.last_scrape) for s in self._slots if s.last_scrape is not None]
        scrapes: list[list[Metric]] = [list(self.registry.collect()), self._workers.carried]
        scrapes += [parse(text) for _, text in texts]
        families = list(sum_families(scrapes, merge.LOWEST, merge.HIGHEST))
        calls = per_worker(
            "modelyard_sidecar_worker_requests",
            "Calls answered by each sidecar worker process since it started.",
            texts,
            "modelyard_sidecar_requests",
        )
        return [*families, calls]


def _not_yet(answer: client.Answer) -> bool:
    """A worker's 503 `unavailable`: its upstreams have not reported their models yet."""
    if answer.status != 503:
        return False
    try:
        return bool(json.loads(answer.body).get("reason") == ErrorReason.UNAVAILABLE.value)
    except (ValueError, AttributeError):
        return False


def _follow(change: Change) -> tuple[tuple[str, str], ...]:
    return (*change.headers, (admin_http.FOLLOW, "1"))


class _Families:
    """A fixed set of families, for prometheus_client's encoders (which want a registry)."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


class _Admin(admin_http.AdminServer):
    """The supervisor's admin endpoint: the same server (TLS, tokens, limits), other answers."""

    def __init__(self, supervisor: Supervisor, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._supervisor = supervisor

    async def _route(self, request: admin_http.Request) -> admin_http.Response:
        supervisor = self._supervisor
        path, method = request.path, request.method
        if method not in admin_http.READS:
            return await supervisor.change(request)
        if path == "/metrics":
            families = _Families(await supervisor.metrics())
            encoder, content_type = choose_encoder(request.headers.get("accept", ""))
            body = await asyncio.to_thread(encoder, families)
            return admin_http.Response(200, body, content_type)
        answers = await supervisor.gather("GET", path)
        if not answers:
            raise admin_http.HttpError(503, ErrorReason.UNAVAILABLE, "no sidecar worker is serving")
        if path == "/breakers" and all(a.status == 200 for _, a in answers):
            views = [(slot.index, json.loads(a.body)) for slot, a in answers]
            return _json(merge.breakers(views))
        if path == "/canary" and all(a.status == 200 for _, a in answers):
            return _json(merge.canary([json.loads(a.body) for _, a in answers]))
        first = answers[0][1]  # /rollouts, and every error: the lowest serving worker's answer
        return admin_http.Response(first.status, first.body, first.content_type or "application/json")


def _json(doc: object) -> admin_http.Response:
    return admin_http.Response(200, json.dumps(doc, allow_nan=False).encode())
