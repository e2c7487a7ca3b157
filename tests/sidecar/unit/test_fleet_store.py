"""Where the fleet controller keeps its state and how replicas elect one leader (sidecar/fleet/
store.py, kube.py). The state file: atomic, checked whole, one leader per file by its lock. The
Kubernetes paths run against an API server stand-in (below): it keeps Leases, ConfigMaps and
EndpointSlices in memory with resourceVersion checks as the API server does (409 for a stale
write, 404, create by POST). So this covers our requests, their conflict handling and the lead's
timing rules; not the real API server's authentication, RBAC or TLS (the manifests' Role is
checked by tests/deploy/unit/test_kubernetes_manifests.py)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from modelyard.sidecar.fleet.kube import KEY, KubeClient, KubeStore
from modelyard.sidecar.fleet.store import FileStore
from modelyard.sidecar.rollout.policy import Rollout, RolloutSpec
from modelyard.sidecar.routes.state_file import StateError


def saved(step: int = 1) -> dict[str, Any]:
    rollout = Rollout.begin("scaler", RolloutSpec(steps=(10, 50, 100)), 1000.0, "2", by="t", origin="admin")
    rollout.step = step
    return {"scaler": {**rollout.doc(), "released": False}}


async def test_the_state_file_survives_and_one_replica_leads(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.json"
    first, second = FileStore(path), FileStore(path)
    assert await first.lead() and not await second.lead()
    assert await first.load() == {}
    await first.save(saved(step=2))
    assert json.loads(path.read_text())["rollouts"]["scaler"]["step"] == 2
    assert (await second.load())["scaler"]["step"] == 2  # a standby reads what the leader wrote
    await first.resign()
    assert await second.lead()
    assert (await second.load())["scaler"]["step"] == 2
    await second.resign()


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("", "empty"),
        ("{", "not JSON"),
        ('{"format": 1, "rollouts": []}', "no rollouts mapping"),
        ('{"format": 1, "rollouts": {"scaler": {"state": "running"}}}', "rollout 'scaler'"),
        ('{"format": 1, "rollouts": {"../x": {}}}', "rollout '../x'"),
    ],
)
def test_a_file_that_is_not_the_state_is_refused(tmp_path: Path, content: str, words: str) -> None:
    path = tmp_path / "rollouts.json"
    path.write_text(content)
    with pytest.raises(StateError, match=words):
        FileStore(path).read()


class ApiServer:
    """The API server stand-in: objects by path, each with a resourceVersion."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.version = 0
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str, str]] = []

    def handle(self, method: str, path: str, body: dict[str, Any] | None, auth: str) -> tuple[int, Any]:
        self.requests.append((method, path, auth))
        base = path.partition("?")[0]
        with self.lock:
            if method == "GET" and base.endswith("/endpointslices"):
                return 200, self.objects.get(base, {"items": []})
            if method == "GET":
                found = self.objects.get(base)
                return (200, found) if found else (404, {"reason": "NotFound"})
            assert body is not None
            if method == "POST":
                where = f"{base}/{body['metadata']['name']}"
                if where in self.objects:
                    return 409, {"reason": "AlreadyExists"}
            else:
                where = base
                current = self.objects.get(where)
                if current is None:
                    return 404, {"reason": "NotFound"}
                if body["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
                    return 409, {"reason": "Conflict"}
            self.version += 1
            body["metadata"]["resourceVersion"] = str(self.version)
            self.objects[where] = json.loads(json.dumps(body))
            return 200, body


@pytest.fixture
def api() -> Iterator[tuple[ApiServer, str]]:
    state = ApiServer()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            size = int(self.headers.get("content-length") or 0)
            body = json.loads(self.rfile.read(size)) if size else None
            status, doc = state.handle(self.command, self.path, body, self.headers.get("authorization", ""))
            raw = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        do_GET = do_POST = do_PUT = _answer

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def client(url: str) -> KubeClient:
    return KubeClient(url, "sa-token", "ml", None)


async def test_one_replica_takes_the_lease_and_the_other_takes_over_when_it_lapses(
    api: tuple[ApiServer, str],
) -> None:
    state, url = api
    a = KubeStore(client(url), "modelyard-rollouts", "replica-a", duration_s=1)
    b = KubeStore(client(url), "modelyard-rollouts", "replica-b", duration_s=1)
    assert await a.lead()  # created
    assert not await b.lead()  # held and fresh
    assert await a.lead()  # renewed
    lease = state.objects["/apis/coordination.k8s.io/v1/namespaces/ml/leases/modelyard-rollouts"]
    assert lease["spec"]["holderIdentity"] == "replica-a" and lease["spec"]["leaseDurationSeconds"] == 1
    assert all(auth == "Bearer sa-token" for _, _, auth in state.requests)

    # a stops renewing (killed): after the lease's duration b takes it, a transition counted.
    lease["spec"]["renewTime"] = "2020-01-01T00:00:00.000000Z"
    assert await b.lead()
    assert lease_of(state)["spec"]["holderIdentity"] == "replica-b"
    assert lease_of(state)["spec"]["leaseTransitions"] == 1
    assert not await a.lead()  # a, back, finds it held


def lease_of(state: ApiServer) -> dict[str, Any]:
    return state.objects["/apis/coordination.k8s.io/v1/namespaces/ml/leases/modelyard-rollouts"]


async def test_a_stale_write_loses_the_race(api: tuple[ApiServer, str]) -> None:
    state, url = api
    a = KubeStore(client(url), "r", "replica-a", duration_s=1)
    assert await a.lead()
    original = state.handle

    def racing(method: str, path: str, body: Any, auth: str) -> tuple[int, Any]:
        if method == "PUT":  # someone wrote between our GET and our PUT
            state.version += 1
            lease_path = "/apis/coordination.k8s.io/v1/namespaces/ml/leases/r"
            state.objects[lease_path]["metadata"]["resourceVersion"] = str(state.version)
        return original(method, path, body, auth)

    state.handle = racing  # type: ignore[method-assign]
    assert not await a.lead()


async def test_the_state_lives_in_a_configmap(api: tuple[ApiServer, str]) -> None:
    state, url = api
    store = KubeStore(client(url), "modelyard-rollouts", "replica-a")
    assert await store.load() == {}
    await store.save(saved(step=1))  # created
    await store.save(saved(step=2))  # replaced, with the resourceVersion it read
    configmap = state.objects["/api/v1/namespaces/ml/configmaps/modelyard-rollouts"]
    assert json.loads(configmap["data"][KEY])["rollouts"]["scaler"]["step"] == 2
    assert (await KubeStore(client(url), "modelyard-rollouts", "replica-b").load())["scaler"]["step"] == 2
    configmap["data"][KEY] = '{"format": 1, "rollouts": {"scaler": {"step": 9}}}'
    with pytest.raises(StateError, match="rollout 'scaler'"):
        await store.load()


def test_the_sidecars_are_the_services_ready_endpoints(api: tuple[ApiServer, str]) -> None:
    state, url = api
    state.objects["/apis/discovery.k8s.io/v1/namespaces/ml/endpointslices"] = {
        "items": [
            {
                "endpoints": [
                    {"addresses": ["10.0.0.7"], "conditions": {"ready": True}},
                    {"addresses": ["10.0.0.8"], "conditions": {"ready": False}},
                    {"addresses": ["fd00::9"]},
                ]
            }
        ]
    }
    assert client(url).endpoint_urls("modelyard", 9101) == ["http://10.0.0.7:9101", "http://[fd00::9]:9101"]
    method, path, _ = state.requests[-1]
    assert method == "GET" and "labelSelector=kubernetes.io/service-name%3Dmodelyard" in path
