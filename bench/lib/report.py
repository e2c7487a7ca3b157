"""Report formatting: the results file, which code ran, the echo-versus-service tables of
bench.unary_latency, and profiles side by side (category by category, against a reference)."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.lib.load import NOISY_OTHER_CPU, LevelResult
from bench.lib.profile import CATEGORIES, IDLE, IDLE_FUNCTIONS, SERVICE_LABELS, Profile


def write_json(path: Path, document: object) -> None:
    path.write_text(json.dumps(document, indent=2) + "\n")


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def summarize(results: list[LevelResult], levels: Sequence[int]) -> dict[str, Any]:
    summary: dict[str, Any] = {"servers": {}, "ratios": {}}
    for name in ("echo", "service"):
        per_level = {}
        for c in levels:
            rows = [r for r in results if r.server == name and r.concurrency == c]
            per_level[str(c)] = {
                "p50_us": median([r.p50_us for r in rows]),
                "p99_us": median([r.p99_us for r in rows]),
                "throughput": median([r.throughput for r in rows]),
                "throughput_min": min(r.throughput for r in rows),
                "throughput_max": max(r.throughput for r in rows),
                "p50_us_min": min(r.p50_us for r in rows),
                "p50_us_max": max(r.p50_us for r in rows),
                "server_cpu_us_per_req": median([r.server_cpu_us_per_req for r in rows]),
                "server_cpu_util": median([r.server_cpu_util for r in rows]),
                "client_cpu_util": median([r.client_cpu_util for r in rows]),
                "other_cpu_util_max": max(r.other_cpu_util for r in rows),
            }
        summary["servers"][name] = per_level
    for c in levels:
        pairs = [
            (e, s)
            for e in results
            for s in results
            if e.server == "echo"
            and s.server == "service"
            and e.concurrency == s.concurrency == c
            and e.round == s.round
        ]
        summary["ratios"][str(c)] = {
            "p50": median([s.p50_us / e.p50_us for e, s in pairs]),
            "p99": median([s.p99_us / e.p99_us for e, s in pairs]),
            "throughput": median([s.throughput / e.throughput for e, s in pairs]),
            "server_cpu_per_req": median(
                [s.server_cpu_us_per_req / e.server_cpu_us_per_req for e, s in pairs]
            ),
            "p50_added_us": median([s.p50_us - e.p50_us for e, s in pairs]),
        }
    summary["other_cpu_util_max"] = max(r.other_cpu_util for r in results)
    return summary


def print_report(
    args: argparse.Namespace,
    raw: dict[str, float],
    summary: dict[str, Any],
    targets: dict[str, Any],
    levels: Sequence[int],
) -> None:
    print()
    print(
        f"raw onnxruntime run(), in-process, sequential, FP32[1,{args.features}]: "
        f"p50 {raw['p50_us']:.1f} us  p99 {raw['p99_us']:.1f} us  {raw['calls_per_s']:,.0f} calls/s"
    )
    print()
    print(
        f"unary Infer over grpc.aio, FP32[1,{args.features}], "
        f"median of {args.repeats} round(s) of {args.duration:g} s per server and level"
    )
    header = (
        f"{'server':<8} {'conc':>4} {'p50 us':>8} {'p50 range':>15} {'p99 us':>8} {'req/s':>8} "
        f"{'req/s range':>13} {'srv CPU us/req':>14} {'srv CPU':>7} {'cli CPU':>7} {'other':>6}"
    )
    print(header)
    print("-" * len(header))
    for c in levels:
        for name in ("echo", "service"):
            s = summary["servers"][name][str(c)]
            print(
                f"{name:<8} {c:>4} {s['p50_us']:>8.1f} {s['p50_us_min']:>7.1f}-{s['p50_us_max']:<7.1f} "
                f"{s['p99_us']:>8.1f} {s['throughput']:>8.0f} "
                f"{s['throughput_min']:>6.0f}-{s['throughput_max']:<6.0f} "
                f"{s['server_cpu_us_per_req']:>14.1f} {s['server_cpu_util']:>7.0%} "
                f"{s['client_cpu_util']:>7.0%} {s['other_cpu_util_max']:>6.0%}"
            )
    print()
    print("service / echo (median of per-round paired ratios)")
    header = f"{'conc':>4} {'p50':>7} {'p99':>7} {'throughput':>10} {'srv CPU/req':>11} {'p50 added us':>12}"
    print(header)
    print("-" * len(header))
    for c in levels:
        r = summary["ratios"][str(c)]
        print(
            f"{c:>4} {r['p50']:>6.2f}x {r['p99']:>6.2f}x {r['throughput']:>9.2f}x "
            f"{r['server_cpu_per_req']:>10.2f}x {r['p50_added_us']:>12.1f}"
        )
    print()
    print(
        "srv CPU: the server process's CPU (1.0 = one core), client CPU: this process's; other: the rest of "
        "the machine (max over rounds)"
    )
    if summary["other_cpu_util_max"] > NOISY_OTHER_CPU:
        print(
            f"WARNING: other processes used up to {summary['other_cpu_util_max']:.0%} of a core during the "
            "measurements: the numbers are disturbed; rerun on a quiet machine"
        )
    service_c1 = summary["servers"]["service"][str(levels[0])]["p50_us"]
    print()
    print(f"service p50 at c={levels[0]} / raw ORT run p50: {service_c1 / raw['p50_us']:.1f}x")
    for key, label, op in (
        ("p50_c1", "p50 at c=1 vs echo", "<="),
        ("throughput_c16", "throughput at c=16 vs echo", ">="),
    ):
        if key in targets:
            t = targets[key]
            verdict = "PASS" if t["pass"] else "FAIL"
            print(f"TARGET {label:<28} {t['ratio']:.2f}x ({op} {t['limit']:.2f}x)  {verdict}")


def print_breakdown(steps: dict[str, float]) -> None:
    if not steps:
        return
    print()
    print("in-process cost per call, no gRPC, hot loop (best of 5 batches), us; inside the loaded server")
    print("the same code costs ~2-4x more (cold caches between requests): see --profile for in-situ costs")
    for label, us in steps.items():
        print(f"  {label:<56} {us:>7.2f}")
    echo = steps.get("echo handler: InferResponse(outputs=request.inputs)")
    service = steps.get("service handler: InferenceServicer.Infer (all)")
    if echo is not None and service is not None:
        print(f"  {'=> the service handler costs more than the echo handler by':<56} {service - echo:>7.2f}")


def print_profiles(profiles: list[Profile], top: int, reference: str = "echo") -> None:
    """Each profile's top functions, then one table of the event-loop thread's CPU per request by
    category: `reference` (the server to beat) beside the service, and their difference."""
    for p in profiles:
        print()
        print(
            f"profile of {p.server} at c=16: py-spy {p.rate} Hz for {p.seconds:g} s ({p.raw_file}), "
            f"{p.throughput:.0f} req/s while sampled"
        )
        threads = ", ".join(f"{name} {us:.0f}" for name, us in p.threads_cpu_us_per_req.items() if us >= 1)
        print(f"  CPU us/request by thread (/proc): {threads}")
        idle = p.categories.get(IDLE, 0) / max(p.main_samples, 1)
        print(
            f"  event-loop thread, top {top} functions by own time: % of its busy samples, CPU us/request "
            f"({idle:.0%} of its samples wait in epoll, left out)"
        )
        busy = [(name, n) for name, n in p.own.items() if name not in IDLE_FUNCTIONS]
        for name, n in busy[:top]:
            print(f"    {n / p.busy_samples:>6.1%} {p.us_per_request(n):>7.1f}  {name}")
    if not profiles:
        return
    by_server = {p.server: p for p in profiles}
    columns = [name for name in (reference, "service") if name in by_server]
    both = len(columns) == 2
    print()
    print("event-loop thread CPU at c=16 by innermost matching frame, us/request (py-spy shares x /proc CPU)")
    header = (
        f"  {'category':<42}"
        + "".join(f"{name:>9}" for name in columns)
        + (f"{'service-' + reference:>14}" if both else "")
    )
    print(header)

    def row(label: str, values: list[float]) -> None:
        line = f"  {label:<42}" + "".join(f"{v:>9.1f}" for v in values)
        print(line + (f"{values[1] - values[0]:>+14.1f}" if both else ""))

    for label in [lab for lab, _ in CATEGORIES if lab != IDLE] + ["other"]:
        values = [
            by_server[name].us_per_request(by_server[name].categories.get(label, 0)) for name in columns
        ]
        if any(v >= 0.05 for v in values):
            row(label, values)
    row(
        "= request handler (all categories above the grpc ones)",
        [
            by_server[name].us_per_request(
                sum(n for lab, n in by_server[name].categories.items() if lab in SERVICE_LABELS)
            )
            for name in columns
        ],
    )
    row("= event-loop thread total (/proc)", [by_server[name].main_cpu_us_per_req for name in columns])
    row("= whole process (/proc)", [sum(by_server[name].threads_cpu_us_per_req.values()) for name in columns])


def source_state(folder: Path) -> dict[str, object]:
    """Which service code ran: the commit and whether service/ differs from it (read-only git)."""
    state: dict[str, object] = {"dir": str(folder)}
    try:
        git = ["git", "-C", str(folder)]
        commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--", "service"], capture_output=True, text=True, timeout=10
        )
        if commit.returncode == 0:
            state["commit"] = commit.stdout.strip()
            state["service_uncommitted_changes"] = bool(dirty.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return state
