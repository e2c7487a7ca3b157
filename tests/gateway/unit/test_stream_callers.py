"""The stream registry's callers, without a network: who a request is (credential, else tenant,
else peer), who may resume a stream, and which detached streams give way to live ones."""

from __future__ import annotations

import asyncio

import pytest

from modelyard.gateway import errors
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.gateway.streams import Registry, Stream
from tests.gateway.unit.test_streams import FakeCall


async def ended(stream: Stream) -> bool:
    """Whether its producer (and so its upstream call) ended cancelled, once it has ended."""
    assert stream.producer is not None
    await asyncio.gather(stream.producer, return_exceptions=True)
    return stream.producer.cancelled()


def test_a_client_is_its_credential_else_its_tenant_else_its_peer() -> None:
    streams = Registry(60.0, 16, 8, GatewayMetrics())
    token = streams.caller("Bearer a", "t1", "10.0.0.1")
    assert token == streams.caller("Bearer a", "t2", "10.0.0.2")  # the credential decides
    assert token.owner is not None and token.client != streams.caller("Bearer b", "t1", "10.0.0.1").client
    tenant = streams.caller("", "t1", "10.0.0.1")
    assert tenant.owner is None and tenant.client == streams.caller("", "t1", "10.0.0.2").client
    assert tenant.client != streams.caller("", "t2", "10.0.0.1").client
    peer = streams.caller("", "", "10.0.0.1")
    assert peer.client != tenant.client and peer.client != streams.caller("", "", "10.0.0.2").client
    # Keys are fixed-size digests, whatever a client sends; none holds what it was made from.
    huge = streams.caller("", "x" * 60_000, "10.0.0.1")
    assert len(huge.client) == len(tenant.client) == len(token.client) == 16
    assert b"Bearer" not in token.owner and b"t1" not in tenant.client
    # Another process's registry (another key) makes other digests of the same credential.
    assert Registry(60.0, 16, 8, GatewayMetrics()).caller("Bearer a", "", "").owner != token.owner


async def test_only_the_starting_credential_resumes_and_an_anonymous_stream_anyone() -> None:
    streams = Registry(60.0, 16, 8, GatewayMetrics())
    a, b, nobody = (streams.caller(auth, "", "p") for auth in ("Bearer a", "Bearer b", ""))
    owned = streams.start("m", FakeCall(1, hold=True), a)
    anonymous = streams.start("m", FakeCall(1, hold=True), nobody)
    assert streams.may_resume(owned, a) and not streams.may_resume(owned, b)
    assert not streams.may_resume(owned, nobody)
    assert all(streams.may_resume(anonymous, caller) for caller in (a, b, nobody))
    for stream in (owned, anonymous):
        streams.drop(stream)


async def test_a_client_over_its_bound_loses_its_oldest_detached_stream_and_no_one_elses() -> None:
    streams = Registry(60.0, 16, 64, GatewayMetrics(), per_client=2)
    abuser, other = streams.caller("", "abuser", "p"), streams.caller("", "other", "p")
    calls = [FakeCall(1, hold=True) for _ in range(4)]
    kept = streams.start("m", calls[0], other)
    streams.detach(kept)
    mine = [streams.start("m", call, abuser) for call in calls[1:]]
    for stream in mine:
        streams.detach(stream)
    assert streams.detached_by(abuser) == 2 and streams.detached_by(other) == 1
    assert streams.get(mine[0].id) is None  # its oldest: forgotten, its upstream call cancelled
    assert await ended(mine[0]) and calls[1].cancelled
    assert [streams.get(s.id) is s for s in mine[1:]] == [True, True]
    assert streams.get(kept.id) is kept and not calls[0].cancelled
    assert streams.metrics.evicted.labels("client")._value.get() == 1
    # Read again, a stream no longer counts as detached.
    streams.attach(mine[1])
    assert streams.detached_by(abuser) == 1 and streams.detached == 2
    for stream in (kept, *mine[1:]):
        streams.drop(stream)
        await ended(stream)
    await asyncio.sleep(0)  # the producers' done callbacks run on the next loop pass
    assert streams.detached == 0 and streams.open == 0


async def test_at_the_limit_a_new_stream_cancels_the_oldest_detached_one_not_a_read_one() -> None:
    streams = Registry(60.0, 16, 3, GatewayMetrics())
    live = streams.start("m", FakeCall(1, hold=True))
    left = [FakeCall(1, hold=True) for _ in range(2)]
    gone = [streams.start("m", call, streams.caller("", f"t{i}", "p")) for i, call in enumerate(left)]
    for stream in gone:
        streams.detach(stream)
    newcomer = streams.start("m", FakeCall(1, hold=True))  # at the limit: the oldest detached goes
    assert streams.get(gone[0].id) is None and streams.open == 3
    assert await ended(gone[0]) and left[0].cancelled
    assert streams.get(gone[1].id) is gone[1] and streams.get(live.id) is live
    another = streams.start("m", FakeCall(1, hold=True))
    assert streams.detached == 0 and await ended(gone[1]) and left[1].cancelled
    refused = FakeCall(1)
    with pytest.raises(errors.HttpError) as raised:  # every open stream is read: 429, as before
        streams.start("m", refused)
    assert raised.value.status == 429 and refused.cancelled
    assert streams.metrics.evicted.labels("full")._value.get() == 2
    for stream in (live, newcomer, another):
        streams.drop(stream)
