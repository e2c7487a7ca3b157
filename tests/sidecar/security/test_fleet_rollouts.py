"""Who may change a fleet rollout, and who owns a weight (issue 36): the controller's API takes the
sidecar admin's credential rules (a management token for every change, none asked only when opened
explicitly, no cross-site change, bad input a 4xx that changes nothing, a standby replica refusing
changes); a weight a controller pushed is its own while its lease runs: a hand-made PUT or a local
rollout on that sidecar is refused 409 and changes nothing, and a lease released or lapsed gives it
back."""

from __future__ import annotations

import asyncio
import json
import ssl
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from models import demo_models
from modelyard.process.auth import Authorizer, AuthSettings
from modelyard.process.tls import TlsFiles
from modelyard.sidecar.fleet.api import ControllerApi
from modelyard.sidecar.fleet.controller import Controller
from modelyard.sidecar.fleet.gates import QUERIES
from modelyard.sidecar.fleet.pods import AdminClient
from modelyard.sidecar.fleet.store import FileStore, MemoryStore, Store
from modelyard.sidecar.server import Sidecar
from tests.certs import make_pki
from tests.sidecar_support import known_versions, running_sidecar
from tests.support import eventually, serving

TOKEN = "fleet-security-token"
SPEC = {"steps": [10, 50, 100], "dwell_s": 5, "min_calls": 10}
CONFIG = {"max_batch_size": 8, "version_policy": {"latest": 2}}


def _request(
    url: str,
    method: str = "GET",
    body: Any = None,
    token: str | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any, dict[str, str]]:
    data = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(
        url, data=data, method=method, headers=headers or {"Content-Type": "application/json"}
    )
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as answer:
            return answer.status, json.loads(answer.read()), dict(answer.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), dict(exc.headers)


async def call(*args: Any, **kw: Any) -> tuple[int, Any, dict[str, str]]:
    return await asyncio.to_thread(_request, *args, **kw)


@asynccontextmanager
async def controller_api(
    tmp_path: Path, *, tokens: bool = True, open_writes: bool = False, store: Store | None = None
) -> AsyncIterator[str]:
    registry = CollectorRegistry()
    path = tmp_path / "tokens"
    path.write_text(TOKEN + "\n")
    controller = Controller(
        sidecars=[],
        prometheus=None,
        queries=QUERIES,
        store=store or MemoryStore(),
        client=AdminClient(),
        owner="controller http://test",
        registry=registry,
    )
    api = ControllerApi(
        "127.0.0.1",
        0,
        registry,
        controller,
        authorizer=Authorizer(AuthSettings(path if tokens else None)),
        open_writes=open_writes,
    )
    await api.start()
    await controller.start()
    try:
        yield f"http://127.0.0.1:{api.port}"
    finally:
        await api.stop()
        await controller.store.resign()


async def test_changes_need_a_management_token(tmp_path: Path) -> None:
    async with controller_api(tmp_path) as url:
        for token in (None, "wrong"):
            status, body, headers = await call(f"{url}/rollouts/scaler", "POST", SPEC, token=token)
            assert (status, body["reason"], headers.get("WWW-Authenticate")) == (
                401,
                "unauthenticated",
                "Bearer",
            )
        assert (await call(f"{url}/rollouts/scaler"))[0] == 404  # nothing was started
        status, view, _ = await call(f"{url}/rollouts/scaler", "POST", SPEC, token=TOKEN)
        assert status == 201 and view["state"] == "running" and view["weight"] == 10, view
        assert (await call(f"{url}/rollouts/scaler/abort", "POST", token=None))[0] == 401
        assert (await call(f"{url}/rollouts/scaler"))[1]["state"] == "running"  # reads are open
        assert (await call(f"{url}/healthz"))[1] == {"status": "ok", "leader": True}


async def test_without_a_tokens_file_changes_are_off_unless_opened(tmp_path: Path) -> None:
    async with controller_api(tmp_path, tokens=False) as url:
        status, body, _ = await call(f"{url}/rollouts/scaler", "POST", SPEC)
        assert status == 403 and body["reason"] == "permission_denied", body
        assert "--tokens-file" in body["error"] and "--open" in body["error"]
        assert (await call(f"{url}/rollouts/scaler"))[0] == 404
    async with controller_api(tmp_path, tokens=False, open_writes=True) as url:
        assert (await call(f"{url}/rollouts/scaler", "POST", SPEC))[0] == 201
        # A web page's simple cross-site POST is refused even when open.
        page = {"Content-Type": "text/plain", "Origin": "http://evil.example"}
        status, body, _ = await call(f"{url}/rollouts/scaler/abort", "POST", b"{}", headers=page)
        assert status == 403 and body["reason"] == "permission_denied"
        assert (await call(f"{url}/rollouts/scaler"))[1]["state"] == "running"


async def test_bad_input_is_a_4xx_that_changes_nothing(tmp_path: Path) -> None:
    async with controller_api(tmp_path) as url:
        bad = [
            ("/rollouts/..", SPEC, 400),
            ("/rollouts/scaler", {"steps": [50, 10, 100]}, 400),
            ("/rollouts/scaler", {"steps": [10, 100], "dwell_s": float("nan")}, 400),
            ("/rollouts/scaler", {"steps": [10, 100], "surprise": 1}, 400),
            ("/rollouts/scaler", b"[1, 2]", 400),
            ("/rollouts/scaler/promote", None, 404),
            ("/rollouts/scaler/abort", None, 404),  # no rollout to abort
        ]
        for path, body, expected in bad:
            raw = json.dumps(body).encode() if isinstance(body, dict) else body
            status, answer, _ = await call(url + path, "POST", raw, token=TOKEN)
            assert status == expected, (path, body, answer)
            assert set(answer) == {"error", "reason"}
        assert (await call(f"{url}/rollouts", token=TOKEN))[1] == {}


async def test_a_standby_replica_refuses_changes_and_shows_the_leaders_state(tmp_path: Path) -> None:
    state = tmp_path / "rollouts.json"
    async with (
        controller_api(tmp_path, store=FileStore(state)) as leader,
        controller_api(tmp_path, store=FileStore(state)) as standby,
    ):
        assert (await call(f"{leader}/healthz"))[1]["leader"] is True
        assert (await call(f"{standby}/healthz"))[1]["leader"] is False
        assert (await call(f"{leader}/rollouts/scaler", "POST", SPEC, token=TOKEN))[0] == 201
        status, body, headers = await call(f"{standby}/rollouts/other", "POST", SPEC, token=TOKEN)
        assert (status, body["reason"], headers.get("Retry-After")) == (503, "unavailable", "1")
        status, view, _ = await call(f"{standby}/rollouts/scaler")
        assert status == 200 and view["state"] == "running" and view["leader"] is False


@asynccontextmanager
async def a_sidecar(tmp_path: Path) -> AsyncIterator[Sidecar]:
    root = tmp_path / "models"
    demo_models.write_model(root, "scaler", 1, demo_models.scaled_identity(16, 2.0), CONFIG)
    demo_models.write_model(root, "scaler", 2, demo_models.scaled_identity(16, 3.0), CONFIG)
    tokens = tmp_path / "sidecar-tokens"
    tokens.write_text(TOKEN + "\n")
    async with (
        serving(root) as service,
        running_sidecar([service.address], admin_tokens_file=str(tokens)) as sidecar,
    ):
        await known_versions(sidecar, "scaler", {"1", "2"})
        yield sidecar


async def test_a_weight_a_controller_owns_is_not_changed_by_hand(tmp_path: Path) -> None:
    async with a_sidecar(tmp_path) as sidecar:
        put = f"http://{sidecar.admin_address}/canary/scaler"
        owner = "controller http://10.0.0.9:9105"
        status, body, _ = await call(
            put, "PUT", {"canary_weight": 10, "owner": owner, "lease_s": 30}, token=TOKEN
        )
        assert status == 200 and body["owner"] == owner, body
        _, view, _ = await call(f"http://{sidecar.admin_address}/canary")
        assert view["models"]["scaler"]["owner"] == owner
        assert 0 < view["models"]["scaler"]["owner_lease_s"] <= 30

        refused = [
            {"canary_weight": 50},  # by hand
            {"canary_weight": 50, "owner": "controller http://elsewhere", "lease_s": 30},  # another one
        ]
        for body in refused:
            status, answer, _ = await call(put, "PUT", body, token=TOKEN)
            assert (status, answer["reason"]) == (409, "failed_precondition"), answer
            assert owner in answer["error"]
        status, answer, _ = await call(
            f"http://{sidecar.admin_address}/rollouts/scaler", "POST", SPEC, token=TOKEN
        )
        assert status == 409 and owner in answer["error"], answer
        assert (await call(f"http://{sidecar.admin_address}/rollouts/scaler"))[0] == 404
        for bad in (
            {"canary_weight": 50, "owner": "x" * 300, "lease_s": 30},
            {"canary_weight": 50, "owner": "tab\there", "lease_s": 30},
            {"canary_weight": 50, "owner": owner, "lease_s": 601},
            {"canary_weight": 50, "owner": owner, "lease_s": "30"},
            {"canary_weight": 50, "owner": owner},
        ):
            status, answer, _ = await call(put, "PUT", bad, token=TOKEN)
            assert (status, answer["reason"]) == (400, "invalid_argument"), (bad, answer)
        assert (await call(put, "PUT", {"canary_weight": 50, "owner": owner, "lease_s": 30}))[0] == 401
        assert sidecar.routes.table.route("scaler").canary_weight == 10  # nothing changed it

        # The owner itself renews and changes it; released, it is the operator's again.
        status, _, _ = await call(
            put, "PUT", {"canary_weight": 50, "owner": owner, "lease_s": 30}, token=TOKEN
        )
        assert status == 200 and sidecar.routes.table.route("scaler").canary_weight == 50
        assert (await call(put, "PUT", {"canary_weight": 50, "owner": owner, "lease_s": 0}, token=TOKEN))[
            0
        ] == 200
        _, view, _ = await call(f"http://{sidecar.admin_address}/canary")
        assert "owner" not in view["models"]["scaler"]
        assert (await call(put, "PUT", {"canary_weight": 5}, token=TOKEN))[0] == 200


async def test_a_lapsed_lease_gives_the_weight_back(tmp_path: Path) -> None:
    async with a_sidecar(tmp_path) as sidecar:
        put = f"http://{sidecar.admin_address}/canary/scaler"
        body = {"canary_weight": 10, "owner": "controller http://gone", "lease_s": 0.5}
        assert (await call(put, "PUT", body, token=TOKEN))[0] == 200
        assert (await call(put, "PUT", {"canary_weight": 20}, token=TOKEN))[0] == 409

        async def by_hand() -> bool:
            return (await call(put, "PUT", {"canary_weight": 20}, token=TOKEN))[0] == 200

        await eventually(by_hand, "the lease to lapse", within_s=10)
        assert sidecar.routes.table.route("scaler").canary_weight == 20


async def test_https_both_ways_with_the_ca_verified(tmp_path: Path) -> None:
    """The controller verifies an HTTPS sidecar with --sidecar-ca (and refuses one it cannot
    verify), and serves its own API over HTTPS with --tls-cert/--tls-key."""
    pki = make_pki(tmp_path)
    root = tmp_path / "models"
    demo_models.write_model(root, "scaler", 1, demo_models.scaled_identity(16, 2.0), CONFIG)
    demo_models.write_model(root, "scaler", 2, demo_models.scaled_identity(16, 3.0), CONFIG)
    tokens = tmp_path / "sidecar-tokens"
    tokens.write_text(TOKEN + "\n")
    cert, key = str(pki["server"].cert), str(pki["server"].key)
    async with (
        serving(root) as service,
        running_sidecar(
            [service.address], admin_tokens_file=str(tokens), tls_cert=cert, tls_key=key
        ) as sidecar,
    ):
        await known_versions(sidecar, "scaler", {"1", "2"})
        url = f"https://127.0.0.1:{sidecar.admin_address.rpartition(':')[2]}"
        verified = AdminClient(TOKEN, str(pki["ca"].path))
        assert "scaler" in (await verified.canary(url))["models"]
        await verified.set_weight(url, "scaler", 10, "controller https://test", 30)
        assert sidecar.routes.table.route("scaler").canary_weight == 10
        with pytest.raises(OSError, match="CERTIFICATE_VERIFY_FAILED"):
            await AdminClient(TOKEN).canary(url)  # the system's roots do not know this CA

    registry = CollectorRegistry()
    controller = Controller(
        sidecars=[],
        prometheus=None,
        queries=QUERIES,
        store=MemoryStore(),
        client=AdminClient(),
        owner="controller https://test",
        registry=registry,
    )
    api = ControllerApi(
        "127.0.0.1",
        0,
        registry,
        controller,
        authorizer=None,
        open_writes=False,
        tls=TlsFiles(pki["server"].cert, pki["server"].key),
    )
    await api.start()
    await controller.start()
    try:
        context = ssl.create_default_context(cafile=str(pki["ca"].path))

        def get() -> Any:
            url = f"https://127.0.0.1:{api.port}/healthz"
            with urllib.request.urlopen(url, context=context, timeout=5) as answer:
                return json.loads(answer.read())

        # A client whose ClientHello arrives at once (from a thread) is served every time: the
        # handshake once started on the plain stream after accepting lost it now and then.
        for _ in range(20):
            assert await asyncio.to_thread(get) == {"status": "ok", "leader": True}
    finally:
        await api.stop()


async def test_a_local_rollout_keeps_its_weight_from_a_controller(tmp_path: Path) -> None:
    async with a_sidecar(tmp_path) as sidecar:
        base = f"http://{sidecar.admin_address}"
        assert (await call(f"{base}/rollouts/scaler", "POST", SPEC, token=TOKEN))[0] == 201
        body = {"canary_weight": 50, "owner": "controller http://10.0.0.9:9105", "lease_s": 30}
        status, answer, _ = await call(f"{base}/canary/scaler", "PUT", body, token=TOKEN)
        assert (status, answer["reason"]) == (409, "failed_precondition") and "a rollout sets" in answer[
            "error"
        ]
        _, view, _ = await call(f"{base}/canary")
        assert view["models"]["scaler"]["canary_weight"] == 10 and "owner" not in view["models"]["scaler"]
