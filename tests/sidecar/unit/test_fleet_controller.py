"""The controller's loop (sidecar/fleet/controller.py), tick by tick, on sidecars that are dicts
and a Prometheus that answers what the test says, with the rollouts' clock the test's: a step
reaches every sidecar, a pod found later starts at the fleet's weight, an unreachable pod pauses
the promotion but never the rollback (which it gets when it answers again), Prometheus' absence
holds the step, a finished rollout gives its leases back. tests/sidecar/integration/test_fleet_rollout.py
runs the same against real processes."""

from __future__ import annotations

import asyncio
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from modelyard.sidecar.fleet.controller import Controller
from modelyard.sidecar.fleet.gates import FleetEvidence, Prometheus, PrometheusError, Queries
from modelyard.sidecar.fleet.pods import AdminClient, AdminRefused
from modelyard.sidecar.fleet.store import MemoryStore
from modelyard.sidecar.rollout.policy import Evidence, RolloutSpec, Tally

OWNER = "controller http://test"
SPEC = RolloutSpec(steps=(10, 50, 100), dwell_s=10, min_calls=10, judge_calls=5)


class Sidecars(AdminClient):
    """Sidecars in memory: url -> model -> its GET /canary entry; `down` ones do not answer."""

    def __init__(self, *urls: str) -> None:
        super().__init__()
        self.views: dict[str, dict[str, dict[str, Any]]] = {
            u: {"scaler": {"canary_weight": 0.0, "canary_version": "2"}} for u in urls
        }
        self.down: set[str] = set()
        self.puts: list[tuple[str, float, float]] = []

    async def canary(self, pod: str) -> dict[str, Any]:
        if pod in self.down:
            raise ConnectionRefusedError(f"{pod} refused")
        return {"models": {m: dict(v) for m, v in self.views[pod].items()}}

    async def set_weight(self, pod: str, model: str, weight: float, owner: str, lease_s: float) -> None:
        if pod in self.down:
            raise ConnectionRefusedError(f"{pod} refused")
        held = self.views[pod][model].get("owner")
        if held and held != owner:
            raise AdminRefused(409, f"409 {held} owns the weight")
        self.puts.append((pod, weight, lease_s))
        entry = self.views[pod][model]
        entry["canary_weight"] = weight
        if lease_s:
            entry["owner"] = owner
        else:
            entry.pop("owner", None)


class Evidenced(Prometheus):
    """Not asked over HTTP: gates.gather is replaced by what `found` holds."""

    def __init__(self) -> None:
        super().__init__("http://prometheus.test")


def healthy(pods: list[str], calls: int = 50) -> FleetEvidence:
    one = Evidence(Tally(calls, 0, calls, 0.004), Tally(calls * 9, 0, calls * 9, 0.004))
    total = Evidence(Tally(calls * len(pods), 0, calls * len(pods), 0.004), Tally(1, 0, 1, 0.004))
    return FleetEvidence(total, dict.fromkeys((p.removeprefix("http://") for p in pods), one), len(pods))


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def controller(sidecars: Sidecars, clock: Clock, monkeypatch: Any, found: list[Any], **kw: Any) -> Controller:
    async def gather(*args: Any) -> FleetEvidence:
        if isinstance(found[0], Exception):
            raise found[0]
        return found[0]  # type: ignore[no-any-return]

    monkeypatch.setattr("modelyard.sidecar.fleet.controller.gather", gather)
    return Controller(
        sidecars=kw.pop("urls", list(sidecars.views)),
        prometheus=Evidenced(),
        queries=Queries(),
        store=MemoryStore(),
        client=sidecars,
        owner=OWNER,
        registry=kw.pop("registry", CollectorRegistry()),
        clock=clock,
        lease_s=30,
        **kw,
    )


def weights(sidecars: Sidecars) -> list[float]:
    return [v["scaler"]["canary_weight"] for v in sidecars.views.values()]


async def test_promoted_step_by_step_on_every_sidecar_and_released(monkeypatch: Any) -> None:
    sidecars, clock = Sidecars("http://a:9101", "http://b:9101"), Clock()
    found: list[Any] = [healthy(list(sidecars.views))]
    c = controller(sidecars, clock, monkeypatch, found)
    await c.start()
    await c.begin("scaler", SPEC, "test")
    await c.tick()
    assert weights(sidecars) == [10, 10]
    assert {v["scaler"]["owner"] for v in sidecars.views.values()} == {OWNER}
    await c.tick()
    assert c.rollouts["scaler"].rollout.step == 0  # the dwell has not passed
    clock.now += 11
    await c.tick()
    assert weights(sidecars) == [50, 50] and c.view("scaler")["step"] == 1
    clock.now += 11
    await c.tick()
    clock.now += 11
    await c.tick()
    view = c.view("scaler")
    assert view["state"] == "succeeded" and weights(sidecars) == [100, 100]
    # Ended and everywhere: the leases are given back (lease_s 0), once.
    assert view["released"] is True
    assert all("owner" not in v["scaler"] for v in sidecars.views.values())
    puts = len(sidecars.puts)
    await c.tick()
    assert len(sidecars.puts) == puts


async def test_an_unreachable_pod_pauses_the_promotion_but_not_the_rollback(monkeypatch: Any) -> None:
    sidecars, clock = Sidecars("http://a:9101", "http://b:9101", "http://c:9101"), Clock()
    found: list[Any] = [healthy(list(sidecars.views))]
    c = controller(sidecars, clock, monkeypatch, found)
    await c.start()
    await c.begin("scaler", SPEC, "test")
    await c.tick()
    sidecars.down.add("http://c:9101")
    found[0] = healthy(["http://a:9101", "http://b:9101"])
    clock.now += 60
    await c.tick()
    view = c.view("scaler")
    assert view["step"] == 0 and "http://c:9101 is unreachable" in view["reason"], view["reason"]
    assert [s["reachable"] for s in view["sidecars"]] == [True, True, False]
    assert c.metrics.held.labels("scaler", "sidecars")._value.get() == 1

    # Red on pod b: rolled back at once on the two that answer, and c gets it when it is back.
    bad = Evidence(Tally(50, 40, 50, 0.004), Tally(450, 0, 450, 0.004))
    red = healthy(["http://a:9101", "http://b:9101"])
    red.pods["b:9101"] = bad
    found[0] = red
    await c.tick()
    view = c.view("scaler")
    assert view["state"] == "rolled_back" and "(on b:9101)" in view["reason"], view["reason"]
    assert weights(sidecars) == [0, 0, 10]
    assert view["released"] is False  # c has not got it yet
    sidecars.down.clear()
    await c.tick()
    assert weights(sidecars) == [0, 0, 0] and c.view("scaler")["released"] is True


async def test_a_pod_found_later_starts_at_the_fleets_weight(monkeypatch: Any) -> None:
    sidecars, clock = Sidecars("http://a:9101", "http://b:9101"), Clock()
    found: list[Any] = [healthy(["http://a:9101"])]
    listed = ["http://a:9101"]

    async def discover() -> list[str]:
        return list(listed)

    c = controller(sidecars, clock, monkeypatch, found, urls=[], discover=discover)
    await c.start()
    await c.begin("scaler", SPEC, "test")
    await c.tick()
    assert weights(sidecars) == [10, 0]
    listed.append("http://b:9101")  # a new pod behind the headless Service
    await c.tick()
    assert weights(sidecars) == [10, 10]
    listed.remove("http://a:9101")  # a pod gone: forgotten, not waited for
    await c.tick()
    assert [s["url"] for s in c.view("scaler")["sidecars"]] == ["http://b:9101"]


async def test_a_pod_found_after_the_release_gets_the_final_weight_once(monkeypatch: Any) -> None:
    sidecars, clock = Sidecars("http://a:9101", "http://b:9101"), Clock()
    found: list[Any] = [healthy(["http://a:9101"])]
    listed = ["http://a:9101"]

    async def discover() -> list[str]:
        return list(listed)

    c = controller(sidecars, clock, monkeypatch, found, urls=[], discover=discover)
    await c.start()
    await c.begin("scaler", SPEC, "test")
    for _ in range(3):
        await c.tick()
        clock.now += 11
    await c.tick()
    assert c.view("scaler")["released"] is True and weights(sidecars) == [100, 0]
    listed.append("http://b:9101")  # a pod started after the rollout ended
    await c.tick()
    assert weights(sidecars) == [100, 100]
    assert "owner" not in sidecars.views["http://b:9101"]["scaler"]  # no lease: the operators' weight
    sidecars.views["http://b:9101"]["scaler"]["canary_weight"] = 30  # an operator's change, by hand
    await c.tick()
    assert weights(sidecars) == [100, 30]  # told once, never fought
    listed.remove("http://b:9101")
    await c.tick()
    listed.append("http://b:9101")  # gone from the Service's records and back: a new pod
    await c.tick()
    assert weights(sidecars) == [100, 100]
    saved = await c.store.load()
    assert saved["scaler"]["told"] == ["http://a:9101", "http://b:9101"]


async def test_without_prometheus_the_step_holds(monkeypatch: Any) -> None:
    sidecars, clock = Sidecars("http://a:9101"), Clock()
    found: list[Any] = [PrometheusError("prometheus at http://prometheus.test is unreachable: refused")]
    c = controller(sidecars, clock, monkeypatch, found)
    await c.start()
    await c.begin("scaler", SPEC, "test")
    for _ in range(3):
        clock.now += 60
        await c.tick()
    view = c.view("scaler")
    assert (view["state"], view["step"], weights(sidecars)) == ("running", 0, [10])
    assert view["reason"] == (
        "held: the gates cannot be judged: prometheus at http://prometheus.test is unreachable: refused"
    )
    # Prometheus back, seeing too few sidecars: still held, for that reason.
    found[0] = FleetEvidence(healthy(["http://a:9101"]).fleet, {}, 0)
    await c.tick()
    assert "prometheus sees 0 of the 1 sidecars" in c.view("scaler")["reason"]
    found[0] = healthy(["http://a:9101"])
    await c.tick()
    assert c.view("scaler")["step"] == 1


async def test_another_owner_is_shown_and_holds_the_promotion(monkeypatch: Any) -> None:
    sidecars, clock = Sidecars("http://a:9101", "http://b:9101"), Clock()
    sidecars.views["http://b:9101"]["scaler"]["owner"] = "controller http://elsewhere"
    found: list[Any] = [healthy(list(sidecars.views))]
    c = controller(sidecars, clock, monkeypatch, found)
    await c.start()
    await c.begin("scaler", SPEC, "test")
    clock.now += 60
    await c.tick()
    view = c.view("scaler")
    assert view["step"] == 0 and "http://b:9101 refused the weight" in view["reason"], view["reason"]
    assert "owns the weight" in view["sidecars"][1]["error"]


async def test_a_sidecar_answering_no_http_is_shown_unreachable(monkeypatch: Any) -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"SSH-2.0-not-a-sidecar\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(garbage, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    clock = Clock()
    c = Controller(
        sidecars=[url],
        prometheus=None,
        queries=Queries(),
        store=MemoryStore(),
        client=AdminClient(timeout_s=5),
        owner=OWNER,
        registry=CollectorRegistry(),
        clock=clock,
    )
    try:
        await c.start()
        await c.begin("scaler", SPEC, "test")
        await c.tick()  # does not raise
        (shown,) = c.view("scaler")["sidecars"]
        assert shown["reachable"] is False and "not an HTTP answer" in shown["error"], shown
    finally:
        server.close()
        await server.wait_closed()


async def test_a_replica_that_loses_the_lead_stops_and_shows_nothing(monkeypatch: Any) -> None:
    sidecars, clock = Sidecars("http://a:9101"), Clock()
    found: list[Any] = [healthy(["http://a:9101"])]
    registry = CollectorRegistry()
    c = controller(sidecars, clock, monkeypatch, found, registry=registry)
    await c.start()
    await c.begin("scaler", SPEC, "test")
    await c.tick()
    assert c.metrics.weight.labels("scaler")._value.get() == 10
    leading = [False]

    async def lead() -> bool:
        return leading[0]

    monkeypatch.setattr(c.store, "lead", lead)
    puts = len(sidecars.puts)
    clock.now += 60
    await c.tick()
    assert not c.leader and c.rollouts == {} and len(sidecars.puts) == puts  # it does nothing
    metrics = generate_latest(registry).decode()
    assert "modelyard_rollouts_weight{" not in metrics and "modelyard_rollouts_leader 0.0" in metrics
