"""The shipped dashboard and alert rules (deploy/observability/) name only metrics that exist: a
real service (`--workers 2`, so the supervisor's series are there too), a sidecar in front of it
and a gateway in front of that are scraped after some traffic, and every metric name in the
dashboard's PromQL expressions and the rules' must be in those scrapes (or be a recording rule's
output). GPU memory is exported only where NVML sees a device: its collector is scraped with a
device reading given to it."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from models import demo_models
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.service.gpu_memory import DeviceMemory, GpuMemoryCollector
from tests.sidecar_support import admin_async, infer, known_versions, running_sidecar
from tests.support import REPO_ROOT, ServiceProcess, start_child

OBSERVABILITY = REPO_ROOT / "deploy" / "observability"
DASHBOARD = OBSERVABILITY / "grafana-dashboard.json"
RULES = OBSERVABILITY / "alerts.yaml"
_GATEWAY_SERVING = re.compile(r"serving HTTP on (http://\S+) \(metrics on (http://\S+)\)")

# PromQL words that are not metric names, and the label lists that follow some of them.
_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"})
_KEYWORDS |= frozenset({"and", "or", "unless", "inf", "nan"})
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_DURATION = re.compile(r"(?<![A-Za-z0-9_:])(?:\d+(?:ms|[smhdwy]))+(?![A-Za-z0-9_:])")
_NUMBER = re.compile(r"(?<![A-Za-z0-9_:])\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
_IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_LABEL_VALUES = re.compile(r"label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: its identifiers that are not functions,
    aggregations, keywords, label names (in matchers and in by/on/... lists) or numbers."""
    text = _STRING.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers (and Grafana's $variables in them)
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range and subquery durations, $__rate_interval
    text = _LABEL_LIST.sub(" ", text)
    text = _DURATION.sub(" ", text)  # offset 5m
    text = _NUMBER.sub(" ", text)
    names = set()
    for match in _IDENTIFIER.finditer(text):
        if text[match.end() :].lstrip().startswith("("):
            continue  # a function or an aggregation
        if match.group() not in _KEYWORDS:
            names.add(match.group())
    return names


def dashboard_expressions() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    exprs: list[str] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            exprs.extend(str(target["expr"]) for target in panel.get("targets", ()))
            walk(panel.get("panels", []))

    walk(doc["panels"])
    for variable in doc.get("templating", {}).get("list", []):
        query = variable.get("query")
        text = query.get("query", "") if isinstance(query, dict) else str(query or "")
        exprs.extend(f"count({name})" for name in _LABEL_VALUES.findall(text))
    return exprs


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def exported_names(text: str) -> set[str]:
    """Every sample name a scrape's families export (a family without series yet still says, by
    its TYPE line, which names it exports)."""
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_count", "_sum", "_created"),
        "summary": ("", "_count", "_sum", "_created"),
        "gauge": ("",),
    }
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.update(family.name + suffix for suffix in suffixes.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names


def missing(used: set[str], exported: set[str], recorded: set[str]) -> set[str]:
    return {name for name in used if name not in exported and name not in recorded}


def test_the_expression_parser_finds_metric_names_only() -> None:
    expr = (
        'sum by (model, dye) (rate(a_total{fault="true", x=~"$model"}[5m])'
        " or rate(a_total[$__rate_interval]) * 0)"
        " / on (model) group_left () max without (le) (b_bucket offset 5m) > bool 1e-3"
        " and histogram_quantile(0.99, c:recorded) unless d"
    )
    assert metric_names(expr) == {"a_total", "b_bucket", "c:recorded", "d"}
    assert missing({"a_total", "nope_total", "c:recorded"}, {"a_total"}, {"c:recorded"}) == {"nope_total"}


def _promtool() -> str:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (make system-deps installs it); make lint runs it")
    return promtool


def test_the_rules_file_passes_promtool() -> None:
    checked = subprocess.run([_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_every_dashboard_expression_is_valid_promql(tmp_path: Path) -> None:
    """promtool parses each expression as a recording rule's (Grafana's variables given values)."""
    exprs = dashboard_expressions()
    assert len(exprs) > 20
    values = {"$__rate_interval": "5m", "$model": ".*"}
    rules_doc = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:expr_{index}", "expr": reduce_vars(expr, values)}
                    for index, expr in enumerate(exprs)
                ],
            }
        ]
    }
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump(rules_doc))
    checked = subprocess.run([_promtool(), "check", "rules", str(path)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"{len(exprs)} rules found" in checked.stdout


def reduce_vars(expr: str, values: dict[str, str]) -> str:
    for name, value in values.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, expr
    return expr


@pytest.fixture
def stack_repository(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    scaler = {"max_batch_size": 64, "version_policy": {"latest": 2}}
    demo_models.write_model(root, "scaler", 1, demo_models.scaled_identity(16, 2.0), scaler)
    demo_models.write_model(root, "scaler", 2, demo_models.scaled_identity(16, 3.0), scaler)
    assert demo_models.copy_trained_models(demo_models.COMMITTED_ROOT, root) == ["codelm"]
    return root


async def _get(url: str) -> str:
    """Off the loop: the gateway's call goes through the sidecar on this very loop."""

    def get() -> str:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return str(reply.read().decode())

    return await asyncio.to_thread(get)


async def test_every_metric_the_dashboard_and_rules_name_is_in_a_real_scrape(
    tmp_path: Path, stack_repository: Path, service_process: Any
) -> None:
    service: ServiceProcess = service_process(stack_repository, "--workers", "2")
    assert service.metrics_url is not None
    routes = tmp_path / "routes.yaml"
    doc = {
        "models": {"scaler": {"canary_weight": 50}},
        "shadow": {"share": 100, "max_in_flight": 4},
        "tenants": {"acme": {"rate": 1000, "burst": 1000}},
    }
    routes.write_text(yaml.safe_dump(doc))
    async with running_sidecar([service.address], config=routes) as sidecar:
        await known_versions(sidecar, "scaler", {"1", "2"})
        gateway = start_child(
            [
                sys.executable,
                "-m",
                "modelyard.gateway",
                "--listen",
                "127.0.0.1:0",
                "--metrics-listen",
                "127.0.0.1:0",
            ],
            _GATEWAY_SERVING,
            "gateway",
            env={"MODELYARD_GATEWAY_UPSTREAM": sidecar.address, "PATH": "/usr/bin:/bin"},
        )
        try:
            async with grpc.aio.insecure_channel(sidecar.address) as channel:
                for user in range(10):
                    await infer(channel, user=f"user-{user}", metadata=[("x-tenant-id", "acme")])
                await infer(channel, metadata=[("x-canary-weight", "100")])  # a canary call, surely
                stub = pb_grpc.InferenceServiceStub(channel)
                request = pb.GenerateRequest(model_name="codelm", prompt="def f(", max_tokens=3)
                assert [e async for e in stub.Generate(request, timeout=30)]
                with pytest.raises(grpc.aio.AioRpcError):
                    await infer(channel, "nosuch")
            base = gateway.ready.group(1)
            assert "scaler" in (await _get(base + "/v1/models"))
            scrapes = {
                "service": await _get(service.metrics_url),
                "sidecar": str(await admin_async(sidecar, "/metrics")),
                "gateway": await _get(gateway.ready.group(2)),  # its own metrics listener
            }
        finally:
            gateway.stop(signal.SIGTERM)
    registry = CollectorRegistry()
    registry.register(GpuMemoryCollector(lambda: [DeviceMemory(0, 1 << 30, 80 << 30)]))
    scrapes["gpu"] = generate_latest(registry).decode()
    scrapes["rollouts"] = _rollout_controller_scrape()

    exported = set().union(*(exported_names(text) for text in scrapes.values()))
    # The traffic really went through each of them, as the test means.
    assert "modelyard_worker_restarts_total" in exported and "modelyard_gateway_requests_total" in exported
    assert 'dye="canary"' in scrapes["sidecar"] and 'method="Generate"' in scrapes["service"]

    all_rules = rules()
    recorded = {str(rule["record"]) for rule in all_rules if "record" in rule}
    assert recorded and all(":" in name for name in recorded)
    by_source = {
        "dashboard": set().union(*(metric_names(e) for e in dashboard_expressions())),
        "rules": set().union(*(metric_names(str(rule["expr"])) for rule in all_rules)),
    }
    for source, used in by_source.items():
        assert used, f"no metric names found in the {source}"
        absent = sorted(missing(used, exported, recorded))
        assert not absent, f"the {source} names metrics that no scrape has: {absent}"
    # What the dashboard is for: each of these graphed.
    assert by_source["dashboard"] >= {
        "modelyard_sidecar_requests_total",  # per-version rate
        "modelyard_sidecar_attempts_total",  # per-version fault ratio
        "modelyard_sidecar_request_seconds_bucket",  # per-version latency
        "modelyard_sidecar_breaker_state",
        "modelyard_sidecar_dye_fallbacks_total",
        "modelyard_sidecar_shadow_rows_agreeing_total",
        "modelyard_sidecar_shadow_tokens_agreeing_total",
        "modelyard_queue_depth",
        "modelyard_generation_time_to_first_token_seconds_bucket",
        "modelyard_generation_tokens_total",
        "modelyard_gpu_memory_used_bytes",
        "modelyard_gateway_requests_total",
    }
    alerts = {str(rule["alert"]) for rule in all_rules if "alert" in rule}
    assert alerts == {
        "ModelyardBreakerOpen",
        "ModelyardCanaryErrorRateOverStable",
        "ModelyardQueueFull",
        "ModelyardModelLoadFailed",
        "ModelyardWorkerRestarts",
        "ModelyardRolloutStuck",
        "ModelyardRolloutRolledBack",
    }


def _rollout_controller_scrape() -> str:
    """The fleet rollout controller's metrics (modelyard.sidecar.fleet) with one rollout in them,
    rolled back and held, as its /metrics renders them (tests/sidecar/integration/test_fleet_rollout.py
    scrapes the real process)."""
    from modelyard.sidecar.fleet.controller import ControllerMetrics, Managed
    from modelyard.sidecar.rollout.policy import Rollout, RolloutSpec

    registry = CollectorRegistry()
    metrics = ControllerMetrics(registry)
    rollout = Rollout.begin("scaler", RolloutSpec(steps=(10, 100)), 1000.0, "2", by="t", origin="admin")
    metrics.show("scaler", Managed(rollout, held="no Prometheus", held_kind="prometheus"), synced=True)
    metrics.transitions.labels("scaler", "failed").inc()
    metrics.sidecar_up.labels("http://10.0.0.7:9101").set(1)
    metrics.leader.set(1)
    return generate_latest(registry).decode()
