"""The breaker defaults, measured: a canary failing a share of its calls against the real breaker
(sidecar/breakers.py, sidecar/breaker_policy.py) on a simulated clock; no sockets, no sleeps.

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

`--live`: the canaries of models/canary_models.py with both versions in one real service, a real
sidecar in front (canary weight 50, its breakers set never to trip: every call is recorded as the
sidecar saw it, the canary's calls never stop) and 1 or 16 clients in closed loops (each on its own
connection: a caller each), `--runs` recordings of `--live-seconds` each per canary and client
count. Model `m` (models/canary_models.py): v1 stable adds one after `--work` Loop iterations
(about a millisecond); v2 the canary:

- shape: the same with a Reshape to the constant [1, 4]: `--shape-share` of the calls send a batch
  of 2, which it refuses (`model_rejected`; the sidecar replays them on stable, `canary-fault`);
- slow: 4 x the work from its first call (a canary 4x slower than stable);
- healthy: the same graph as stable (what must not be cut off).

Each recording (per call: when, which client, the dye and version that answered, the fallback, the
call's duration at the client, the service's x-run-us and x-queue-us) is then replayed through the
real breaker (the sidecar's Breakers, the recorded times as its clock) under each policy of
LIVE_POLICIES: the earlier judgement, the defaults before issue 34 (the call's duration, 4 x
stable, a 0.25 s floor, a canary's model_rejected no fault), and the candidates (the latency read
as x-run-us, x-run-us + x-queue-us or the duration; the median rule's multiple and floor).
`--busy N` keeps N more cores busy while recording (a loaded machine). Printed per policy, canary
and client count: caught (recordings in which the canary's breaker opened), the median seconds and
canary calls from the canary's first call to the trip; for the healthy canary, false trips. Then
each canary's recorded medians (every signal), and the rollout's latency gate on the same
recordings.

    .venv/bin/python -m bench.breaker_defaults --live [--runs 5] [--live-seconds 8] [--work 500]
        [--busy 0] [--save FILE] [--load FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from modelyard.sidecar.breaker_policy import BreakerPolicy, State
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


# --- live: the canaries recorded through a real sidecar, replayed through the breaker --------------

LIVE_CANARIES = ("shape", "slow", "healthy")
LIVE_CLIENTS = (1, 16)
SLOW_FACTOR = 4
# The judgement before issue 34's change, and the candidates: (signal, policy, model_rejected
# replayed on stable). "duration": the call's duration; "service": x-queue-us + x-run-us. The
# multiple and floor are the median rule's (canary_latency_*); the p99 rule keeps 4x and 0.25 s.
_BEFORE = dataclasses.replace(BreakerPolicy(), canary_latency_multiple=4.0, canary_latency_floor_s=0.25)


def _median_rule(multiple: float, floor_s: float) -> BreakerPolicy:
    return dataclasses.replace(
        BreakerPolicy(), canary_latency_multiple=multiple, canary_latency_floor_s=floor_s
    )


LIVE_POLICIES: dict[str, tuple[str, BreakerPolicy, bool]] = {
    "before (duration, 4x, 0.25 s, no replay)": ("duration", _BEFORE, False),
    "duration, 2.5x, 1 ms": ("duration", _median_rule(2.5, 0.001), True),
    "run + queue, 4x, 0.25 s": ("service", _BEFORE, True),
    "run + queue, 3x, 2 ms": ("service", _median_rule(3.0, 0.002), True),
    "run + queue, 2.5x, 1 ms": ("service", _median_rule(2.5, 0.001), True),
    "run, 4x, 1 ms": ("run", _median_rule(4.0, 0.001), True),
    "run, 3x, 2 ms": ("run", _median_rule(3.0, 0.002), True),
    "run, 3x, 1 ms": ("run", _median_rule(3.0, 0.001), True),
    "run, 2.5x, 1 ms": ("run", _median_rule(2.5, 0.001), True),
    "run, 2x, 1 ms": ("run", _median_rule(2.0, 0.001), True),
    "run, 2.5x, 0.5 ms": ("run", _median_rule(2.5, 0.0005), True),
}
# The sidecar that records: weight 50, breakers that never trip (the canary keeps its calls).
RECORDING_ROUTES = {
    "models": {"m": {"canary_weight": 50}},
    "breaker": {
        "min_calls": 10**9,
        "latency_min_calls": 10**9,
        "consecutive_faults": 10**9,
        "canary_latency_floor_s": 3600,
        "latency_floor_s": 3600,
    },
}


@dataclasses.dataclass(frozen=True, slots=True)
class Call:
    at: float  # seconds since the recording began
    client: int
    version: str  # that answered ("" for an error)
    dye: str
    fallback: str
    code: str
    duration: float  # the call's, at the client
    service: float | None  # x-queue-us + x-run-us, seconds
    run: float | None = None  # x-run-us alone

    def latency(self, signal: str) -> float:
        """The call's latency as `signal` reads it ("duration", "service", "run"), the duration
        when the answer carried no timing."""
        found = self.service if signal == "service" else self.run if signal == "run" else None
        return found if found is not None else self.duration


@dataclasses.dataclass
class Judged:
    tripped_s: float | None = None  # from the canary's first call
    calls: int = 0  # canary attempts until the trip (or in all)


def replay(calls: Sequence[Call], signal: str, policy: BreakerPolicy, replayed: bool) -> Judged:
    """The recording through the real breaker: each canary attempt to the canary's (judged against
    stable), each stable answer to stable's, the recorded times as the clock; until the first trip."""
    now = [0.0]
    breakers = Breakers(policy, lambda *args: None, lambda: now[0])
    canary, stable = breakers.get("u", "m", "2"), breakers.get("u", "m", "1")
    judged = Judged()
    first: float | None = None
    for call in calls:
        now[0] = call.at
        latency = call.latency(signal)
        caller = hash(("peer", call.client))
        refused = call.fallback == "canary-fault"  # the canary refused it; stable answered
        if call.dye == "canary" or refused:
            permit = canary.allow()
            if permit is None:
                continue
            first = call.at if first is None else first
            judged.calls += 1
            if refused:  # before: the client got the canary's refusal, no fault
                canary.report(permit, replayed, None, caller, True, "1")
            else:
                canary.report(
                    permit, call.code != "OK", latency if call.code == "OK" else None, caller, True, "1"
                )
            if canary.state is not State.CLOSED:
                judged.tripped_s = call.at - first
                return judged
            if not (refused and replayed):
                continue
        if call.code == "OK" and call.version == "1":
            permit = stable.allow()
            if permit is not None:
                stable.report(permit, False, latency, caller)
    return judged


# The rollout's latency gate (max_latency_ratio 2, the p99's floor 50 ms) on the same recordings:
# (signal, the median rule's floor; 3600 s: no median rule, the gate before issue 34's change).
GATE_ROWS: dict[str, tuple[str, float]] = {
    "before (duration, p99 only)": ("duration", 3600.0),
    "duration, median floor 1 ms": ("duration", 0.001),
    "run + queue, median floor 1 ms": ("service", 0.001),
    "run, p99 only": ("run", 3600.0),
    "run, median floor 2 ms": ("run", 0.002),
    "run, median floor 1 ms": ("run", 0.001),
    "run, median floor 0.5 ms": ("run", 0.0005),
}


def gate_red(calls: Sequence[Call], signal: str, median_floor_s: float, tick_s: float = 1.0) -> bool:
    """Whether a rollout step that began with the recording would see its latency gate red at any
    tick (every `tick_s` of recorded time, as the driver judges), with `median_floor_s`: the real
    gate (rollout.judge) on the real driver's tallies (rollout_driver.Outcomes)."""
    from modelyard.sidecar.breakers import BreakerKey
    from modelyard.sidecar.rollout.driver import STABLE_REFERENCE, Outcomes
    from modelyard.sidecar.rollout.policy import RED, Evidence, RolloutSpec, judge

    spec = RolloutSpec(median_floor_s=median_floor_s)
    now = [0.0]
    outcomes = Outcomes(lambda: now[0])
    outcomes.watch(["m"])
    keys = {version: BreakerKey("u", "m", version) for version in ("1", "2")}
    next_tick = tick_s
    for call in calls:
        now[0] = call.at
        if call.code != "OK" or call.fallback:
            continue
        latency = call.latency(signal)
        outcomes.record(keys[call.version], False, latency)
        if call.at >= next_tick:
            next_tick += tick_s
            canary = outcomes.tally("m", "2", since=0.0)
            stable = outcomes.tally("m", "1", newest=STABLE_REFERENCE)
            if judge(spec, Evidence(canary, stable))["latency"].result == RED:
                return True
    return False


def _infer_request(rows: int, features: int) -> Any:
    import numpy as np

    from modelyard.inference.v1 import inference_service_pb2 as pb
    from modelyard.tensors import to_tensor

    x = np.ones((rows, features), np.float32)
    return pb.InferRequest(model_name="m", inputs=[to_tensor("INPUT0", x)])


async def record(address: str, clients: int, seconds: float, shape_share: float, seed: int) -> list[Call]:
    """`clients` closed loops through the sidecar at `address` for `seconds`, each call recorded."""
    import grpc

    from models.canary_models import FEATURES
    from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc

    requests = {rows: _infer_request(rows, FEATURES) for rows in (1, 2)}
    calls: list[Call] = []
    began = time.perf_counter()
    end = began + seconds

    async def client(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            while time.perf_counter() < end:
                rows = 2 if rng.random() < shape_share else 1
                started = time.perf_counter()
                call = stub.Infer(requests[rows], timeout=60)
                code = "OK"
                trailing: Any
                try:
                    await call
                    trailing = await call.trailing_metadata()
                except grpc.aio.AioRpcError as exc:
                    code, trailing = exc.code().name, exc.trailing_metadata()
                ended = time.perf_counter()
                md = {k: v for k, v in trailing or () if isinstance(v, str)}
                service = run = None
                if "x-run-us" in md:
                    run = int(md["x-run-us"]) / 1e6
                    service = run + int(md.get("x-queue-us", "0")) / 1e6
                calls.append(
                    Call(
                        ended - began,
                        index,
                        md.get("x-served-version", ""),
                        md.get("x-model-dye", ""),
                        md.get("x-dye-fallback", ""),
                        code,
                        ended - started,
                        service,
                        run,
                    )
                )

    await asyncio.gather(*(client(i) for i in range(clients)))
    calls.sort(key=lambda c: c.at)
    return calls


def _busy(count: int) -> list[Any]:
    """`count` processes that each keep a core busy (a loaded machine), stopped by the caller."""
    import subprocess

    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


async def _until_dyed(address: str) -> None:
    """Until the sidecar routes m (it has learned its versions: an answer dyed)."""
    import grpc

    from models.canary_models import FEATURES
    from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            call = stub.Infer(_infer_request(1, FEATURES), wait_for_ready=True, timeout=10)
            await call
            if any(key == "x-model-dye" for key, _ in await call.trailing_metadata() or ()):
                return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"the sidecar at {address} never dyed a call")


async def live_recordings(args: argparse.Namespace) -> dict[str, dict[int, list[list[Call]]]]:
    """Per canary and client count, `args.runs` recordings (one service and sidecar per canary)."""
    import yaml

    from bench.isolation import SIDECAR_READY
    from bench.processes import SERVICE_READY, ServerProcess, service_command
    from models.canary_models import CONFIG, adds_one, reshape_bug
    from models.demo_models import write_model

    canaries = {
        "shape": lambda: reshape_bug(args.work),
        "slow": lambda: adds_one(SLOW_FACTOR * args.work),
        "healthy": lambda: adds_one(args.work),
    }
    found: dict[str, dict[int, list[list[Call]]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-breaker-live-") as tmp:
        for name in args.canaries:
            work = Path(tmp) / name
            write_model(work / "models", "m", 1, adds_one(args.work), CONFIG)
            write_model(work / "models", "m", 2, canaries[name](), CONFIG)
            routes = work / "routes.yaml"
            routes.write_text(yaml.safe_dump(RECORDING_ROUTES))
            argv = [*service_command(work / "models"), "--metrics-listen", "", "--grace-s", "1"]
            service = ServerProcess(f"{name}-service", argv, work, SERVICE_READY)
            sidecar: ServerProcess | None = None
            try:
                service.spawn()
                upstream = f"127.0.0.1:{await service.wait_ready()}"
                sidecar_argv = [sys.executable, "-m", "modelyard.sidecar", "--listen", "127.0.0.1:0"]
                sidecar_argv += ["--upstream", upstream, "--admin-listen", "", "--config", str(routes)]
                sidecar = ServerProcess(f"{name}-sidecar", sidecar_argv, work, SIDECAR_READY)
                sidecar.spawn()
                address = f"127.0.0.1:{await sidecar.wait_ready()}"
                await _until_dyed(address)
                share = args.shape_share if name == "shape" else 0.0
                found[name] = {}
                for clients in args.clients:
                    found[name][clients] = []
                    for run in range(args.runs):
                        busy = _busy(args.busy)
                        try:
                            calls = await record(address, clients, args.live_seconds, share, run)
                        finally:
                            for proc in busy:
                                proc.kill()
                                proc.wait()
                        found[name][clients].append(calls)
                        print(
                            f"recorded {name} at {clients} clients, run {run + 1}: {len(calls)} calls",
                            flush=True,
                        )
            finally:
                if sidecar is not None:
                    sidecar.stop()
                service.stop()
    return found


def _p50(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _p50s(calls: list[Call], version: str, dye: str) -> str:
    """The median run, service time and duration (ms) of the version's own good answers."""
    chosen = [c for c in calls if c.version == version and c.dye == dye and not c.fallback and c.code == "OK"]
    medians = [_p50([c.latency(signal) for c in chosen]) * 1e3 for signal in ("run", "service", "duration")]
    return " / ".join(f"{m:.2f}" for m in medians)


def live_tables(recordings: dict[str, dict[int, list[list[Call]]]]) -> list[str]:
    columns = [(name, clients) for name, by in recordings.items() for clients in by]
    lines = [
        "| policy | "
        + " | ".join(f"{name}, {clients} client{'s' if clients > 1 else ''}" for name, clients in columns)
        + " |",
        "|---|" + "---|" * len(columns),
    ]
    for label, (signal, policy, replayed) in LIVE_POLICIES.items():
        cells = []
        for name, clients in columns:
            judged = [replay(calls, signal, policy, replayed) for calls in recordings[name][clients]]
            caught = [r for r in judged if r.tripped_s is not None]
            if name == "healthy":
                cells.append(f"{len(caught)}/{len(judged)} false trips")
            elif not caught:
                cells.append(f"never (0/{len(judged)})")
            else:
                trip_s = statistics.median(r.tripped_s or 0.0 for r in caught)
                trip_calls = statistics.median(r.calls for r in caught)
                cells.append(f"{len(caught)}/{len(judged)}, {trip_s:.2f} s ({trip_calls:.0f} calls)")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| canary, clients | calls per run | stable p50 ms (run / run + queue / duration) "
        "| canary p50 ms (run / run + queue / duration) |",
        "|---|---|---|---|",
    ]
    for name, clients in columns:
        runs = recordings[name][clients]
        every = [c for calls in runs for c in calls]
        per_run = statistics.median(len(calls) for calls in runs)
        stable, canary = _p50s(every, "1", "stable"), _p50s(every, "2", "canary")
        lines.append(f"| {name}, {clients} | {per_run:.0f} | {stable} | {canary} |")
    gated = [(name, clients) for name, clients in columns if name != "shape"]
    lines += [
        "",
        "| rollout latency gate (ratio 2): red in | "
        + " | ".join(f"{name}, {clients}" for name, clients in gated)
        + " |",
        "|---|" + "---|" * len(gated),
    ]
    for label, (signal, floor_s) in GATE_ROWS.items():
        cells = []
        for name, clients in gated:
            runs = recordings[name][clients]
            cells.append(f"{sum(gate_red(calls, signal, floor_s) for calls in runs)}/{len(runs)}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=10.0, help="canary calls per second")
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--duration", type=float, default=300.0, help="simulated seconds per run")
    parser.add_argument("--live", action="store_true", help="issue 34's canaries through a real sidecar")
    parser.add_argument("--runs", type=int, default=5, help="--live: recordings per canary and client count")
    parser.add_argument("--live-seconds", type=float, default=8.0, help="--live: seconds per recording")
    parser.add_argument("--work", type=int, default=500, help="--live: stable's Loop iterations (~1 ms)")
    parser.add_argument("--shape-share", type=float, default=0.3, help="--live: calls with a batch of 2")
    parser.add_argument(
        "--busy", type=int, default=0, help="--live: processes keeping a core busy while recording"
    )
    parser.add_argument(
        "--canaries", type=lambda text: text.split(","), default=list(LIVE_CANARIES), help="--live: which"
    )
    parser.add_argument(
        "--clients", type=lambda text: [int(c) for c in text.split(",")], default=list(LIVE_CLIENTS)
    )
    parser.add_argument("--save", type=Path, help="--live: keep the recordings here (JSON)")
    parser.add_argument("--load", type=Path, help="replay recordings saved by --save (no new ones)")
    args = parser.parse_args()
    if args.live or args.load:
        if args.load:
            raw = json.loads(args.load.read_text())
            recordings = {
                name: {
                    int(clients): [[Call(*c) for c in run] for run in runs] for clients, runs in by.items()
                }
                for name, by in raw.items()
            }
        else:
            recordings = asyncio.run(live_recordings(args))
        if args.save:
            doc = {
                name: {
                    str(k): [[dataclasses.astuple(c) for c in run] for run in runs] for k, runs in by.items()
                }
                for name, by in recordings.items()
            }
            args.save.write_text(json.dumps(doc))
        print("\n".join(live_tables(recordings)))
        return
    print("\n".join(table(args.rate, args.seeds, args.duration)))


if __name__ == "__main__":
    main()
