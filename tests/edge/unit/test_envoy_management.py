"""envoy/python/render.py's management policy: by default every management route and method
(modelyard.common.surfaces) is answered by Envoy itself before any route that forwards, paths are
normalised before routes match, and `management_routes` (`--management-routes`) forwards them.
(The real Envoy's answers: tests/edge/security/test_default_edge.py.)"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from modelyard.common.surfaces import MANAGEMENT_METHODS, MANAGEMENT_PATH_PREFIXES, is_management_path
from modelyard.envoy import render

PUBLIC_METHODS = (
    "/inference.GRPCInferenceService/ModelInfer",
    "/inference.GRPCInferenceService/ServerLive",
    "/inference.GRPCInferenceService/ModelMetadata",
    "/modelyard.inference.v1.InferenceService/Infer",
    "/modelyard.inference.v1.ModelService/ListModels",
    "/grpc.health.v1.Health/Check",
)
PATHS = (
    "/v2/repository",
    "/v2/repository/index",
    "/v2/repository/models/scaler/load",
    "/v2/repositoryx",
    "/v2/systemsharedmemory/region/r/register",
    "/v2/cudasharedmemory/status",
    "/v2/logging",
    "/v2/loggingx",
    "/v2/trace/setting",
    "/v2/models/scaler/trace/setting",
    "/v2/models/scaler/versions/1/trace",
    "/v2/models/scaler/trace/settingx",
    "/v2/models/scaler/infer",
    "/v2/models/scaler",
    "/v2/health/ready",
    "/v1/models/codelm/generate",
    "/",
)


def manager(text: str) -> dict[str, Any]:
    doc = yaml.safe_load(text)
    typed: dict[str, Any] = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"
    ]
    return typed


def all_routes(settings: render.RenderSettings) -> list[dict[str, Any]]:
    routes: list[dict[str, Any]] = manager(render.render(settings))["route_config"]["virtual_hosts"][0][
        "routes"
    ]
    return routes


def path_matches(match: dict[str, Any], path: str) -> bool:
    """Envoy's path matching of the matchers render uses (safe_regex: the whole path)."""
    if "path" in match:
        return bool(path == match["path"])
    if "path_separated_prefix" in match:
        prefix = match["path_separated_prefix"]
        return bool(path == prefix or path.startswith(prefix + "/"))
    if "prefix" in match:
        return bool(path.startswith(match["prefix"]))
    return re.fullmatch(match["safe_regex"]["regex"], path) is not None


def headers_match(match: dict[str, Any], request: dict[str, str]) -> bool:
    for header in match.get("headers", ()):
        value = request.get(header["name"])
        string = header["string_match"]
        if value is None:
            return False
        if "prefix" in string and not value.startswith(string["prefix"]):
            return False
        if "exact" in string and value != string["exact"]:
            return False
        if "safe_regex" in string and re.fullmatch(string["safe_regex"]["regex"], value) is None:
            return False
    return True


def first_route(routes: list[dict[str, Any]], path: str, request: dict[str, str]) -> dict[str, Any]:
    return next(r for r in routes if path_matches(r["match"], path) and headers_match(r["match"], request))


GRPC = {"content-type": "application/grpc"}
GRPC_WEB = {"content-type": "application/grpc-web+proto"}
GRPC_WEB_TEXT = {"content-type": "application/grpc-web-text", "origin": "http://127.0.0.1:8080"}


@pytest.mark.parametrize(
    "settings", [render.RenderSettings(), render.KUBERNETES], ids=["local", "kubernetes"]
)
def test_every_management_method_is_refused_before_it_could_be_forwarded(
    settings: render.RenderSettings,
) -> None:
    routes = all_routes(settings)
    for method in MANAGEMENT_METHODS:
        native = first_route(routes, method, GRPC)
        assert native["direct_response"]["status"] == 403, method  # Envoy sends it as gRPC status 7
        assert {"header": {"key": "x-error-reason", "value": "permission_denied"}} in native[
            "response_headers_to_add"
        ]
        for web in (GRPC_WEB, GRPC_WEB_TEXT):
            answer = first_route(routes, method, web)
            assert answer["direct_response"] == {"status": 200}, method  # trailers-only gRPC-Web
            added = {h["header"]["key"]: h["header"]["value"] for h in answer["response_headers_to_add"]}
            assert added["grpc-status"] == "7" and added["x-error-reason"] == "permission_denied"
            assert "not served at the public edge" in added["grpc-message"]
    for method in PUBLIC_METHODS:
        assert first_route(routes, method, GRPC)["route"]["cluster"] == "sidecar", method
        assert first_route(routes, method, GRPC_WEB)["route"]["cluster"] == "sidecar", method


@pytest.mark.parametrize(
    "settings", [render.RenderSettings(), render.KUBERNETES], ids=["local", "kubernetes"]
)
def test_the_http_refusals_are_exactly_the_management_paths(settings: render.RenderSettings) -> None:
    routes = all_routes(settings)
    for path in PATHS:
        for request in ({}, {"origin": "http://evil.example"}, {"origin": "http://127.0.0.1:8000"}):
            route = first_route(routes, path, request)
            refused = route.get("direct_response", {}).get("status") == 403
            assert refused == is_management_path(path), (path, request)
            if refused:
                body = json.loads(route["direct_response"]["body"]["inline_string"])
                assert body["code"] == "PERMISSION_DENIED" and body["reason"] == "permission_denied"
                assert "docs/security.md" in body["error"]
                added = {h["header"]["key"]: h["header"]["value"] for h in route["response_headers_to_add"]}
                assert added["content-type"] == "application/json"
                assert added["x-error-reason"] == "permission_denied"
                # A page on an allowed origin reads the refusal (Envoy's CORS filter skips direct
                # responses); any other origin gets no CORS header.
                allowed = request.get("origin") in settings.cors_origins
                assert ("access-control-allow-origin" in added) == allowed, (path, request)


def test_paths_are_normalised_before_routes_match() -> None:
    for text in (render.render(render.RenderSettings()), render.render(render.KUBERNETES)):
        typed = manager(text)
        assert typed["normalize_path"] is True and typed["merge_slashes"] is True
        assert typed["path_with_escaped_slashes_action"] == "UNESCAPE_AND_FORWARD"


def test_management_routes_forward_management_like_the_rest(tmp_path: Path) -> None:
    opened = all_routes(render.RenderSettings(management_routes=True))
    assert not [r for r in opened if r.get("direct_response", {}).get("status") == 403]
    assert first_route(opened, "/v2/repository/index", {})["route"]["cluster"] == "gateway"
    method = "/inference.GRPCInferenceService/RepositoryModelUnload"
    assert first_route(opened, method, GRPC)["route"]["cluster"] == "sidecar"
    # The same through the operator's command line (tracked files untouched).
    before = render.OUTPUT.read_text()
    out = tmp_path / "envoy.yaml"
    assert render.main(["--management-routes", "--out", str(out)]) == 0
    assert render.OUTPUT.read_text() == before
    routes = manager(out.read_text())["route_config"]["virtual_hosts"][0]["routes"]
    assert first_route(routes, "/v2/logging", {})["route"]["cluster"] == "gateway"
    assert render.main(["--out", str(out)]) == 0
    routes = manager(out.read_text())["route_config"]["virtual_hosts"][0]["routes"]
    assert first_route(routes, "/v2/logging", {})["direct_response"]["status"] == 403


def test_management_routes_needs_out() -> None:
    with pytest.raises(SystemExit) as exited:
        render.main(["--management-routes"])
    assert exited.value.code == 2


def test_the_surfaces_list_is_what_the_refusals_are_made_of() -> None:
    """A prefix or method added to modelyard.common.surfaces is refused at the edge with no
    change here (the rendered files are regenerated from it)."""
    text = render.render(render.RenderSettings())
    for prefix in MANAGEMENT_PATH_PREFIXES:
        assert f"path_separated_prefix: {prefix}\n" in text
    assert render.OUTPUT.read_text() == text
