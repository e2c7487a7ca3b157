"""Serving overhead of unary Infer, as ratios measured in one run.

Three things are measured on the same tiny model (``scaled_identity``: one Mul, whose own run costs
microseconds, so that the serving path is what is measured) and the same payload:

  (a) raw ORT   ``onnxruntime.InferenceSession.run()`` in this process, sequentially;
  (b) echo      bench/echo_server.py, a bare grpc.aio InferenceService whose Infer echoes the inputs;
  (c) service   ``python -m modelyard.service`` serving the model.

One grpc.aio client (this process) drives (b) and (c) at each concurrency level, alternating the
servers level by level and round by round so that machine noise hits both alike. Ratios are the
median over rounds of the paired (same round, same level) service/echo ratios.

Targets (the issue): p50 at concurrency 1 within 1.25x of echo; throughput at concurrency 16 at
least 0.85x of echo. ``--profile`` samples both servers with py-spy under concurrency 16 and says
where each spends its CPU, in microseconds per request. Unless ``--no-breakdown`` is given, the
service's request steps are also timed in-process (no gRPC), per call.

    .venv/bin/python -m bench.unary_latency [--profile] [--features 256] [--duration 5] [--repeats 3]

Results go to bench/results/unary_latency.json (and the raw py-spy profiles beside it).
Everything runs on 127.0.0.1; every process started here is stopped before exit.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import re
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnxruntime as ort

from bench.lib.breakdown import breakdown
from bench.lib.load import NOISY_OTHER_CPU, Infer, LevelResult, RequestFailed, machine_busy_s, measure
from bench.lib.profile import IDLE, Profile, profile_server
from bench.lib.report import (
    print_breakdown,
    print_profiles,
    print_report,
    source_state,
    summarize,
    write_json,
)
from bench.processes import SERVICE_READY, ServerProcess
from models.demo_models import scaled_identity, write_model
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.inference.v1 import tensor_pb2

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
ECHO_SCRIPT = BENCH / "echo_server.py"
DEFAULT_OUTPUT = BENCH / "results" / "unary_latency.json"

MODEL = "tiny"
SCALE = 2.0
INPUT, OUTPUT = "INPUT0", "OUTPUT0"
HOST = "127.0.0.1"

TARGET_P50_C1 = 1.25  # service p50 at concurrency 1 <= 1.25x echo
TARGET_TPUT_C16 = 0.85  # service throughput at concurrency 16 >= 0.85x echo

SERVICE_LOADED = re.compile(
    r"model " + MODEL + r" version 1 loaded on (\S+)[^(]*\(warm-up run (\d+) us, (\w+)\)"
)


# -- (a) raw onnxruntime ---------------------------------------------------------------------


def raw_ort(model_file: Path, x: np.ndarray, seconds: float) -> dict[str, float]:
    """Sequential in-process session.run() on the model, with the service's session options."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(str(model_file), sess_options=options, providers=["CPUExecutionProvider"])
    feeds, names = {INPUT: x}, [OUTPUT]
    (y,) = session.run(names, feeds)
    if not np.allclose(y, x * SCALE):
        raise RuntimeError("raw ORT: the model's output is not INPUT0 * scale")
    for _ in range(500):
        session.run(names, feeds)
    timings: list[int] = []
    end = time.perf_counter() + seconds
    cpu0, wall0 = time.process_time(), time.perf_counter()
    while time.perf_counter() < end:
        for _ in range(100):
            t0 = time.perf_counter_ns()
            session.run(names, feeds)
            timings.append(time.perf_counter_ns() - t0)
    wall = time.perf_counter() - wall0
    array = np.asarray(timings, dtype=np.int64)
    p50, p99 = np.percentile(array, [50, 99]) / 1e3
    return {
        "calls": int(array.size),
        "p50_us": float(p50),
        "p99_us": float(p99),
        "mean_us": float(array.mean() / 1e3),
        "calls_per_s": array.size / wall,
        "cpu_util": (time.process_time() - cpu0) / wall,
    }


def evaluate_targets(summary: dict[str, Any], levels: Sequence[int]) -> dict[str, Any]:
    targets: dict[str, Any] = {}
    if 1 in levels:
        ratio = summary["ratios"]["1"]["p50"]
        targets["p50_c1"] = {"ratio": ratio, "limit": TARGET_P50_C1, "pass": ratio <= TARGET_P50_C1}
    if 16 in levels:
        ratio = summary["ratios"]["16"]["throughput"]
        targets["throughput_c16"] = {
            "ratio": ratio,
            "limit": TARGET_TPUT_C16,
            "pass": ratio >= TARGET_TPUT_C16,
        }
    return targets


# -- the run ---------------------------------------------------------------------------------


def build_request(features: int, seed: int = 0) -> tuple[pb.InferRequest, np.ndarray]:
    x = np.random.default_rng(seed).standard_normal((1, features), dtype=np.float32)
    tensor = tensor_pb2.Tensor(
        name=INPUT,
        datatype=tensor_pb2.DATA_TYPE_FP32,
        shape=list(x.shape),
        raw_data=x.astype("<f4").tobytes(),
    )
    return pb.InferRequest(model_name=MODEL, inputs=[tensor]), x


def check_response(server: str, response: pb.InferResponse, x: np.ndarray, scale: float) -> None:
    (tensor,) = response.outputs
    y = np.frombuffer(tensor.raw_data, dtype="<f4").reshape(tuple(tensor.shape))
    if not np.allclose(y, x * scale):
        raise RuntimeError(f"{server}: wrong answer (expected INPUT0 * {scale})")


async def run(args: argparse.Namespace) -> int:
    levels: list[int] = args.concurrency
    output: Path = args.output
    output.parent.mkdir(parents=True, exist_ok=True)
    servers: list[ServerProcess] = []
    channels: list[grpc.aio.Channel] = []
    with tempfile.TemporaryDirectory(prefix="modelyard-bench-") as tmp:
        workdir = Path(tmp)
        repository = workdir / "repository"
        model_file = write_model(
            repository, MODEL, 1, scaled_identity(args.features, SCALE), config={"max_batch_size": 64}
        )
        request, x = build_request(args.features)
        echo = ServerProcess(
            "echo",
            [sys.executable, str(ECHO_SCRIPT), "--listen", f"{HOST}:0"],
            workdir,
            re.compile(r"^(\d+)$", re.M),
        )
        service = ServerProcess(
            "service",
            [
                *(
                    sys.executable,
                    "-m",
                    "modelyard.service",
                    "--repository",
                    str(repository),
                    "--listen",
                    f"{HOST}:0",
                ),
                *("--metrics-listen", "", "--grace-s", "1", "--log-level", "INFO"),
            ],
            workdir,
            SERVICE_READY,
            # `python -m` puts the working folder first on sys.path: its `service` package runs.
            cwd=args.service_dir or ROOT,
        )
        try:
            busy_before, cpu_before = machine_busy_s(), time.process_time()
            await asyncio.sleep(0.5)
            others = (machine_busy_s() - busy_before - (time.process_time() - cpu_before)) / 0.5
            if others > NOISY_OTHER_CPU:
                print(
                    f"WARNING: other processes use {others:.0%} of a core: the machine is busy",
                    file=sys.stderr,
                )
            for server in (echo, service):
                servers.append(server)
                server.spawn()
            print(f"starting echo and service (logs in {workdir}) ...", file=sys.stderr)
            await asyncio.gather(echo.wait_ready(), service.wait_ready())
            loaded = SERVICE_LOADED.search(service.log())
            service_model = (
                {
                    "provider": loaded.group(1),
                    "warmup_run_us": int(loaded.group(2)),
                    "dispatch": loaded.group(3),
                }
                if loaded
                else {}
            )
            print(
                f"echo on port {echo.port}, service on port {service.port}; model: {service_model}",
                file=sys.stderr,
            )

            print(f"raw ORT for {args.raw_seconds:g} s ...", file=sys.stderr)
            raw = raw_ort(model_file, x, args.raw_seconds)

            steps: dict[str, float] = {}
            if args.breakdown:
                print("in-process breakdown ...", file=sys.stderr)
                try:
                    steps = await breakdown(repository, request, args.breakdown_iterations)
                except Exception as exc:  # internals moved: the benchmark itself still stands
                    print(f"  breakdown failed: {exc!r}", file=sys.stderr)

            infers: dict[str, Infer] = {}
            for server, scale in ((echo, 1.0), (service, SCALE)):
                channel = grpc.aio.insecure_channel(f"{HOST}:{server.port}")
                channels.append(channel)
                stub = pb_grpc.InferenceServiceStub(channel)
                check_response(server.name, await stub.Infer(request, timeout=10), x, scale)
                infers[server.name] = stub.Infer

            results: list[LevelResult] = []
            for round_ in range(args.repeats):
                for index, c in enumerate(levels):
                    order = (echo, service) if (round_ + index) % 2 == 0 else (service, echo)
                    for server in order:
                        result = await measure(
                            server, infers[server.name], request, c, round_, args.warmup, args.duration
                        )
                        results.append(result)
                        print(
                            f"round {round_ + 1}/{args.repeats} c={c:<2} {server.name:<7} "
                            f"p50 {result.p50_us:7.1f} us  p99 {result.p99_us:7.1f} us  "
                            f"{result.throughput:7.0f} req/s  server CPU {result.server_cpu_util:4.0%}  "
                            f"other CPU {result.other_cpu_util:4.0%}",
                            file=sys.stderr,
                        )

            profiles: list[Profile] = []
            if args.profile:
                for server in (echo, service):
                    print(
                        f"profiling {server.name} at c=16 for {args.profile_seconds:g} s ...", file=sys.stderr
                    )
                    profile = await profile_server(
                        server,
                        infers[server.name],
                        request,
                        16,
                        args.warmup,
                        args.profile_seconds,
                        args.profile_rate,
                        output.parent / f"profile_{server.name}.raw",
                        blocking=args.profile_blocking,
                    )
                    if profile is not None:
                        profiles.append(profile)
        finally:
            for channel in channels:
                await channel.close(None)
            for server in reversed(servers):
                server.stop()

    summary = summarize(results, levels)
    targets = evaluate_targets(summary, levels)
    document = {
        "benchmark": "unary_latency",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "grpc": grpc.__version__,
            "onnxruntime": ort.__version__,
            "machine": platform.machine(),
        },
        "config": {
            "features": args.features,
            "payload_bytes": args.features * 4,
            "concurrency": levels,
            "warmup_s": args.warmup,
            "duration_s": args.duration,
            "repeats": args.repeats,
            "service_model": service_model,
            "service_source": source_state(args.service_dir or ROOT),
        },
        "raw_ort": raw,
        "summary": summary,
        "targets": targets,
        "rounds": [asdict(r) for r in results],
        "breakdown_us": steps,
        "profiles": [
            {
                **{k: v for k, v in asdict(p).items() if k not in ("own", "categories")},
                "own_top": dict(list(p.own.items())[:40]),
                "idle_share_of_main_samples": p.categories.get(IDLE, 0) / max(p.main_samples, 1),
                "categories_us_per_request": {
                    k: p.us_per_request(v) for k, v in p.categories.items() if k != IDLE
                },
            }
            for p in profiles
        ],
    }
    write_json(output, document)
    print_report(args, raw, summary, targets, levels)
    print_breakdown(steps)
    print_profiles(profiles, args.top)
    print(f"\nresults written to {output}")
    return 0 if all(t["pass"] for t in targets.values()) or not args.strict else 1


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--features", type=int, default=256, help="payload: FP32 [1, FEATURES] (default 256)")
    parser.add_argument(
        "--concurrency", type=lambda s: [int(v) for v in s.split(",")], default=[1, 4, 16],
        help="comma-separated concurrency levels (default 1,4,16)",
    )  # fmt: skip
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds of warm-up per measurement")
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds per server and level")
    parser.add_argument(
        "--repeats", type=int, default=3, help="rounds over all levels; the median is reported"
    )
    parser.add_argument("--raw-seconds", type=float, default=2.0, help="seconds of raw ORT runs")
    parser.add_argument(
        "--no-breakdown", dest="breakdown", action="store_false", help="skip in-process timings"
    )
    parser.add_argument("--breakdown-iterations", type=int, default=2000)
    parser.add_argument("--profile", action="store_true", help="py-spy both servers at concurrency 16")
    parser.add_argument("--profile-seconds", type=float, default=5.0)
    parser.add_argument("--profile-rate", type=int, default=500, help="py-spy samples per second")
    parser.add_argument(
        "--profile-blocking", action="store_true", help="let py-spy pause the server for each sample"
    )
    parser.add_argument("--top", type=int, default=15, help="functions listed per profile")
    parser.add_argument(
        "--service-dir",
        type=Path,
        default=None,
        help="run the service package from this checkout (e.g. `git archive` of another commit), "
        "to compare versions; default: this one",
    )
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON results file")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target fails")
    args = parser.parse_args(argv)
    if args.features < 1 or args.repeats < 1 or args.duration <= 0 or not args.concurrency:
        parser.error("--features and --repeats must be >= 1, --duration > 0, --concurrency non-empty")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)

    async def guarded() -> int:
        # SIGTERM cancels the run like Ctrl-C does, so the finally blocks stop the servers.
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        return await run(args)

    try:
        return asyncio.run(guarded())
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("interrupted; servers stopped", file=sys.stderr)
        return 130
    except (RequestFailed, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
