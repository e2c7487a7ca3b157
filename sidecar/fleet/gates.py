"""The fleet's gates: the controller's Prometheus queries, and the Evidence they make for the
sidecar's rollout policy (modelyard.sidecar.rollout.policy.judge), for the fleet and for each pod.

Every query is a template (`$model`, `$dye`: canary or stable, `$canary`: the canary's version,
`$window`: the step's window, e.g. `42s`) answered by Prometheus' HTTP API (`/api/v1/query`) as a
vector by `instance` (the scraped sidecar). The fleet's numbers are the sums over the pods (the
p99s: a quantile over the fleet's summed buckets), judged as one sidecar judges its own; each pod's
errors, shadow agreement and breaker are judged too, against its own stable over the same window,
so one bad pod among many is not averaged away. Latency is judged on the fleet's p99 only: a tail
over every canary call already shows a pod that is slow on every call (it holds 1/N of the canary's
calls, over 1% below 100 pods), while a pod's p99 over its few calls is its slowest one, and N of
them would fail a healthy canary N times as often. `QUERIES` is the documented default; a YAML
file (`--queries FILE`) overrides any of its keys (docs/fleet-rollouts.md).

Latency is the sidecar's own `modelyard_sidecar_request_seconds` (arrival to answer), not the
service's x-run-us that a sidecar's local rollout judges: that run time is not exported by the
sidecars, and what a client waits is what the fleet is judged on; the p99 floor
(`latency_floor_s`) keeps a fast model's scheduling noise from failing a rollout.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import math
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from string import Template
from typing import Any

import yaml

from modelyard.sidecar.rollout.policy import RED, Evidence, RolloutSpec, Tally, Verdict, judge

_BY_DYE = '{model="$model",dye="$dye"}'


@dataclass(frozen=True)
class Queries:
    """The gate queries (PromQL templates) and the window they are asked over."""

    calls: str = f"sum by (instance) (increase(modelyard_sidecar_attempts_total{_BY_DYE}[$window]))"
    faults: str = (
        "sum by (instance) (increase(modelyard_sidecar_attempts_total"
        '{model="$model",dye="$dye",fault="true"}[$window]))'
    )
    p99_fleet: str = (
        "histogram_quantile(0.99, sum by (le) "
        f"(rate(modelyard_sidecar_request_seconds_bucket{_BY_DYE}[$window])))"
    )
    shadow_rows: str = (
        'sum by (instance) (increase(modelyard_sidecar_shadow_rows_total{model="$model"}[$window]))'
    )
    shadow_agreeing: str = (
        'sum by (instance) (increase(modelyard_sidecar_shadow_rows_agreeing_total{model="$model"}[$window]))'
    )
    breaker: str = 'max by (instance) (modelyard_sidecar_breaker_state{model="$model",version="$canary"})'
    # The sidecars Prometheus scrapes now that serve the model with a canary: fewer than the
    # controller reaches, and the evidence is partial (a step holds).
    pods: str = 'count by (instance) (modelyard_sidecar_canary_weight{model="$model"})'
    min_window_s: float = 60.0  # at least a few scrape intervals: increase() needs two samples
    max_window_s: float = 600.0
    timeout_s: float = 5.0  # each query

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "str" and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"queries: {f.name} must be a PromQL template")
            if f.type == "float":
                if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                    raise ValueError(f"queries: {f.name} must be a finite number")
                if value <= 0:
                    raise ValueError(f"queries: {f.name} must be above 0")
                object.__setattr__(self, f.name, float(value))
        if self.max_window_s < self.min_window_s:
            raise ValueError("queries: max_window_s must be at least min_window_s")

    def window(self, step_age_s: float) -> str:
        """The window for a step `step_age_s` old: since it began, within the bounds."""
        seconds = min(self.max_window_s, max(self.min_window_s, step_age_s))
        return f"{math.ceil(seconds)}s"


QUERIES = Queries()


def load_queries(path: Path | None) -> Queries:
    """The defaults, with what a YAML file sets; ValueError naming a bad file or key."""
    if path is None:
        return QUERIES
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"queries file {path}: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"queries file {path}: expected a mapping of query names")
    known = {f.name for f in fields(Queries)}
    unknown = sorted(set(map(str, raw)) - known)
    if unknown:
        raise ValueError(f"queries file {path}: unknown key(s) {', '.join(unknown)} (known: {sorted(known)})")
    return replace(QUERIES, **raw)


class PrometheusError(Exception):
    """Prometheus could not answer (down, refused, an error, not a vector)."""


class Prometheus:
    """The HTTP query API, from the event loop (each query in a thread)."""

    def __init__(self, url: str, timeout_s: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def _query(self, promql: str) -> dict[str, float]:
        address = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        try:
            with urllib.request.urlopen(address, timeout=self.timeout_s) as answer:
                doc = json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            raise PrometheusError(f"prometheus answered {exc.code} to {promql!r}") from None
        except (OSError, ValueError, http.client.HTTPException) as exc:
            raise PrometheusError(f"prometheus at {self.url} is unreachable: {exc}") from None
        data = doc.get("data") if isinstance(doc, dict) else None
        if doc.get("status") != "success" or not isinstance(data, dict) or data.get("resultType") != "vector":
            raise PrometheusError(f"prometheus did not answer a vector to {promql!r}")
        vector: dict[str, float] = {}
        for sample in data.get("result", []):
            try:
                value = float(sample["value"][1])
            except (KeyError, IndexError, TypeError, ValueError):
                raise PrometheusError(f"prometheus answered a malformed sample to {promql!r}") from None
            if math.isfinite(value):  # histogram_quantile over no calls is NaN: no number
                vector[str(sample.get("metric", {}).get("instance", ""))] = value
        return vector

    async def query(self, promql: str) -> dict[str, float]:
        """instance -> value ("" for a sum with no `by`); PrometheusError."""
        return await asyncio.to_thread(self._query, promql)


@dataclass(frozen=True)
class FleetEvidence:
    fleet: Evidence
    pods: dict[str, Evidence] = field(default_factory=dict)  # by instance
    seen: int = 0  # sidecars Prometheus scrapes that serve the model with a canary


async def gather(
    prometheus: Prometheus, queries: Queries, model: str, canary: str, step_age_s: float
) -> FleetEvidence:
    """The step's evidence from Prometheus; PrometheusError when any query fails."""
    window = queries.window(step_age_s)

    def ask(template: str, dye: str = "") -> Any:
        promql = Template(template).safe_substitute(model=model, dye=dye, canary=canary, window=window)
        return prometheus.query(promql)

    names = ("calls", "faults", "p99_fleet")
    asked = [ask(getattr(queries, n), dye) for dye in ("canary", "stable") for n in names]
    asked += [ask(queries.shadow_rows), ask(queries.shadow_agreeing), ask(queries.breaker), ask(queries.pods)]
    answers: list[dict[str, float]] = list(await asyncio.gather(*asked))
    c_calls, c_faults, c_p99, s_calls, s_faults, s_p99 = answers[:6]
    rows, agreeing, breaker, seen = answers[6:]

    def tally(calls: float, faults: float, p99: float | None) -> Tally:
        n = round(calls)
        return Tally(n, min(n, round(faults)), n if p99 is not None else 0, p99)

    def evidence(key: str | None) -> Evidence:
        def one(vector: dict[str, float]) -> float:
            return sum(vector.values()) if key is None else vector.get(key, 0.0)

        canary_p99 = c_p99.get("") if key is None else None  # the fleet's only (above)
        stable_p99 = s_p99.get("") if key is None else None
        compared = round(one(rows))
        open_ = any(v >= 2 for k, v in breaker.items() if key is None or k == key)
        return Evidence(
            tally(one(c_calls), one(c_faults), canary_p99),
            tally(one(s_calls), one(s_faults), stable_p99),
            shadowing=compared > 0,
            compared=compared,
            agreeing=min(compared, round(one(agreeing))),
            breaker_open=open_,
        )

    pods = {k: evidence(k) for k in sorted(set(c_calls) | set(breaker)) if k}
    return FleetEvidence(evidence(None), pods, len(seen))


def worst(spec: RolloutSpec, found: FleetEvidence) -> tuple[Evidence, str]:
    """The evidence to judge the step on: the fleet's, unless a pod's canary is red (or its breaker
    open) on its own; then that pod's, with its instance (a pod's red turns the fleet's gate red)."""
    if found.fleet.breaker_open:
        opened = [k for k, ev in found.pods.items() if ev.breaker_open]
        return found.fleet, ", ".join(opened)
    for instance, ev in found.pods.items():
        verdicts: dict[str, Verdict] = judge(spec, ev)
        if ev.breaker_open or any(v.result == RED for v in verdicts.values()):
            return ev, instance
    return found.fleet, ""
