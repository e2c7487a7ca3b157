"""The parts of worker mode that need no process: answers merged across workers, scrapes summed,
the region store shared through a file, and the --workers setting."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from modelyard.inference.v1 import model_service_pb2 as pb
from modelyard.kserve.v2 import grpc_service_pb2 as kpb
from modelyard.service.settings import worker_count
from modelyard.service.shm.files import FileRegionStore
from modelyard.service.shm.registry import RegionSpec
from modelyard.service.workers import protocol
from modelyard.service.workers.merge import FANNED, merge_models
from modelyard.service.workers.metrics_sum import carry, parse, sum_families, sum_scrapes

KSERVE = "/inference.GRPCInferenceService/"


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


def test_a_model_that_a_worker_does_not_list_is_not_ready_in_list_models() -> None:
    ready = pb.MODEL_STATE_READY
    merge = FANNED["/modelyard.inference.v1.ModelService/ListModels"].merge
    answers = [
        pb.ListModelsResponse(models=[model(("1", ready))]).SerializeToString(),
        pb.ListModelsResponse().SerializeToString(),
    ]
    (merged,) = pb.ListModelsResponse.FromString(merge(b"", answers)).models
    assert [v.state for v in merged.versions] == [pb.MODEL_STATE_LOADING]


def index(*entries: tuple[str, str, str]) -> bytes:
    response = kpb.RepositoryIndexResponse()
    for name, version, state in entries:
        response.models.add(name=name, version=version, state=state, reason=f"{name}{version}:{state}")
    return response.SerializeToString()


def test_repository_index_is_the_least_ready_state_over_workers() -> None:
    merge = FANNED[KSERVE + "RepositoryIndex"].merge
    answers = [
        index(("m", "1", "READY"), ("m", "2", "READY"), ("n", "1", "READY"), ("gone", "", "UNAVAILABLE")),
        index(("m", "1", "READY"), ("m", "2", "LOADING"), ("gone", "", "UNAVAILABLE")),
    ]
    merged = kpb.RepositoryIndexResponse.FromString(
        merge(kpb.RepositoryIndexRequest().SerializeToString(), answers)
    )
    assert [(m.name, m.version, m.state, m.reason) for m in merged.models] == [
        ("m", "1", "READY", "m1:READY"),
        ("m", "2", "LOADING", "m2:LOADING"),
        ("n", "1", "LOADING", "not yet on every worker"),  # only on one worker
        ("gone", "", "UNAVAILABLE", "gone:UNAVAILABLE"),
    ]
    # Asked for READY versions only, workers list only those: keep what every worker lists.
    ready = [
        index(("m", "1", "READY"), ("m", "2", "READY"), ("n", "1", "READY")),
        index(("m", "1", "READY"), ("n", "1", "READY")),
    ]
    merged = kpb.RepositoryIndexResponse.FromString(
        merge(kpb.RepositoryIndexRequest(ready=True).SerializeToString(), ready)
    )
    assert [(m.name, m.version) for m in merged.models] == [("m", "1"), ("n", "1")]


def test_model_ready_only_when_every_worker_says_ready() -> None:
    merge = FANNED[KSERVE + "ModelReady"].merge
    request = kpb.ModelReadyRequest(name="m").SerializeToString()

    def ready(*answers: bool) -> bool:
        replies = [kpb.ModelReadyResponse(ready=a).SerializeToString() for a in answers]
        return kpb.ModelReadyResponse.FromString(merge(request, replies)).ready

    assert ready(True, True)
    assert not ready(True, False)
    assert not ready(False, True)


def test_model_reads_are_fanned_out_but_never_replayed() -> None:
    for method in ("RepositoryIndex", "ModelReady", "ModelStatistics"):
        assert FANNED[KSERVE + method].changes == ""


def test_statistics_add_up_across_workers() -> None:
    def answer(count: int, ns: int, last: int) -> bytes:
        stats = kpb.ModelStatistics(name="m", version="1", inference_count=count, last_inference=last)
        stats.inference_stats.success.count = count
        stats.inference_stats.success.ns = ns
        stats.batch_stats.add(batch_size=1).compute_infer.count = count
        stats.batch_stats.add(batch_size=count).compute_infer.count = 1
        return kpb.ModelStatisticsResponse(model_stats=[stats]).SerializeToString()

    merge = FANNED["/inference.GRPCInferenceService/ModelStatistics"].merge
    merged = kpb.ModelStatisticsResponse.FromString(merge(b"", [answer(3, 30, 100), answer(4, 40, 200)]))
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
    assert second.get("", "a") is None
    spec = RegionSpec("a", "/key", 0, 16)
    assert first.add(spec)
    assert second.get("", "a") == spec
    assert not second.add(RegionSpec("a", "/other", 0, 8))  # the name is taken, seen across stores
    assert second.remove("", "a") == spec
    assert first.get("", "a") is None
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


def worker_scrape(requests: float, queued: float, seconds: list[float]) -> str:
    """A scrape as a worker's prometheus_client writes it (with its `_created` series)."""
    registry = CollectorRegistry()
    Counter("modelyard_requests", "Requests.", ["method"], registry=registry).labels("Infer").inc(requests)
    Gauge("modelyard_queue_depth", "Queued.", registry=registry).set(queued)
    histogram = Histogram("modelyard_seconds", "Seconds.", buckets=[1.0], registry=registry)
    for value in seconds:
        histogram.observe(value)
    return generate_latest(registry).decode()


def samples(families: object) -> dict[str, float]:
    return {s.name: s.value for f in families for s in f.samples}  # type: ignore[attr-defined]


def test_the_sum_has_no_created_timestamps() -> None:
    assert "modelyard_requests_created" in worker_scrape(1, 0, [])  # prometheus_client writes them
    summed = samples(sum_scrapes([worker_scrape(1, 0, []), worker_scrape(2, 0, [])]))
    assert summed["modelyard_requests_total"] == 3
    assert not [name for name in summed if name.endswith("_created")]
    # A gauge of our own that merely ends in _created is still summed.
    text = "# TYPE jobs_created gauge\njobs_created 2.0\n"
    assert samples(sum_scrapes([text, text])) == {"jobs_created": 4}


def test_a_dead_workers_counters_are_carried_into_later_sums() -> None:
    carried = carry([], worker_scrape(5, 3, [0.5, 2.0]))
    # Counters and histograms carry over; the queue depth (a gauge) died with the worker.
    assert {f.name for f in carried} == {"modelyard_requests", "modelyard_seconds"}
    assert samples(carried)["modelyard_requests_total"] == 5
    assert (samples(carried)["modelyard_seconds_count"], samples(carried)["modelyard_seconds_sum"]) == (
        2,
        2.5,
    )
    buckets = {
        s.labels["le"]: s.value for f in carried for s in f.samples if s.name == "modelyard_seconds_bucket"
    }
    assert buckets == {"1.0": 1, "+Inf": 2}
    # The replacement starts from zero; the sum goes on from where the dead worker left it.
    summed = samples(sum_families([carried, parse(worker_scrape(1, 4, [0.1]))]))
    assert summed["modelyard_requests_total"] == 6
    assert summed["modelyard_seconds_count"] == 3
    assert summed["modelyard_queue_depth"] == 4
    # Another death folds into the same totals: one set of series, however many restarts.
    again = carry(carried, worker_scrape(1, 4, [0.1]))
    assert samples(again)["modelyard_requests_total"] == 6
    assert sum(len(f.samples) for f in again) == sum(len(f.samples) for f in carried)
