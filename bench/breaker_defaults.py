"""The breaker defaults, measured: a canary failing a share of its calls against the real breaker
(sidecar/breakers.py, sidecar/adaptive.py) on a simulated clock; no sockets, no sleeps.

Canary traffic: `--rate` calls per second (default 10: a 10% canary of a 100 calls/s model), each
from one of 1000 users (the leave-one-out sees many callers), judged against a stable version that
does not fail; the policies differ in `canary_error_rate`. A call the breaker refuses goes to
stable (the effective weight is 0 while it is open). For each failure share and policy, `--seeds`
runs of `--duration` seconds:

- caught: the runs in which the breaker opened;
- trip s / calls: the median time (and canary calls) from the first failing call to the first trip;
- leak: the share of canary-dyed calls the failing canary still answered after its first trip
  (flapping lets them through: each half-open probe that passes, and each close);
- closes: the median number of times it closed again after the first trip (a flap each).

Row "100% late": the canary is healthy for 60 s, then dead (the successes of before stay in the
window: without the burst rule the error rate needs half the window to reach 50%). Row "slow": no
faults, but every canary call takes 0.5 s against stable's 20 ms from the first call (stable's calls,
9 for each canary call, are simulated too: they are what the canary is judged against).

    .venv/bin/python -m bench.breaker_defaults [--rate 10] [--seeds 20] [--duration 300]
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
from collections.abc import Sequence

from modelyard.sidecar.adaptive import BreakerPolicy, State
from modelyard.sidecar.breakers import Breakers

# Before issue 20: error rate 0.5 for every version, no burst rule, a run of 3 probes, no reference.
OLD = BreakerPolicy(canary_error_rate=0.5, consecutive_faults=10**6, probes=3, probes_max=3)
POLICIES = {
    "old (0.5, 3 probes)": OLD,
    "0.5 + burst + run": BreakerPolicy(canary_error_rate=0.5),
    "0.3 + burst + run": BreakerPolicy(canary_error_rate=0.3),
    "0.2 + burst + run (default)": BreakerPolicy(),
    "0.1 + burst + run": BreakerPolicy(canary_error_rate=0.1),
}
SHARES = (0.0, 0.05, 0.10, 0.30, 0.50, 1.0)
LATE_S = 60.0


@dataclasses.dataclass
class Run:
    tripped_at: float | None = None
    calls_to_trip: int = 0
    after: int = 0  # canary-dyed calls after the first trip
    leaked: int = 0  # ...that the canary answered (it failed them with the share)
    closes: int = 0


def simulate(
    policy: BreakerPolicy, share: float, seed: int, rate: float, duration: float, late: bool, slow: bool
) -> Run:
    now = [0.0]
    run = Run()
    closes: list[int] = [0]

    def changed(key: object, old: State, new: State, why: str) -> None:
        if new is State.CLOSED:
            closes[0] += 1

    breakers = Breakers(policy, changed, lambda: now[0])
    canary = breakers.get("canary:1", "m", "2")
    stable = breakers.get("stable:1", "m", "1")  # stable: known, no faults (the reference)
    rng = random.Random(seed)
    fails_from = LATE_S if late else 0.0
    while now[0] < duration:
        now[0] += rng.expovariate(rate * (10 if slow else 1))
        if slow and rng.random() < 0.9:  # a stable call
            granted = stable.allow()
            assert granted is not None
            stable.report(granted, False, 0.02, hash(("user", rng.randrange(1000))))
            continue
        permit = canary.allow()
        if run.tripped_at is not None:
            run.after += 1
        if permit is None:
            continue  # stable answers it
        failing = now[0] >= fails_from and (slow or share > 0)
        fault = failing and rng.random() < share
        if run.tripped_at is None and failing:
            run.calls_to_trip += 1
        elif run.tripped_at is not None:
            run.leaked += 1
        latency = 0.5 if slow else 0.005
        # The old policy also stands for the old code: no judging against stable.
        reference = "" if policy is OLD else "1"
        canary.report(permit, fault, latency, hash(("user", rng.randrange(1000))), True, stable=reference)
        if run.tripped_at is None and canary.state is not State.CLOSED:
            run.tripped_at = now[0] - fails_from
            closes[0] = 0
    run.closes = closes[0]
    return run


def table(rate: float, seeds: int, duration: float) -> list[str]:
    lines = [
        "| failing | policy | caught | trip s (median) | trip calls | leak after trip | closes |",
        "|---|---|---|---|---|---|---|",
    ]
    rows: Sequence[tuple[str, float, bool, bool]] = [
        *((f"{share:.0%}", share, False, False) for share in SHARES),
        ("100% late", 1.0, True, False),
        ("slow", 0.0, False, True),
    ]
    for label, share, late, slow in rows:
        for name, policy in POLICIES.items():
            runs = [simulate(policy, share, seed, rate, duration, late, slow) for seed in range(seeds)]
            caught = [r for r in runs if r.tripped_at is not None]
            trip_s = f"{statistics.median(r.tripped_at or 0.0 for r in caught):.1f}" if caught else "-"
            trip_calls = f"{statistics.median(r.calls_to_trip for r in caught):.0f}" if caught else "-"
            after = sum(r.after for r in caught)
            leak = f"{sum(r.leaked for r in caught) / after:.1%}" if after else "-"
            closes = f"{statistics.median(r.closes for r in caught):.0f}" if caught else "-"
            lines.append(
                f"| {label} | {name} | {len(caught)}/{seeds} | {trip_s} | {trip_calls} | {leak} | {closes} |"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=10.0, help="canary calls per second")
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--duration", type=float, default=300.0, help="simulated seconds per run")
    args = parser.parse_args()
    print("\n".join(table(args.rate, args.seeds, args.duration)))


if __name__ == "__main__":
    main()
