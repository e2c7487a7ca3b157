"""deploy/kubernetes (the base) and deploy/overlays/*: every manifest of every kustomize build
valid against the Kubernetes API schemas (kubernetes-validate, offline, strict) and every custom
resource against its CRD's schema (tests/crds.py: Istio's, the Prometheus operator's), the API
server's own checks that no schema holds (quantities, names, selectors), every pod
meeting Pod Security "restricted", the builds equal to their committed renders (deploy/rendered,
when kubectl's kustomize is here), and the pieces agreeing with each other and with the
processes: each container's arguments parse with its process's own settings parser, probes and
Services name ports the containers listen on, Envoy's and the gateway's upstream names are
Services with those ports, what the kustomization generates is what the pods mount, autoscalers,
disruption budgets and spread name real Deployments, and the overlays do what they say."""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from modelyard.envoy import render
from modelyard.gateway.settings import parse_settings as gateway_settings
from modelyard.service.settings import parse_settings as service_settings
from modelyard.sidecar.fleet.settings import parse_settings as rollouts_settings
from modelyard.sidecar.routes.route_table import parse_table
from modelyard.sidecar.settings import parse_settings as sidecar_settings
from tests import crds, kubernetes_renders

ROOT = Path(__file__).resolve().parents[3]
KUBERNETES = ROOT / "deploy" / "kubernetes"
KUSTOMIZATION = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
OLDEST = "1.30"  # preStop `sleep` (beta, on by default) first validates here
PARSERS: dict[str, Callable[[list[str]], Any]] = {
    "serve": service_settings,
    "sidecar": sidecar_settings,
    "gateway": gateway_settings,
    "rollouts": rollouts_settings,
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


@functools.cache
def rendered(build: str) -> list[dict[str, Any]]:
    """The committed render of a build (base, or an overlay's name): what `kubectl apply -k` applies."""
    text = (kubernetes_renders.RENDERED / f"{build}.yaml").read_text()
    return [d for d in yaml.safe_load_all(text) if d]


# Custom resources: not in kubernetes-validate; checked against their CRDs' own schemas (tests/crds.py).
CUSTOM = {"networking.istio.io", "monitoring.coreos.com"}


def is_custom(doc: dict[str, Any]) -> bool:
    return str(doc["apiVersion"]).split("/")[0] in CUSTOM


def test_every_build_is_rendered_and_every_overlay_built() -> None:
    assert set(kubernetes_renders.BUILDS) == {
        "base",
        "gpu",
        "models-pvc",
        "models-init",
        "monitoring",
        "istio",
    }
    committed = {p.stem for p in kubernetes_renders.RENDERED.glob("*.yaml")}
    assert committed == set(kubernetes_renders.BUILDS)


@pytest.mark.skipif(kubernetes_renders.kubectl() is None, reason="no kubectl (kustomize) on this machine")
def test_the_committed_renders_are_the_kustomize_builds() -> None:
    for name, text in kubernetes_renders.build_all().items():
        committed = (kubernetes_renders.RENDERED / f"{name}.yaml").read_text()
        assert text == committed, f"deploy/rendered/{name}.yaml is stale: python -m tests.kubernetes_renders"


@pytest.mark.parametrize("build", kubernetes_renders.BUILDS)
@pytest.mark.parametrize("version", [OLDEST, str(kubernetes_validate.latest_version())])
def test_every_manifest_is_valid_against_the_api_schema(build: str, version: str) -> None:
    docs = rendered(build)
    assert {d["kind"] for d in docs} >= {"Deployment", "Service", "NetworkPolicy"}
    for doc in docs:
        if not is_custom(doc):
            kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("build", kubernetes_renders.BUILDS)
def test_every_custom_resource_is_valid_against_its_crd_schema(build: str) -> None:
    assert [e for doc in rendered(build) if is_custom(doc) for e in crds.errors(doc)] == []


def test_the_vendored_crds_are_the_kinds_the_overlays_use() -> None:
    used = {
        (d["apiVersion"], d["kind"]) for b in kubernetes_renders.BUILDS for d in rendered(b) if is_custom(d)
    }
    assert used == set(crds.schemas())
    with pytest.raises(crds.UnknownKind):
        crds.errors({"apiVersion": "networking.istio.io/v1", "kind": "ServiceEntry", "metadata": {}})


def _custom(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [
        copy.deepcopy(d)
        for b in kubernetes_renders.BUILDS
        for d in rendered(b)
        if d["kind"] == kind and d["metadata"]["name"] == name
    ][:1]
    return doc


@pytest.mark.parametrize(
    ("kind", "name", "change", "expected"),
    [
        (
            "VirtualService",
            "modelyard",
            lambda d: d["spec"]["http"][0].update(retry={}),
            "'retry' was unexpected",
        ),
        (
            "VirtualService",
            "modelyard",
            lambda d: d["spec"]["http"][0]["route"][0]["destination"]["port"].update(number="50051"),
            "not of type 'integer'",
        ),
        (
            "DestinationRule",
            "modelyard-gateway-http",
            lambda d: d["spec"]["trafficPolicy"]["loadBalancer"].update(simple="ROUND_ROBIN"),
            "valid under each of",  # simple and consistentHash: one of them only
        ),
        (
            "Gateway",
            "modelyard",
            lambda d: d["spec"]["servers"][0].update(tls_mode="x"),
            "'tls_mode' was unexpected",
        ),
        (
            "PodMonitor",
            "modelyard-inference",
            lambda d: d["spec"]["podMetricsEndpoints"][0].update(scheme="gopher"),
            "'gopher' is not one of",
        ),
        (
            "PodMonitor",
            "modelyard-inference",
            lambda d: d["metadata"].update(label={}),
            "'label' was unexpected",
        ),
        ("Gateway", "modelyard", lambda d: d.update(specs={}), "'specs' was unexpected"),
    ],
)
def test_the_crd_check_refuses_unknown_fields_and_wrong_values(
    kind: str, name: str, change: Callable[[dict[str, Any]], object], expected: str
) -> None:
    doc = _custom(kind, name)
    assert crds.errors(doc) == []
    change(doc)
    assert [e for e in crds.errors(doc) if expected in e], crds.errors(doc)


def test_the_crd_check_keeps_what_the_schema_preserves() -> None:
    # Istio's `status` is x-kubernetes-preserve-unknown-fields: an unknown field there is kept, as
    # on a cluster, while its specified parts (conditions) still refuse theirs.
    doc = _custom("Gateway", "modelyard")
    doc["status"] = {"anything": {"nested": 1}}
    assert crds.errors(doc) == []
    doc["status"] = {"conditions": [{"anything": 1}]}
    assert [e for e in crds.errors(doc) if "'anything' was unexpected" in e]


def test_the_schema_check_catches_a_wrong_field() -> None:
    deployment = yaml.safe_load((KUBERNETES / "modelyard.yaml").read_text().split("\n---")[0])
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grcp"] = {"port": 1}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, OLDEST, strict=True)


# What the API server checks beyond the schemas (its validation code, which the JSON schemas leave
# out): the quantity grammar, object, container and port names, and a Deployment's selector.
QUANTITY = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?\d+)?")
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # RFC 1123
DNS_1035 = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")  # a Service's name
PORT_NAME = re.compile(r"(?=.*[a-z])(?!.*--)[a-z0-9]([-a-z0-9]{0,13}[a-z0-9])?")  # IANA service name


def quantities(doc: dict[str, Any]) -> Iterator[tuple[str, object]]:
    for name, pod in pod_specs([doc]):
        for container in pod.get("initContainers", []) + pod["containers"]:
            for bound in ("requests", "limits"):
                for resource, value in container.get("resources", {}).get(bound, {}).items():
                    yield f"{name}/{container['name']} {bound}.{resource}", value
        for volume in pod.get("volumes", []):
            if "sizeLimit" in volume.get("emptyDir", {}):
                yield f"{name} volume {volume['name']}", volume["emptyDir"]["sizeLimit"]
    if doc["kind"] == "PersistentVolumeClaim":
        for resource, value in doc["spec"]["resources"]["requests"].items():
            yield f"{doc['metadata']['name']} {resource}", value


def api_server_violations(doc: dict[str, Any]) -> list[str]:
    found = []
    name = str(doc["metadata"]["name"])
    rule = DNS_1035 if doc["kind"] == "Service" else DNS_LABEL
    if not all(rule.fullmatch(part) for part in ([name] if doc["kind"] == "Service" else name.split("."))):
        found.append(f"{doc['kind']} {name}: not a valid name")
    for where, value in quantities(doc):
        if not QUANTITY.fullmatch(str(value)):
            found.append(f"{where}: {value!r} is not a quantity")
    for pod_name, pod in pod_specs([doc]):
        containers = pod.get("initContainers", []) + pod["containers"]
        if len({c["name"] for c in containers}) != len(containers):
            found.append(f"{pod_name}: container names repeat")
        for container in containers:
            if not DNS_LABEL.fullmatch(container["name"]):
                found.append(f"{pod_name}/{container['name']}: not a valid container name")
            for entry in container.get("ports", []):
                if "name" in entry and not PORT_NAME.fullmatch(entry["name"]):
                    found.append(f"{pod_name}/{container['name']}: port name {entry['name']!r}")
    if doc["kind"] == "Deployment":
        selector = doc["spec"]["selector"]["matchLabels"].items()
        if not selector <= doc["spec"]["template"]["metadata"]["labels"].items():
            found.append(f"{name}: the selector does not match the pod template's labels")
    return found


@pytest.mark.parametrize("build", kubernetes_renders.BUILDS)
def test_every_manifest_passes_the_api_servers_own_checks(build: str) -> None:
    docs = rendered(build)
    assert [q for d in docs for q in quantities(d)]  # there are some to check
    assert [v for doc in docs for v in api_server_violations(doc)] == []


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            lambda d: d["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"].update(
                cpu="lots"
            ),
            "quantity",
        ),
        (
            lambda d: d["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"].update(
                memory="1GB"
            ),
            "quantity",
        ),
        (
            lambda d: d["spec"]["template"]["spec"]["containers"][0]["ports"][0].update(
                name="a-very-long-port-name"
            ),
            "port name",
        ),
        (lambda d: d["spec"]["template"]["spec"]["containers"][1].update(name="Sidecar"), "container name"),
        (lambda d: d["spec"]["selector"]["matchLabels"].update(tier="x"), "selector"),
        (lambda d: d["metadata"].update(name="Modelyard"), "valid name"),
    ],
)
def test_the_api_server_checks_catch_each_rule(
    change: Callable[[dict[str, Any]], object], expected: str
) -> None:
    deployment = copy.deepcopy(named(rendered("base"), "Deployment", "modelyard"))
    assert api_server_violations(deployment) == []
    change(deployment)
    assert [v for v in api_server_violations(deployment) if expected in v]


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


def test_the_istio_overlay_routes_to_clusterip_services_without_retrying_answers() -> None:
    docs = rendered("istio")
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    (virtual,) = [d for d in docs if d["kind"] == "VirtualService"]
    for route in virtual["spec"]["http"]:
        for destination in route["route"]:
            service = services[destination["destination"]["host"]]
            # Istio ignores a DestinationRule's load balancing for a headless Service.
            assert service["spec"].get("clusterIP") != "None", destination
            assert destination["destination"]["port"]["number"] in {
                p["port"] for p in service["spec"]["ports"]
            }
        if route["route"][0]["destination"]["port"]["number"] == 50051 or route["name"] == "streams":
            assert route["timeout"] == "0s", f"{route['name']}: a stream needs no route timeout"
        # Explicit: none, or only connections that could not be made (never the sidecar's
        # breaker_open/draining answers, which are UNAVAILABLE by design).
        retries = route["retries"]
        assert retries["attempts"] == 0 or retries["retryOn"] == "connect-failure", route["name"]
    assert virtual["spec"]["http"][2]["name"] == "streams" and virtual["spec"]["http"][2]["retries"] == {
        "attempts": 0
    }
    rules = {d["spec"]["host"]: d for d in docs if d["kind"] == "DestinationRule"}
    assert set(rules) <= set(services)
    hashed = [r for r in rules.values() if "consistentHash" in r["spec"]["trafficPolicy"]["loadBalancer"]]
    (rule,) = hashed
    cookie = rule["spec"]["trafficPolicy"]["loadBalancer"]["consistentHash"]["httpCookie"]["name"]
    edge = yaml.safe_load((KUBERNETES / "envoy.yaml").read_text())
    assert f"name: {cookie}" in yaml.safe_dump(edge)  # the same cookie as the Envoy edge's
    for host, destination in rules.items():
        outlier = destination["spec"]["trafficPolicy"]["outlierDetection"]
        # Only local-origin failures eject a pod: a sidecar's answers (any status) never do.
        assert outlier["splitExternalLocalOriginErrors"] is True, host
        assert outlier["consecutive5xxErrors"] == outlier["consecutiveGatewayErrors"] == 0, host
    kinds = {d["kind"] for d in docs}
    assert not [d for d in docs if d["metadata"]["name"] == "modelyard-edge"], "the Envoy edge is replaced"
    assert {"Gateway", "VirtualService", "DestinationRule"} <= kinds


# --- Pod Security "restricted" ------------------------------------------------------------------

# The volume types the restricted profile allows.
RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


def pod_specs(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for doc in docs:
        template = doc.get("spec", {}).get("template", {}).get("spec")
        if doc["kind"] == "Pod":
            template = doc["spec"]
        if template is not None:
            yield doc["metadata"]["name"], template


def restricted_violations(name: str, pod: dict[str, Any]) -> list[str]:
    """The Pod Security Standards' restricted rules (v1.30+), and a read-only root file system."""
    found = []
    context = pod.get("securityContext", {})
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(host):
            found.append(f"{name}: {host}")
    for volume in pod.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            found.append(f"{name}: volume {volume['name']} is {kinds}")
    for container in pod.get("initContainers", []) + pod["containers"]:
        where = f"{name}/{container['name']}"
        own = container.get("securityContext", {})
        if own.get("privileged"):
            found.append(f"{where}: privileged")
        if own.get("allowPrivilegeEscalation") is not False:
            found.append(f"{where}: allowPrivilegeEscalation must be false")
        if own.get("runAsNonRoot", context.get("runAsNonRoot")) is not True:
            found.append(f"{where}: runAsNonRoot")
        if own.get("runAsUser", context.get("runAsUser")) == 0:
            found.append(f"{where}: runAsUser 0")
        seccomp = own.get("seccompProfile", context.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            found.append(f"{where}: seccompProfile {seccomp}")
        capabilities = own.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []):
            found.append(f"{where}: capabilities must drop ALL")
        if set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"{where}: adds {capabilities['add']}")
        if any(p.get("hostPort") for p in container.get("ports", [])):
            found.append(f"{where}: hostPort")
        if own.get("readOnlyRootFilesystem") is not True:
            found.append(f"{where}: readOnlyRootFilesystem")
    return found


@pytest.mark.parametrize("build", kubernetes_renders.BUILDS)
def test_every_pod_meets_the_restricted_profile(build: str) -> None:
    pods = list(pod_specs(rendered(build)))
    assert pods
    assert [v for name, pod in pods for v in restricted_violations(name, pod)] == []


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda pod: pod["containers"][0]["securityContext"].pop("capabilities"), "drop ALL"),
        (lambda pod: pod["securityContext"].pop("seccompProfile"), "seccompProfile"),
        (
            lambda pod: pod["containers"][1]["securityContext"].update(allowPrivilegeEscalation=True),
            "Escalation",
        ),
        (lambda pod: pod["containers"][0]["securityContext"].update(runAsNonRoot=False), "runAsNonRoot"),
        (lambda pod: pod["containers"][0]["securityContext"].pop("readOnlyRootFilesystem"), "readOnlyRoot"),
        (lambda pod: pod["volumes"].append({"name": "h", "hostPath": {"path": "/"}}), "hostPath"),
        (lambda pod: pod.update(hostNetwork=True), "hostNetwork"),
    ],
)
def test_the_restricted_check_catches_each_rule(
    change: Callable[[dict[str, Any]], object], expected: str
) -> None:
    (pod,) = [copy.deepcopy(p) for name, p in pod_specs(rendered("base")) if name == "modelyard"]
    assert restricted_violations("modelyard", pod) == []
    change(pod)
    assert [v for v in restricted_violations("modelyard", pod) if expected in v]


# --- The builds' pieces -------------------------------------------------------------------------


def named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


@pytest.mark.parametrize("build", kubernetes_renders.BUILDS)
def test_the_routes_configmap_is_updated_in_place_and_envoys_rolls(build: str) -> None:
    docs = rendered(build)
    names = {d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap"}
    # Unhashed: an edit to routes.yaml reaches the running sidecars (their in-place reload).
    assert "modelyard-routes" in names
    pod = named(docs, "Deployment", "modelyard")["spec"]["template"]["spec"]
    assert {"configMap": {"name": "modelyard-routes"}, "name": "routes"} in pod["volumes"]
    edge = [n for n in names if n.startswith("modelyard-edge")]
    assert all(n != "modelyard-edge" for n in edge), "Envoy does not re-read its file: hashed, it rolls"


@pytest.mark.parametrize("build", kubernetes_renders.BUILDS)
def test_each_containers_arguments_parse_in_every_build(build: str) -> None:
    for _, pod in pod_specs(rendered(build)):
        for container in pod["containers"]:
            args = container.get("args", [])
            if args and args[0] in PARSERS:
                PARSERS[args[0]](args[1:])


@pytest.mark.parametrize("build", kubernetes_renders.BUILDS)
def test_autoscalers_budgets_and_spread_name_real_deployments(build: str) -> None:
    docs = rendered(build)
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    scaled = set()
    for hpa in [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]:
        target = deployments[hpa["spec"]["scaleTargetRef"]["name"]]
        scaled.add(target["metadata"]["name"])
        # The autoscaler owns the count: a `replicas` in the Deployment would reset it on apply.
        assert "replicas" not in target["spec"], hpa["metadata"]["name"]
        assert hpa["spec"]["minReplicas"] >= 2
        for metric in hpa["spec"]["metrics"]:
            if metric["type"] == "Resource":
                for container in target["spec"]["template"]["spec"]["containers"]:
                    assert container["resources"]["requests"]["cpu"], "CPU utilization needs requests"
    expected = {"modelyard-gateway"} | ({"modelyard-edge"} if "modelyard-edge" in deployments else set())
    assert expected <= scaled
    budgets = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    for name, deployment in deployments.items():
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        covering = [b for b in budgets if b["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        assert len(covering) == 1, f"{name}: one PodDisruptionBudget"
        assert deployment["spec"].get("replicas", 2) >= 2 or name in scaled
        spread = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
        assert {s["topologyKey"] for s in spread} == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}
        for constraint in spread:
            assert constraint["labelSelector"]["matchLabels"].items() <= labels.items(), name


def test_the_edge_drains_before_it_stops() -> None:
    pod = named(rendered("base"), "Deployment", "modelyard-edge")["spec"]["template"]["spec"]
    (envoy,) = pod["containers"]
    hook = " ".join(envoy["lifecycle"]["preStop"]["exec"]["command"])
    admin = render.KUBERNETES.admin
    assert f"/dev/tcp/{admin[0]}/{admin[1]}" in hook and "POST /drain_listeners?graceful" in hook
    drain_s = int(envoy["args"][envoy["args"].index("--drain-time-s") + 1])
    assert f"sleep {drain_s}" in hook and drain_s < pod["terminationGracePeriodSeconds"]


def test_the_gpu_overlay_asks_for_a_gpu_and_runs_the_cuda_image() -> None:
    pod = named(rendered("gpu"), "Deployment", "modelyard")["spec"]["template"]["spec"]
    by_name = {c["name"]: c for c in pod["containers"]}
    service = by_name["service"]
    assert service["image"].startswith("modelyard-service-cuda")
    assert service["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert service_settings(service["args"][1:]).workers == "1"  # one copy of each model per device
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["nodeSelector"]
    assert by_name["sidecar"]["image"].startswith("modelyard-sidecar:")  # only the service changes


@pytest.mark.parametrize("build", ["models-pvc", "models-init"])
def test_the_model_overlays_mount_the_repository_the_service_serves(build: str) -> None:
    docs = rendered(build)
    pod = named(docs, "Deployment", "modelyard")["spec"]["template"]["spec"]
    service = next(c for c in pod["containers"] if c["name"] == "service")
    repository = str(service_settings(service["args"][1:]).repository)
    (mount,) = [m for m in service["volumeMounts"] if m["mountPath"] == repository]
    assert mount.get("readOnly") is True  # the service reads it; the publisher writes it
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    if build == "models-pvc":
        claim = volume["persistentVolumeClaim"]["claimName"]
        assert named(docs, "PersistentVolumeClaim", claim)
    else:
        assert "emptyDir" in volume
        (init,) = pod["initContainers"]
        assert not init["image"].startswith("modelyard")  # a stock image, not ours
        assert {m["name"] for m in init["volumeMounts"] if m["mountPath"] == repository} == {mount["name"]}


def test_the_monitoring_overlay_scrapes_what_the_pods_serve_and_scales_on_queue_depth() -> None:
    docs = rendered("monitoring")
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    for monitor in [d for d in docs if d["kind"] == "PodMonitor"]:
        labels = monitor["spec"]["selector"]["matchLabels"]
        (pod,) = [
            d
            for d in deployments.values()
            if labels.items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        ports = {p["name"] for c in pod["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
        assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} <= ports
    hpa = named(docs, "HorizontalPodAutoscaler", "modelyard")
    (metric,) = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    rules = yaml.safe_load(
        named(docs, "ConfigMap", "modelyard-prometheus-adapter-rules")["data"]["config.yaml"]
    )
    assert name in {r["name"]["as"] for r in rules["rules"]}
    # The series the rule reads is one the service exports.
    from modelyard.service.metrics import ServiceMetrics

    assert name in {family.name for family in ServiceMetrics().registry.collect()}


def test_the_monitoring_overlay_ships_the_dashboard_and_alert_rules_as_they_are_checked() -> None:
    observability = kubernetes_renders.DEPLOY / "observability"
    maps = {d["metadata"]["name"]: d for d in rendered("monitoring") if d["kind"] == "ConfigMap"}
    dashboard = maps["modelyard-grafana-dashboard"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert (
        dashboard["data"]["grafana-dashboard.json"] == (observability / "grafana-dashboard.json").read_text()
    )
    rules = maps["modelyard-alert-rules"]["data"]["alerts.yaml"]
    assert rules == (observability / "alerts.yaml").read_text()  # what promtool checks in make lint
