"""PUT /canary/<model> bodies, as hypothesis makes them: any bytes and any JSON give a 200 or a
400 with a reason, never another exception (a 500)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from modelyard.sidecar.admin import AdminServer, HttpError
from modelyard.sidecar.routes.route_table import RouteSource

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20,
)
route_keys = st.sampled_from(["canary_weight", "stable", "canary", "other"])
bodies = st.dictionaries(route_keys, json_values, max_size=3)


def server() -> AdminServer:
    return AdminServer("127.0.0.1", 0, CollectorRegistry(), RouteSource(None), list)


def put(admin: AdminServer, raw: bytes) -> int:
    try:
        return admin._put_route("scaler", raw).status
    except HttpError as exc:
        assert exc.reason.value == "invalid_argument" and len(str(exc)) < 1100
        return exc.status


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_any_bytes_are_200_or_400(raw: bytes) -> None:
    assert put(server(), raw) in (200, 400)


@settings(max_examples=300, deadline=None)
@given(json_values | bodies)
def test_any_json_is_200_or_400(doc: Any) -> None:
    admin = server()
    status = put(admin, json.dumps(doc).encode())
    assert status in (200, 400)
    if status == 200:
        route = admin._routes.table.route("scaler")
        assert 0 <= route.canary_weight <= 100
