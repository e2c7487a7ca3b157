"""The fleet's sidecars, as the controller sees them: found (a list, a headless Service's DNS
records, or the inference Service's EndpointSlices through kube.py), read (GET /canary: each
model's weight, its owner, the canary's version) and told (PUT /canary/<model> with the
controller's name and a lease, sidecar/fleet/ownership.py) through their admin endpoints, with a
token. Standard library HTTP in threads: the controller needs no web client.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote


@dataclass
class Pod:
    """One sidecar: what its last GET /canary said, and whether it answered."""

    url: str
    reachable: bool = False
    last_seen: float | None = None  # wall seconds of its last answer
    error: str = ""
    models: dict[str, dict[str, Any]] = field(default_factory=dict)  # GET /canary's "models"
    renewed: dict[str, float] = field(default_factory=dict)  # model -> when we last PUT it (monotonic)
    refused: dict[str, str] = field(default_factory=dict)  # model -> why its PUT was refused

    def applied(self, model: str) -> float | None:
        found = self.models.get(model)
        weight = found.get("canary_weight") if found else None
        return float(weight) if isinstance(weight, int | float) else None

    def owner(self, model: str) -> str:
        found = self.models.get(model) or {}
        return str(found.get("owner") or "")

    def view(self, model: str) -> dict[str, Any]:
        return {
            "url": self.url,
            "reachable": self.reachable,
            "applied_weight": self.applied(model),
            "owner": self.owner(model) or None,
            "last_seen": self.last_seen,
            "error": self.refused.get(model) or self.error or None,
        }


class AdminRefused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class AdminClient:
    """Requests to sidecars' admin endpoints (each in a thread, with a timeout)."""

    def __init__(self, token: str = "", ca_file: str = "", timeout_s: float = 2.0) -> None:
        self._token = token
        self._context = ssl.create_default_context(cafile=ca_file) if ca_file else None
        self.timeout_s = timeout_s

    def _call(self, url: str, method: str, body: dict[str, Any] | None) -> Any:
        data = json.dumps(body, allow_nan=False).encode() if body is not None else None
        request = urllib.request.Request(
            url, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        if self._token:
            request.add_header("Authorization", f"Bearer {self._token}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s, context=self._context) as answer:
                return json.loads(answer.read() or b"null")
        except urllib.error.HTTPError as exc:
            try:
                message = str(json.loads(exc.read())["error"])
            except (ValueError, KeyError, TypeError, OSError):
                message = str(exc.reason)
            raise AdminRefused(exc.code, f"{exc.code} {message}") from None
        except http.client.HTTPException as exc:  # not HTTP at all: as good as unreachable
            raise OSError(f"{method} {url}: not an HTTP answer ({exc!r})") from None

    async def canary(self, pod: str) -> dict[str, Any]:
        """GET /canary; OSError (unreachable), AdminRefused."""
        doc = await asyncio.to_thread(self._call, pod.rstrip("/") + "/canary", "GET", None)
        if not isinstance(doc, dict) or not isinstance(doc.get("models"), dict):
            raise ValueError("GET /canary did not answer its models")
        return doc

    async def set_weight(self, pod: str, model: str, weight: float, owner: str, lease_s: float) -> None:
        body = {"canary_weight": weight, "owner": owner, "lease_s": lease_s}
        url = f"{pod.rstrip('/')}/canary/{quote(model, safe='')}"
        await asyncio.to_thread(self._call, url, "PUT", body)


def from_dns(name: str, scheme: str = "http") -> list[str]:
    """A headless Service's records: `name` is host[:port] (port 9101, the sidecar admin's, when
    not given); one admin URL per address. Blocking: run it in a thread. OSError when it fails."""
    host, _, port = name.rpartition(":") if name.count(":") == 1 else (name, "", "")
    port = port or "9101"
    infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    addresses = sorted({str(info[4][0]) for info in infos})
    return [f"{scheme}://{f'[{a}]' if ':' in a else a}:{port}" for a in addresses]
