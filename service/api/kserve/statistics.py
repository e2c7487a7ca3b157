"""Triton's statistics extension: per served version, its counts and durations as Triton
reports them (perf_analyzer reads them). With workers, every worker answers and the supervisor
adds them up (service/workers/merge.py)."""

from __future__ import annotations

from modelyard.kserve.v2 import grpc_service_pb2 as pb
from modelyard.service.runtime.manager import ModelManager
from modelyard.service.runtime.served import ServedVersion


def model_statistics(manager: ModelManager, request: pb.ModelStatisticsRequest) -> pb.ModelStatisticsResponse:
    """The statistics of the request's model and version (no name: every model's). The name and
    version are checked already."""
    if request.name:
        chosen = [manager.resolve(request.name, request.version)]
        if not request.version:  # Triton: no version means every served version
            model = manager.served(request.name)
            chosen = list(model.versions.values()) if model else chosen
    else:
        chosen = [v for s in manager.statuses() if (m := manager.served(s.name)) for v in m.versions.values()]
    return pb.ModelStatisticsResponse(model_stats=[_version_statistics(v) for v in chosen])


def _version_statistics(served: ServedVersion) -> pb.ModelStatistics:
    stats = served.stats
    return pb.ModelStatistics(
        name=served.model,
        version=str(served.version),
        last_inference=stats.last_inference_ms,
        inference_count=stats.inference_count,
        execution_count=stats.execution_count,
        inference_stats=pb.InferStatistics(
            success=pb.StatisticDuration(count=stats.success_count, ns=stats.success_ns),
            fail=pb.StatisticDuration(count=stats.fail_count, ns=stats.fail_ns),
            # perf_analyzer finds the version it measured by the queue count that grew.
            queue=pb.StatisticDuration(count=stats.queue_count, ns=stats.queue_ns),
            # Per request, as Triton counts them. Tensor conversion is not timed apart: it is
            # inside the queue time (input) and the request total (output); the counts must match
            # compute_infer's for perf_analyzer.
            compute_input=pb.StatisticDuration(count=stats.compute_request_count),
            compute_infer=pb.StatisticDuration(
                count=stats.compute_request_count, ns=stats.compute_request_ns
            ),
            compute_output=pb.StatisticDuration(count=stats.compute_request_count),
        ),
    )
