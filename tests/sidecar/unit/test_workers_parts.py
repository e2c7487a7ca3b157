"""The sidecar supervisor's parts that need no process: merging the workers' breakers and canary
views, which gauges of the summed scrape are read as one worker, and the changes kept for replay."""

from __future__ import annotations

from typing import Any

from modelyard.process.metrics_sum import sum_scrapes
from modelyard.sidecar.settings import Settings
from modelyard.sidecar.workers import merge
from modelyard.sidecar.workers.supervisor import Change, Supervisor


def breaker(state: str, version: str = "2") -> dict[str, object]:
    return {"upstream": "u:1", "model": "m", "version": version, "state": state, "trips": 1}


def test_breakers_show_the_worst_worker_and_every_workers_state() -> None:
    merged = merge.breakers(
        [(0, [breaker("closed"), breaker("closed", "1")]), (1, [breaker("open"), breaker("half-open", "1")])]
    )
    assert [(b["version"], b["state"]) for b in merged] == [("1", "half-open"), ("2", "open")]
    assert merged[1]["workers"] == {"0": "closed", "1": "open"}
    # The worst is the worst whichever worker is listed first.
    again = merge.breakers([(1, [breaker("open")]), (0, [breaker("closed")])])
    assert again[0]["state"] == "open" and again[0]["workers"] == {"0": "closed", "1": "open"}


def test_canary_view_takes_the_lowest_effective_weight_and_worst_breaker() -> None:
    view: dict[str, Any] = {
        "canary_weight": 0,
        "models": {"m": {"canary_weight": 50, "effective_weight": 50, "breaker": "closed"}},
    }
    other: dict[str, Any] = {
        "canary_weight": 0,
        "models": {"m": {"canary_weight": 50, "effective_weight": 0, "breaker": "open"}},
    }
    merged = merge.canary([view, other])
    assert merged["models"]["m"] == {"canary_weight": 50, "effective_weight": 0, "breaker": "open"}
    assert view["models"]["m"]["effective_weight"] == 50  # the workers' views are left alone


def test_state_gauges_are_not_summed() -> None:
    def scrape(state: int, weight: int, calls: int) -> str:
        return (
            "# TYPE modelyard_sidecar_breaker_state gauge\n"
            f'modelyard_sidecar_breaker_state{{upstream="u",model="m",version="2"}} {state}\n'
            "# TYPE modelyard_sidecar_canary_weight gauge\n"
            f'modelyard_sidecar_canary_weight{{model="m"}} {weight}\n'
            "# TYPE modelyard_sidecar_requests_total counter\n"
            f'modelyard_sidecar_requests_total{{model="m"}} {calls}\n'
        )

    families = {
        f.name: f for f in sum_scrapes([scrape(0, 10, 3), scrape(2, 10, 4)], merge.LOWEST, merge.HIGHEST)
    }
    assert families["modelyard_sidecar_breaker_state"].samples[0].value == 2
    assert families["modelyard_sidecar_canary_weight"].samples[0].value == 10
    assert families["modelyard_sidecar_requests"].samples[0].value == 7


def test_replay_keeps_the_last_put_and_a_rollouts_start_with_its_last_control() -> None:
    supervisor = Supervisor(Settings(), 2)

    def change(method: str, path: str, body: bytes = b"") -> Change:
        return Change(method, path, body, ())

    supervisor._keep(change("PUT", "/canary/m", b"1"))
    supervisor._keep(change("PUT", "/canary/m", b"2"))
    supervisor._keep(change("POST", "/rollouts/m", b"start"))
    supervisor._keep(change("POST", "/rollouts/m/pause"))
    supervisor._keep(change("POST", "/rollouts/m/resume"))
    kept = {key: [(c.path, c.body) for c in changes] for key, changes in supervisor._changes.items()}
    assert kept == {
        "canary/m": [("/canary/m", b"2")],
        "rollouts/m": [("/rollouts/m", b"start"), ("/rollouts/m/resume", b"")],
    }
    supervisor._keep(change("POST", "/rollouts/m", b"again"))
    assert [c.body for c in supervisor._changes["rollouts/m"]] == [b"again"]
