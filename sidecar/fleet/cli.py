"""`python -m modelyard.rollouts ...` (also `modelyard rollouts ...`): the fleet rollout controller.

    python -m modelyard.rollouts --listen 127.0.0.1:9105 --prometheus http://127.0.0.1:9090 \\
        --sidecar http://10.0.0.7:9101 --sidecar http://10.0.0.8:9101 \\
        --sidecar-token-file sidecar-token --tokens-file tokens --state-file rollouts.json

In Kubernetes: `--sidecars-from-dns modelyard-sidecars:9101` (a headless Service's records) or
`--sidecars-from-endpointslices SERVICE`, and `--kubernetes-state NAME` (the state in ConfigMap
NAME, the lead by Lease NAME, through the API server with the pod's service account).
docs/fleet-rollouts.md says what each does.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter

from modelyard.process.auth import Authorizer, AuthSettings
from modelyard.process.lifecycle import EXIT_USAGE, BindError, bind_reason, run_process
from modelyard.process.logs import configure as configure_logging
from modelyard.process.settings import split_address
from modelyard.process.startup import check_listeners, usage_error
from modelyard.process.tls import TlsFiles
from modelyard.sidecar.fleet import kube
from modelyard.sidecar.fleet.api import ControllerApi
from modelyard.sidecar.fleet.controller import Controller
from modelyard.sidecar.fleet.gates import Prometheus, load_queries
from modelyard.sidecar.fleet.pods import AdminClient, from_dns
from modelyard.sidecar.fleet.settings import ENV_PREFIX, Settings, parse_settings
from modelyard.sidecar.fleet.store import FileStore, MemoryStore, Store
from modelyard.sidecar.routes.state_file import StateError

PROG = "modelyard rollouts"
log = logging.getLogger(__name__)


def _first_word(path: str) -> str:
    if not path:
        return ""
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        words = line.split()
        if words and not words[0].startswith("#"):
            return words[0]
    raise ValueError(f"token file {path}: holds no token")


class RolloutsProcess:
    """What run_process drives: the API and the loop."""

    def __init__(self, args: Settings) -> None:
        self.host, self.port = split_address(args.listen)
        tls = TlsFiles.from_settings(args.tls_cert, args.tls_key)
        self.owner = "controller " + (args.advertise or f"{'https' if tls else 'http'}://{args.listen}")
        self._advertised = bool(args.advertise)
        registry = CollectorRegistry()
        store: Store
        if args.kubernetes_state:
            store = kube.KubeStore(
                kube.KubeClient.in_cluster(), args.kubernetes_state, args.identity or self.owner
            )
        elif args.state_file:
            store = FileStore(Path(args.state_file))
        else:
            log.warning("no --state-file: a restart of the controller forgets its rollouts")
            store = MemoryStore()
        discover = None
        if args.sidecars_from_dns:
            name = args.sidecars_from_dns

            async def discover() -> list[str]:
                return await asyncio.to_thread(from_dns, name)

        elif args.sidecars_from_endpointslices:
            client = kube.KubeClient.in_cluster()
            service, port = args.sidecars_from_endpointslices, args.sidecar_admin_port

            async def discover() -> list[str]:
                return await asyncio.to_thread(client.endpoint_urls, service, port)

        self.controller = Controller(
            sidecars=args.sidecar,
            discover=discover,
            prometheus=Prometheus(args.prometheus) if args.prometheus else None,
            queries=load_queries(Path(args.queries) if args.queries else None),
            store=store,
            client=AdminClient(_first_word(args.sidecar_token_file), args.sidecar_ca),
            owner=self.owner,
            registry=registry,
            tick_s=args.tick_s,
            lease_s=args.lease_s,
        )
        authorizer = Authorizer(AuthSettings(Path(args.tokens_file) if args.tokens_file else None))
        denials = Counter(
            "modelyard_rollouts_api_denials",
            "API requests refused by outcome: unauthenticated, denied, off, cross_site",
            ["outcome"],
            registry=registry,
        )
        self.api = ControllerApi(
            self.host,
            self.port,
            registry,
            self.controller,
            authorizer=authorizer,
            open_writes=args.open,
            auth_reads=args.auth_reads,
            tls=tls,
            denials=denials,
        )
        self.tls = tls
        self._loop: asyncio.Task[None] | None = None
        if args.open:
            log.warning(
                "the rollout controller's API is open (--open): anyone who reaches it may start rollouts"
            )

    async def start(self) -> None:
        try:
            await self.api.start()
        except OSError as exc:
            raise BindError(ENV_PREFIX, "listen", f"{self.host}:{self.port}", bind_reason(exc)) from exc
        if self.port == 0 and not self._advertised:  # its name says the port it got
            scheme = "https" if self.tls else "http"
            self.controller.owner = f"controller {scheme}://{self.host}:{self.api.port}"
        await self.controller.start()
        self._loop = asyncio.get_running_loop().create_task(self.controller.run())
        scheme = "https" if self.tls else "http"
        log.warning(
            "rollout controller serving on %s://%s:%d; %s; state in %s",
            scheme,
            self.host,
            self.api.port,
            "leading" if self.controller.leader else "standing by",
            self.controller.store.where,
        )

    async def stop(self) -> None:
        if self._loop is not None:
            self._loop.cancel()
            await asyncio.gather(self._loop, return_exceptions=True)
        await self.api.stop()
        await self.controller.store.resign()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_settings(sys.argv[1:] if argv is None else argv)
    if not args.sidecar and not args.sidecars_from_dns and not args.sidecars_from_endpointslices:
        message = "name the sidecars (or sidecars_from_dns, sidecars_from_endpointslices)"
        return usage_error(PROG, ENV_PREFIX, "sidecar", message)
    if args.lease_s < 3 * args.tick_s:
        message = f"{args.lease_s:g} is under 3 ticks (tick_s): the lease is renewed every third of it"
        return usage_error(PROG, ENV_PREFIX, "lease_s", message)
    if args.state_file and args.kubernetes_state:
        return usage_error(
            PROG, ENV_PREFIX, "kubernetes_state", "give state_file or kubernetes_state, not both"
        )
    failed = check_listeners(args, ("listen",), ENV_PREFIX, PROG)
    if failed is not None:
        return failed
    configure_logging(args.log_level, args.log_format, "rollouts")
    try:
        process = RolloutsProcess(args)
        if isinstance(process.controller.store, FileStore):
            process.controller.store.read()  # a file that is not the state: one line, exit 2
    except (ValueError, OSError, StateError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return asyncio.run(run_process(lambda: process, "rollouts", 1.0, PROG))
