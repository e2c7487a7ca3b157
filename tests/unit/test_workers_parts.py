"""The parts of worker mode that need no process: answers merged across workers, scrapes summed,
the region store shared through a file, and the --workers setting."""

from __future__ import annotations

from pathlib import Path

import pytest
from modelyard.inference.v1 import model_service_pb2 as pb
from modelyard.kserve.v2 import grpc_service_pb2 as kpb

from service.config import worker_count
from service.shm.files import FileRegionStore
from service.shm.registry import RegionSpec
from service.workers import protocol
from service.workers.merge import FANNED, merge_models
from service.workers.metrics_sum import sum_scrapes


def model(*states: tuple[str, int], default: str = "1") -> pb.Model:
    m = pb.Model(name="m", default_version=default)
    for version, state in states:
        m.versions.add(version=version, state=state, reason=f"{version}:{state}")
    return m


def test_a_version_is_ready_only_when_every_worker_serves_it() -> None:
    ready, loading = pb.MODEL_STATE_READY, pb.MODEL_STATE_LOADING
    merged = merge_models([model(("1", ready), ("2", ready)), model(("1", ready), ("2", loading))])
    assert [(v.version, v.state) for v in merged.versions] == [("1", ready), ("2", loading)]
    missing = merge_models([model(("1", ready), ("2", ready)), model(("1", ready))])
    assert [v.state for v in missing.versions] == [ready, loading]
    assert merge_models([model(("1", ready)), model(("1", pb.MODEL_STATE_FAILED))]).versions[0].state == (
        pb.MODEL_STATE_FAILED
    )


def test_statistics_add_up_across_workers() -> None:
    def answer(count: int, ns: int, last: int) -> bytes:
        stats = kpb.ModelStatistics(name="m", version="1", inference_count=count, last_inference=last)
        stats.inference_stats.success.count = count
        stats.inference_stats.success.ns = ns
        stats.batch_stats.add(batch_size=1).compute_infer.count = count
        stats.batch_stats.add(batch_size=count).compute_infer.count = 1
        return kpb.ModelStatisticsResponse(model_stats=[stats]).SerializeToString()

    merge = FANNED["/inference.GRPCInferenceService/ModelStatistics"].merge
    merged = kpb.ModelStatisticsResponse.FromString(merge([answer(3, 30, 100), answer(4, 40, 200)]))
    (stats,) = merged.model_stats
    assert (stats.inference_count, stats.inference_stats.success.count, stats.inference_stats.success.ns) == (
        7,
        7,
        70,
    )
    assert stats.last_inference == 200
    # Batch statistics pair up by batch size, which is a key, not a count.
    assert [(b.batch_size, b.compute_infer.count) for b in stats.batch_stats] == [(1, 7), (3, 1), (4, 1)]


def test_scrapes_sum_except_state_gauges() -> None:
    text = """# HELP modelyard_requests Requests.
# TYPE modelyard_requests counter
modelyard_requests_total{method="Infer"} {n}
# HELP modelyard_model_versions_ready Versions.
# TYPE modelyard_model_versions_ready gauge
modelyard_model_versions_ready{model="m"} {v}
"""
    families = list(
        sum_scrapes(
            [text.replace("{n}", "3").replace("{v}", "2"), text.replace("{n}", "4").replace("{v}", "1")]
        )
    )
    samples = {(s.name, tuple(s.labels.items())): s.value for f in families for s in f.samples}
    assert samples[("modelyard_requests_total", (("method", "Infer"),))] == 7
    assert samples[("modelyard_model_versions_ready", (("model", "m"),))] == 1


def test_a_region_registered_through_one_store_is_seen_by_another(tmp_path: Path) -> None:
    path = tmp_path / "regions.json"
    first, second = FileRegionStore(path), FileRegionStore(path)
    assert second.get("a") is None
    spec = RegionSpec("a", "/key", 0, 16)
    assert first.add(spec)
    assert second.get("a") == spec
    assert not second.add(RegionSpec("a", "/other", 0, 8))  # the name is taken, seen across stores
    assert second.remove("a") == spec
    assert first.get("a") is None
    assert first.all() == []


def test_workers_setting() -> None:
    assert worker_count("1") == 1
    assert worker_count("4") == 4
    assert worker_count("auto") >= 1
    for bad in ("0", "-1", "two", ""):
        with pytest.raises(ValueError, match="--workers"):
            worker_count(bad)


def test_answers_pack_and_unpack() -> None:
    assert protocol.unpack(protocol.pack([b"", b"ab", b"c"])) == [b"", b"ab", b"c"]
