"""The custom resources the overlays use, checked against their CRDs' own schemas: the
openAPIV3Schema of each kind, vendored from the project that defines it (tests/data/crds/, pinned to
a release, trimmed to those kinds' served-and-stored version), applied as the Kubernetes API server
applies a structural schema under `kubectl apply --validate=strict`: an unknown field anywhere is
refused unless its object says `x-kubernetes-preserve-unknown-fields`, `nullable` admits null, and
`metadata` is checked as the API's ObjectMeta (kubernetes-validate's strict schema). Not checked
(the API server's own code, not the schema): CEL rules (`x-kubernetes-validations`) and `format`s.

`python -m tests.crds ISTIO_CRD_ALL PODMONITORS` rewrites the vendored files from those upstream
files (SOURCES names each one's repository, release, commit and path).
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib.resources
import json
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml
from referencing import Registry, Resource

ROOT = Path(__file__).resolve().parents[1]
CRDS = ROOT / "tests" / "data" / "crds"
APACHE = "Apache License 2.0 (https://www.apache.org/licenses/LICENSE-2.0); see the repository's LICENSE"
SOURCES: dict[str, dict[str, Any]] = {
    "istio-networking.yaml": {
        "repository": "https://github.com/istio/istio",
        "release": "1.30.3",
        "commit": "56df41f63e513f834c9a3af33d8aed82d1d961f2",
        "path": "manifests/charts/base/files/crd-all.gen.yaml",
        "copyright": "Copyright Istio Authors",
        "kinds": ["DestinationRule", "Gateway", "VirtualService"],
    },
    "prometheus-operator.yaml": {
        "repository": "https://github.com/prometheus-operator/prometheus-operator",
        "release": "v0.93.0",
        "commit": "f8fafd475f3d132e239432ae6172de60a6cb6516",
        "path": "example/prometheus-operator-crd/monitoring.coreos.com_podmonitors.yaml",
        "copyright": "Copyright The prometheus-operator Authors",
        "kinds": ["PodMonitor"],
    },
}
OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"


class UnknownKind(Exception):
    """A custom resource whose CRD schema is not vendored here."""


@functools.cache
def schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> that version's openAPIV3Schema, made strict."""
    found = {}
    for name in SOURCES:
        for crd in yaml.safe_load_all((CRDS / name).read_text()):
            for version in crd["spec"]["versions"]:
                api_version = f"{crd['spec']['group']}/{version['name']}"
                schema = version["schema"]["openAPIV3Schema"]
                found[api_version, crd["spec"]["names"]["kind"]] = _strict(schema)
    return found


def _strict(node: dict[str, Any]) -> dict[str, Any]:
    """The structural skeleton (properties, items, additionalProperties; not the value checks
    under allOf/anyOf/oneOf/not) with unknown fields refused where Kubernetes would prune them."""
    node = dict(node)
    if node.get("nullable") and isinstance(node.get("type"), str):
        node["type"] = [node["type"], "null"]
    preserve = node.get("x-kubernetes-preserve-unknown-fields") is True
    if "properties" in node:
        node["properties"] = {k: _strict(v) for k, v in node["properties"].items()}
    if isinstance(node.get("additionalProperties"), dict):
        node["additionalProperties"] = _strict(node["additionalProperties"])
    elif node.get("type") == "object" and "additionalProperties" not in node and not preserve:
        node["additionalProperties"] = False
    if isinstance(node.get("items"), dict):
        node["items"] = _strict(node["items"])
    return node


@functools.cache
def _object_meta() -> jsonschema.protocols.Validator:
    folder = f"v{kubernetes_validate.latest_version()}-local-strict"
    files = importlib.resources.files("kubernetes_validate") / "kubernetes-json-schema" / folder
    definitions = json.loads((files / "_definitions.json").read_text())
    resource = Resource.from_contents(definitions)
    schema = {"$ref": f"{definitions['$id']}#/$defs/{OBJECT_META}"}
    return jsonschema.Draft202012Validator(schema, registry=resource @ Registry())


def errors(doc: dict[str, Any]) -> list[str]:
    """What the API server would refuse in `doc` (a custom resource), one line each."""
    schema = schemas().get((doc.get("apiVersion", ""), doc.get("kind", "")))
    if schema is None:
        raise UnknownKind(f"{doc.get('apiVersion')} {doc.get('kind')}: no CRD schema in {CRDS}")
    schema = copy.deepcopy(schema)
    # The fields every object has (a CRD's schema may leave them out); metadata is checked below.
    schema["properties"].update(apiVersion={"type": "string"}, kind={"type": "string"}, metadata={})
    where = f"{doc['kind']}/{doc.get('metadata', {}).get('name')}"
    found = [
        f"{where}: {'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
        for e in jsonschema.Draft4Validator(schema).iter_errors(doc)  # OpenAPI 3.0's dialect
    ]
    found += [
        f"{where}: metadata.{'.'.join(map(str, e.absolute_path))}: {e.message}"
        for e in _object_meta().iter_errors(doc.get("metadata", {}))
    ]
    return found


def main(argv: list[str]) -> int:
    """Trim the upstream CRD files (in SOURCES' order) into tests/data/crds/."""
    parser = argparse.ArgumentParser(prog="python -m tests.crds", description=__doc__)
    for name, source in SOURCES.items():
        parser.add_argument(name.removesuffix(".yaml"), help=f"{source['repository']}'s {source['path']}")
    upstreams = list(vars(parser.parse_args(argv)).values())
    CRDS.mkdir(parents=True, exist_ok=True)
    for (name, source), upstream in zip(SOURCES.items(), upstreams, strict=True):
        kept = []
        for crd in yaml.safe_load_all(Path(upstream).read_text()):
            if not crd or crd["spec"]["names"]["kind"] not in source["kinds"]:
                continue
            versions = [v for v in crd["spec"]["versions"] if v.get("storage")]
            kept.append(
                {
                    "apiVersion": crd["apiVersion"],
                    "kind": crd["kind"],
                    "metadata": {"name": crd["metadata"]["name"]},
                    "spec": {**crd["spec"], "versions": versions},
                }
            )
        assert sorted(c["spec"]["names"]["kind"] for c in kept) == sorted(source["kinds"]), upstream
        header = (
            f"# {', '.join(source['kinds'])}: the CRDs' stored version, trimmed (other kinds and versions\n"
            "# dropped) by `python -m tests.crds` from\n"
            f"# {source['repository']} release {source['release']}\n"
            f"# (commit {source['commit']}), {source['path']}.\n# {source['copyright']}; {APACHE}.\n"
        )
        body = yaml.safe_dump_all(kept, sort_keys=False, width=1000)
        (CRDS / name).write_text(header + body)
        print(f"wrote {CRDS / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
