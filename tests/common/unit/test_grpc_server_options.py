"""The one list of gRPC listener options: names gRPC core knows, limits from the settings."""

from __future__ import annotations

import grpc
import pytest

from modelyard.process.grpc_server import INT_MAX, MAX_METADATA_BYTES, connection_options
from modelyard.service.settings import Settings as ServiceSettings
from modelyard.sidecar.settings import Settings as SidecarSettings


def test_options_come_from_the_settings_and_zero_means_no_limit() -> None:
    options = dict(
        connection_options(ServiceSettings(grpc_max_connection_age_s=0, grpc_max_connection_idle_s=2.5))
    )
    assert options["grpc.max_concurrent_streams"] == 256
    assert options["grpc.max_connection_age_ms"] == INT_MAX
    assert options["grpc.max_connection_idle_ms"] == 2500
    assert options["grpc.http2.max_ping_strikes"] > 0
    assert options["grpc.http.overload_protection"] == 1
    # Soft = hard: no call under the limit is refused at random.
    assert options["grpc.max_metadata_size"] == MAX_METADATA_BYTES
    assert options["grpc.absolute_max_metadata_size"] == MAX_METADATA_BYTES
    assert dict(connection_options(SidecarSettings())) == dict(connection_options(ServiceSettings()))
    with pytest.raises(ValueError, match="at least 1"):
        connection_options(ServiceSettings(grpc_max_concurrent_streams=0))


async def test_a_server_takes_them() -> None:
    server = grpc.aio.server(options=connection_options(ServiceSettings()))
    assert server.add_insecure_port("127.0.0.1:0") > 0
    await server.start()
    await server.stop(None)
