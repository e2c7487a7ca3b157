"""deploy/kubernetes: every manifest valid against the Kubernetes API schemas (kubernetes-validate,
offline), and the pieces agreeing with each other and with the processes: each container's
arguments parse with its process's own settings parser, probes and Services name ports the
containers listen on, Envoy's and the gateway's upstream names are Services with those ports, and
what the kustomization generates is what the pods mount."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from modelyard.envoy import render
from modelyard.gateway.config import parse_settings as gateway_settings
from modelyard.service.config import parse_settings as service_settings
from modelyard.sidecar.config import parse_settings as sidecar_settings
from modelyard.sidecar.routes import parse_table

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
KUSTOMIZATION = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
OLDEST = "1.30"  # preStop `sleep` (beta, on by default) first validates here
PARSERS: dict[str, Callable[[list[str]], Any]] = {
    "serve": service_settings,
    "sidecar": sidecar_settings,
    "gateway": gateway_settings,
}


def documents() -> list[dict[str, Any]]:
    docs = []
    for name in KUSTOMIZATION["resources"]:
        docs += [d for d in yaml.safe_load_all((KUBERNETES / name).read_text()) if d]
    return docs


DOCS = documents()


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [d for d in DOCS if d["kind"] == kind]


def containers() -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for deployment in of_kind("Deployment"):
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            yield deployment, container


def port(address: str) -> int:
    return int(address.rpartition(":")[2])


def flag(container: dict[str, Any], name: str) -> str:
    values = [str(a).split("=", 1)[1] for a in container["args"] if str(a).startswith(f"--{name}=")]
    assert len(values) == 1, f"{container['name']}: --{name}"
    return values[0]


@pytest.mark.parametrize("version", [OLDEST, str(kubernetes_validate.latest_version())])
def test_every_manifest_is_valid_against_the_api_schema(version: str) -> None:
    assert {d["kind"] for d in DOCS} >= {"Deployment", "Service", "NetworkPolicy"}
    for doc in DOCS:
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_schema_check_catches_a_wrong_field() -> None:
    deployment = yaml.safe_load((KUBERNETES / "modelyard.yaml").read_text().split("\n---")[0])
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grcp"] = {"port": 1}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, OLDEST, strict=True)


def test_each_containers_arguments_parse_with_its_process_settings() -> None:
    seen = set()
    for _, container in containers():
        command, *args = container["args"]
        if command not in PARSERS:  # Envoy: its config is validated by `envoy --mode validate`
            continue
        settings = PARSERS[command](args)
        seen.add(command)
        declared = {p["containerPort"] for p in container.get("ports", [])}
        listening = {port(settings.listen)}
        for extra in ("metrics_listen", "admin_listen"):
            if getattr(settings, extra, ""):
                listening.add(port(getattr(settings, extra)))
        assert declared == listening, f"{container['name']}: ports {declared} vs listeners {listening}"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            spec = container.get(probe)
            if spec:
                target = next(v for k, v in spec.items() if k in ("grpc", "httpGet", "tcpSocket"))["port"]
                named = {p["name"]: p["containerPort"] for p in container["ports"]}
                assert named.get(target, target) == port(settings.listen), f"{container['name']} {probe}"
    assert seen == set(PARSERS)


def test_the_sidecar_reaches_its_own_service_over_the_pods_loopback() -> None:
    (pod,) = [d for d in of_kind("Deployment") if d["metadata"]["name"] == "modelyard"]
    by_name = {c["name"]: c for c in pod["spec"]["template"]["spec"]["containers"]}
    upstream = sidecar_settings(by_name["sidecar"]["args"][1:]).upstream
    assert upstream == (f"127.0.0.1:{port(flag(by_name['service'], 'listen'))}",)
    # Both drain after the same pause: a service that drained first would fail its sidecar's calls.
    pauses = {name: c["lifecycle"]["preStop"]["sleep"]["seconds"] for name, c in by_name.items()}
    assert pauses["service"] == pauses["sidecar"] > 0


def service_named(name: str) -> dict[str, Any]:
    (service,) = [s for s in of_kind("Service") if s["metadata"]["name"] == name]
    return service


def test_services_select_pods_and_target_ports_they_declare() -> None:
    for service in of_kind("Service"):
        selector = service["spec"]["selector"]
        pods = [
            d
            for d in of_kind("Deployment")
            if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert pods, service["metadata"]["name"]
        names = {p["name"] for _, c in containers() for p in c.get("ports", []) if _ in pods}
        for entry in service["spec"]["ports"]:
            assert entry["targetPort"] in names, (service["metadata"]["name"], entry)


def test_envoy_and_the_gateway_call_headless_services_on_their_ports() -> None:
    edge = yaml.safe_load((KUBERNETES / "envoy.yaml").read_text())
    assert (KUBERNETES / "envoy.yaml").read_text() == render.render(render.KUBERNETES)
    gateway = next(c for _, c in containers() if c["args"][0] == "gateway")
    upstream = gateway_settings(gateway["args"][1:]).upstream
    assert upstream.startswith("dns:///")
    targets = [tuple(upstream.removeprefix("dns:///").split(":"))]
    for cluster in edge["static_resources"]["clusters"]:
        assert cluster["type"] == "STRICT_DNS"
        address = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
        targets.append((address["socket_address"]["address"], str(address["socket_address"]["port_value"])))
    for host, number in targets:
        service = service_named(host)
        assert service["spec"].get("clusterIP") == "None", f"{host}: a ClusterIP pins HTTP/2 to one pod"
        assert int(number) in {p["port"] for p in service["spec"]["ports"]}
    edge_container = next(c for _, c in containers() if c["name"] == "envoy")
    listener = edge["static_resources"]["listeners"][0]["address"]["socket_address"]
    assert listener["address"] == "0.0.0.0"
    assert {p["containerPort"] for p in edge_container["ports"]} == {listener["port_value"]}


def test_only_the_sidecar_and_metrics_ports_are_open_to_other_pods() -> None:
    (policy,) = of_kind("NetworkPolicy")
    allowed = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    (pod,) = [d for d in of_kind("Deployment") if d["metadata"]["name"] == "modelyard"]
    assert (
        policy["spec"]["podSelector"]["matchLabels"].items()
        <= pod["spec"]["template"]["metadata"]["labels"].items()
    )
    by_name = {c["name"]: c for c in pod["spec"]["template"]["spec"]["containers"]}
    service = by_name["service"]
    assert port(flag(service, "listen")) not in allowed
    assert port(flag(by_name["sidecar"], "listen")) in allowed
    assert port(flag(service, "metrics-listen")) in allowed


def test_what_the_kustomization_generates_is_what_the_pods_mount() -> None:
    generated = {g["name"] for g in KUSTOMIZATION["configMapGenerator"] + KUSTOMIZATION["secretGenerator"]}
    for generator in KUSTOMIZATION["configMapGenerator"]:
        for file in generator["files"]:
            assert (KUBERNETES / file.rpartition("=")[2]).is_file(), file
    mounted = set()
    for deployment in of_kind("Deployment"):
        for volume in deployment["spec"]["template"]["spec"].get("volumes", []):
            source = volume.get("configMap") or volume.get("secret") or {}
            name = source.get("name") or source.get("secretName")
            if name:
                mounted.add(name)
    assert mounted == generated
    images = {i["name"] for i in KUSTOMIZATION["images"]}
    used = {c["image"] for _, c in containers()}
    assert used - images == {c["image"] for _, c in containers() if c["name"] == "envoy"}
    secret_files = KUSTOMIZATION["secretGenerator"][0]["files"]
    mount_paths = {
        a.split("=", 1)[1] for _, c in containers() for a in c.get("args", []) if "tokens-file=" in a
    }
    assert {f"/etc/modelyard/tokens/{f.partition('=')[0]}" for f in secret_files} == mount_paths


def test_the_sidecars_route_file_parses() -> None:
    table = parse_table(yaml.safe_load((KUBERNETES / "routes.yaml").read_text()))
    assert table.stickiness_header == "x-user-id"


def test_the_istio_example_routes_to_the_same_services_and_headers() -> None:
    docs = list(yaml.safe_load_all((KUBERNETES / "istio" / "routing.yaml").read_text()))
    (virtual,) = [d for d in docs if d["kind"] == "VirtualService"]
    for route in virtual["spec"]["http"]:
        for destination in route["route"]:
            service = service_named(destination["destination"]["host"])
            assert destination["destination"]["port"]["number"] in {
                p["port"] for p in service["spec"]["ports"]
            }
        if route["route"][0]["destination"]["host"] == "modelyard-grpc" or route["name"] == "streams":
            assert route["timeout"] == "0s", f"{route['name']}: a stream needs no route timeout"
    (rule,) = [d for d in docs if d["kind"] == "DestinationRule"]
    cookie = rule["spec"]["trafficPolicy"]["loadBalancer"]["consistentHash"]["httpCookie"]["name"]
    edge = yaml.safe_load((KUBERNETES / "envoy.yaml").read_text())
    assert f"name: {cookie}" in yaml.safe_dump(edge)
