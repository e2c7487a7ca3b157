"""What the state file (sidecar/routes/state_file.py) holds, checked whole before the sidecar uses any of it:
its shape (declared below, so a message names the key path), every model name and version by the
one name rule (modelyard.common.names), each route as an admin PUT's, each rollout's spec as a
POST's (bounded, finite numbers). A file that fails is a StateError naming the file and what is
wrong: the sidecar does not start (cli.py: one line, exit 2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from modelyard.common.names import InvalidName, check_name, check_version
from modelyard.process.documents import DocumentError, load
from modelyard.sidecar.rollout.policy import MAX_HISTORY, Rollout
from modelyard.sidecar.routes.file import RolloutDoc, Weight
from modelyard.sidecar.routes.route_table import FROM_FILE, Change, ConfigError
from modelyard.sidecar.routes.state_file import StateError, load_state

Seconds = Annotated[float, Meta(ge=0)]  # wall-clock seconds (finite: the file's JSON allows no other)


class _Doc(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class _ChangeDoc(_Doc, kw_only=True):
    canary_weight: Weight
    stable: str = ""
    canary: str = ""
    at: Seconds
    source: str = ""
    by: str = ""


class _RoutesDoc(_Doc, kw_only=True):
    overrides: dict[str, _ChangeDoc] = msgspec.field(default_factory=dict)
    file: dict[str, _ChangeDoc] = msgspec.field(default_factory=dict)


class _EventDoc(_Doc, kw_only=True):
    event: str
    step: Annotated[int, Meta(ge=0)]
    weight: Weight
    at: Seconds
    reason: str | None = None
    by: str = ""


class _RolloutDoc(_Doc, kw_only=True):
    spec: RolloutDoc
    started: Seconds
    state: Literal["running", "paused", "succeeded", "failed", "aborted"]
    step: Annotated[int, Meta(ge=0)]
    step_started: Seconds
    reason: str | None = None
    canary: str = ""
    origin: Literal["admin", "route_file"] = "admin"
    history: Annotated[list[_EventDoc], Meta(max_length=MAX_HISTORY)] = msgspec.field(default_factory=list)


class _StateDoc(_Doc, kw_only=True):
    format: int
    routes: _RoutesDoc = msgspec.field(default_factory=_RoutesDoc)
    rollouts: dict[str, _RolloutDoc] = msgspec.field(default_factory=dict)


def read_saved(path: Path | None) -> dict[str, Any]:
    """The state file's contents (empty without a file or for a missing one), checked whole;
    StateError naming the file and what is wrong otherwise."""
    doc = load_state(path)
    if not doc:
        return doc
    try:
        check_saved(doc)
    except (DocumentError, ConfigError, InvalidName, ValueError) as exc:
        raise StateError(f"state file {path}: {exc}") from None
    return doc


def check_saved(doc: dict[str, Any]) -> None:
    """ValueError (a DocumentError names the key path) for contents the sidecar could not use."""
    load(doc, _StateDoc, "state")
    routes = doc.get("routes") or {}
    for section in ("overrides", "file"):
        for model, raw in (routes.get(section) or {}).items():
            _name(model, f"routes.{section}")
            Change.from_doc(raw, FROM_FILE, f"routes.{section}.{model}")  # versions as a PUT's
    for model, raw in (doc.get("rollouts") or {}).items():
        _name(model, "rollouts")
        if raw.get("canary"):
            check_version(raw["canary"], f"rollouts.{model}.canary")
        try:
            Rollout.from_doc(model, raw)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"rollouts.{model}: {exc}") from None


def _name(model: str, where: str) -> None:
    try:
        check_name(model, "model")
    except InvalidName as exc:
        raise ValueError(f"{where}: {exc}") from None
