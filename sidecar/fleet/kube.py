"""The controller in Kubernetes, through the API server with the pod's service account (the
standard library's HTTPS client; no Kubernetes library): the lead is a coordination.k8s.io Lease,
the state a ConfigMap, the sidecars the inference Service's EndpointSlices.

KubeStore.lead(): a replica takes the Lease when it has no holder or its holder has not renewed it
for `leaseDurationSeconds`, and renews it each tick while it leads; every write carries the
resourceVersion it read, so of two replicas racing only one succeeds (409 for the other). The
state is the ConfigMap's `rollouts.json` key, written the same way (a leader that lost a race
writes nothing). The RBAC it needs is deploy/kubernetes/rollouts.yaml's Role.
"""

from __future__ import annotations

import asyncio
import datetime
import http.client
import json
import ssl
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import quote

from modelyard.sidecar.fleet.store import check_saved
from modelyard.sidecar.routes.state_file import StateError, parse_json

ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
KEY = "rollouts.json"


class KubeError(OSError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class KubeClient:
    def __init__(self, base: str, token: str, namespace: str, context: ssl.SSLContext | None) -> None:
        self.base, self.token, self.namespace, self._context = base.rstrip("/"), token, namespace, context

    @staticmethod
    def in_cluster(account: Path = ACCOUNT, base: str = "https://kubernetes.default.svc") -> KubeClient:
        """The pod's service account (OSError when there is none)."""
        token = (account / "token").read_text().strip()
        namespace = (account / "namespace").read_text().strip()
        return KubeClient(base, token, namespace, ssl.create_default_context(cafile=str(account / "ca.crt")))

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """Blocking; KubeError with the status (404, 409, ...), OSError when unreachable."""
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.base + path, data=data, method=method)
        request.add_header("Authorization", f"Bearer {self.token}")
        request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=5, context=self._context) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            raise KubeError(exc.code, f"{method} {path}: {exc.code} {exc.reason}") from None
        except (http.client.HTTPException, ValueError) as exc:
            raise OSError(f"{method} {path}: not the API server's answer ({exc!r})") from None

    def endpoint_urls(self, service: str, port: int, scheme: str = "http") -> list[str]:
        """The ready addresses of a Service's EndpointSlices, as sidecar admin URLs."""
        selector = quote(f"kubernetes.io/service-name={service}")
        doc = self.call(
            "GET",
            f"/apis/discovery.k8s.io/v1/namespaces/{self.namespace}/endpointslices?labelSelector={selector}",
        )
        urls = set()
        for item in doc.get("items", []):
            for endpoint in item.get("endpoints") or []:
                if (endpoint.get("conditions") or {}).get("ready") is False:
                    continue
                for address in endpoint.get("addresses") or []:
                    urls.add(f"{scheme}://{f'[{address}]' if ':' in address else address}:{port}")
        return sorted(urls)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _micro(at: datetime.datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class KubeStore:
    def __init__(self, client: KubeClient, name: str, identity: str, duration_s: int = 15) -> None:
        self.client, self.name, self.identity, self.duration_s = client, name, identity, duration_s
        self.where = f"ConfigMap {client.namespace}/{name} (Lease {name})"
        ns = client.namespace
        self._lease = f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/{name}"
        self._leases = f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"
        self._map = f"/api/v1/namespaces/{ns}/configmaps/{name}"
        self._maps = f"/api/v1/namespaces/{ns}/configmaps"

    def _lead(self) -> bool:
        now = _now()
        spec = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": self.duration_s,
            "renewTime": _micro(now),
        }
        try:
            lease = self.client.call("GET", self._lease)
        except KubeError as exc:
            if exc.status != 404:
                raise
            body = {
                "metadata": {"name": self.name},
                "spec": {**spec, "acquireTime": _micro(now), "leaseTransitions": 0},
            }
            try:
                self.client.call("POST", self._leases, body)
            except KubeError as race:
                if race.status == 409:
                    return False
                raise
            return True
        held = lease.get("spec") or {}
        holder = held.get("holderIdentity") or ""
        if holder and holder != self.identity:
            renewed = held.get("renewTime") or held.get("acquireTime")
            try:
                at = datetime.datetime.strptime(str(renewed), "%Y-%m-%dT%H:%M:%S.%fZ").replace(
                    tzinfo=datetime.UTC
                )
            except ValueError:
                at = now  # unreadable: assume it is fresh (never take a lease that may be held)
            if now - at < datetime.timedelta(
                seconds=int(held.get("leaseDurationSeconds") or self.duration_s)
            ):
                return False
            spec["acquireTime"] = _micro(now)
            spec["leaseTransitions"] = int(held.get("leaseTransitions") or 0) + 1
        lease["spec"] = {**held, **spec}
        try:
            self.client.call("PUT", self._lease, lease)  # carries the resourceVersion it read
        except KubeError as exc:
            if exc.status == 409:
                return False
            raise
        return True

    async def lead(self) -> bool:
        try:
            return await asyncio.to_thread(self._lead)
        except OSError:
            return False  # the API server unreachable: stop acting (a leader may not know it leads)

    def _read(self) -> tuple[dict[str, Any], dict[str, Any] | None]:
        try:
            found = self.client.call("GET", self._map)
        except KubeError as exc:
            if exc.status == 404:
                return {}, None
            raise
        raw = (found.get("data") or {}).get(KEY)
        if raw is None:
            return {}, found
        where = f"ConfigMap {self.client.namespace}/{self.name} key {KEY}"
        try:
            doc = parse_json(str(raw).encode(), where)
        except ValueError as exc:
            raise StateError(str(exc)) from None
        return check_saved(doc, where), found

    async def load(self) -> dict[str, Any]:
        return (await asyncio.to_thread(self._read))[0]

    def _save(self, rollouts: dict[str, Any]) -> None:
        data = {KEY: json.dumps({"format": 1, "rollouts": rollouts}, sort_keys=True, allow_nan=False)}
        _, found = self._read()
        if found is None:
            self.client.call("POST", self._maps, {"metadata": {"name": self.name}, "data": data})
        else:
            found["data"] = {**(found.get("data") or {}), **data}
            self.client.call("PUT", self._map, found)

    async def save(self, rollouts: dict[str, Any]) -> None:
        await asyncio.to_thread(self._save, rollouts)

    async def resign(self) -> None:
        pass  # the Lease lapses by itself; a successor waits at most its duration
