"""Weights that survive, through a real sidecar's admin endpoint: an admin change is kept in the
state file and comes back after a restart, a route-file edit of another model does not wipe it,
GET /canary says where each weight came from, a model neither the file nor an upstream names is
refused (503 while no upstream reported), and every accepted change is one audit line (who, what,
when). No upstream answers: the route file names the models."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import yaml

from modelyard.sidecar.server import Sidecar
from tests.sidecar_support import admin_async, running_sidecar
from tests.support import eventually


def write_config(path: Path, doc: dict[str, object]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(doc))
    tmp.replace(path)


def weights(sidecar: Sidecar) -> dict[str, float]:
    return {m: r.canary_weight for m, r in sidecar.routes.table.models.items()}


async def test_admin_weights_survive_a_restart_and_file_edits_of_other_models(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config, state = tmp_path / "routes.yaml", tmp_path / "state.json"
    write_config(config, {"models": {"scaler": {"canary_weight": 10}, "other": {"canary_weight": 10}}})
    settings: dict[str, Any] = {"state_file": str(state), "admin_open": True}
    caplog.set_level(logging.INFO, "modelyard.sidecar.audit")
    async with running_sidecar(["127.0.0.1:9"], config=config, **settings) as sidecar:
        answer = await admin_async(sidecar, "/canary/scaler", "PUT", {"canary_weight": 25})
        assert answer["canary_weight"] == 25
        # The upstream never answers: a model the route file does not name may be one it serves
        # (503, retry), not one nobody serves (404, once every upstream reported).
        missing = await admin_async(sidecar, "/canary/nosuch", "PUT", {"canary_weight": 25})
        assert missing["reason"] == "unavailable"
        lines = [r.getMessage() for r in caplog.records if r.name == "modelyard.sidecar.audit"]
        assert len(lines) == 1, lines  # the refused change is not audited
        assert "model=scaler canary_weight 10.0 -> 25.0 by=peer:127.0.0.1:" in lines[0]
        assert " at=20" in lines[0]

        # An edit of the other model's entry leaves scaler's admin weight alone.
        write_config(config, {"models": {"scaler": {"canary_weight": 10}, "other": {"canary_weight": 50}}})
        await eventually(lambda: weights(sidecar)["other"] == 50, "the file's edit of other")
        assert weights(sidecar)["scaler"] == 25
        lines = [r.getMessage() for r in caplog.records if r.name == "modelyard.sidecar.audit"]
        assert len(lines) == 2 and "model=other canary_weight 10.0 -> 50.0 by=route_file" in lines[1]
        listing = await admin_async(sidecar, "/canary")
        assert listing["models"]["scaler"]["source"] == "admin"
        assert listing["models"]["other"]["source"] == "route_file"
        await sidecar.state.flush()
    saved = json.loads(state.read_text())
    assert saved["routes"]["overrides"]["scaler"]["canary_weight"] == 25

    async with running_sidecar(["127.0.0.1:9"], config=config, **settings) as again:
        assert weights(again) == {"scaler": 25, "other": 50}
        listing = await admin_async(again, "/canary")
        assert listing["models"]["scaler"]["source"] == "state_file"
        assert listing["models"]["other"]["source"] == "route_file"


async def test_a_state_file_that_is_not_one_refuses_the_start(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    state.write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a sidecar state file"):
        async with running_sidecar(["127.0.0.1:9"], state_file=str(state)):
            pass
