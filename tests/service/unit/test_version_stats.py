"""VersionStats.record_run (a request that was a run of its own, counted in one body: it runs on
every request of a cheap model) counts what its four parts count, for a success and a failure."""

from __future__ import annotations

import time

import numpy as np

from modelyard.service.runtime.served import VersionStats


def _parts(ok: bool, items: int, admitted_ns: int, start_ns: int, end_ns: int) -> VersionStats:
    stats = VersionStats()
    stats.record_request(ok, end_ns - admitted_ns)
    if ok:
        stats.record_queue(start_ns - admitted_ns)
        stats.record_execution(items, end_ns - start_ns)
        stats.record_compute(1, end_ns - start_ns)
    return stats


def test_record_run_counts_what_its_parts_count() -> None:
    for ok in (True, False):
        fused = VersionStats()
        admitted = time.perf_counter_ns()
        start = admitted + 1_000
        inputs = {"x": np.zeros((3, 2), np.float32)}  # 3 batch rows, for a model that batches
        end = fused.record_run(ok, inputs, 8, admitted, start)
        expected = _parts(ok, 3, admitted, start, end)
        fused.last_inference_ms = expected.last_inference_ms  # a wall-clock stamp: both "now"
        assert fused == expected, ok


def test_a_model_that_does_not_batch_counts_one_item_per_run() -> None:
    stats = VersionStats()
    stats.record_run(True, {"x": np.zeros((3, 2), np.float32)}, 0, 0, 0)
    assert stats.inference_count == 1 and stats.execution_count == 1
