"""The stack as `make up` starts it (python -m modelyard.deploy, nothing configured), tried as an
anonymous client and as a web page on another site would (issue 33): at Envoy's public port only
the public APIs answer; management (repository, logging, trace, shared memory; HTTP, gRPC and
gRPC-Web) is refused by Envoy itself, spelled however, with or without a credential; a browser's
simple cross-site POST to a management route is refused at Envoy's port and at the gateway's; and
the printed way to manage (the run's token, at the gateway's and the sidecar's own ports) works.

One stack for the module (each start costs many seconds on 2 cores), plus, for the cross-site
checks that must be able to fail, a gateway in front of a service whose management is open to
anyone (--management-open): there a request the guard let through would act."""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.http as tritonhttp

from models import demo_models
from modelyard.common.surfaces import MANAGEMENT_METHODS
from modelyard.gateway import origin
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.kserve.v2 import grpc_service_pb2 as kpb
from modelyard.kserve.v2 import grpc_service_pb2_grpc as kpb_grpc
from modelyard.tensors import to_array, to_tensor
from tests.envoy_support import grpc_web_frame, grpc_web_parse, start_envoy
from tests.support import REPO_ROOT, ChildProcess, metric, start_child, start_service_process

pytestmark = pytest.mark.timeout(600)  # the module's stack starts inside the first test's time

EDGE_REFUSAL = "not served at the public edge"  # Envoy's own answer: nothing was forwarded
PLAYWRIGHT = REPO_ROOT / "gateway" / "web" / "node_modules" / "playwright-core"
PAGE_SCRIPT = Path(__file__).with_name("cross_site_page.mjs")


def _find(pattern: str, text: str) -> str:
    found = re.search(pattern, text)
    assert found, f"{pattern!r} not in:\n{text}"
    return found.group(1)


@dataclass
class Up:
    """`python -m modelyard.deploy` on ephemeral ports, and the addresses and token it printed."""

    proc: subprocess.Popen[str]
    printed: str
    pids: list[int]
    edge: str  # http://127.0.0.1:PORT (Envoy)
    gateway: str  # http://127.0.0.1:PORT (the gateway's own port)
    sidecar: str  # 127.0.0.1:PORT
    admin: str  # http://127.0.0.1:PORT (the sidecar's admin endpoint)
    tokens: Path
    token: str

    @property
    def edge_address(self) -> str:
        return self.edge.removeprefix("http://")

    def bearer(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.token}"}


def _start_up(repository: Path, tmp: Path) -> Up:
    cmd = [sys.executable, "-m", "modelyard.deploy", "--repository", str(repository)]
    cmd += ["--service-listen", "127.0.0.1:0", "--service-metrics", ""]
    cmd += ["--sidecar-listen", "127.0.0.1:0", "--sidecar-admin", "127.0.0.1:0"]
    cmd += ["--gateway-listen", "127.0.0.1:0", "--gateway-metrics", ""]
    cmd += ["--envoy-port", "0", "--envoy-admin-port", "0"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELYARD_")}
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
        env={**env, "TMPDIR": str(tmp)},
    )
    pids: list[int] = []
    err: list[str] = []

    def pump_err() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            err.append(line)
            if found := re.search(r"\w+ started \(pid (\d+)\)", line):
                pids.append(int(found.group(1)))

    threading.Thread(target=pump_err, daemon=True).start()
    lines: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:  # the supervisor prints its block once every process is ready
        lines.append(line)
        if "not through Envoy" in line:
            break
    printed = "".join(lines)
    if "not through Envoy" not in printed:
        _stop_up(proc, pids)
        raise AssertionError("the stack did not come up:\n" + "".join(err[-40:]))
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # drain the rest
    tokens = Path(_find(r"tokens file (\S+)", printed))
    return Up(
        proc=proc,
        printed=printed,
        pids=pids,
        edge=_find(r"browser page\s+(http://\S+)/", printed),
        gateway=_find(r"gateway\s+(http://\S+)", printed),
        sidecar=_find(r"\(Envoy\), (\S+) \(sidecar\)", printed),
        admin=_find(r"curl -X PUT .* (http://\S+)/canary/scaler", printed),
        tokens=tokens,
        token=tokens.read_text().split()[0],
    )


def _stop_up(proc: subprocess.Popen[str], pids: list[int]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # the supervisor stops its processes in order
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for pid in pids:  # only if the supervisor failed to: a process left behind is killed
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    root = tmp_path_factory.mktemp("edge") / "models"
    demo_models.build_demo_repository(root)
    assert demo_models.copy_trained_models(demo_models.COMMITTED_ROOT, root) == ["codelm"]
    tmp = tmp_path_factory.mktemp("tmp")
    running = _start_up(root, tmp)
    try:
        yield running
    finally:
        _stop_up(running.proc, running.pids)
    assert not running.tokens.exists()  # the run's token went with it


@dataclass
class OpenGateway:
    """A gateway in front of a service whose management is open to anyone that reaches it."""

    url: str
    metrics: str  # its /metrics URL


@pytest.fixture(scope="module")
def open_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenGateway]:
    root = tmp_path_factory.mktemp("open") / "models"
    demo_models.build_demo_repository(root)
    service = start_service_process(root, "--management-open")
    gateway: ChildProcess | None = None
    try:
        cmd = [sys.executable, "-m", "modelyard.gateway", "--listen", "127.0.0.1:0"]
        cmd += ["--upstream", service.address, "--metrics-listen", "127.0.0.1:0"]
        announced = re.compile(r"serving HTTP on (http://\S+) \(metrics on (\S+/metrics)\)")
        gateway = start_child(cmd, announced, "gateway")
        yield OpenGateway(gateway.ready.group(1), gateway.ready.group(2))
    finally:
        if gateway is not None:
            gateway.stop()
        service.stop()


def ready(base: str, model: str = "scaler") -> int:
    return httpx.get(f"{base}/v2/models/{model}/ready", timeout=30).status_code


def log_settings(up: Up) -> dict[str, Any]:
    answer = httpx.get(f"{up.gateway}/v2/logging", headers=up.bearer(), timeout=30)
    assert answer.status_code == 200, answer.text
    settings: dict[str, Any] = answer.json()
    return settings


def trace_settings(up: Up, model: str = "") -> dict[str, Any]:
    path = f"/v2/models/{model}/trace/setting" if model else "/v2/trace/setting"
    answer = httpx.get(up.gateway + path, headers=up.bearer(), timeout=30)
    assert answer.status_code == 200, answer.text
    settings: dict[str, Any] = answer.json()
    return settings


def planted_upload() -> dict[str, Any]:
    """A load that would serve a new model `planted` (a valid model and config) were it forwarded."""
    model = base64.b64encode(demo_models.serialize(demo_models.scaled_identity(16, 5.0))).decode()
    config = {"max_batch_size": 8, "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [16]}]}
    return {"parameters": {"config": json.dumps(config), "file:1/model.onnx": model}}


SHM = {"key": "/modelyard-edge-test", "offset": 0, "byte_size": 64}
# Every management HTTP route (Triton's extensions), as a client would call it.
MANAGEMENT_ROUTES: list[tuple[str, str, Any]] = [
    ("POST", "/v2/repository/index", {}),
    ("POST", "/v2/repository/models/planted/load", planted_upload()),
    ("POST", "/v2/repository/models/scaler/unload", {}),
    ("GET", "/v2/logging", None),
    ("POST", "/v2/logging", {"log_verbose_level": 4294967295, "log_info": False}),
    ("GET", "/v2/trace/setting", None),
    ("POST", "/v2/trace/setting", {"trace_rate": "7", "trace_level": ["TIMESTAMPS"]}),
    ("GET", "/v2/trace", None),
    ("GET", "/v2/models/scaler/trace/setting", None),
    ("POST", "/v2/models/scaler/trace/setting", {"trace_rate": "9"}),
    ("POST", "/v2/models/scaler/versions/1/trace/setting", {"trace_rate": "9"}),
    ("GET", "/v2/systemsharedmemory/status", None),
    ("GET", "/v2/systemsharedmemory/region/r/status", None),
    ("POST", "/v2/systemsharedmemory/region/r/register", SHM),
    ("POST", "/v2/systemsharedmemory/region/r/unregister", {}),
    ("POST", "/v2/systemsharedmemory/unregister", {}),
    ("GET", "/v2/cudasharedmemory/status", None),
    ("POST", "/v2/cudasharedmemory/region/r/register", {"raw_handle": {"b64": ""}, "device_id": 0}),
    ("POST", "/v2/cudasharedmemory/region/r/unregister", {}),
]


def assert_edge_refusal(answer: httpx.Response, what: str) -> None:
    assert answer.status_code == 403, (what, answer.status_code, answer.text)
    assert answer.headers["x-error-reason"] == "permission_denied", what
    assert answer.headers["content-type"] == "application/json", what
    body = answer.json()
    assert body["code"] == "PERMISSION_DENIED" and body["reason"] == "permission_denied", (what, body)
    assert EDGE_REFUSAL in body["error"] and "docs/security.md" in body["error"], (what, body)


def assert_nothing_changed(up: Up, logs: dict[str, Any], traces: dict[str, Any]) -> None:
    assert ready(up.edge) == 200  # scaler still served, to everyone
    assert httpx.get(f"{up.edge}/v2/models/planted", timeout=30).status_code == 404
    index = httpx.post(f"{up.gateway}/v2/repository/index", headers=up.bearer(), timeout=30).json()
    assert "planted" not in {m["name"] for m in index}
    assert log_settings(up) == logs
    assert trace_settings(up) == traces
    shm = httpx.get(f"{up.gateway}/v2/systemsharedmemory/status", headers=up.bearer(), timeout=30)
    assert shm.status_code == 200 and shm.json() == []


def test_management_at_envoys_port_is_refused_there_with_or_without_a_token(up: Up) -> None:
    logs, traces = log_settings(up), trace_settings(up)
    scaler_traces = trace_settings(up, "scaler")
    with httpx.Client(base_url=up.edge, timeout=30) as client:
        for credential in ({}, up.bearer()):  # a token does not open the edge: nothing is forwarded
            for method, path, body in MANAGEMENT_ROUTES:
                answer = client.request(method, path, json=body, headers=credential)
                assert_edge_refusal(answer, f"{method} {path} {sorted(credential)}")
    assert_nothing_changed(up, logs, traces)
    assert trace_settings(up, "scaler") == scaler_traces
    # tritonclient.http reads the refusal as the server's error.
    client = tritonhttp.InferenceServerClient(up.edge_address)
    with pytest.raises(Exception, match=EDGE_REFUSAL):
        client.unload_model("scaler")
    assert client.is_model_ready("scaler")


# Path spellings that name a management route to a router that decodes or normalises (the
# gateway's decodes %XX), each sent as is. With the token: were one forwarded, it would act.
VARIANTS = (
    "//v2/repository/index",
    "/v2//repository/index",
    "/v2/./repository/index",
    "/v2/x/../repository/index",
    "/v2/%2e%2e/v2/repository/index",
    "/v2/%72epository/index",
    "/v2/repository%2Findex",
    "/v2/repository%2findex",
    "/v2%2Frepository%2Findex",
    "/v2/repository%5Cindex",
    "/v2/repository/index/",
    "/v2/repository/index?ready=true",
    "/v2/repository/index;x=1",
    "/v2/repository;x=1/index",
    "/v2/REPOSITORY/index",
    "/v2/repository%2Fmodels%2Fscaler%2Funload",
    "/v2/repository/models/scaler/%75nload",
    "/v2/repository/models/scaler/unload/",
    "/v2/repository/models/scaler/unload?x=1",
    "/v2/repository/models/scaler/unload;x=1",
    "/v2/models/x/..%2F..%2Frepository/models/scaler/unload",
    "/v2/models/scaler;x/trace/setting",
    "/v2/models/scaler/trace%2Fsetting",
    "/v2/%6cogging",
)


def raw_post(address: str, path: str, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    """A POST with the path exactly as given (httpx would normalise it)."""
    host, port = address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.putrequest("POST", path, skip_accept_encoding=True)
        for key, value in {**headers, "content-type": "application/json", "content-length": "2"}.items():
            connection.putheader(key, value)
        connection.endheaders(b"{}")
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def test_no_spelling_of_a_management_path_reaches_its_handler(up: Up) -> None:
    logs = log_settings(up)
    for path in VARIANTS:
        status, headers, body = raw_post(up.edge_address, path, up.bearer())
        assert status in (403, 404), (path, status, body)
        assert headers.get("x-error-reason") in ("permission_denied", "unsupported"), path
        if status == 403:
            assert EDGE_REFUSAL.encode() in body, (path, body)
        assert ready(up.edge) == 200, path  # scaler was not unloaded
    assert log_settings(up) == logs
    # The public routes still answer after the edge's normalisation, dot segments and all.
    status, _, body = raw_post(up.edge_address, "/v2/models/x/../scaler/infer", {})
    assert status == 422 and b"inputs" in body, body  # scaler's infer route, answering the empty body


def test_grpc_and_grpc_web_management_through_envoy_are_permission_denied(up: Up) -> None:
    with grpc.insecure_channel(up.edge_address) as channel:
        for method in sorted(MANAGEMENT_METHODS):
            call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
            for metadata in ((), tuple(up.bearer().items())):
                with pytest.raises(grpc.RpcError) as refused:
                    call(b"", metadata=metadata, timeout=30)
                error: Any = refused.value
                assert error.code() == grpc.StatusCode.PERMISSION_DENIED, (method, error)
                assert EDGE_REFUSAL in error.details(), method
                assert dict(error.trailing_metadata())["x-error-reason"] == "permission_denied", method
        # The public surface over native gRPC through Envoy: our Infer, KServe ModelInfer.
        stub = pb_grpc.InferenceServiceStub(channel)
        x = np.ones((1, 16), np.float32)
        reply = stub.Infer(pb.InferRequest(model_name="scaler", inputs=[to_tensor("INPUT0", x)]), timeout=30)
        scale = {"1": 2.0, "2": 3.0}[reply.model_version]
        assert to_array(reply.outputs[0]).tolist() == (x * scale).tolist()
        kstub = kpb_grpc.GRPCInferenceServiceStub(channel)
        assert kstub.ModelReady(kpb.ModelReadyRequest(name="scaler"), timeout=30).ready
    assert ready(up.edge) == 200
    # gRPC-Web (binary and text), as a page's client sends it, from an allowed origin and none.
    unload = kpb.RepositoryModelUnloadRequest(model_name="scaler").SerializeToString()
    path = "/inference.GRPCInferenceService/RepositoryModelUnload"
    for content_type, accept in (
        ("application/grpc-web+proto", "application/grpc-web+proto"),
        ("application/grpc-web-text", "application/grpc-web-text"),
    ):
        for browser in ({"origin": "http://127.0.0.1:8080"}, {}):
            body = grpc_web_frame(unload)
            if content_type.endswith("text"):
                body = base64.b64encode(body)
            headers = {"content-type": content_type, "accept": accept, "x-grpc-web": "1", **browser}
            answer = httpx.post(up.edge + path, content=body, headers={**headers, **up.bearer()}, timeout=30)
            assert answer.status_code == 200, answer  # a trailers-only gRPC-Web answer
            assert answer.headers["grpc-status"] == "7" and EDGE_REFUSAL in answer.headers["grpc-message"]
            assert answer.headers["x-error-reason"] == "permission_denied"
            assert answer.headers["content-type"].startswith(accept)
            if browser:  # a page on an allowed origin may read it (Envoy's CORS skips direct answers)
                assert answer.headers["access-control-allow-origin"] == browser["origin"]
                assert "grpc-status" in answer.headers["access-control-expose-headers"]
    # A public call over gRPC-Web still goes through.
    live = grpc_web_frame(kpb.ServerLiveRequest().SerializeToString())
    answer = httpx.post(
        up.edge + "/inference.GRPCInferenceService/ServerLive",
        content=live,
        headers={"content-type": "application/grpc-web+proto", "x-grpc-web": "1"},
        timeout=30,
    )
    messages, trailers = grpc_web_parse(answer.content)
    assert trailers["grpc-status"] == "0" and kpb.ServerLiveResponse.FromString(messages[0]).live
    assert ready(up.edge) == 200


def simple_post(
    base: str, path: str, origin: str | None = "http://evil.example", **headers: str
) -> httpx.Response:
    """What a page on another site may send without asking: a text/plain POST with its Origin."""
    browser = {"content-type": "text/plain", **headers}
    if origin is not None:
        browser["origin"] = origin
    return httpx.post(base + path, content=b'{"log_verbose_level": 1}', headers=browser, timeout=30)


def test_a_cross_site_simple_post_cannot_manage_at_either_port(up: Up, open_gateway: OpenGateway) -> None:
    logs = log_settings(up)
    for path in ("/v2/repository/models/scaler/unload", "/v2/logging"):
        assert_edge_refusal(simple_post(up.edge, path), path)
        at_gateway = simple_post(up.gateway, path)
        assert at_gateway.status_code == 403 and at_gateway.headers["x-error-reason"] == "permission_denied"
        assert at_gateway.json() == {
            "error": origin.MESSAGE,
            "code": "PERMISSION_DENIED",
            "reason": "permission_denied",
        }
        # Without the Origin, a fetch metadata header says the same.
        fetched = simple_post(up.gateway, path, origin=None, **{"sec-fetch-site": "cross-site"})
        assert fetched.status_code == 403, fetched.text
    assert ready(up.edge) == 200 and log_settings(up) == logs
    # Where management is open to anyone, the same requests would act: the guard is what refuses.
    for path in ("/v2/repository/models/scaler/unload", "/v2/logging"):
        refused = simple_post(open_gateway.url, path)
        assert refused.status_code == 403 and refused.json()["error"] == origin.MESSAGE
        for sec_fetch_site in ("cross-site", "same-site"):
            fetched = simple_post(open_gateway.url, path, origin=None, **{"sec-fetch-site": sec_fetch_site})
            assert fetched.status_code == 403, fetched.text
    assert ready(open_gateway.url) == 200
    # ... as the same call with a JSON content type (which a page cannot send unasked) does.
    acted = httpx.post(f"{open_gateway.url}/v2/repository/models/scaler/unload", json={}, timeout=30)
    assert acted.status_code == 200 and ready(open_gateway.url) == 503
    loaded = httpx.post(f"{open_gateway.url}/v2/repository/models/scaler/load", json={}, timeout=30)
    assert loaded.status_code == 200 and ready(open_gateway.url) == 200


def test_the_public_surface_still_works_at_envoy(up: Up) -> None:
    with httpx.Client(base_url=up.edge, timeout=60) as client:
        assert client.get("/v2/health/live").status_code == 200
        assert client.get("/v2/health/ready").json() == {"ready": True}
        assert client.get("/v2").json()["name"]
        assert client.get("/v2/models/scaler").json()["name"] == "scaler"
        assert client.get("/v2/models/scaler/config").status_code == 200
        assert client.get("/v2/models/stats").status_code == 200
        tensor = {"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [1.0] * 16}
        infer = client.post("/v2/models/scaler/versions/1/infer", json={"inputs": [tensor]})
        assert infer.status_code == 200 and infer.json()["outputs"][0]["data"] == [2.0] * 16
        generate = {"text_input": "def main():", "max_tokens": 3}
        assert client.post("/v2/models/codelm/generate", json=generate).json()["text_output"]
        with client.stream(
            "GET", "/v1/models/codelm/generate", params={"prompt": "def f(", "max_tokens": "3"}
        ) as sse:
            assert sse.status_code == 200 and sse.headers["content-type"].startswith("text/event-stream")
            events = [line for line in sse.iter_lines() if line.startswith("event: ")]
        assert "event: token" in events and events[-1] == "event: done", events  # a stream, to its end
        completion = client.post(
            "/v1/completions", json={"model": "codelm", "prompt": "import", "max_tokens": 2}
        )
        assert completion.status_code == 200 and completion.json()["choices"][0]["text"]
        assert client.get("/v1/models").status_code == 200
        page = client.get("/", follow_redirects=True)
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert client.get("/favicon.ico").status_code == 200


def test_the_printed_way_to_manage_works(up: Up) -> None:
    # The token is in a 0600 file of the run's private folder, and the printed lines use it.
    assert stat.S_IMODE(up.tokens.stat().st_mode) == 0o600
    assert stat.S_IMODE(up.tokens.parent.stat().st_mode) == 0o700
    assert up.token not in up.printed  # the secret stays in its file
    assert f"export MODELYARD_TOKEN=$(cut -d' ' -f1 {up.tokens})" in up.printed
    assert f'-H "authorization: Bearer $MODELYARD_TOKEN" {up.gateway}/v2/repository/index' in up.printed
    assert f"gRPC {up.sidecar}: metadata authorization: Bearer $MODELYARD_TOKEN" in up.printed
    assert len(up.token) >= 43  # secrets.token_urlsafe(32)
    with httpx.Client(base_url=up.gateway, timeout=60) as client:
        # Anonymous at the gateway's own port: the service refuses, nothing changes.
        anonymous = client.post("/v2/repository/models/scaler/unload", json={})
        assert anonymous.status_code == 401 and anonymous.headers["x-error-reason"] == "unauthenticated"
        assert ready(up.edge) == 200
        wrong = client.post(
            "/v2/repository/models/scaler/unload", json={}, headers={"authorization": "Bearer x"}
        )
        assert wrong.status_code == 401 and ready(up.edge) == 200
        # With the token (curl's request: no content type): unload and load scaler.
        try:
            assert client.post("/v2/repository/models/scaler/unload", headers=up.bearer()).status_code == 200
            assert ready(up.edge) == 503
        finally:
            assert client.post("/v2/repository/models/scaler/load", headers=up.bearer()).status_code == 200
        assert ready(up.edge) == 200
    # tritonclient.http at the gateway's port with the token.
    triton = tritonhttp.InferenceServerClient(up.gateway.removeprefix("http://"))
    assert {"scaler", "codelm"} <= {m["name"] for m in triton.get_model_repository_index(headers=up.bearer())}
    # Over gRPC through the sidecar, with the token as metadata.
    with grpc.insecure_channel(up.sidecar) as channel:
        stub = kpb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.RepositoryModelUnload(kpb.RepositoryModelUnloadRequest(model_name="scaler"), timeout=30)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        metadata = tuple(up.bearer().items())
        try:
            stub.RepositoryModelUnload(
                kpb.RepositoryModelUnloadRequest(model_name="scaler"), metadata=metadata, timeout=30
            )
            assert not stub.ModelReady(kpb.ModelReadyRequest(name="scaler"), timeout=30).ready
        finally:
            stub.RepositoryModelLoad(
                kpb.RepositoryModelLoadRequest(model_name="scaler"), metadata=metadata, timeout=30
            )
        assert stub.ModelReady(kpb.ModelReadyRequest(name="scaler"), timeout=30).ready
    # The sidecar's admin writes take the same token.
    body = json.dumps({"canary_weight": 0})
    assert httpx.put(f"{up.admin}/canary/scaler", content=body, timeout=30).status_code == 401
    put = httpx.put(f"{up.admin}/canary/scaler", content=body, headers=up.bearer(), timeout=30)
    assert put.status_code == 200, put.text


def test_an_operators_edge_with_management_routes_forwards_and_the_token_decides(
    up: Up, tmp_path: Path
) -> None:
    envoy = start_envoy(tmp_path, up.gateway.removeprefix("http://"), up.sidecar, management_routes=True)
    try:
        index = httpx.post(f"{envoy.url}/v2/repository/index", headers=up.bearer(), timeout=30)
        assert index.status_code == 200 and "scaler" in {m["name"] for m in index.json()}
        anonymous = httpx.post(f"{envoy.url}/v2/repository/models/scaler/unload", timeout=30)
        assert anonymous.status_code == 401 and anonymous.headers["x-error-reason"] == "unauthenticated"
        # The gateway's cross-site guard holds behind this edge too.
        cross_site = simple_post(envoy.url, "/v2/repository/models/scaler/unload")
        assert cross_site.status_code == 403 and cross_site.json()["error"] == origin.MESSAGE
        with grpc.insecure_channel(f"127.0.0.1:{envoy.port}") as channel:
            stub = kpb_grpc.GRPCInferenceServiceStub(channel)
            metadata = tuple(up.bearer().items())
            assert stub.RepositoryIndex(kpb.RepositoryIndexRequest(), metadata=metadata, timeout=30).models
            with pytest.raises(grpc.RpcError) as refused:
                stub.RepositoryIndex(kpb.RepositoryIndexRequest(), timeout=30)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        envoy.stop()
    assert ready(up.edge) == 200


def refused(gateway: OpenGateway) -> float:
    """The gateway's 403s answered before any route (the cross-site guard's)."""
    text = httpx.get(gateway.metrics, timeout=30).text
    return metric(text, "modelyard_gateway_requests_total", route="other", status="403") or 0.0


class _EvilSite(BaseHTTPRequestHandler):
    """Another site's page: it POSTs text/plain to every target of its fragment, unasked."""

    PAGE = b"""<!doctype html><title>elsewhere</title><script>
const targets = JSON.parse(decodeURIComponent(location.hash.slice(1)));
window.done = Promise.all(targets.map((url) =>
  fetch(url, {method: "POST", mode: "no-cors", headers: {"content-type": "text/plain"},
              body: '{"log_verbose_level": 1}'})
    .then((r) => "sent: " + r.type, (e) => "failed: " + e.message)));
</script>"""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/html")
        self.send_header("content-length", str(len(self.PAGE)))
        self.end_headers()
        self.wfile.write(self.PAGE)

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass


def test_a_page_on_another_origin_cannot_manage_in_a_real_browser(up: Up, open_gateway: OpenGateway) -> None:
    assert shutil.which("chromium") and shutil.which("node") and PLAYWRIGHT.exists(), (
        "run `make browser-deps` (make test does)"
    )
    site = ThreadingHTTPServer(("127.0.0.1", 0), _EvilSite)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    refused_before = refused(open_gateway)
    targets = [
        f"{open_gateway.url}/v2/repository/models/scaler/unload",
        f"{open_gateway.url}/v2/logging",
        f"{up.edge}/v2/repository/models/scaler/unload",
        f"{up.gateway}/v2/repository/models/scaler/unload",
    ]
    page = f"http://127.0.0.1:{site.server_address[1]}/#" + urllib.parse.quote(json.dumps(targets))
    try:
        node = subprocess.run(
            ["node", str(PAGE_SCRIPT), page], capture_output=True, text=True, timeout=180, cwd=REPO_ROOT
        )
    finally:
        site.shutdown()
        site.server_close()
    assert node.returncode == 0, node.stderr
    result = json.loads(node.stdout.strip().splitlines()[-1])
    assert result["outcomes"] == ["sent: opaque"] * len(targets), result  # the browser did send them
    # (Playwright reports only the page's own headers; Origin and Sec-Fetch-Site are the network
    # stack's: the open gateway's refusals show they arrived.) Nothing acted, the open service's
    # scaler included, which a request without them would have unloaded.
    assert sorted(r["url"] for r in result["requests"] if r["method"] == "POST") == sorted(targets)
    assert refused(open_gateway) == refused_before + 2  # the open gateway refused both of its requests
    assert ready(open_gateway.url) == 200 and ready(up.edge) == 200
    log = httpx.get(f"{open_gateway.url}/v2/logging", timeout=30).json()
    assert log.get("log_verbose_level") == 0, log
