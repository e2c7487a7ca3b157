"""The fleet's gates (sidecar/fleet/gates.py): the documented queries and their overrides, the
evidence they make for the sidecar's rollout policy, and the per-pod judgement that keeps one bad
pod among many from being averaged away."""

from __future__ import annotations

from pathlib import Path
from string import Template

import pytest

from modelyard.sidecar.fleet.gates import (
    QUERIES,
    FleetEvidence,
    Prometheus,
    PrometheusError,
    Queries,
    gather,
    load_queries,
    worst,
)
from modelyard.sidecar.rollout.policy import RED, Evidence, RolloutSpec, Tally, judge

SPEC = RolloutSpec(steps=(10, 50, 100), dwell_s=5, min_calls=10, judge_calls=5)


def test_the_default_queries_read_the_sidecars_series() -> None:
    assert "modelyard_sidecar_attempts_total" in QUERIES.calls
    assert 'fault="true"' in QUERIES.faults
    assert QUERIES.p99_fleet.startswith("histogram_quantile(0.99, sum by (le)")
    assert "modelyard_sidecar_request_seconds_bucket" in QUERIES.p99_fleet
    assert "modelyard_sidecar_shadow_rows_agreeing_total" in QUERIES.shadow_agreeing
    assert 'version="$canary"' in QUERIES.breaker
    promql = Template(QUERIES.faults).substitute(model="scaler", dye="canary", window="60s")
    assert promql == (
        "sum by (instance) (increase(modelyard_sidecar_attempts_total"
        '{model="scaler",dye="canary",fault="true"}[60s]))'
    )


def test_the_window_is_the_steps_age_within_bounds() -> None:
    q = Queries(min_window_s=3, max_window_s=30)
    assert (q.window(0.2), q.window(12.3), q.window(1e6)) == ("3s", "13s", "30s")


def test_a_queries_file_overrides_keys_and_refuses_unknown_ones(tmp_path: Path) -> None:
    path = tmp_path / "q.yaml"
    path.write_text("min_window_s: 5\ncalls: 'sum by (instance) (my_calls{model=\"$model\"})'\n")
    q = load_queries(path)
    assert q.min_window_s == 5 and q.calls.startswith("sum by (instance) (my_calls")
    assert q.faults == QUERIES.faults
    path.write_text("callz: x\n")
    with pytest.raises(ValueError, match="unknown key"):
        load_queries(path)
    for bad in ("min_window_s: -1\n", "max_window_s: 1\n", "calls: ''\n", "timeout_s: .nan\n"):
        path.write_text(bad)
        with pytest.raises(ValueError, match="queries"):
            load_queries(path)


class FakePrometheus(Prometheus):
    """Answers by the query's metric and dye, as Prometheus would for three pods."""

    def __init__(self, answers: dict[str, dict[str, float]], down: bool = False) -> None:
        super().__init__("http://prometheus.invalid")
        self.answers, self.down = answers, down
        self.asked: list[str] = []

    async def query(self, promql: str) -> dict[str, float]:
        self.asked.append(promql)
        if self.down:
            raise PrometheusError("prometheus at http://prometheus.invalid is unreachable")
        for key, vector in self.answers.items():
            if all(part in promql for part in key.split("&")):
                return vector
        return {}


PODS = ("a:9101", "b:9101", "c:9101")


def fleet(canary_faults: dict[str, float], calls: float = 100.0) -> FakePrometheus:
    each = dict.fromkeys(PODS, calls)
    return FakePrometheus(
        {
            'dye="canary",fault="true"': canary_faults,
            'dye="stable",fault="true"': dict.fromkeys(PODS, 0.0),
            'attempts_total{model="scaler",dye="canary"}': each,
            'attempts_total{model="scaler",dye="stable"}': dict.fromkeys(PODS, 400.0),
            'sum by (le)&dye="canary"': {"": 0.004},
            'sum by (le)&dye="stable"': {"": 0.003},
            "breaker_state": dict.fromkeys(PODS, 0.0),
            "canary_weight": dict.fromkeys(PODS, 1.0),
        }
    )


async def test_the_fleets_evidence_is_the_sum_of_its_pods() -> None:
    prometheus = fleet({"a:9101": 1.0})  # one fault in a pod's 100 canary calls: within the excess
    found = await gather(prometheus, QUERIES, "scaler", "2", 12.0)
    assert len(prometheus.asked) == 10 and all("[60s]" in q or "[" not in q for q in prometheus.asked)
    assert found.seen == 3 and sorted(found.pods) == list(PODS)
    assert (found.fleet.canary.calls, found.fleet.canary.faults, found.fleet.canary.p99_s) == (300, 1, 0.004)
    assert (found.fleet.stable.calls, found.fleet.stable.p99_s) == (1200, 0.003)
    assert found.pods["a:9101"].canary == Tally(100, 1, 0, None)  # latency: the fleet's only
    assert not found.fleet.shadowing and not found.fleet.breaker_open
    assert all(v.result != RED for v in judge(SPEC, found.fleet).values())
    assert worst(SPEC, found) == (found.fleet, "")


async def test_one_bad_pod_among_many_is_not_averaged_away() -> None:
    # Ten pods: one whose canary fails every call. The fleet's rate (10 of 400: 2.5%) is within
    # the allowed excess of 5 points; that pod's (100%) is not.
    spec = RolloutSpec(steps=(10, 100), min_calls=10, judge_calls=5, max_error_excess=0.05)
    calm = Evidence(Tally(40, 0, 40, 0.004), Tally(400, 0, 400, 0.003))
    bad = Evidence(Tally(10, 10, 10, 0.004), Tally(400, 0, 400, 0.003))
    pods = {f"p{i}:9101": calm for i in range(9)} | {"bad:9101": bad}
    summed = Evidence(Tally(370, 10, 370, 0.004), Tally(4000, 0, 4000, 0.003))
    assert judge(spec, summed)["errors"].result != RED
    evidence, culprit = worst(spec, FleetEvidence(summed, pods, 10))
    assert culprit == "bad:9101" and judge(spec, evidence)["errors"].result == RED


async def test_a_pods_open_breaker_is_the_fleets() -> None:
    prometheus = fleet({})
    prometheus.answers["breaker_state"] = {"a:9101": 0.0, "b:9101": 2.0, "c:9101": 0.0}
    found = await gather(prometheus, QUERIES, "scaler", "2", 12.0)
    assert found.fleet.breaker_open
    assert worst(SPEC, found) == (found.fleet, "b:9101")
    assert 'version="2"' in next(q for q in prometheus.asked if "breaker_state" in q)


async def test_prometheus_down_is_an_error_not_evidence() -> None:
    with pytest.raises(PrometheusError, match="unreachable"):
        await gather(FakePrometheus({}, down=True), QUERIES, "scaler", "2", 1.0)


async def test_no_samples_is_no_evidence() -> None:
    found = await gather(FakePrometheus({}), QUERIES, "scaler", "2", 1.0)
    assert found.seen == 0 and found.pods == {}
    assert found.fleet.canary.calls == 0 and found.fleet.canary.p99_s is None
    verdicts = judge(SPEC, found.fleet)
    assert {v.result for v in verdicts.values()} <= {"pending", "off"}


def test_an_unreachable_prometheus_is_named() -> None:
    # The HTTP client itself, against a port where nothing listens: an error naming the URL.
    client = Prometheus("http://127.0.0.1:9", timeout_s=1)
    with pytest.raises(PrometheusError, match=r"127\.0\.0\.1:9 is unreachable"):
        client._query("up")
