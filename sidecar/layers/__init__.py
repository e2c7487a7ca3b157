"""The sidecar's call path as layers, each a small pure module with one job, a frozen value
passing from each to the next (docs/sidecar.md, "A call through the layers"):

    read (read.py: Asked) -> route (route.py: Route) -> balance (balance.py: an upstream and its
    breaker's permit) -> attempt (attempt.py: one frozen Attempt) -> retry policy (retry.py:
    after a failed attempt, the next one or none)

with what a dyed call reads of its model in view.py. No transport, no I/O, no asyncio, no
per-call state (the call's scope holds that: scope.py); the proxy composes them once per method
and runs the one attempt loop (proxy.py).
"""
