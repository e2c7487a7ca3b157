"""Which proxied calls are mirrored to the canary, and the mirror's upstream call (shadow.py
compares the answers, in the background, bounded).

A stable-dyed unary call (shadow.METHODS) is mirrored once it has answered; a stable-dyed greedy
Generate has its tokens collected as they stream, then is mirrored. The canary's upstream is the
balance layer's choice (layers.balance.shadow_target: one whose breaker would let a call
through).
"""

from __future__ import annotations

from modelyard.sidecar.breakers import Breakers
from modelyard.sidecar.dyeing import STABLE
from modelyard.sidecar.layers.attempt import Attempt
from modelyard.sidecar.layers.balance import shadow_target
from modelyard.sidecar.layers.read import Metadata
from modelyard.sidecar.message_fields import with_version
from modelyard.sidecar.routes.route_table import RouteSource
from modelyard.sidecar.shadow.compare import GENERATE, METHODS, Shadows, is_greedy, token_ids
from modelyard.sidecar.upstreams import Upstream, Upstreams


class Mirror:
    def __init__(
        self, upstreams: Upstreams, breakers: Breakers, routes: RouteSource, shadows: Shadows
    ) -> None:
        self._upstreams = upstreams
        self._breakers = breakers
        self._routes = routes
        self._shadows = shadows

    def answered(self, path: str, attempt: Attempt[Upstream], request: bytes, answer: bytes) -> None:
        """A unary call answered: mirror its request to the canary, if the route file asks."""
        if attempt.dye != STABLE or attempt.fallback or path not in METHODS:
            return  # a canary-dyed call that stable answered: the canary has just failed it
        policy = self._routes.table.shadow
        if policy.share <= 0 or not self._shadows.wants(policy) or (target := self._target(attempt)) is None:
            return
        canary, upstream, md = target
        held = (upstream.address, attempt.model, canary)  # what a shadow_dropped's pushback holds
        if self._shadows.held(held, attempt.model):
            return
        method = upstream.method(path, "unary_unary")

        async def send(message: bytes) -> bytes:
            answer: bytes = await method(with_version(message, canary), metadata=md, timeout=30)
            return answer

        self._shadows.mirror(
            policy, attempt.model, path, request, answer, send, (attempt.version, canary), held
        )

    def tokens(self, path: str, attempt: Attempt[Upstream], request: bytes | None) -> list[int] | None:
        """A list to collect the stable stream's tokens in, when this Generate is mirrored."""
        if path != GENERATE or attempt.dye != STABLE or attempt.fallback or request is None:
            return None
        if not self._shadows.wants(self._routes.table.shadow) or not is_greedy(request):
            return None
        return []

    def generated(self, attempt: Attempt[Upstream], request: bytes, tokens: list[int]) -> None:
        """A mirrored Generate ended: the canary generates for the same request, to compare."""
        if (target := self._target(attempt)) is None:
            return
        canary, upstream, md = target
        held = (upstream.address, attempt.model, canary)
        if self._shadows.held(held, attempt.model):
            return
        method = upstream.method(GENERATE, "unary_stream")

        async def send(message: bytes) -> list[int]:
            produced: list[int] = []
            async for event in method(with_version(message, canary), metadata=md, timeout=120):
                produced.extend(token_ids(event))
            return produced

        policy = self._routes.table.shadow
        self._shadows.mirror_tokens(
            policy, attempt.model, request, tokens, send, (attempt.version, canary), held
        )

    def _target(self, attempt: Attempt[Upstream]) -> tuple[str, Upstream, Metadata] | None:
        return shadow_target(attempt, self._routes.table, self._upstreams, self._breakers)
