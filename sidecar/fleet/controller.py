"""The fleet rollout controller's loop: each tick (`tick_s`) it finds the sidecars, reads each one's
weights and pushes the fleet's (reconcile), judges every active rollout on the fleet's evidence
from Prometheus (gates.py) with the sidecar's own policy (modelyard.sidecar.rollout.policy), and saves
each transition (store.py) before it is pushed. A change over the API wakes it at once.

Who wins a weight: while a rollout of a model is active, the controller owns that model's weight
on every sidecar (a lease it renews; ownership.py): a hand-made PUT there is refused 409. When the
rollout ends (succeeded, rolled back, aborted) its final weight is pushed until every sidecar has
it, then the leases are released and the weight is the operators' again; a sidecar found after
that is told the final weight once (no lease), so a new pod begins at the fleet's weight.

What holds a step (never promotes blind), shown as the rollout's `reason` and in
`modelyard_rollouts_held{why}`: Prometheus absent, down, or seeing fewer sidecars than the
controller reaches (`prometheus`); a sidecar unreachable or refusing the weight (`sidecars`); too
few canary calls in the window yet (`evidence`); no sidecar serving a canary (`canary`). A red
gate fails the rollout whatever holds it: the rollback to 0 is pushed to every sidecar that
answers, and to the others when they answer again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from modelyard.sidecar.fleet.gates import Prometheus, PrometheusError, Queries, gather, worst
from modelyard.sidecar.fleet.pods import AdminClient, AdminRefused, Pod
from modelyard.sidecar.fleet.store import Store
from modelyard.sidecar.rollout.policy import (
    ADMIN,
    FAILED,
    GATES,
    RED,
    RESULTS,
    RUNNING,
    Rollout,
    RolloutSpec,
    judge,
)
from modelyard.sidecar.routes.state_file import audit

log = logging.getLogger(__name__)

ROLLED_BACK = "rolled_back"  # the policy's `failed`, in the fleet's words
SHOWN_STATES = ("running", "paused", "succeeded", ROLLED_BACK, "aborted")
HOLDS = ("prometheus", "sidecars", "evidence", "canary")


class ControlError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Managed:
    rollout: Rollout
    released: bool = False  # ended, its final weight everywhere, the leases given back
    held: str | None = None  # why the step holds now
    held_kind: str = ""
    # Released: the sidecars that have its final weight (those of the release, and any found
    # later that were told it); a pod gone from them is told again if it comes back.
    told: list[str] = field(default_factory=list)

    def doc(self) -> dict[str, Any]:
        return {**self.rollout.doc(), "released": self.released, "told": self.told}

    @staticmethod
    def from_doc(model: str, raw: dict[str, Any]) -> Managed:
        told = raw.get("told", [])
        if not isinstance(told, list) or not all(isinstance(url, str) for url in told):
            raise ValueError("told: must be a list of sidecar URLs")
        return Managed(Rollout.from_doc(model, raw), released=bool(raw.get("released", False)), told=told)


def shown_state(rollout: Rollout) -> str:
    return ROLLED_BACK if rollout.state == FAILED else rollout.state


class ControllerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        def gauge(name: str, doc: str, labels: Iterable[str] = ()) -> Gauge:
            return Gauge(f"modelyard_rollouts_{name}", doc, list(labels), registry=registry)

        self.leader = gauge("leader", "1 while this controller replica leads (0: it waits)")
        self.state = gauge(
            "state", "Each fleet rollout's state: 1 for the state it is in", ["model", "state"]
        )
        self.step = gauge("step", "The step (index into its steps) each fleet rollout is at", ["model"])
        self.weight = gauge("weight", "The canary weight each fleet rollout sets on every sidecar", ["model"])
        self.held = gauge(
            "held",
            "1 while a fleet rollout's step holds, by why: prometheus, sidecars, evidence, canary",
            ["model", "why"],
        )
        self.gate = gauge(
            "gate", "Each fleet gate's result: 1 for the result it has", ["model", "gate", "result"]
        )
        self.synced = gauge(
            "synced", "1 when every sidecar has the fleet rollout's weight from this controller", ["model"]
        )
        self.sidecar_up = gauge("sidecar_up", "1 while a sidecar's admin endpoint answers", ["sidecar"])
        self.prometheus_up = gauge("prometheus_up", "1 when the last gate queries were answered")
        self.transitions = Counter(
            "modelyard_rollouts_transitions",
            "Fleet rollout transitions by event (started, step, succeeded, failed, paused, ...)",
            ["model", "event"],
            registry=registry,
        )

    def forget(self) -> None:
        for gauge in (self.state, self.step, self.weight, self.held, self.gate, self.synced, self.sidecar_up):
            gauge.clear()

    def show(self, model: str, managed: Managed, synced: bool) -> None:
        rollout = managed.rollout
        for state in SHOWN_STATES:
            self.state.labels(model, state).set(1 if shown_state(rollout) == state else 0)
        self.step.labels(model).set(rollout.step)
        self.weight.labels(model).set(rollout.weight)
        for why in HOLDS:
            self.held.labels(model, why).set(1 if managed.held and managed.held_kind == why else 0)
        for gate in GATES:
            current = rollout.gates.get(gate)
            for result in RESULTS:
                self.gate.labels(model, gate, result).set(
                    1 if current is not None and current.result == result else 0
                )
        self.synced.labels(model).set(1 if synced else 0)


class Controller:
    def __init__(
        self,
        *,
        sidecars: Iterable[str],
        prometheus: Prometheus | None,
        queries: Queries,
        store: Store,
        client: AdminClient,
        owner: str,
        registry: CollectorRegistry,
        discover: Callable[[], Awaitable[list[str]]] | None = None,
        tick_s: float = 1.0,
        lease_s: float = 30.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._static = list(dict.fromkeys(s.rstrip("/") for s in sidecars))
        self._discover = discover
        self.prometheus = prometheus
        self.queries = queries
        self.store = store
        self.client = client
        self.owner = owner
        self.tick_s = tick_s
        self.lease_s = lease_s
        self._clock = clock
        self.metrics = ControllerMetrics(registry)
        self.pods: dict[str, Pod] = {url: Pod(url) for url in self._static}
        self.rollouts: dict[str, Managed] = {}
        self.leader = False
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()  # one tick at a time, and no change in the middle of one

    # --- leading and the loop ---------------------------------------------------------------

    async def start(self) -> None:
        await self._lead()

    async def _lead(self) -> bool:
        leading = await self.store.lead()
        if leading and not self.leader:
            saved = await self.store.load()
            self.rollouts = {m: Managed.from_doc(m, raw) for m, raw in saved.items()}
            log.info("leading: %d rollout(s) from %s", len(self.rollouts), self.store.where)
        elif self.leader and not leading:
            log.warning("lost the lead: waiting (another replica leads)")
            self.rollouts = {}
            self.metrics.forget()  # the leader's series are the new leader's now
        self.leader = leading
        self.metrics.leader.set(1 if leading else 0)
        return leading

    async def run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.tick_s)
            self._wake.clear()
            try:
                await self.tick()
            except Exception:  # a bug here must not end the loop silently
                log.exception("rollouts: a tick failed")

    def wake(self) -> None:
        self._wake.set()

    async def tick(self) -> None:
        if not await self._lead():
            return
        async with self._lock:
            await self._find()
            await self.reconcile()
            if await self._judge():
                await self.save()
                await self.reconcile()
            await self._release()
            await self._tell_late()
            for model in self.rollouts:
                self._show(model)

    def _show(self, model: str) -> None:
        self.metrics.show(model, self.rollouts[model], self.synced(model))

    async def save(self) -> None:
        await self.store.save({m: managed.doc() for m, managed in sorted(self.rollouts.items())})

    # --- the sidecars -------------------------------------------------------------------------

    async def _find(self) -> None:
        if self._discover is None:
            return
        try:
            found = await self._discover()
        except (OSError, ValueError) as exc:  # keep the ones known: a DNS hiccup must not forget them
            log.warning("rollouts: finding the sidecars failed: %s", exc)
            return
        for url in found:
            self.pods.setdefault(url, Pod(url))
        for url in [u for u in self.pods if u not in found and u not in self._static]:
            del self.pods[url]  # a pod gone from the Service's records
            self.metrics.sidecar_up.remove(url)

    async def reconcile(self) -> None:
        """Every sidecar read, and told the weight of each rollout not yet released."""
        wanted = {m: managed.rollout.weight for m, managed in self.rollouts.items() if not managed.released}
        await asyncio.gather(*(self._sync(pod, wanted) for pod in list(self.pods.values())))

    async def _sync(self, pod: Pod, wanted: dict[str, float]) -> None:
        try:
            doc = await self.client.canary(pod.url)
        except (OSError, ValueError, AdminRefused) as exc:
            self._unreachable(pod, f"GET /canary: {exc}")
            return
        pod.reachable, pod.last_seen, pod.error = True, self._clock(), ""
        pod.models = dict(doc["models"])
        self.metrics.sidecar_up.labels(pod.url).set(1)
        for model, weight in wanted.items():
            renew_due = time.monotonic() - pod.renewed.get(model, -math.inf) >= self.lease_s / 3
            if pod.applied(model) == weight and pod.owner(model) == self.owner and not renew_due:
                continue
            try:
                await self.client.set_weight(pod.url, model, weight, self.owner, self.lease_s)
            except AdminRefused as exc:  # a local rollout, another owner, a model it lacks
                pod.refused[model] = f"PUT /canary/{model}: {exc}"
                continue
            except (OSError, ValueError) as exc:
                self._unreachable(pod, f"PUT /canary/{model}: {exc}")
                return
            before = pod.applied(model)
            pod.refused.pop(model, None)
            pod.renewed[model] = time.monotonic()
            pod.models.setdefault(model, {}).update(canary_weight=weight, owner=self.owner)
            if before != weight:
                log.info("rollouts: %s weight of %s %s -> %g", pod.url, model, before, weight)

    def _unreachable(self, pod: Pod, why: str) -> None:
        if pod.reachable or not pod.error:
            log.warning("rollouts: sidecar %s unreachable: %s", pod.url, why)
        pod.reachable, pod.error = False, why
        pod.renewed.clear()  # its leases lapse meanwhile: push again when it answers
        self.metrics.sidecar_up.labels(pod.url).set(0)

    def synced(self, model: str) -> bool:
        weight = self.rollouts[model].rollout.weight
        return bool(self.pods) and all(
            p.reachable
            and p.applied(model) == weight
            and p.owner(model) == self.owner
            and model not in p.refused
            for p in self.pods.values()
        )

    def _out_of_step(self, model: str) -> str:
        weight = self.rollouts[model].rollout.weight
        lagging = []
        for pod in self.pods.values():
            if not pod.reachable:
                lagging.append(f"sidecar {pod.url} is unreachable ({pod.error})")
            elif model in pod.refused:
                lagging.append(f"sidecar {pod.url} refused the weight ({pod.refused[model]})")
            elif pod.applied(model) != weight:
                lagging.append(f"sidecar {pod.url} has weight {pod.applied(model)}, not {weight:g}")
        if not self.pods:
            lagging.append("no sidecars found")
        return "; ".join(lagging)

    async def _release(self) -> None:
        """An ended rollout, its final weight on every sidecar: the leases go back."""
        for model, managed in list(self.rollouts.items()):
            if managed.rollout.active or managed.released or not self.synced(model):
                continue
            weight = managed.rollout.weight
            for pod in self.pods.values():
                with contextlib.suppress(OSError, ValueError, AdminRefused):
                    await self.client.set_weight(pod.url, model, weight, self.owner, 0)
            managed.released = True
            managed.told = list(self.pods)
            await self.save()
            log.info(
                "rollouts: %s %s at weight %g on every sidecar; released",
                model,
                managed.rollout.state,
                weight,
            )

    async def _tell_late(self) -> None:
        """A sidecar found after a rollout ended and released its leases (a new pod, or one that
        left the Service's records and came back) gets that rollout's final weight once, without
        a lease: a newly started pod begins at the fleet's weight, which is the operators' again."""
        changed = False
        for model, managed in self.rollouts.items():
            if not managed.released:
                continue
            known = [url for url in managed.told if url in self.pods]
            if known != managed.told:
                managed.told, changed = known, True
            weight = managed.rollout.weight
            for pod in list(self.pods.values()):
                if pod.url in managed.told or not pod.reachable or model not in pod.models:
                    continue
                if pod.applied(model) != weight:
                    try:
                        await self.client.set_weight(pod.url, model, weight, self.owner, 0)
                    except (OSError, ValueError, AdminRefused) as exc:
                        log.warning("rollouts: %s: the final weight of %s not taken: %s", pod.url, model, exc)
                        continue
                    pod.models[model]["canary_weight"] = weight
                    log.info(
                        "rollouts: %s (found after the rollout) weight of %s -> %g", pod.url, model, weight
                    )
                managed.told.append(pod.url)
                changed = True
        if changed:
            await self.save()

    def canary_version(self, model: str) -> str:
        for pod in self.pods.values():
            found = pod.models.get(model) or {}
            version = found.get("canary_version")
            if pod.reachable and isinstance(version, str) and version:
                return version
        return ""

    # --- judging ---------------------------------------------------------------------------

    async def _judge(self) -> bool:
        changed = False
        for model, managed in list(self.rollouts.items()):
            rollout = managed.rollout
            if not rollout.active:
                managed.held = None
                continue
            now = self._clock()
            canary = self.canary_version(model)
            if canary and rollout.canary_is(canary, now) is not None:
                self._transition(rollout, "")
                changed = True
            if not rollout.canary:
                self._hold(managed, "canary", f"no sidecar serves a canary version of {model}")
                continue
            if self.prometheus is None:
                self._hold(managed, "prometheus", "no Prometheus configured: the gates cannot be judged")
                continue
            try:
                found = await gather(
                    self.prometheus, self.queries, model, rollout.canary, now - rollout.step_started
                )
            except PrometheusError as exc:
                self.metrics.prometheus_up.set(0)
                self._hold(managed, "prometheus", f"the gates cannot be judged: {exc}")
                continue
            self.metrics.prometheus_up.set(1)
            evidence, culprit = worst(rollout.spec, found)
            verdicts = judge(rollout.spec, evidence)
            red = evidence.breaker_open or any(v.result == RED for v in verdicts.values())
            reachable = sum(1 for p in self.pods.values() if p.reachable)
            blocked: tuple[str, str] | None = None
            if not self.synced(model):
                blocked = ("sidecars", f"promotion paused: {self._out_of_step(model)}")
            elif found.seen < reachable:
                blocked = (
                    "prometheus",
                    f"prometheus sees {found.seen} of the {reachable} sidecars serving {model}'s canary",
                )
            if blocked is not None and not red:
                rollout.gates = verdicts  # shown; the policy is not asked to promote
                self._hold(managed, *blocked)
                continue
            event = rollout.evaluate(evidence, now)
            if event is not None:
                if rollout.state == FAILED and culprit:
                    rollout.reason = f"{rollout.reason} (on {culprit})"
                    rollout.history[-1]["reason"] = rollout.reason
                self._transition(rollout, "")
                managed.held = None
                self._show(model)  # now: the pushes that follow may take a while
                changed = True
            elif rollout.state == RUNNING and evidence.canary.calls < rollout.spec.min_calls:
                calls = evidence.canary.calls
                self._hold(
                    managed,
                    "evidence",
                    f"waiting for canary calls: {calls} of {rollout.spec.min_calls} in the window",
                )
            else:
                managed.held = None
        return changed

    def _hold(self, managed: Managed, kind: str, why: str) -> None:
        if managed.held != why:
            log.info("rollouts: %s holds: %s", managed.rollout.model, why)
        managed.held, managed.held_kind = why, kind

    def _transition(self, rollout: Rollout, by: str) -> None:
        event = rollout.history[-1]
        reason = f" reason={event['reason']!r}" if event.get("reason") else ""
        audit(
            f"fleet model={rollout.model} rollout {event['event']} step={rollout.step} "
            f"canary_weight {rollout.weight:g} state={shown_state(rollout)}{reason}",
            by or "rollouts",
            float(event["at"]),
        )
        self.metrics.transitions.labels(rollout.model, event["event"]).inc()

    # --- what operators ask -------------------------------------------------------------------

    async def begin(self, model: str, spec: RolloutSpec, by: str) -> dict[str, Any]:
        self._leading()
        async with self._lock:
            current = self.rollouts.get(model)
            if current is not None and current.rollout.active:
                raise ControlError(
                    409, f"model {model} has a {current.rollout.state} rollout: abort it first"
                )
            rollout = Rollout.begin(
                model, spec, self._clock(), self.canary_version(model), by=by, origin=ADMIN
            )
            self.rollouts[model] = Managed(rollout)
            self._transition(rollout, by)
            self._show(model)
            await self.save()
        self.wake()
        return self.view(model)

    async def control(self, model: str, action: str, by: str) -> dict[str, Any]:
        self._leading()
        async with self._lock:
            managed = self.rollouts.get(model)
            if managed is None:
                raise ControlError(404, f"model {model} has no rollout")
            rollout = managed.rollout
            change = {"pause": rollout.pause, "resume": rollout.resume, "abort": rollout.abort}[action]
            if change(self._clock(), by) is None:
                raise ControlError(
                    409, f"the rollout of {model} is {shown_state(rollout)}: it cannot {action}"
                )
            self._transition(rollout, by)
            self._show(model)
            await self.save()
        self.wake()
        return self.view(model)

    def _leading(self) -> None:
        if not self.leader:
            raise ControlError(503, "this controller replica is standing by (another one leads): retry")

    def view(self, model: str) -> dict[str, Any]:
        managed = self.rollouts[model]
        return self._view(model, managed, [p.view(model) for p in self.pods.values()])

    def _view(self, model: str, managed: Managed, sidecars: list[dict[str, Any]]) -> dict[str, Any]:
        rollout = managed.rollout
        view = rollout.view()
        view["state"] = shown_state(rollout)
        if managed.held and rollout.active:
            view["reason"] = f"held: {managed.held}"
        view.update(
            held=managed.held if rollout.active else None,
            released=managed.released,
            sidecars=sidecars,
            controller=self.owner,
            leader=self.leader,
        )
        return view

    async def views(self) -> dict[str, Any]:
        if self.leader:
            return {m: self.view(m) for m in sorted(self.rollouts)}
        saved = await self.store.load()  # a standby shows what the leader saved
        return {m: self._view(m, Managed.from_doc(m, raw), []) for m, raw in sorted(saved.items())}
