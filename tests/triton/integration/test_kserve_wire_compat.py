"""Wire compatibility of our KServe V2 contract with the descriptors tritonclient ships.

tritonclient and our generated code both register package `inference` in protobuf's default
descriptor pool, so they can never be imported into one process (duplicate symbol). tritonclient's
FileDescriptorProtos are therefore read in a subprocess and parsed here into plain
descriptor_pb2.FileDescriptorProto messages, which do not touch the pool.

What "compatible" means here, for every element of ours that tritonclient also has:
- each field of ours exists in theirs with the same number, type, label, type name, oneof
  membership and map-ness (a field that is only ours must be listed in NEWER_THAN_CLIENT);
- each RPC of ours has the same request/response types and streaming flags;
- each enum value of ours has the same number.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from google.protobuf import descriptor_pb2

from modelyard.kserve.v2 import grpc_service_pb2, model_config_pb2

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tritonclient") is None, reason="tritonclient is not installed"
)

FDP = descriptor_pb2.FileDescriptorProto
FieldProto = descriptor_pb2.FieldDescriptorProto

_DUMP_TRITON = """
import base64, json, sys
from google.protobuf import descriptor_pb2
from tritonclient.grpc import model_config_pb2, service_pb2
out = {}
for key, module in (("service", service_pb2), ("model_config", model_config_pb2)):
    proto = descriptor_pb2.FileDescriptorProto()
    module.DESCRIPTOR.CopyToProto(proto)
    out[key] = base64.b64encode(proto.SerializeToString()).decode("ascii")
json.dump(out, sys.stdout)
"""

REQUIRED_RPCS = {
    "ServerLive",
    "ServerReady",
    "ModelReady",
    "ServerMetadata",
    "ModelMetadata",
    "ModelInfer",
    "ModelStreamInfer",
    "ModelConfig",
    "ModelStatistics",
    "RepositoryIndex",
    "RepositoryModelLoad",
    "RepositoryModelUnload",
}

# In the specification (Triton's statistics extension) but newer than tritonclient 2.41; with a
# newer client these are compared like everything else.
NEWER_THAN_CLIENT = {
    ".inference.InferResponseStatistics",
    ".inference.ModelStatistics.ResponseStatsEntry",
    ".inference.ModelStatistics.response_stats",
}

# Messages whose every client-side field we must carry too: a field missing here would be
# dropped silently (proto3 skips unknown fields) on the data path or in what clients read.
COMPLETE_MESSAGES = {
    ".inference.InferParameter",
    ".inference.InferTensorContents",
    ".inference.ModelInferRequest",
    ".inference.ModelInferRequest.InferInputTensor",
    ".inference.ModelInferRequest.InferRequestedOutputTensor",
    ".inference.ModelInferResponse",
    ".inference.ModelInferResponse.InferOutputTensor",
    ".inference.ModelStreamInferResponse",
    ".inference.ModelMetadataResponse",
    ".inference.ModelMetadataResponse.TensorMetadata",
    ".inference.ServerMetadataResponse",
    ".inference.RepositoryIndexResponse.ModelIndex",
    ".inference.ModelConfig",
    ".inference.ModelInput",
    ".inference.ModelOutput",
    ".inference.ModelVersionPolicy",
    ".inference.ModelDynamicBatching",
    ".inference.ModelQueuePolicy",
    ".inference.ModelInstanceGroup",
}


@dataclass(frozen=True)
class Contract:
    """The messages, enums and services of a set of files, by fully qualified name."""

    messages: dict[str, descriptor_pb2.DescriptorProto]
    enums: dict[str, descriptor_pb2.EnumDescriptorProto]
    services: dict[str, descriptor_pb2.ServiceDescriptorProto]


def _walk(
    prefix: str, messages: list[descriptor_pb2.DescriptorProto]
) -> Iterator[tuple[str, descriptor_pb2.DescriptorProto]]:
    for message in messages:
        name = f"{prefix}.{message.name}"
        yield name, message
        yield from _walk(name, list(message.nested_type))


def contract(*files: FDP) -> Contract:
    messages: dict[str, descriptor_pb2.DescriptorProto] = {}
    enums: dict[str, descriptor_pb2.EnumDescriptorProto] = {}
    services: dict[str, descriptor_pb2.ServiceDescriptorProto] = {}
    for file in files:
        root = f".{file.package}"
        enums.update({f"{root}.{e.name}": e for e in file.enum_type})
        for name, message in _walk(root, list(file.message_type)):
            messages[name] = message
            enums.update({f"{name}.{e.name}": e for e in message.enum_type})
        services.update({f"{root}.{s.name}": s for s in file.service})
    return Contract(messages, enums, services)


def _oneof(message: descriptor_pb2.DescriptorProto, field: FieldProto) -> str | None:
    # proto3 `optional` fields sit in synthetic oneofs; those are not wire-visible oneofs.
    if not field.HasField("oneof_index") or field.proto3_optional:
        return None
    return message.oneof_decl[field.oneof_index].name


def _is_map(side: Contract, field: FieldProto) -> bool:
    entry = side.messages.get(field.type_name) if field.type == FieldProto.TYPE_MESSAGE else None
    return entry is not None and entry.options.map_entry


def _field_shape(
    side: Contract, message: descriptor_pb2.DescriptorProto, field: FieldProto
) -> dict[str, object]:
    return {
        "number": field.number,
        "type": FieldProto.Type.Name(field.type),
        "label": FieldProto.Label.Name(field.label),
        "type_name": field.type_name,
        "oneof": _oneof(message, field),
        "map": _is_map(side, field),
    }


def mismatches(ours: Contract, theirs: Contract) -> list[str]:
    """Every way in which `ours` would not read or write what `theirs` does."""
    found: list[str] = []
    for name, message in ours.messages.items():
        other = theirs.messages.get(name)
        if other is None:
            if name not in NEWER_THAN_CLIENT:
                found.append(f"message {name}: not in tritonclient")
            continue
        if message.options.map_entry != other.options.map_entry:
            found.append(
                f"message {name}: map entry {message.options.map_entry} vs {other.options.map_entry}"
            )
        their_fields = {f.name: f for f in other.field}
        for field in message.field:
            path = f"{name}.{field.name}"
            twin = their_fields.get(field.name)
            if twin is None:
                if path not in NEWER_THAN_CLIENT:
                    found.append(f"field {path}: not in tritonclient")
                continue
            mine, their = _field_shape(ours, message, field), _field_shape(theirs, other, twin)
            for key in mine:
                if mine[key] != their[key]:
                    found.append(f"field {path}: {key} {mine[key]!r}, tritonclient has {their[key]!r}")
    for name, enum in ours.enums.items():
        other_enum = theirs.enums.get(name)
        if other_enum is None:
            found.append(f"enum {name}: not in tritonclient")
            continue
        numbers = {v.name: v.number for v in other_enum.value}
        for value in enum.value:
            if numbers.get(value.name) != value.number:
                found.append(
                    f"enum {name}.{value.name}: {value.number}, tritonclient has {numbers.get(value.name)}"
                )
    for name, service in ours.services.items():
        other_service = theirs.services.get(name)
        if other_service is None:
            found.append(f"service {name}: not in tritonclient")
            continue
        methods = {m.name: m for m in other_service.method}
        for method in service.method:
            twin_method = methods.get(method.name)
            if twin_method is None:
                found.append(f"rpc {name}/{method.name}: not in tritonclient")
                continue
            for key in ("input_type", "output_type", "client_streaming", "server_streaming"):
                if getattr(method, key) != getattr(twin_method, key):
                    found.append(
                        f"rpc {name}/{method.name}: {key} {getattr(method, key)!r}, "
                        f"tritonclient has {getattr(twin_method, key)!r}"
                    )
    return found


def _ours_files() -> tuple[FDP, FDP]:
    service, config = FDP(), FDP()
    grpc_service_pb2.DESCRIPTOR.CopyToProto(service)
    model_config_pb2.DESCRIPTOR.CopyToProto(config)
    return service, config


@pytest.fixture(scope="module")
def triton_files() -> tuple[FDP, FDP]:
    done = subprocess.run(
        [sys.executable, "-c", _DUMP_TRITON], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, f"could not read tritonclient's descriptors:\n{done.stderr}"
    dumped = json.loads(done.stdout)
    service, config = FDP(), FDP()
    service.ParseFromString(base64.b64decode(dumped["service"]))
    config.ParseFromString(base64.b64decode(dumped["model_config"]))
    return service, config


@pytest.fixture(scope="module")
def ours() -> Contract:
    return contract(*_ours_files())


@pytest.fixture(scope="module")
def theirs(triton_files: tuple[FDP, FDP]) -> Contract:
    return contract(*triton_files)


def test_package_is_inference_so_method_paths_match() -> None:
    service, config = _ours_files()
    assert (service.package, config.package) == ("inference", "inference")
    assert grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name == (
        "inference.GRPCInferenceService"
    )


def test_all_required_rpcs_are_present(ours: Contract) -> None:
    methods = {m.name for m in ours.services[".inference.GRPCInferenceService"].method}
    assert methods >= REQUIRED_RPCS, f"missing: {sorted(REQUIRED_RPCS - methods)}"
    stream = next(
        m for m in ours.services[".inference.GRPCInferenceService"].method if m.name == "ModelStreamInfer"
    )
    assert stream.client_streaming and stream.server_streaming


def test_everything_we_define_matches_tritonclient(ours: Contract, theirs: Contract) -> None:
    found = mismatches(ours, theirs)
    assert not found, "wire mismatches with tritonclient:\n  " + "\n  ".join(found)


def test_the_messages_clients_read_are_complete(ours: Contract, theirs: Contract) -> None:
    missing = [
        f"{name}.{field.name} = {field.number}"
        for name in sorted(COMPLETE_MESSAGES)
        for field in theirs.messages[name].field
        if field.name not in {f.name for f in ours.messages[name].field}
    ]
    assert not missing, "fields tritonclient has and we lack:\n  " + "\n  ".join(missing)


def test_the_comparison_catches_each_kind_of_mismatch(theirs: Contract) -> None:
    """Mutate a copy of our descriptors in each compared property; each must be reported."""

    def broken(mutate: object) -> list[str]:
        service, config = _ours_files()
        assert callable(mutate)
        mutate(service, config)
        return mismatches(contract(service, config), theirs)

    def message(file: FDP, *path: str) -> descriptor_pb2.DescriptorProto:
        found = next(m for m in file.message_type if m.name == path[0])
        for part in path[1:]:
            found = next(m for m in found.nested_type if m.name == part)
        return found

    def field(file: FDP, name: str, *path: str) -> FieldProto:
        return next(f for f in message(file, *path).field if f.name == name)

    def renumber(s: FDP, c: FDP) -> None:
        field(s, "raw_input_contents", "ModelInferRequest").number = 17

    def retype(s: FDP, c: FDP) -> None:
        field(c, "priority_levels", "ModelDynamicBatching").type = FieldProto.TYPE_UINT32

    def relabel(s: FDP, c: FDP) -> None:
        field(s, "shape", "ModelInferRequest", "InferInputTensor").label = FieldProto.LABEL_OPTIONAL

    def rename_type(s: FDP, c: FDP) -> None:
        field(
            s, "contents", "ModelInferResponse", "InferOutputTensor"
        ).type_name = ".inference.InferParameter"

    def leave_oneof(s: FDP, c: FDP) -> None:
        field(s, "uint64_param", "InferParameter").ClearField("oneof_index")

    def unmap(s: FDP, c: FDP) -> None:
        message(s, "ModelInferRequest", "ParametersEntry").options.map_entry = False

    def stream(s: FDP, c: FDP) -> None:
        next(m for m in s.service[0].method if m.name == "ModelStreamInfer").client_streaming = False

    def enum_value(s: FDP, c: FDP) -> None:
        next(v for v in c.enum_type[0].value if v.name == "TYPE_FP16").number = 99

    def extra_field(s: FDP, c: FDP) -> None:
        message(s, "ModelInferRequest").field.add(
            name="extra", number=99, type=FieldProto.TYPE_STRING, label=FieldProto.LABEL_OPTIONAL
        )

    expected = {
        renumber: "ModelInferRequest.raw_input_contents: number 17",
        retype: "ModelDynamicBatching.priority_levels: type 'TYPE_UINT32'",
        relabel: "InferInputTensor.shape: label 'LABEL_OPTIONAL'",
        rename_type: "InferOutputTensor.contents: type_name",
        leave_oneof: "InferParameter.uint64_param: oneof None",
        unmap: "ModelInferRequest.parameters: map False",
        stream: "ModelStreamInfer: client_streaming False",
        enum_value: "DataType.TYPE_FP16: 99",
        extra_field: "ModelInferRequest.extra: not in tritonclient",
    }
    for mutate, text in expected.items():
        reported = broken(mutate)
        assert any(text in line for line in reported), f"{mutate.__name__} not caught; got {reported}"
