"""A fleet rollout end to end (issue 36): three service + sidecar pairs on loopback, the real
Prometheus scraping every sidecar each second, and the controller (`python -m modelyard.rollouts`)
judging the fleet's gates through Prometheus' query API and pushing each step's weight to every
sidecar. A healthy canary is promoted 10, 50, 100 on all three through a SIGKILL of a sidecar and
of the controller (while that sidecar is down); a canary failing on one pod only is rolled back
everywhere, with no client error after; without Prometheus (absent, then killed) the step holds
and says why."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.fleet_support import PROMETHEUS, Controller, Fleet, Traffic, call, free_port, running_fleet
from tests.support import eventually, metric

pytestmark = pytest.mark.skipif(
    not PROMETHEUS.exists(), reason=f"{PROMETHEUS} is missing (make system-deps installs it)"
)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with running_fleet(tmp_path_factory.mktemp("fleet")) as running:
        running.prometheus_url = running.start_prometheus(free_port())
        yield running


def _every(weights: list[float | None], weight: float) -> bool:
    return all(w == weight for w in weights)


async def test_a_healthy_canary_is_promoted_on_every_pod_through_restarts(fleet: Fleet) -> None:
    port = free_port()
    controller = fleet.start_controller(port, fleet.prometheus_url, "scaler-rollouts.json")
    dwell_s = 4
    spec = {"steps": [10, 50, 100], "dwell_s": dwell_s, "min_calls": 10, "judge_calls": 5}
    url = f"{controller.url}/rollouts/scaler"
    async with Traffic(fleet, "scaler").running():
        assert (await call(url, "POST", spec, token=None))[0] == 401
        assert (await call(url, "POST", spec, token="wrong"))[0] == 401
        status, view = await call(url, "POST", spec)
        assert status == 201, view
        assert (view["state"], view["step"], view["weight"]) == ("running", 0, 10)
        assert (await call(url, "POST", spec))[0] == 409  # one rollout of a model at a time

        # The step reaches every sidecar within 5 s, owned by the controller.
        await eventually(lambda: _all(fleet, "scaler", 10), "weight 10 on every sidecar", within_s=5)
        assert set(await fleet.owners("scaler")) == {f"controller {controller.url}"}
        # A hand-made PUT on one sidecar does not fight it: 409, and the weight stays.
        pod = fleet.pods[1]
        status, refused = await call(f"{pod.admin}/canary/scaler", "PUT", {"canary_weight": 30})
        assert status == 409 and "owns the weight" in refused["error"], refused
        status, refused = await call(f"{pod.admin}/rollouts/scaler", "POST", spec)
        assert status == 409, refused  # nor does a local rollout start under it
        assert (await fleet.weights("scaler"))[1] == 10

        await eventually(lambda: _step(controller, "scaler", 1), "the second step", within_s=60)
        await eventually(lambda: _all(fleet, "scaler", 50), "weight 50 on every sidecar", within_s=5)

        # A sidecar SIGKILLed: shown unreachable, and the promotion pauses (the dwell passes).
        fleet.kill_sidecar(fleet.pods[0])

        async def shown_unreachable() -> bool:
            view = await controller.rollout("scaler")
            return view["sidecars"][0]["reachable"] is False and "unreachable" in (view["reason"] or "")

        await eventually(shown_unreachable, "sidecar 0 shown unreachable", within_s=10)
        view = await controller.rollout("scaler")
        assert view["step"] == 1 and view["state"] == "running", view
        dwell_end = float(view["step_started"]) + dwell_s + 2

        async def dwell_passed_held() -> bool:
            view = await controller.rollout("scaler")
            assert view["step"] == 1, view  # never promoted while a sidecar is out of reach
            return time.time() > dwell_end

        await eventually(dwell_passed_held, "the dwell to pass with the step held", within_s=30)
        metrics = (await call(f"{controller.url}/metrics"))[1]
        assert metric(metrics, "modelyard_rollouts_held", model="scaler", why="sidecars") == 1

        # The controller SIGKILLed and started again: it resumes at its step (held still: the
        # sidecar is still down).
        controller.stop(signal.SIGKILL)
        controller = fleet.start_controller(port, fleet.prometheus_url, "scaler-rollouts.json")
        view = await controller.rollout("scaler")
        assert (view["state"], view["step"], view["weight"]) == ("running", 1, 50), view
        await eventually(shown_unreachable, "sidecar 0 shown unreachable again", within_s=10)

        # Restarted (no state file: it starts at weight 0): the fleet's weight within 10 s.
        fleet.start_sidecar(fleet.pods[0])
        restarted = time.monotonic()
        await eventually(lambda: _all(fleet, "scaler", 50), "the restarted sidecar at 50", within_s=10)
        assert time.monotonic() - restarted < 10

        await _until_state(controller, "scaler", "succeeded", within_s=60)
        await eventually(lambda: _all(fleet, "scaler", 100), "weight 100 on every sidecar", within_s=5)
    view = await controller.rollout("scaler")
    weights = [(e["event"], e["weight"]) for e in view["history"]]
    assert weights == [("started", 10), ("step", 50), ("step", 100), ("succeeded", 100)], weights
    # Ended, with its weight everywhere: the leases go back (a hand-made PUT works again).
    await eventually(lambda: _released(fleet, "scaler"), "the leases released", within_s=10)
    assert (await controller.rollout("scaler"))["released"] is True


async def test_a_canary_failing_on_one_pod_is_rolled_back_everywhere(fleet: Fleet) -> None:
    controller = fleet.start_controller(free_port(), fleet.prometheus_url, "flaky-rollouts.json")
    # A dwell longer than the test: only the gates can end this rollout.
    spec = {"steps": [10, 50, 100], "dwell_s": 300, "min_calls": 10, "judge_calls": 5}
    traffic = Traffic(fleet, "flaky", value=100.0)  # values the first pod's canary fails on
    async with traffic.running():
        status, view = await call(f"{controller.url}/rollouts/flaky", "POST", spec)
        assert status == 201, view
        await eventually(lambda: _all(fleet, "flaky", 10), "weight 10 on every sidecar", within_s=5)
        await _until_state(controller, "flaky", "rolled_back", within_s=60)
        view = await controller.rollout("flaky")
        failed_at = view["history"][-1]["at"]
        await eventually(lambda: _all(fleet, "flaky", 0), "weight 0 on every sidecar", within_s=10)
        assert time.time() - failed_at < 10
        assert view["weight"] == 0 and view["history"][-1]["event"] == "failed", view
        assert fleet.pods[0].instance in view["reason"], view["reason"]  # the pod that failed
        for other in fleet.pods[1:]:
            assert other.instance not in view["reason"]
        traffic.reset()
        await eventually(lambda: traffic.ok >= 150, "calls after the rollback", within_s=30)
    assert traffic.errors == [], traffic.errors[:5]
    assert traffic.dyes == {"stable/1"}
    metrics = (await call(f"{controller.url}/metrics"))[1]
    assert metric(metrics, "modelyard_rollouts_state", model="flaky", state="rolled_back") == 1
    assert metric(metrics, "modelyard_rollouts_transitions_total", model="flaky", event="failed") == 1


async def test_without_prometheus_the_step_holds_and_says_why(fleet: Fleet) -> None:
    port = free_port()  # nothing listens there yet: Prometheus is absent
    controller = fleet.start_controller(free_port(), f"http://127.0.0.1:{port}", "held-rollouts.json")
    spec = {"dwell_s": 2}
    async with Traffic(fleet, "held").running():
        # Started from a shell, as an operator does: `modelyard canary --controller URL rollout start`.
        started = await asyncio.to_thread(
            subprocess.run,
            [
                *(sys.executable, "-m", "modelyard.cli", "canary", "--controller", controller.url),
                *("--token-file", str(fleet.tokens), "rollout", "start", "held", "--steps", "10,50,100"),
                *("--dwell-s", "2", "--min-calls", "10", "--judge-calls", "5"),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert started.returncode == 0, started.stderr
        view = json.loads(started.stdout)
        assert (view["state"], view["weight"], view["spec"]["dwell_s"]) == ("running", 10, 2), view
        await eventually(lambda: _all(fleet, "held", 10), "weight 10 on every sidecar", within_s=5)
        await _held_past_dwell(controller, "held", 0, spec["dwell_s"])
        metrics = (await call(f"{controller.url}/metrics"))[1]
        assert metric(metrics, "modelyard_rollouts_held", model="held", why="prometheus") == 1
        assert metric(metrics, "modelyard_rollouts_prometheus_up") == 0

        # Prometheus comes: the rollout goes on. Then it is killed: the next step holds again.
        fleet.start_prometheus(port)
        await eventually(lambda: _step(controller, "held", 1), "the second step", within_s=60)
        fleet.prometheuses[-1].send_signal(signal.SIGKILL)
        fleet.prometheuses[-1].wait()
        await _held_past_dwell(controller, "held", 1, spec["dwell_s"])
        assert await fleet.weights("held") == [50, 50, 50]

        status, view = await call(f"{controller.url}/rollouts/held/abort", "POST")
        assert status == 200 and view["state"] == "aborted", view
        await eventually(lambda: _all(fleet, "held", 0), "weight 0 after the abort", within_s=10)


async def _held_past_dwell(controller: Controller, model: str, step: int, dwell_s: float) -> None:
    async def held() -> bool:
        view = await controller.rollout(model)
        return "prometheus" in (view["reason"] or "") and view["held"] is not None

    await eventually(held, "the step held for want of Prometheus", within_s=20)
    view = await controller.rollout(model)
    assert view["reason"].startswith("held: "), view["reason"]
    dwell_end = float(view["step_started"]) + dwell_s + 2

    async def passed() -> bool:
        view = await controller.rollout(model)
        assert (view["state"], view["step"]) == ("running", step), view  # never promoted blind
        return time.time() > dwell_end

    await eventually(passed, "the dwell to pass with the step held", within_s=30)


async def _all(fleet: Fleet, model: str, weight: float) -> bool:
    return _every(await fleet.weights(model), weight)


async def _released(fleet: Fleet, model: str) -> bool:
    return set(await fleet.owners(model)) == {None}


async def _step(controller: Controller, model: str, step: int) -> bool:
    view = await controller.rollout(model)
    assert view["state"] == "running", f"{view['state']}: {view['reason']} {view['gates']}"
    return bool(view["step"] >= step)


async def _state(controller: Controller, model: str, state: str) -> bool:
    view = await controller.rollout(model)
    return bool(view["state"] == state)


async def _until_state(controller: Controller, model: str, state: str, within_s: float) -> None:
    """Wait for a rollout's state; a timeout says where it was and why."""
    try:
        await eventually(lambda: _state(controller, model, state), f"the rollout {state}", within_s)
    except AssertionError:
        view = await controller.rollout(model)
        seen = [(s["url"], s["reachable"], s["applied_weight"], s["error"]) for s in view["sidecars"]]
        raise AssertionError(
            f"not {state}: {view['state']} step {view['step']}: {view['reason']}; {view['gates']}; {seen}"
        ) from None
