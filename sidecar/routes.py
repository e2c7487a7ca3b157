"""The sidecar's route configuration: a YAML file reloaded on change, plus admin changes.

    stickiness_header: x-user-id      # the header whose value keeps a user's dye
    canary_weight: 0                  # default weight for models without their own entry
    models:
      scaler: {canary_weight: 10, stable: "1", canary: "2"}   # versions optional
    breaker: {window_s: 10, min_calls: 20, error_rate: 0.5, ...}  # see adaptive.BreakerPolicy
    tenants:
      acme: {rate: 50, burst: 100, concurrency: 8}             # see limits.TenantLimit
      "*": {rate: 0, burst: 0, concurrency: 0}   # all other tenants, together; 0 = unlimited
    shadow: {share: 5, max_in_flight: 4}     # mirror 5% of stable unary calls to the canary

The keys, types and bounds are declared in sidecar/route_file.py. The whole table is built and
then rebound, so a request never sees half a configuration. A file change replaces the table
(admin changes included: the last writer wins).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar

import msgspec
import yaml
from msgspec import UnsetType

from modelyard.common import headers
from modelyard.common.names import InvalidName, check_version
from modelyard.process.documents import DocumentError, load
from modelyard.sidecar.adaptive import BreakerPolicy
from modelyard.sidecar.limits import TenantLimit
from modelyard.sidecar.route_file import ModelRouteDoc, RouteFileDoc
from modelyard.sidecar.routing import ModelRoute, normalize_version
from modelyard.sidecar.shadow import ShadowPolicy

T = TypeVar("T")

log = logging.getLogger(__name__)


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

    def route(self, model: str) -> ModelRoute:
        found = self.models.get(model)
        return found if found is not None else ModelRoute(canary_weight=self.canary_weight)

    def with_route(self, model: str, route: ModelRoute) -> RouteTable:
        return replace(self, models={**self.models, model: route})


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
    return RouteTable(
        stickiness_header=doc.stickiness_header.lower(),
        canary_weight=weight,
        models={
            name: _model_route(route, f"models.{name}", weight) for name, route in (doc.models or {}).items()
        },
        breaker=_policy(BreakerPolicy, doc.breaker, "breaker"),
        tenants={
            name: _policy(TenantLimit, limit, f"tenants.{name}")
            for name, limit in (doc.tenants or {}).items()
        },
        shadow=_policy(ShadowPolicy, doc.shadow, "shadow"),
    )


def _keys_as_text(raw: object) -> object:
    """Model and tenant names as text: YAML reads `42:` as a number."""
    if not isinstance(raw, dict):
        return raw
    named = {}
    for section in ("models", "tenants"):
        entries = raw.get(section)
        if isinstance(entries, dict):
            named[section] = {
                str(k) if isinstance(k, int) and not isinstance(k, bool) else k: v for k, v in entries.items()
            }
    return {**raw, **named}


class RouteSource:
    """The current table, from the file (re-read when its modification time or size changes)
    and from admin changes. `table` is read on every request: a plain attribute, rebound whole."""

    def __init__(self, path: Path | None) -> None:
        self._path = path
        self._stamp: tuple[int, int] | None = None
        self.table = RouteTable()
        if path is not None:
            self.table = self._read()  # a bad file at start-up is an error: refuse to start

    def _read(self) -> RouteTable:
        assert self._path is not None
        stat = os.stat(self._path)
        self._stamp = (stat.st_mtime_ns, stat.st_size)
        try:
            doc = yaml.safe_load(self._path.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"{self._path}: not YAML: {exc}") from exc
        return parse_table(doc)

    def reload_if_changed(self) -> bool:
        """Re-read the file if it changed; a bad file keeps the current table (and is logged)."""
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
            self.table = self._read()
        except (OSError, ConfigError) as exc:
            log.error("route config %s rejected, keeping the current routes: %s", self._path, exc)
            return False
        log.info("route config %s reloaded", self._path)
        return True

    def set_route(self, model: str, route: ModelRoute) -> None:
        self.table = self.table.with_route(model, route)
