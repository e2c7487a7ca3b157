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

The whole table is built and then rebound, so a request never sees half a configuration. A file
change replaces the table (admin changes included: the last writer wins).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml
from modelyard.common import headers
from modelyard.common.names import InvalidName, check_version

from sidecar.adaptive import BreakerPolicy
from sidecar.limits import TenantLimit
from sidecar.routing import ModelRoute, normalize_version, parse_weight
from sidecar.shadow import ShadowPolicy

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


def _mapping(raw: object, where: str) -> Mapping[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a mapping")
    return raw


def _number(raw: object, where: str) -> float:
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise ConfigError(f"{where}: expected a number")
    return float(raw)


def _weight(raw: object, where: str) -> float:
    try:
        return parse_weight(str(_number(raw, where)))
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def parse_model_route(raw: object, where: str, default_weight: float = 0.0) -> ModelRoute:
    doc = _mapping(raw, where)
    unknown = set(doc) - {"canary_weight", "stable", "canary"}
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")
    weight = (
        _weight(doc["canary_weight"], f"{where}.canary_weight") if "canary_weight" in doc else default_weight
    )
    return ModelRoute(
        canary_weight=weight,
        stable=_version(doc.get("stable"), f"{where}.stable"),
        canary=_version(doc.get("canary"), f"{where}.canary"),
    )


def _version(raw: object, where: str) -> str:
    """A route's version: empty, or a string or number that passes the one name rule."""
    if raw is None or raw == "":
        return ""
    if isinstance(raw, bool) or not isinstance(raw, str | int):
        raise ConfigError(f"{where}: expected a version (a string or a number)")
    try:
        return normalize_version(check_version(str(raw), where))
    except InvalidName as exc:
        raise ConfigError(str(exc)) from exc


def _dataclass_from(cls: type[Any], raw: object, where: str) -> Any:
    doc = _mapping(raw, where)
    known = {f.name: f for f in fields(cls)}
    unknown = set(doc) - set(known)
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")
    values: dict[str, Any] = {}
    for name, value in doc.items():
        number = _number(value, f"{where}.{name}")
        values[name] = int(number) if isinstance(known[name].default, int) else number
    try:
        return cls(**values)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def parse_table(doc: object) -> RouteTable:
    top = _mapping(doc, "config")
    unknown = set(top) - {"stickiness_header", "canary_weight", "models", "breaker", "tenants", "shadow"}
    if unknown:
        raise ConfigError(f"config: unknown keys {sorted(unknown)}")
    weight = _weight(top["canary_weight"], "canary_weight") if "canary_weight" in top else 0.0
    models = {
        str(name): parse_model_route(raw, f"models.{name}", weight)
        for name, raw in _mapping(top.get("models"), "models").items()
    }
    tenants = {
        str(name): _dataclass_from(TenantLimit, raw, f"tenants.{name}")
        for name, raw in _mapping(top.get("tenants"), "tenants").items()
    }
    return RouteTable(
        stickiness_header=str(top.get("stickiness_header", headers.USER_ID)).lower(),
        canary_weight=weight,
        models=models,
        breaker=_dataclass_from(BreakerPolicy, top.get("breaker"), "breaker"),
        tenants=tenants,
        shadow=_dataclass_from(ShadowPolicy, top.get("shadow"), "shadow"),
    )


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
