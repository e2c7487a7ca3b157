"""envoy/python/render.py's command line and header policy: an operator's variant is rendered to --out
without touching the tracked files; by default every route removes a client's x-canary-weight and
x-model-dye (and sets the operator's weight where rendered)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from modelyard.envoy import render


def routes_of(text: str) -> list[dict[str, object]]:
    """The routes that forward (not those Envoy answers itself: the gateway's private paths)."""
    doc = yaml.safe_load(text)
    manager = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    routes: list[dict[str, object]] = manager["route_config"]["virtual_hosts"][0]["routes"]
    return [r for r in routes if "route" in r]


def test_out_renders_the_operators_weights_and_leaves_tracked_files_alone(tmp_path: Path) -> None:
    before = render.OUTPUT.read_text()
    out = tmp_path / "envoy.yaml"
    assert render.main(["--canary", "scaler=10", "--canary-weight", "3", "--out", str(out)]) == 0
    assert render.OUTPUT.read_text() == before
    routes = routes_of(out.read_text())
    assert all(r["request_headers_to_remove"] == ["x-canary-weight", "x-model-dye"] for r in routes)
    added = {str(r["match"]): r["request_headers_to_add"][0]["header"]["value"] for r in routes}  # type: ignore[index]
    assert added["{'prefix': '/v2/models/scaler/'}"] == "10" and added["{'prefix': '/'}"] == "3"


def test_client_weights_pass_only_when_the_render_allows_them(tmp_path: Path) -> None:
    out = tmp_path / "envoy.yaml"
    assert render.main(["--allow-client-weights", "--out", str(out)]) == 0
    assert all(r["request_headers_to_remove"] == ["x-model-dye"] for r in routes_of(out.read_text()))
    default = routes_of(render.render(render.RenderSettings()))
    assert all("x-canary-weight" in r["request_headers_to_remove"] for r in default)  # type: ignore[operator]


@pytest.mark.parametrize(
    "argv",
    [["--canary", "scaler=10"], ["--canary", "scaler=101", "--out", "x"], ["--canary", "=5", "--out", "x"]],
)
def test_operator_settings_need_out_and_good_weights(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        render.main(argv)
    assert exited.value.code == 2
