"""Progressive rollouts, the policy and its driver, with the clock injected: outcomes are reported
as the breakers report them (per model and version), the shadow counters are the sidecar's own
metrics, and each tick is the driver's. Promotion through every step, rollback on errors,
latency and shadow disagreement, a restart mid-rollout, a new version mid-rollout."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelyard.sidecar.breakers import BreakerKey
from modelyard.sidecar.metrics import SidecarMetrics
from modelyard.sidecar.rollout.driver import RolloutDriver, RolloutError
from modelyard.sidecar.rollout.policy import (
    ABORTED,
    FAILED,
    PAUSED,
    RUNNING,
    SUCCEEDED,
    Evidence,
    RolloutSpec,
    Tally,
    judge,
)
from modelyard.sidecar.routes.route_table import FROM_ROLLOUT, RouteSource
from modelyard.sidecar.routes.state_file import audit_log

SPEC = RolloutSpec(steps=(1, 5, 25, 50, 100), dwell_s=60, min_calls=50, judge_calls=20)


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


class Harness:
    """A driver over a route table, the versions `served` and breakers that `open` names."""

    def __init__(
        self, saved: dict[str, object] | None = None, clock: Clock | None = None, config: Path | None = None
    ) -> None:
        self.clock = clock or Clock()
        self.served = {"scaler": {"1", "2"}}
        self.open: set[tuple[str, str]] = set()
        self.metrics = SidecarMetrics()
        saved = saved or {}
        self.routes = RouteSource(config, saved=saved.get("routes"), clock=self.clock)  # type: ignore[arg-type]
        self.driver = RolloutDriver(
            self.routes,
            lambda model: self.served.get(model, ()),
            lambda model, version: (model, version) in self.open,
            self.metrics.registry,
            saved=saved.get("rollouts"),  # type: ignore[arg-type]
            clock=self.clock,
        )

    def calls(self, version: str, n: int, *, faults: int = 0, latency: float | None = 0.01) -> None:
        key = BreakerKey("127.0.0.1:1", "scaler", version)
        for i in range(n):
            self.driver.outcomes.record(key, i < faults, latency)

    def weight(self) -> float:
        return self.routes.table.route("scaler").canary_weight

    def step(self, *, canary_faults: int = 0, canary_latency: float = 0.01, wait_s: float = 60) -> None:
        """One step's traffic (stable and canary, healthy unless told), its dwell, a tick."""
        self.calls("1", 100)
        self.calls("2", 60, faults=canary_faults, latency=canary_latency)
        self.clock.now += wait_s
        self.driver.tick()

    def saved(self) -> dict[str, object]:
        return {"routes": self.routes.saved(), "rollouts": self.driver.saved()}

    def gauge(self, name: str, **labels: str) -> float | None:
        return self.metrics.registry.get_sample_value(name, {"model": "scaler", **labels})


def test_a_good_canary_is_promoted_through_every_step(caplog: pytest.LogCaptureFixture) -> None:
    h = Harness()
    caplog.set_level("INFO", audit_log.name)
    rollout = h.driver.start("scaler", SPEC, "token:ab@ops")
    assert (rollout.state, rollout.step, h.weight()) == (RUNNING, 0, 1)
    assert h.routes.sources["scaler"].source == FROM_ROLLOUT
    seen = [h.weight()]
    for _ in SPEC.steps:
        h.clock.now += 30  # half the dwell: not yet
        h.calls("2", 60)
        h.calls("1", 60)
        h.driver.tick()
        assert h.weight() == seen[-1]
        h.clock.now += 30
        h.driver.tick()
        seen.append(h.weight())
    assert seen == [1, 5, 25, 50, 100, 100]
    assert rollout.state == SUCCEEDED and rollout.reason is None
    events = [e["event"] for e in rollout.history]
    assert events == ["started", "step", "step", "step", "step", "succeeded"]
    assert h.gauge("modelyard_sidecar_rollout_step") == 4
    assert h.gauge("modelyard_sidecar_rollout_gate", gate="errors", result="green") == 1
    lines = [r.getMessage() for r in caplog.records if r.name == audit_log.name]
    assert len(lines) == 6 and "canary_weight 1 -> 5" in lines[1] and "state=succeeded" in lines[-1]


def test_a_step_waits_for_its_calls_as_well_as_its_dwell() -> None:
    h = Harness()
    h.driver.start("scaler", SPEC, "ops")
    h.calls("1", 100)
    h.calls("2", SPEC.min_calls - 1)
    h.clock.now += 600
    h.driver.tick()
    assert h.weight() == 1
    h.calls("2", 1)
    h.driver.tick()
    assert h.weight() == 5


def test_a_canary_that_starts_failing_at_step_3_is_rolled_back() -> None:
    h = Harness()
    rollout = h.driver.start("scaler", SPEC, "ops")
    h.step()
    h.step()
    assert (rollout.step, h.weight()) == (2, 25)
    h.calls("1", 100, faults=1)  # stable's own rate: 1%
    h.calls("2", 30, faults=9)  # 30% of the canary's calls fail, well before the dwell ends
    h.clock.now += 1
    h.driver.tick()
    assert (rollout.state, h.weight()) == (FAILED, 0)
    assert rollout.reason is not None and rollout.reason.startswith("gate red: errors")
    assert h.gauge("modelyard_sidecar_rollout_gate", gate="errors", result="red") == 1
    assert h.gauge("modelyard_sidecar_rollout_weight") == 0
    h.step()
    assert h.weight() == 0  # a failed rollout stays failed


def test_a_canary_slower_than_stable_is_rolled_back_but_jitter_is_not() -> None:
    h = Harness()
    rollout = h.driver.start("scaler", SPEC, "ops")
    # Jitter: a few calls 3x a 10 ms stable (the canary's p99, under the p99's 50 ms floor), its
    # median stable's: green.
    h.calls("1", 100)
    h.calls("2", 57)
    h.calls("2", 3, latency=0.03)
    h.clock.now += 60
    h.driver.tick()
    assert rollout.step == 1 and rollout.gates["latency"].result == "green"
    # Slower on most calls (1.5x): within max_latency_ratio, green.
    h.step(canary_latency=0.015)
    assert rollout.step == 2
    # 3x on most calls: its median over 2x stable's (the floor, a few ms, scales with stable).
    h.step(canary_latency=0.03)
    assert rollout.state == FAILED and "median 30.0 ms vs 10.0 ms" in str(rollout.reason)


def test_a_slow_tail_is_judged_on_p99s_over_their_own_floor() -> None:
    h = Harness()
    rollout = h.driver.start("scaler", SPEC, "ops")
    h.calls("1", 100)
    h.calls("2", 55)
    h.calls("2", 5, latency=0.5)  # its median stable's, its p99 half a second
    h.clock.now += 60
    h.driver.tick()
    assert rollout.state == FAILED and "latency: canary p99 500.0 ms vs stable 10.0 ms" in str(rollout.reason)


def test_shadow_disagreement_rolls_back(tmp_path: Path) -> None:
    config = tmp_path / "routes.yaml"
    config.write_text("shadow: {share: 50}\n")
    h = Harness(config=config)
    rollout = h.driver.start("scaler", SPEC, "ops")
    rows, agreeing = h.metrics.shadow_rows.labels("scaler"), h.metrics.shadow_rows_agreeing.labels("scaler")
    rows.inc(100)
    agreeing.inc(100)
    h.step()
    assert rollout.step == 1 and rollout.gates["shadow"].result == "green"
    rows.inc(100)
    agreeing.inc(80)  # this step's agreement is 80%, whatever the earlier steps' was
    h.step()
    assert rollout.state == FAILED and "shadow agreement 0.800" in str(rollout.reason)


def test_the_canary_breaker_opening_rolls_back_at_once() -> None:
    h = Harness()
    rollout = h.driver.start("scaler", SPEC, "ops")
    h.open.add(("scaler", "2"))
    h.driver.tick()
    assert rollout.state == FAILED and "breaker" in str(rollout.reason) and h.weight() == 0


def test_a_restart_mid_rollout_resumes_where_it_was() -> None:
    h = Harness()
    rollout = h.driver.start("scaler", SPEC, "ops")
    h.step()
    h.step()
    assert (rollout.step, h.weight()) == (2, 25)
    again = Harness(saved=h.saved(), clock=h.clock)
    resumed = again.driver.rollouts["scaler"]
    assert (resumed.state, resumed.step, again.weight()) == (RUNNING, 2, 25)
    assert resumed.history == rollout.history
    again.step()
    again.step()
    again.step()
    assert (resumed.state, again.weight()) == (SUCCEEDED, 100)


def test_a_restarted_sidecar_holds_the_step_until_its_upstreams_report_the_canary() -> None:
    """A restart's first ticks can run before the upstreams say what they serve: no canary known
    then is no new canary, so the step saved is kept (it used to fall back to the first)."""
    h = Harness()
    rollout = h.driver.start("scaler", SPEC, "ops")
    h.step()
    h.step()
    again = Harness(saved=h.saved(), clock=h.clock)
    resumed = again.driver.rollouts["scaler"]
    again.served["scaler"] = set()  # nothing reported yet
    again.driver.tick()
    again.clock.now += 60
    again.driver.tick()
    assert (resumed.state, resumed.step, again.weight()) == (RUNNING, 2, 25)
    assert resumed.history == rollout.history  # no `restarted`
    again.served["scaler"] = {"1", "2"}
    again.step()
    assert resumed.step == 3


def test_a_new_canary_version_mid_rollout_restarts_from_the_first_step() -> None:
    h = Harness()
    rollout = h.driver.start("scaler", SPEC, "ops")
    h.step()
    h.step()
    assert rollout.step == 2
    h.served["scaler"] = {"1", "2", "3"}
    h.driver.tick()
    assert (rollout.state, rollout.step, rollout.canary, h.weight()) == (RUNNING, 0, "3", 1)
    assert rollout.history[-1]["event"] == "restarted" and "3" in rollout.history[-1]["reason"]
    h.calls("2", 100)  # the old canary's calls do not count for the new one
    h.clock.now += 60
    h.driver.tick()
    assert rollout.step == 0
    h.calls("3", 60)
    h.driver.tick()
    assert rollout.step == 1


def test_pause_holds_resume_goes_on_abort_sets_zero() -> None:
    h = Harness()
    rollout = h.driver.start("scaler", SPEC, "ops")
    with pytest.raises(RolloutError) as running:
        h.driver.start("scaler", SPEC, "ops")
    assert running.value.status == 409
    h.driver.control("scaler", "pause", "ops")
    h.step()
    assert (rollout.state, h.weight()) == (PAUSED, 1)
    h.driver.control("scaler", "resume", "ops")
    h.step()
    assert (rollout.state, h.weight()) == (RUNNING, 5)
    h.driver.control("scaler", "abort", "token:1@x")
    assert (rollout.state, h.weight(), rollout.reason) == (ABORTED, 0, "aborted by token:1@x")
    with pytest.raises(RolloutError):
        h.driver.control("scaler", "resume", "ops")


def test_gates_are_pending_until_judged_and_relative_to_stable() -> None:
    spec = RolloutSpec(judge_calls=10, min_calls=10)
    few = judge(spec, Evidence(Tally(5, 5, 5, 1.0), Tally(100, 0, 100, 0.01)))
    assert few["errors"].result == "pending" and few["latency"].result == "pending"
    # A stable that fails 20% of calls: a canary at 21% is within its 2 points.
    same = judge(spec, Evidence(Tally(100, 21, 0, None), Tally(100, 20, 0, None)))
    assert same["errors"].result == "green" and same["shadow"].result == "off"


@pytest.mark.parametrize(
    ("steps", "message"), [((5, 1, 100), "rise"), ((1, 50), "last step"), ((0, 100), "above 0")]
)
def test_a_bad_spec_says_why(steps: tuple[float, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RolloutSpec(steps=steps)


def test_a_rollout_in_the_route_file_starts_once_and_again_when_its_spec_changes(tmp_path: Path) -> None:
    config = tmp_path / "routes.yaml"
    config.write_text("rollout: {scaler: {steps: [10, 100], dwell_s: 5, min_calls: 5}}\n")
    h = Harness(config=config)
    first = h.driver.rollouts["scaler"]
    assert (first.origin, first.state, h.weight()) == ("route_file", RUNNING, 10)
    h.step()
    assert h.weight() == 100
    again = Harness(saved=h.saved(), clock=h.clock, config=config)  # a restart: the same rollout
    assert again.driver.rollouts["scaler"].history == first.history and again.weight() == 100
    config.write_text("rollout: {scaler: {steps: [20, 100], dwell_s: 5, min_calls: 5}}\n")
    assert again.routes.reload_if_changed()
    again.driver.from_file()
    assert again.driver.rollouts["scaler"].spec.steps == (20.0, 100.0)
    assert again.weight() == 20


def test_an_active_rollout_holds_its_weight_against_a_route_file_edit(tmp_path: Path) -> None:
    config = tmp_path / "routes.yaml"
    config.write_text("models: {scaler: {canary_weight: 0}}\n")
    h = Harness(config=config)
    h.driver.start("scaler", SPEC, "ops")
    config.write_text("models: {scaler: {canary_weight: 90}}\n")
    h.clock.now = 4_000_000_000.0  # after the file's modification time: the edit is the newer change
    assert h.routes.reload_if_changed() and h.weight() == 90
    h.driver.tick()
    assert h.weight() == 1 and h.routes.sources["scaler"].source == FROM_ROLLOUT
