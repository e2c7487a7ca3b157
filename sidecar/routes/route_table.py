"""The sidecar's route configuration: a YAML file reloaded on change, plus admin changes.

    stickiness_header: x-user-id      # the header whose value keeps a user's dye
    canary_weight: 0                  # default weight for models without their own entry
    models:
      scaler: {canary_weight: 10, stable: "1", canary: "2"}   # versions optional
    breaker: {window_s: 10, min_calls: 20, error_rate: 0.5, ...}  # see breaker_policy.BreakerPolicy
    tenants:
      acme: {rate: 50, burst: 100, concurrency: 8}             # see limits.TenantLimit
      "*": {rate: 0, burst: 0, concurrency: 0}   # all other tenants, together; 0 = unlimited
    shadow: {share: 5, max_in_flight: 4}     # mirror 5% of stable unary calls to the canary
    sticky_cohort: model              # model: each model has its own canary users; shared: one cohort
    rollout:                          # progressive delivery per model (sidecar/rollout/policy.py)
      scaler: {steps: [1, 5, 25, 50, 100], dwell_s: 60, min_calls: 100}

The keys, types and bounds are declared in sidecar/routes/file.py. The whole table is built and
then rebound, so a request never sees half a configuration.

Each model's route has its own history: the file's entry for it, and changes made over the admin
endpoint (or by a rollout), each stamped with when it was made. The newer one wins, per model: a
file edit changes only the models whose entries it changed, and an admin change to one model
survives edits of the others. Admin changes are kept in the state file (sidecar/routes/state_file.py) and
come back at start; the file's entries seen then are kept too, so that a restart tells an entry
edited while the sidecar was down (newer: it wins) from one it had already seen.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import yaml
from msgspec import UnsetType

from modelyard.common import headers
from modelyard.common.names import InvalidName, check_version
from modelyard.process.documents import DocumentError, load
from modelyard.sidecar.breaker_policy import BreakerPolicy
from modelyard.sidecar.dyeing import ModelRoute, normalize_version
from modelyard.sidecar.rollout.policy import RolloutSpec
from modelyard.sidecar.routes.file import ModelRouteDoc, RouteFileDoc
from modelyard.sidecar.routes.state_file import audit
from modelyard.sidecar.shadow.compare import ShadowPolicy
from modelyard.sidecar.tenant_limits import TenantLimit

T = TypeVar("T")

log = logging.getLogger(__name__)


DEFAULTS_KEPT = 1024


class ConfigError(ValueError):
    """The route file is malformed; the message names the key."""


@dataclass(frozen=True)
class RouteTable:
    stickiness_header: str = headers.USER_ID
    canary_weight: float = 0.0
    models: Mapping[str, ModelRoute] = field(default_factory=dict)
    breaker: BreakerPolicy = field(default_factory=BreakerPolicy)
    tenants: Mapping[str, TenantLimit] = field(default_factory=dict)
    shadow: ShadowPolicy = field(default_factory=ShadowPolicy)
    shared_cohort: bool = False  # one canary cohort across models (the bucket is not salted)
    rollouts: Mapping[str, RolloutSpec] = field(default_factory=dict)
    # The default route of models without their own entry, made once per model (asked per call);
    # at most DEFAULTS_KEPT of them, since any name a client sends is asked for.
    _defaults: dict[str, ModelRoute] = field(default_factory=dict, init=False, repr=False, compare=False)

    def route(self, model: str) -> ModelRoute:
        found = self.models.get(model)
        if found is None:
            found = self._defaults.get(model)
            if found is None:
                found = ModelRoute(
                    canary_weight=self.canary_weight, cohort="" if self.shared_cohort else model
                )
                if len(self._defaults) < DEFAULTS_KEPT:
                    self._defaults[model] = found
        return found

    def with_route(self, model: str, route: ModelRoute) -> RouteTable:
        return replace(self, models={**self.models, model: self._cohort(model, route)})

    def _cohort(self, model: str, route: ModelRoute) -> ModelRoute:
        """The route with its stickiness salt (the model's name, or none for a shared cohort)."""
        cohort = "" if self.shared_cohort else model
        return route if route.cohort == cohort else replace(route, cohort=cohort)


def parse_model_route(raw: object, where: str, default_weight: float = 0.0) -> ModelRoute:
    """One model's route (a route file entry, or an admin PUT body): ConfigError names the key."""
    try:
        return _model_route(load(raw, ModelRouteDoc, "config", at=where), where, default_weight)
    except DocumentError as exc:
        raise ConfigError(str(exc)) from None


def _model_route(doc: ModelRouteDoc, where: str, default_weight: float) -> ModelRoute:
    return ModelRoute(
        canary_weight=default_weight if isinstance(doc.canary_weight, UnsetType) else doc.canary_weight,
        stable=_version(doc.stable, f"{where}.stable"),
        canary=_version(doc.canary, f"{where}.canary"),
    )


def _version(raw: str | int | None, where: str) -> str:
    """A route's version: empty, or a string or number that passes the one name rule."""
    if raw is None or raw == "":
        return ""
    try:
        return normalize_version(check_version(str(raw), where))
    except InvalidName as exc:
        raise ConfigError(str(exc)) from exc


def _policy(cls: Callable[..., T], doc: msgspec.Struct | None, where: str) -> T:
    """A policy from its section; the policy's own checks (across keys) name the section."""
    try:
        return cls(**({} if doc is None else msgspec.structs.asdict(doc)))
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def parse_table(raw: object) -> RouteTable:
    """A parsed route file (None: an empty file) as the table; ConfigError names the key."""
    try:
        doc = load(_keys_as_text({} if raw is None else raw), RouteFileDoc, "config")
    except DocumentError as exc:
        raise ConfigError(str(exc)) from None
    weight = doc.canary_weight
    shared = doc.sticky_cohort == "shared"
    return RouteTable(
        stickiness_header=doc.stickiness_header.lower(),
        canary_weight=weight,
        models={
            name: replace(_model_route(route, f"models.{name}", weight), cohort="" if shared else name)
            for name, route in (doc.models or {}).items()
        },
        breaker=_policy(BreakerPolicy, doc.breaker, "breaker"),
        tenants={
            name: _policy(TenantLimit, limit, f"tenants.{name}")
            for name, limit in (doc.tenants or {}).items()
        },
        shadow=_policy(ShadowPolicy, doc.shadow, "shadow"),
        shared_cohort=shared,
        rollouts={
            name: _policy(RolloutSpec, spec, f"rollout.{name}") for name, spec in (doc.rollout or {}).items()
        },
    )


def _keys_as_text(raw: object) -> object:
    """Model and tenant names as text: YAML reads `42:` as a number."""
    if not isinstance(raw, dict):
        return raw
    named = {}
    for section in ("models", "tenants", "rollout"):
        entries = raw.get(section)
        if isinstance(entries, dict):
            named[section] = {
                str(k) if isinstance(k, int) and not isinstance(k, bool) else k: v for k, v in entries.items()
            }
    return {**raw, **named}


# Where a model's route came from (GET /canary says it).
FROM_FILE = "route_file"
FROM_ADMIN = "admin"  # a PUT /canary/<model> made since this process started
FROM_STATE = "state_file"  # an admin change made before a restart, read back from the state file
FROM_ROLLOUT = "rollout"  # a progressive rollout's step (sidecar/rollout/policy.py)


@dataclass(frozen=True)
class Change:
    """One model's route as one source last set it: what, when (wall-clock seconds), by whom."""

    route: ModelRoute
    at: float
    source: str
    by: str = ""

    def doc(self) -> dict[str, Any]:
        return {**route_doc(self.route), "at": self.at, "source": self.source, "by": self.by}

    @staticmethod
    def from_doc(raw: Mapping[str, Any], source: str, where: str = "state") -> Change:
        route = parse_model_route({k: raw.get(k) for k in ("canary_weight", "stable", "canary")}, where)
        return Change(route, float(raw["at"]), source, str(raw.get("by", "")))


def route_doc(route: ModelRoute) -> dict[str, object]:
    return {"canary_weight": route.canary_weight, "stable": route.stable, "canary": route.canary}


def route_change(old: ModelRoute, new: ModelRoute) -> str:
    """The audit words for a route change: each field that changed, old -> new."""
    words = [
        f"{name} {getattr(old, name) or '-'} -> {getattr(new, name) or '-'}"
        for name in ("canary_weight", "stable", "canary")
        if getattr(old, name) != getattr(new, name)
    ]
    return ", ".join(words) or f"canary_weight {old.canary_weight} (unchanged)"


def _same(a: ModelRoute, b: ModelRoute) -> bool:
    return (a.canary_weight, a.stable, a.canary) == (b.canary_weight, b.stable, b.canary)


class RouteSource:
    """The current table, from the file (re-read when its modification time or size changes)
    and from admin changes, merged per model (the newer change wins). `table` is read on every
    request: a plain attribute, rebound whole. `on_change` is told after every change (the state
    file is written from it)."""

    def __init__(
        self,
        path: Path | None,
        *,
        saved: Mapping[str, Any] | None = None,  # the state file's "routes" section
        clock: Callable[[], float] = time.time,  # wall clock: changes are compared across restarts
    ) -> None:
        self._path = path
        self._clock = clock
        self._stamp: tuple[int, int] | None = None
        self._file = RouteTable()
        self._file_changes: dict[str, Change] = {}  # when each file entry was first seen as it is
        self._overrides: dict[str, Change] = {}  # admin and rollout changes
        self.sources: dict[str, Change] = {}  # the winning change per model with its own route
        self.on_change: Callable[[], None] = lambda: None
        self.table = RouteTable()
        saved = saved or {}
        for model, raw in (saved.get("overrides") or {}).items():
            source = FROM_ROLLOUT if raw.get("source") == FROM_ROLLOUT else FROM_STATE
            self._overrides[model] = Change.from_doc(raw, source)
        if path is not None:
            self._file, mtime = self._read()  # a bad file at start-up is an error: refuse to start
            seen = saved.get("file") or {}
            for model, route in self._file.models.items():
                before = seen.get(model)
                known = Change.from_doc(before, FROM_FILE) if before is not None else None
                unchanged = known is not None and _same(known.route, route)
                at = known.at if known is not None and unchanged else mtime
                self._file_changes[model] = Change(route, at, FROM_FILE)
        self._merge()

    def _read(self) -> tuple[RouteTable, float]:
        assert self._path is not None
        stat = os.stat(self._path)
        self._stamp = (stat.st_mtime_ns, stat.st_size)
        try:
            doc = yaml.safe_load(self._path.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"{self._path}: not YAML: {exc}") from exc
        return parse_table(doc), stat.st_mtime_ns / 1e9

    def _merge(self) -> None:
        """The table: the file's, with each model's route from its newer change."""
        winners: dict[str, Change] = {}
        for model in {*self._file_changes, *self._overrides}:
            from_file, override = self._file_changes.get(model), self._overrides.get(model)
            if from_file is None or (override is not None and override.at >= from_file.at):
                assert override is not None
                winners[model] = override
            else:
                winners[model] = from_file
        table = replace(self._file, models={})
        self.sources = winners
        self.table = replace(table, models={m: table._cohort(m, c.route) for m, c in winners.items()})

    def reload_if_changed(self) -> bool:
        """Re-read the file if it changed; a bad file keeps the current table (and is logged).
        Only the models whose entries changed (or went) take the file's route."""
        if self._path is None:
            return False
        try:
            stat = os.stat(self._path)
        except OSError as exc:
            log.warning("route config %s unreadable: %s; keeping the current routes", self._path, exc)
            return False
        if (stat.st_mtime_ns, stat.st_size) == self._stamp:
            return False
        try:
            table, _ = self._read()
        except (OSError, ConfigError) as exc:
            log.error("route config %s rejected, keeping the current routes: %s", self._path, exc)
            return False
        now = self._clock()
        changes: dict[str, Change] = {}
        for model, route in table.models.items():
            known = self._file_changes.get(model)
            changes[model] = (
                known if known is not None and _same(known.route, route) else Change(route, now, FROM_FILE)
            )
        for model in set(self._file_changes) - set(changes):
            # The entry went: that is a change too (newer than any admin change for the model).
            self._overrides.pop(model, None)
        before = self.table
        self._file, self._file_changes = table, changes
        self._merge()
        log.info("route config %s reloaded", self._path)
        for model in sorted({*before.models, *self.table.models}):
            old, new = before.route(model), self.table.route(model)
            if not _same(old, new):
                audit(f"model={model} {route_change(old, new)}", "route_file", now)
        self.on_change()
        return True

    def set_route(self, model: str, route: ModelRoute, *, source: str = FROM_ADMIN, by: str = "") -> Change:
        """An admin (or rollout) change for one model; returns the change it replaced (for the audit
        line: the current route's)."""
        old = self.sources.get(model) or Change(self.table.route(model), 0.0, "default")
        at = max(self._clock(), old.at)  # never older than what it replaces (a stepped-back clock)
        self._overrides[model] = Change(route, at, source, by)
        self._merge()
        self.on_change()
        return old

    def saved(self) -> dict[str, Any]:
        """What the state file keeps: the admin and rollout changes, and the file's entries as seen."""
        return {
            "overrides": {m: c.doc() for m, c in sorted(self._overrides.items())},
            "file": {m: c.doc() for m, c in sorted(self._file_changes.items())},
        }
