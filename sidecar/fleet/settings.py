"""Settings of the fleet rollout controller. Every value has a flag and a MODELYARD_ROLLOUTS_*
variable, declared once below (see modelyard.process.settings); docs/operations.md's table is
generated from them (docs/reference.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated

from msgspec import Meta

from modelyard.process import logs
from modelyard.process.settings import LISTEN
from modelyard.process.settings import parse_settings as parse

ENV_PREFIX = "MODELYARD_ROLLOUTS_"


@dataclass(frozen=True)
class Settings:
    listen: Annotated[
        str, LISTEN, Meta(description="the API's HTTP address HOST:PORT (port 0 picks a free port)")
    ] = "127.0.0.1:9105"
    sidecar: Annotated[
        tuple[str, ...], Meta(description="a sidecar's admin URL (http[s]://HOST:PORT); repeat for several")
    ] = ()
    sidecars_from_dns: Annotated[
        str,
        Meta(description="HOST[:PORT] whose addresses are the sidecars (a headless Service; port 9101)"),
    ] = ""
    sidecars_from_endpointslices: Annotated[
        str, Meta(description="the Kubernetes Service whose ready endpoints are the sidecars")
    ] = ""
    sidecar_admin_port: Annotated[
        int, Meta(ge=1, le=65535, description="the sidecars' admin port, with sidecars_from_endpointslices")
    ] = 9101
    sidecar_token_file: Annotated[
        str, Meta(description="a file whose first word is the token the sidecars' admin endpoints take")
    ] = ""
    sidecar_ca: Annotated[str, Meta(description="PEM CA bundle verifying HTTPS sidecar admin endpoints")] = ""
    prometheus: Annotated[
        str, Meta(description="Prometheus' URL: its query API judges the gates; empty: every step holds")
    ] = ""
    queries: Annotated[
        str, Meta(description="YAML file overriding the gate queries (docs/fleet-rollouts.md)")
    ] = ""
    state_file: Annotated[
        str,
        Meta(
            description="JSON file keeping the rollouts across restarts; its lock elects one leader "
            "per file; empty: memory only"
        ),
    ] = ""
    kubernetes_state: Annotated[
        str,
        Meta(description="ConfigMap and Lease NAME in the pod's namespace: the state and the lead"),
    ] = ""
    identity: Annotated[str, Meta(description="this replica's name in the Lease; empty: its owner name")] = ""
    tick_s: Annotated[float, Meta(gt=0, description="seconds between the reconcile-and-judge ticks")] = 1.0
    lease_s: Annotated[
        float, Meta(gt=0, le=600, description="seconds a pushed weight stays the controller's unrenewed")
    ] = 30.0
    advertise: Annotated[
        str, Meta(description="this controller's URL, its name as the weights' owner; empty: from listen")
    ] = ""
    tokens_file: Annotated[
        str,
        Meta(
            description="bearer tokens, a line each (the service's format); changes need the management scope"
        ),
    ] = ""
    auth_reads: Annotated[bool, Meta(description="require a token for reads too")] = False
    open: Annotated[
        bool, Meta(description="let every client that reaches the API change rollouts without a credential")
    ] = False
    tls_cert: Annotated[str, Meta(description="PEM certificate chain of the API; empty: no TLS")] = ""
    tls_key: Annotated[str, Meta(description="PEM private key for tls_cert")] = ""
    log_level: logs.Level = "INFO"
    log_format: logs.Format = "text"


def parse_settings(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    return parse(
        Settings,
        ENV_PREFIX,
        argv,
        environ,
        prog="modelyard rollouts",
        description="One progressive canary across every sidecar of a fleet, judged through Prometheus "
        "(docs/fleet-rollouts.md).",
    )
