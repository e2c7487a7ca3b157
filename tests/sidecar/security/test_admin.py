"""The sidecar's admin endpoint against hostile and careless HTTP clients: bodies that are not JSON
objects or are nested too deeply are 400 with a reason (never 500), bodies over the bound 413 before
they are read, a held half-request and an idle connection are closed after their timeouts, a
connection flood is bounded, and one slow client never holds up another (asyncio, not a thread per
connection). Changes are off without a credential unless the operator opens them, a web page's
cross-site simple request cannot act even then, and no number that is not finite or out of its
bounds is taken (nor ever written back). The upstream address is closed: the admin endpoint needs
none."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from modelyard.sidecar.server import Sidecar
from tests.sidecar_support import running_sidecar
from tests.support import metric

MAX_CONNECTIONS = 8
LIMITS: dict[str, Any] = {
    "admin_header_timeout_s": 0.5,
    "admin_body_timeout_s": 0.5,
    "admin_idle_timeout_s": 0.5,
    "admin_max_body_bytes": 64 * 1024,
    "admin_max_connections": MAX_CONNECTIONS,
}


@pytest.fixture
async def sidecar(tmp_path: Path) -> AsyncIterator[Sidecar]:
    # No upstream answers: the route file names the one model the changes are about.
    config = tmp_path / "routes.yaml"
    config.write_text("models: {scaler: {canary_weight: 0}}\n")
    async with running_sidecar(["127.0.0.1:9"], config=config, admin_open=True, **LIMITS) as running:
        yield running


@pytest.fixture
async def http(sidecar: Sidecar) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=f"http://{sidecar.admin_address}", timeout=10) as client:
        yield client


def error(answer: httpx.Response) -> tuple[int, str]:
    return answer.status_code, answer.json()["reason"]


@pytest.mark.parametrize(
    "body",
    [
        b"[1, 2]",
        b"42",
        b'"canary_weight"',
        b"null",
        b"{not json",
        b"\xff\xfe",
        b"[" * 30_000 + b"]" * 30_000,  # RecursionError in the decoder
        b'{"stable": ' + b"[" * 5000 + b"]" * 5000 + b"}",  # decoded, but no version
        b'{"stable": {"a": 1}}',
        b'{"canary": "../../etc"}',
        b'{"canary_weight": "x" }',
        b'{"nonsense": 1}',
    ],
)
async def test_a_bad_body_is_400_with_a_reason(http: httpx.AsyncClient, body: bytes) -> None:
    answer = await http.put("/canary/scaler", content=body)
    assert error(answer) == (400, "invalid_argument"), answer.text
    assert len(answer.text) < 1024


async def test_a_bad_model_name_is_400_and_a_good_change_applies(
    http: httpx.AsyncClient, sidecar: Sidecar
) -> None:
    for name in ("a..b", "%2e%2e%2fetc", "a" * 200, "-flag", "x%00y"):
        answer = await http.put(f"/canary/{name}", json={"canary_weight": 10})
        assert error(answer) == (400, "invalid_argument"), name
    assert set(sidecar.routes.table.models) == {"scaler"}
    # No upstream has reported (none answers): a model the route file does not name is not known
    # to be unknown yet, and is refused as retryable.
    assert error(await http.put("/canary/nosuch", json={"canary_weight": 10})) == (503, "unavailable")
    assert set(sidecar.routes.table.models) == {"scaler"}
    answer = await http.put("/canary/scaler", json={"canary_weight": 10, "stable": 1, "canary": "v2"})
    assert answer.status_code == 200 and answer.json()["canary"] == "2"
    assert error(await http.get("/nowhere")) == (404, "unsupported")


async def test_a_body_over_the_bound_is_413_before_it_is_read(sidecar: Sidecar) -> None:
    reader, writer = await connect(sidecar)
    writer.write(b"PUT /canary/scaler HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n")
    status, body = await read_answer(reader)
    assert status == 413 and body["reason"] == "too_large"
    assert await reader.read() == b""  # and the connection is closed
    writer.close()


async def test_a_head_over_the_bound_is_431(sidecar: Sidecar) -> None:
    reader, writer = await connect(sidecar)
    writer.write(b"GET /breakers HTTP/1.1\r\nX-Padding: " + b"a" * 20_000 + b"\r\n\r\n")
    status, body = await asyncio.wait_for(read_answer(reader), 5)
    assert status == 431 and body["reason"] == "too_large"
    writer.close()


async def test_a_chunked_body_is_refused(http: httpx.AsyncClient) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"canary_weight": 1}'

    answer = await http.put("/canary/scaler", content=chunks())
    assert error(answer) == (411, "invalid_argument")


async def test_held_half_requests_and_idle_connections_are_closed(sidecar: Sidecar) -> None:
    started = time.monotonic()
    idle = await connect(sidecar)
    half = await connect(sidecar)
    half[1].write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # and never the end of the head
    body = await connect(sidecar)
    body[1].write(b"PUT /canary/scaler HTTP/1.1\r\nContent-Length: 50\r\n\r\n{")
    assert await asyncio.wait_for(idle[0].read(), 5) == b""
    status, _ = await asyncio.wait_for(read_answer(half[0]), 5)
    assert status == 408
    status, _ = await asyncio.wait_for(read_answer(body[0]), 5)
    assert status == 408
    assert time.monotonic() - started < 5
    for _, writer in (idle, half, body):
        writer.close()


async def test_slow_clients_hold_up_nobody_and_the_flood_is_bounded(
    sidecar: Sidecar, http: httpx.AsyncClient
) -> None:
    threads = threading.active_count()
    held = [await connect(sidecar) for _ in range(MAX_CONNECTIONS - 1)]
    for _, writer in held:
        writer.write(b"GET /breakers HTTP/1.1\r\n")  # half a request each
    answer = await http.get("/breakers")  # the one connection left
    assert answer.status_code == 200
    # No thread per connection (httpx's own connection included; /metrics was not asked for).
    assert threading.active_count() == threads
    extra = await connect(sidecar)  # one over the bound
    extra[1].write(b"GET /breakers HTTP/1.1\r\n\r\n")
    status, body = await asyncio.wait_for(read_answer(extra[0]), 5)
    assert status == 503 and body["reason"] == "queue_full"
    # Keep-alive: the client's connection answers again.
    assert (await http.get("/canary")).status_code == 200
    for _, writer in [*held, extra]:
        writer.close()


async def connect(sidecar: Sidecar) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, _, port = sidecar.admin_address.rpartition(":")
    return await asyncio.open_connection(host, int(port))


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, Any]:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    return status, json.loads(await reader.readexactly(length))


# --- who may change the sidecar's state -------------------------------------------------------


async def test_changes_are_off_by_default_and_reads_stay_open(tmp_path: Path) -> None:
    config = tmp_path / "routes.yaml"
    config.write_text("models: {scaler: {canary_weight: 0}}\n")
    async with (
        running_sidecar(["127.0.0.1:9"], config=config) as sidecar,
        httpx.AsyncClient(base_url=f"http://{sidecar.admin_address}", timeout=10) as http,
    ):
        changes = [
            http.put("/canary/scaler", json={"canary_weight": 50}),
            http.post("/rollouts/scaler", json={"steps": [10, 100]}),
            http.post("/rollouts/scaler/abort", json={}),
            http.delete("/canary/scaler"),
        ]
        for change in changes:
            answer = await change
            assert error(answer) == (403, "permission_denied"), answer.text
            assert "--admin-tokens-file" in answer.json()["error"]
            assert "--admin-open" in answer.json()["error"]
        # Nothing happened: the weight is the file's, no rollout started.
        assert sidecar.routes.table.route("scaler").canary_weight == 0
        assert sidecar.rollouts.rollouts == {}
        assert (await http.get("/canary")).json()["models"]["scaler"]["canary_weight"] == 0
        assert (await http.get("/rollouts")).json() == {}
        scraped = (await http.get("/metrics")).text
        assert metric(scraped, "modelyard_sidecar_admin_denials_total", outcome="off") == 4


async def test_a_change_needs_the_management_scope(tmp_path: Path) -> None:
    config, tokens = tmp_path / "routes.yaml", tmp_path / "tokens"
    config.write_text("models: {scaler: {canary_weight: 0}}\n")
    tokens.write_text("reader-token inference\nadmin-token management\n")
    async with (
        running_sidecar(["127.0.0.1:9"], config=config, admin_tokens_file=str(tokens)) as sidecar,
        httpx.AsyncClient(base_url=f"http://{sidecar.admin_address}", timeout=10) as http,
    ):
        body = {"canary_weight": 20}
        assert error(await http.put("/canary/scaler", json=body)) == (401, "unauthenticated")
        reader = {"authorization": "Bearer reader-token"}
        answer = await http.put("/canary/scaler", json=body, headers=reader)
        assert error(answer) == (403, "permission_denied")
        assert sidecar.routes.table.route("scaler").canary_weight == 0
        admin = {"authorization": "Bearer admin-token"}
        assert (await http.put("/canary/scaler", json=body, headers=admin)).status_code == 200
        assert sidecar.routes.table.route("scaler").canary_weight == 20


EVIL = {"origin": "http://evil.example", "content-type": "text/plain"}


async def test_a_cross_site_simple_request_cannot_act(http: httpx.AsyncClient, sidecar: Sidecar) -> None:
    """Even with changes open to everyone (a newcomer's loopback setup), a web page's POST that a
    browser sends without a preflight (text/plain or a form, with Origin or Sec-Fetch-Site) is
    refused before it does anything."""
    spec = json.dumps({"steps": [10, 100], "dwell_s": 60}).encode()
    answer = await http.post("/rollouts/scaler", content=spec, headers=EVIL)
    assert error(answer) == (403, "permission_denied") and "application/json" in answer.json()["error"]
    assert sidecar.rollouts.rollouts == {}  # no rollout started
    assert sidecar.routes.table.route("scaler").canary_weight == 0

    # A rollout the operator started (JSON, no Origin: curl, the CLI): a page cannot abort it
    # (which would set the weight to 0) nor pause it, whatever a browser may put in the headers.
    started = await http.post("/rollouts/scaler", content=spec, headers={"content-type": "application/json"})
    assert started.status_code == 201, started.text
    assert sidecar.routes.table.route("scaler").canary_weight == 10
    pages = [
        EVIL,
        {"origin": "null", "content-type": "application/x-www-form-urlencoded"},
        {"sec-fetch-site": "cross-site", "content-type": "multipart/form-data; boundary=x"},
        {"sec-fetch-site": "same-site"},  # another port of 127.0.0.1 is the same site
        {"origin": "http://127.0.0.1:9101", "content-type": "text/plain;charset=UTF-8"},
    ]
    for headers in pages:
        for action in ("abort", "pause"):
            answer = await http.post(f"/rollouts/scaler/{action}", content=b"{}", headers=headers)
            assert error(answer) == (403, "permission_denied"), (headers, answer.text)
        answer = await http.post("/canary/scaler", content=b'{"canary_weight": 0}', headers=headers)
        assert error(answer) == (403, "permission_denied"), headers
    assert sidecar.rollouts.rollouts["scaler"].state == "running"
    assert sidecar.routes.table.route("scaler").canary_weight == 10

    # The preflight a JSON request from a page needs is never granted.
    preflight = await http.options(
        "/rollouts/scaler/abort",
        headers={"origin": "http://evil.example", "access-control-request-method": "POST"},
    )
    assert preflight.status_code >= 400
    assert not any(name.lower().startswith("access-control-") for name in preflight.headers)
    # A request no browser page sends cross-site without that preflight is a change as before.
    json_from_a_page = {"origin": "http://evil.example", "content-type": "application/json"}
    answer = await http.post("/rollouts/scaler/pause", content=b"{}", headers=json_from_a_page)
    assert answer.status_code == 200 and answer.json()["state"] == "paused"
    same_origin = {"sec-fetch-site": "same-origin", "content-type": "text/plain"}
    answer = await http.post("/rollouts/scaler/resume", content=b"{}", headers=same_origin)
    assert answer.status_code == 200 and answer.json()["state"] == "running"


# --- numbers ----------------------------------------------------------------------------------

NOT_FINITE = ["Infinity", "-Infinity", "NaN", "1e999", "-1e999"]
ROLLOUT_KNOBS = [
    "dwell_s",
    "min_calls",
    "judge_calls",
    "max_error_excess",
    "max_latency_ratio",
    "latency_floor_s",
    "min_agreement",
]


def strict_json(raw: bytes) -> Any:
    """What a strict parser reads: no NaN or Infinity."""

    def refuse(text: str) -> None:
        raise ValueError(f"not JSON: {text}")

    return json.loads(raw, parse_constant=refuse)


@pytest.mark.parametrize("number", NOT_FINITE)
@pytest.mark.parametrize("knob", ROLLOUT_KNOBS)
async def test_a_rollout_knob_that_is_not_finite_is_400_naming_it(
    http: httpx.AsyncClient, sidecar: Sidecar, knob: str, number: str
) -> None:
    body = f'{{"steps": [10, 100], "{knob}": {number}}}'.encode()
    answer = await http.post("/rollouts/scaler", content=body)
    assert error(answer) == (400, "invalid_argument"), answer.text
    assert knob in answer.json()["error"]
    assert sidecar.rollouts.rollouts == {}
    assert strict_json((await http.get("/rollouts")).content) == {}


@pytest.mark.parametrize(
    ("knob", "value"),
    [
        ("min_calls", 2**70),
        ("min_calls", 20_001),  # more than the driver keeps of a version's calls: never reached
        ("judge_calls", 2**64),
        ("dwell_s", 1e9),
        ("max_latency_ratio", 1e6),
        ("max_latency_ratio", 0),
        ("latency_floor_s", 1e5),
        ("max_error_excess", 1.5),
        ("min_agreement", -0.1),
        ("steps", [*range(1, 101), 100]),  # 101 steps
        ("steps", [10, "NaN", 100]),
    ],
)
async def test_a_rollout_knob_out_of_its_bounds_is_400_naming_it(
    http: httpx.AsyncClient, sidecar: Sidecar, knob: str, value: object
) -> None:
    answer = await http.post("/rollouts/scaler", json={"steps": [10, 100], knob: value})
    assert error(answer) == (400, "invalid_argument"), answer.text
    assert knob in answer.json()["error"]
    assert sidecar.rollouts.rollouts == {}


async def test_the_bounds_themselves_are_taken_and_read_back_as_strict_json(
    http: httpx.AsyncClient, sidecar: Sidecar
) -> None:
    spec = {
        "steps": [10, 100],
        "dwell_s": 7 * 86400,
        "min_calls": 20_000,
        "judge_calls": 20_000,
        "max_latency_ratio": 1000,
        "latency_floor_s": 3600,
    }
    answer = await http.post("/rollouts/scaler", json=spec)
    assert answer.status_code == 201, answer.text
    shown = strict_json((await http.get("/rollouts")).content)["scaler"]["spec"]
    assert all(math.isfinite(v) for v in shown.values() if not isinstance(v, list))
    assert shown["min_calls"] == 20_000 and shown["max_latency_ratio"] == 1000


@pytest.mark.parametrize("number", NOT_FINITE)
async def test_a_weight_that_is_not_finite_is_400_naming_it(
    http: httpx.AsyncClient, sidecar: Sidecar, number: str
) -> None:
    answer = await http.put("/canary/scaler", content=f'{{"canary_weight": {number}}}'.encode())
    assert error(answer) == (400, "invalid_argument"), answer.text
    assert "canary_weight" in answer.json()["error"]
    # Even where no number is expected, or nested: named, never taken.
    answer = await http.put("/canary/scaler", content=f'{{"other": [1, {{"x": {number}}}]}}'.encode())
    assert error(answer) == (400, "invalid_argument") and "other[1].x" in answer.json()["error"]
    assert sidecar.routes.table.route("scaler").canary_weight == 0
    assert strict_json((await http.get("/canary")).content)["models"]["scaler"]["canary_weight"] == 0
