"""One answer from the answers of every worker, for the calls that the supervisor fans out:
model state is the least ready state of any worker (a version is READY when every worker serves
it), statistics are summed."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import Message

from modelyard.inference.v1 import model_service_pb2 as pb
from modelyard.kserve.v2 import grpc_service_pb2 as kpb

# Least ready first: a version is reported in the first of these states that any worker has it in.
_ORDER = [
    pb.MODEL_STATE_FAILED,
    pb.MODEL_STATE_LOADING,
    pb.MODEL_STATE_DRAINING,
    pb.MODEL_STATE_UNLOADED,
    pb.MODEL_STATE_UNSPECIFIED,
    pb.MODEL_STATE_READY,
]


def least_ready(events: Sequence[pb.WatchModelsResponse], missing: bool) -> pb.WatchModelsResponse:
    """One version's event from the workers' latest events for it; `missing`: some worker has not
    reported the version at all (it has not started loading it)."""
    worst = min(events, key=lambda e: _ORDER.index(e.state))
    if missing and worst.state == pb.MODEL_STATE_READY:
        merged = pb.WatchModelsResponse()
        merged.CopyFrom(worst)
        merged.state = pb.MODEL_STATE_LOADING
        merged.reason = "not yet on every worker"
        return merged
    return worst


def merge_models(models: Sequence[pb.Model]) -> pb.Model:
    merged = pb.Model()
    merged.CopyFrom(models[0])
    for other in models[1:]:
        theirs = {v.version: v for v in other.versions}
        for version in merged.versions:
            their = theirs.get(version.version)
            if their is None:
                version.state = (
                    pb.MODEL_STATE_LOADING if version.state == pb.MODEL_STATE_READY else version.state
                )
                version.reason = version.reason or "not yet on every worker"
            elif _ORDER.index(their.state) < _ORDER.index(version.state):
                version.state = their.state
                version.reason = their.reason
        if other.default_version != merged.default_version:
            # Workers disagree while a swap is on its way: say which version every worker serves.
            merged.reason = merged.reason or "workers are swapping versions"
    return merged


Merge = Callable[[bytes, Sequence[bytes]], bytes]  # (the request, every worker's answer) -> one answer


def _single(cls: type[Message]) -> Merge:
    def merge(request: bytes, answers: Sequence[bytes]) -> bytes:
        parsed = [cls.FromString(a) for a in answers]
        out = cls()
        out.CopyFrom(parsed[0])
        out.model.CopyFrom(merge_models([p.model for p in parsed]))  # type: ignore[attr-defined]
        return out.SerializeToString()

    return merge


def _list(request: bytes, answers: Sequence[bytes]) -> bytes:
    by_name: dict[str, list[pb.Model]] = {}
    for answer in answers:
        for model in pb.ListModelsResponse.FromString(answer).models:
            by_name.setdefault(model.name, []).append(model)
    # A model that some worker does not list has none of its versions there.
    return pb.ListModelsResponse(
        models=[
            merge_models(models + [pb.Model(name=name)] * (len(answers) - len(models)))
            for name, models in sorted(by_name.items())
        ]
    ).SerializeToString()


# Triton's words in the repository index, least ready first (service/api/kserve/repository.py).
_INDEX_ORDER = ["UNAVAILABLE", "LOADING", "UNLOADING", "READY"]


def _index_rank(entry: kpb.RepositoryIndexResponse.ModelIndex) -> int:
    return _INDEX_ORDER.index(entry.state) if entry.state in _INDEX_ORDER else -1


def _repository_index(request: bytes, answers: Sequence[bytes]) -> bytes:
    """Per (model, version), the least ready state of any worker; a version that some worker does
    not list is not READY there. Asked for READY versions only, the index keeps those READY on
    every worker."""
    entries: dict[tuple[str, str], list[kpb.RepositoryIndexResponse.ModelIndex]] = {}
    for answer in answers:
        for entry in kpb.RepositoryIndexResponse.FromString(answer).models:
            entries.setdefault((entry.name, entry.version), []).append(entry)
    ready_only = kpb.RepositoryIndexRequest.FromString(request).ready
    merged = kpb.RepositoryIndexResponse()
    for listed in entries.values():  # in the order the workers list them
        worst = min(listed, key=_index_rank)
        missing = len(listed) < len(answers)
        if ready_only and missing:
            continue
        out = merged.models.add()
        out.CopyFrom(worst)
        if missing and out.state == "READY":
            out.state, out.reason = "LOADING", "not yet on every worker"
    return merged.SerializeToString()


def _model_ready(request: bytes, answers: Sequence[bytes]) -> bytes:
    ready = all(kpb.ModelReadyResponse.FromString(a).ready for a in answers)
    return kpb.ModelReadyResponse(ready=ready).SerializeToString()


def add_numbers(into: Message, other: Message) -> None:
    """Add every integer field of `other` into `into`, recursively (statistics are counts and
    nanoseconds); repeated messages pair up by their key (batch size) or position;
    last_inference takes the latest."""
    for field, value in other.ListFields():
        if field.message_type is not None and field.is_repeated:
            target = getattr(into, field.name)
            if field.message_type.GetOptions().map_entry:
                for key, item in value.items():
                    add_numbers(target[key], item)
                continue
            for i, item in enumerate(value):
                match = _matching(target, item, i)
                if match is None:
                    target.add().CopyFrom(item)
                else:
                    add_numbers(match, item)
        elif field.message_type is not None:
            add_numbers(getattr(into, field.name), value)
        elif field.name in _KEYS:
            setattr(into, field.name, value)
        elif field.name == "last_inference":
            setattr(into, field.name, max(getattr(into, field.name), value))
        elif field.type in _INTEGERS:
            setattr(into, field.name, getattr(into, field.name) + value)


# Fields that say which entry a repeated message is (batch statistics by batch size): not added.
_KEYS = frozenset({"batch_size"})


def _matching(target: Any, item: Message, position: int) -> Message | None:
    keys = [f.name for f in item.DESCRIPTOR.fields if f.name in _KEYS]
    if keys:
        wanted = [getattr(item, k) for k in keys]
        return next((t for t in target if [getattr(t, k) for k in keys] == wanted), None)
    return target[position] if position < len(target) else None


_INTEGERS = {3, 4, 5, 6, 13, 15, 16, 17, 18}  # FieldDescriptor int/uint/fixed/sint types


def _statistics(request: bytes, answers: Sequence[bytes]) -> bytes:
    merged: dict[tuple[str, str], kpb.ModelStatistics] = {}
    for answer in answers:
        for stats in kpb.ModelStatisticsResponse.FromString(answer).model_stats:
            key = (stats.name, stats.version)
            if key not in merged:
                merged[key] = kpb.ModelStatistics(name=stats.name, version=stats.version)
            add_numbers(merged[key], stats)
    return kpb.ModelStatisticsResponse(model_stats=list(merged.values())).SerializeToString()


def _first(request: bytes, answers: Sequence[bytes]) -> bytes:
    return answers[0]


@dataclass(frozen=True)
class Fanned:
    """A public method answered by every worker: how to read its request's model (set for model
    control, which the supervisor replays to a worker that joins later) and how to merge answers."""

    request: type[Message]
    merge: Merge
    changes: str = ""  # the request field naming the model it changes; empty: a read


_MODEL = "/modelyard.inference.v1.ModelService/"
_KSERVE = "/inference.GRPCInferenceService/"

FANNED: dict[str, Fanned] = {
    _MODEL + "LoadModel": Fanned(pb.LoadModelRequest, _single(pb.LoadModelResponse), "name"),
    _MODEL + "UnloadModel": Fanned(pb.UnloadModelRequest, _single(pb.UnloadModelResponse), "name"),
    _MODEL + "GetModel": Fanned(pb.GetModelRequest, _single(pb.GetModelResponse)),
    _MODEL + "ListModels": Fanned(pb.ListModelsRequest, _list),
    _KSERVE + "RepositoryModelLoad": Fanned(kpb.RepositoryModelLoadRequest, _first, "model_name"),
    _KSERVE + "RepositoryModelUnload": Fanned(kpb.RepositoryModelUnloadRequest, _first, "model_name"),
    _KSERVE + "ModelStatistics": Fanned(kpb.ModelStatisticsRequest, _statistics),
    _KSERVE + "RepositoryIndex": Fanned(kpb.RepositoryIndexRequest, _repository_index),
    _KSERVE + "ModelReady": Fanned(kpb.ModelReadyRequest, _model_ready),
}
