"""Route weights merged per model from the route file and admin changes (the newer change wins),
kept across a restart through the saved state; stickiness salted by the model's name."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import yaml

from modelyard.sidecar.dyeing import ModelRoute, decide
from modelyard.sidecar.routes.route_table import FROM_ADMIN, FROM_FILE, FROM_STATE, RouteSource
from modelyard.sidecar.routes.state_file import load_state, write_atomically


class Clock:
    """Wall seconds (the file's modification time is one), moved on by the test."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def write(path: Path, doc: object, at: float | None = None) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(doc))
    if at is not None:
        os.utime(tmp, (at, at))
    tmp.replace(path)


def weights(source: RouteSource) -> dict[str, float]:
    return {m: r.canary_weight for m, r in source.table.models.items()}


def test_a_file_edit_keeps_admin_changes_to_the_models_it_did_not_change(tmp_path: Path) -> None:
    path, clock = tmp_path / "routes.yaml", Clock()
    write(path, {"models": {"a": {"canary_weight": 10}, "b": {"canary_weight": 10}}})
    source = RouteSource(path, clock=clock)
    clock.now += 10
    source.set_route("a", ModelRoute(canary_weight=40), by="ops")
    assert source.sources["a"].source == FROM_ADMIN and source.sources["b"].source == FROM_FILE
    clock.now += 10
    write(path, {"models": {"a": {"canary_weight": 10}, "b": {"canary_weight": 20}}, "canary_weight": 1})
    assert source.reload_if_changed()
    assert weights(source) == {"a": 40, "b": 20}  # b's entry changed; a's did not: the admin's holds
    clock.now += 10
    write(path, {"models": {"a": {"canary_weight": 15}, "b": {"canary_weight": 20}}})
    assert source.reload_if_changed()
    assert weights(source) == {"a": 15, "b": 20}  # now a's entry is the newer change
    assert source.sources["a"].source == FROM_FILE


def test_a_restart_brings_admin_changes_back_unless_the_file_changed_that_model(tmp_path: Path) -> None:
    path, state, clock = tmp_path / "routes.yaml", tmp_path / "state.json", Clock()
    write(path, {"models": {"a": {"canary_weight": 10}, "b": {"canary_weight": 10}}})
    source = RouteSource(path, clock=clock)
    clock.now += 10
    source.set_route("a", ModelRoute(canary_weight=40), by="ops")
    source.set_route("b", ModelRoute(canary_weight=50), by="ops")
    source.set_route("c", ModelRoute(canary_weight=60, stable="1", canary="2"), by="ops")
    write_atomically(state, {"routes": source.saved()})
    assert not list(tmp_path.glob(".state.json.*"))  # the temporary file was renamed over it

    again = RouteSource(path, saved=load_state(state)["routes"], clock=clock)
    assert weights(again) == {"a": 40, "b": 50, "c": 60}
    assert {c.source for c in again.sources.values()} == {FROM_STATE} and len(again.sources) == 3
    assert again.table.route("c") == ModelRoute(60, "1", "2") and again.sources["c"].by == "ops"

    # While the sidecar was down, the operator edited b's entry (a later modification time).
    clock.now += 10
    write(path, {"models": {"a": {"canary_weight": 10}, "b": {"canary_weight": 5}}}, at=clock.now)
    later = RouteSource(path, saved=json.loads(state.read_text())["routes"], clock=clock)
    assert weights(later) == {"a": 40, "b": 5, "c": 60}
    assert later.sources["b"].source == FROM_FILE


def test_an_entry_removed_from_the_file_goes_back_to_the_default(tmp_path: Path) -> None:
    path, clock = tmp_path / "routes.yaml", Clock()
    write(path, {"canary_weight": 3, "models": {"a": {"canary_weight": 10}}})
    source = RouteSource(path, clock=clock)
    clock.now += 1
    source.set_route("a", ModelRoute(canary_weight=40))
    clock.now += 1
    write(path, {"canary_weight": 3})
    assert source.reload_if_changed()
    assert "a" not in source.table.models and source.table.route("a").canary_weight == 3


def test_each_model_has_its_own_canary_users_unless_the_cohort_is_shared() -> None:
    users = [f"user-{i}" for i in range(2000)]

    def canaries(model: str, shared: bool) -> set[str]:
        route = ModelRoute(canary_weight=20, stable="1", canary="2", cohort="" if shared else model)
        dyes = {u: decide(route, (), pin="", sticky_key=u, header_weight=None).dye for u in users}
        return {u for u, dye in dyes.items() if dye == "canary"}

    a, b = canaries("a", shared=False), canaries("b", shared=False)
    assert 0.15 < len(a) / len(users) < 0.25 and 0.15 < len(b) / len(users) < 0.25
    assert len(a & b) / len(a) < 0.35  # about 20% overlap by chance, not the same users
    assert canaries("a", shared=True) == canaries("b", shared=True)
