"""The request path against the floor: the service next to the thinnest Python server that runs
the same model (bench/bare_server.py: grpc.aio, session.run inline), in one run.

Two models: tiny (one Mul on FP32[1,16]: the serving path is all there is) and an MLP
256-1024-1024-16 (~0.1 ms per run: as long as the serving path). Two APIs: KServe V2 ModelInfer
and our v1 Infer. Both servers run with one intra-op thread and, on a machine with 2 or more cores,
pinned to core 1 (taskset) while this client is pinned to core 0. The service runs with metrics
and statistics on. For each (model, API, concurrency) the two servers take back-to-back windows,
which goes first alternating round by round; ratios are medians of the paired (same round)
ratios, printed with their range over rounds: p50 at concurrency 1, throughput and CPU per
request at concurrency 16 (service/bare).

`--peers kserve,mlserver` adds the established Python servers (KServe's Python model server,
MLServer; bench/peer_servers.py, each in its own virtual environment built by `make bench-peers`)
to the same rounds (taking turns before and after the bare/service pair), through the KServe V2
API only, with the same pinning, and prints the service/peer ratios: p50 and p99 at concurrency
1, throughput at 16 (and 64 when measured), server CPU per request at 16.

    .venv/bin/python -m bench.floor [--models tiny,mlp] [--apis kserve,v1] [--duration 4] [--repeats 3]
        [--no-pin] [--profile] [--service-arg=--workers=1 ...] [--peers kserve,mlserver]
        [--concurrency 1,16,64] [--instances 2]

`--instances N` gives the service's models N sessions each (execution.instances; the bare server
keeps one): with `--no-pin`, the gain of model instances on this machine's cores.

`--profile` samples both servers with py-spy at concurrency 16 on the MLP (each API) and prints
where their CPU goes, category by category, side by side (bench/lib/profile.py parses py-spy).
Results: bench/results/floor.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from bench.lib.load import RequestFailed, drive
from bench.lib.profile import Profile, profile_server
from bench.lib.report import print_profiles
from bench.peer_servers import PEERS, peer_process, wait_models_ready
from bench.processes import ROOT, SERVICE_READY, ServerProcess, service_command
from models.demo_models import mlp, scaled_identity, write_model
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.inference.v1 import tensor_pb2
from modelyard.kserve.v2 import grpc_service_pb2 as kpb
from modelyard.kserve.v2 import grpc_service_pb2_grpc as kgrpc

DEFAULT_OUTPUT = ROOT / "bench" / "results" / "floor.json"
MODELS = {"tiny": (lambda: scaled_identity(16, 2.0), 16), "mlp": (lambda: mlp((256, 1024, 1024, 16)), 256)}
EXECUTION = {"intra_op_threads": 1, "inter_op_threads": 1}
CONFIG = {"max_batch_size": 8, "execution": EXECUTION}
SERVER_CORE, CLIENT_CORE = 1, 0
Call = Callable[[Any], Awaitable[Any]]


def turn_order(servers: Sequence[ServerProcess], turn: int) -> list[ServerProcess]:
    """The servers in the order they take a point: the bare server and the service back to back
    (the service/bare ratios are paired: the machine drifts between windows further apart), the
    pair's own order alternating, and the peers taking turns around the pair."""
    pair, peers = list(servers[:2]), list(servers[2:])
    if turn % 2:
        pair.reverse()
    units: list[list[ServerProcess]] = [pair, *([peer] for peer in peers)]
    shift = turn % len(units)
    return [server for unit in units[shift:] + units[:shift] for server in unit]


def request_for(api: str, model: str, features: int) -> Any:
    x = np.random.default_rng(0).standard_normal((1, features), dtype=np.float32)
    if api == "kserve":
        request = kpb.ModelInferRequest(model_name=model)
        request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, features])
        request.raw_input_contents.append(x.tobytes())
        return request
    tensor = tensor_pb2.Tensor(
        name="INPUT0", datatype=tensor_pb2.DATA_TYPE_FP32, shape=[1, features], raw_data=x.tobytes()
    )
    return pb.InferRequest(model_name=model, inputs=[tensor])


def open_calls(
    servers: Sequence[ServerProcess], channels: list[grpc.aio.Channel]
) -> dict[tuple[str, str], Call]:
    """(server name, API) -> its call, on one channel per server (added to `channels`, for the
    caller to close)."""
    calls: dict[tuple[str, str], Call] = {}
    for server in servers:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        channels.append(channel)
        calls[(server.name, "kserve")] = kgrpc.GRPCInferenceServiceStub(channel).ModelInfer
        calls[(server.name, "v1")] = pb_grpc.InferenceServiceStub(channel).Infer
    return calls


async def send_all(call: Any, request: Any, count: int, concurrency: int, call_timeout_s: float) -> None:
    """`count` calls (rounded down to a multiple of `concurrency`) from `concurrency` closed-loop
    clients: the counted load of bench.instructions and bench.footprint."""

    async def client() -> None:
        for _ in range(count // concurrency):
            await call(request, timeout=call_timeout_s)

    await asyncio.gather(*(client() for _ in range(concurrency)))


async def measure(
    server: ServerProcess, call: Call, request: Any, concurrency: int, args: argparse.Namespace
) -> dict[str, float]:
    cpu: list[float] = []

    async def sample() -> None:  # the server's CPU seconds at the measured window's edges
        await asyncio.sleep(args.warmup)
        cpu.append(server.cpu_seconds())
        await asyncio.sleep(args.duration)
        cpu.append(server.cpu_seconds())

    sampler = asyncio.create_task(sample())
    latencies, window = await drive(call, request, concurrency, args.warmup, args.duration)
    await sampler
    return {
        "throughput": latencies.size / window,
        "p50_us": float(np.percentile(latencies, 50) / 1e3),
        "p99_us": float(np.percentile(latencies, 99) / 1e3),
        # Less disturbed by other load on the machine than latency and throughput are.
        "server_cpu_us_per_request": (cpu[1] - cpu[0]) / latencies.size * 1e6,
    }


async def run(args: argparse.Namespace) -> int:
    pin = args.pin and (os.cpu_count() or 1) >= 2
    prefix = ["taskset", "-c", str(SERVER_CORE)] if pin else []
    if pin:
        os.sched_setaffinity(0, {CLIENT_CORE})
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-floor-") as tmp:
        workdir = Path(tmp)
        repository = workdir / "models"
        execution = {**EXECUTION, "instances": args.instances}
        for name in args.models:
            write_model(repository, name, 1, MODELS[name][0](), {**CONFIG, "execution": execution})
        bare = ServerProcess(
            "bare",
            [*prefix, sys.executable, str(ROOT / "bench" / "bare_server.py"), str(repository)],
            workdir,
            re.compile(r"^(\d+)$", re.M),
        )
        service = ServerProcess(
            "service",
            [
                *service_command(repository, prefix),
                *("--metrics-listen", "127.0.0.1:0", "--grace-s", "1", *args.service_arg),
            ],
            workdir,
            SERVICE_READY,
        )
        peers = [peer_process(peer, repository, workdir, prefix) for peer in args.peers]
        servers = [bare, service, *peers]
        channels: list[grpc.aio.Channel] = []
        try:
            for server in servers:
                server.spawn()
            await asyncio.gather(*(server.wait_ready() for server in servers))
            await asyncio.gather(*(wait_models_ready(peer, args.models) for peer in peers))
            calls = open_calls(servers, channels)
            for round_ in range(args.repeats):
                for model in args.models:
                    for api in args.apis:
                        request = request_for(api, model, MODELS[model][1])
                        # The peers serve the KServe V2 API only.
                        taking_part = servers if api == "kserve" else [bare, service]
                        for index, c in enumerate(args.concurrency):
                            for server in turn_order(taking_part, round_ + index):
                                result = await measure(server, calls[(server.name, api)], request, c, args)
                                row = {"round": round_, "model": model, "api": api, "concurrency": c}
                                rows.append({**row, "server": server.name, **result})
                                print(
                                    f"round {round_ + 1} {model:<4} {api:<6} c={c:<2} {server.name:<8} "
                                    f"p50 {result['p50_us']:7.1f} us  p99 {result['p99_us']:7.1f} us  "
                                    f"{result['throughput']:7.0f} req/s  "
                                    f"CPU {result['server_cpu_us_per_request']:6.1f} us/req",
                                    file=sys.stderr,
                                )
            profiles: dict[str, list[Profile]] = {}
            profiled = "mlp" if "mlp" in args.models else args.models[0]
            for api in args.apis if args.profile else ():
                request = request_for(api, profiled, MODELS[profiled][1])
                for server in (bare, service):
                    profile = await profile_server(
                        server,
                        calls[(server.name, api)],
                        request,
                        16,
                        args.warmup,
                        args.duration,
                        500,
                        workdir / f"profile_{server.name}_{api}.raw",
                        blocking=False,
                    )
                    if profile is not None:
                        profiles.setdefault(api, []).append(profile)
        except RequestFailed as exc:
            print(f"a request failed: {exc}", file=sys.stderr)
            for server in servers:
                print(f"-- {server.name}\n{server.log_tail()}", file=sys.stderr)
            return 1
        finally:
            for channel in channels:
                await channel.close(None)
            for server in reversed(servers):
                server.stop()
    summary = summarize(rows, args)
    print(f"\nserver pinned to core {SERVER_CORE}, client to core {CLIENT_CORE}" if pin else "\nnot pinned")
    print(
        f"{'model':<5} {'api':<7} {'p50 c=1 service/bare':>22} {'throughput c=16 service/bare':>30} "
        f"{'CPU/request c=16 service/bare':>31}   (median [range] of the rounds' paired ratios)"
    )
    for key, value in summary.items():
        model, api = key.split("/")
        cells = [ranged(value, name) for name in ("p50_c1", "tput_c16", "cpu_per_request_c16")]
        print(f"{model:<5} {api:<7} {cells[0]:>22} {cells[1]:>30} {cells[2]:>31}")
    peer_summary = summarize_peers(rows, args)
    print_peers(peer_summary, rows, args)
    for api, api_profiles in profiles.items():
        print(f"\n== profiles through {api}, {profiled}, concurrency 16")
        print_profiles(api_profiles, 15, reference="bare")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    document = {"pinned": pin, "summary": summary, "rows": rows}
    if args.peers:
        document["peers"] = peer_summary
    args.output.write_text(json.dumps(document, indent=2))
    return 0


def summarize(rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Median over rounds of the paired service/bare ratios."""
    by: dict[tuple[Any, ...], dict[str, float]] = {}
    for row in rows:
        key = (row["model"], row["api"], row["concurrency"], row["round"])
        by.setdefault(key, {})[row["server"]] = (
            row["p50_us"] if row["concurrency"] == 1 else row["throughput"]
        )
        cpu_key = (row["model"], row["api"], -row["concurrency"], row["round"])
        by.setdefault(cpu_key, {})[row["server"]] = row["server_cpu_us_per_request"]
    summary: dict[str, dict[str, float]] = {}
    for model in args.models:
        for api in args.apis:
            entry: dict[str, float] = {}
            for c, name in ((1, "p50_c1"), (16, "tput_c16"), (-16, "cpu_per_request_c16")):
                ratios = [
                    v["service"] / v["bare"]
                    for (m, a, cc, _), v in by.items()
                    if (m, a, cc) == (model, api, c) and "service" in v and "bare" in v
                ]
                if ratios:
                    entry[name] = round(statistics.median(ratios), 3)
                    entry[f"{name}_min"], entry[f"{name}_max"] = round(min(ratios), 3), round(max(ratios), 3)
            summary[f"{model}/{api}"] = entry
    return summary


def ranged(entry: dict[str, float], name: str) -> str:
    """A median ratio with its range over rounds: "1.07 [1.02-1.12]"."""
    if name not in entry:
        return "-"
    return f"{entry[name]:.2f} [{entry[f'{name}_min']:.2f}-{entry[f'{name}_max']:.2f}]"


def paired_ratio(
    rows: list[dict[str, Any]], model: str, concurrency: int, metric: str, server: str, reference: str
) -> float | None:
    """Median over rounds of server/reference for one metric (KServe API: all servers take it)."""
    by_round: dict[int, dict[str, float]] = {}
    for row in rows:
        if (row["model"], row["api"], row["concurrency"]) == (model, "kserve", concurrency):
            by_round.setdefault(row["round"], {})[row["server"]] = row[metric]
    ratios = [v[server] / v[reference] for v in by_round.values() if server in v and reference in v]
    return round(statistics.median(ratios), 3) if ratios else None


PEER_RATIOS = (  # name in the summary, concurrency, metric
    ("p50_c1", 1, "p50_us"),
    ("p99_c1", 1, "p99_us"),
    ("tput_c16", 16, "throughput"),
    ("tput_c64", 64, "throughput"),
    ("cpu_per_request_c16", 16, "server_cpu_us_per_request"),
)


def summarize_peers(rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Median over rounds of the paired service/peer ratios, through the KServe V2 API."""
    summary: dict[str, dict[str, float]] = {}
    for peer in args.peers:
        for model in args.models:
            entry: dict[str, float] = {}
            for name, c, metric in PEER_RATIOS:
                ratio = paired_ratio(rows, model, c, metric, "service", peer)
                if ratio is not None:
                    entry[name] = ratio
            summary[f"{model}/{peer}"] = entry
    return summary


def print_peers(
    summary: dict[str, dict[str, float]], rows: list[dict[str, Any]], args: argparse.Namespace
) -> None:
    if not args.peers:
        return
    print("\nKServe V2 ModelInfer, medians over rounds")
    columns = ("p50 c=1 us", "p99 c=1 us", "req/s c=16", "req/s c=64")
    print(f"{'model':<5} {'server':<9} " + " ".join(f"{name:>11}" for name in columns))
    for model in args.models:
        for server in ("bare", "service", *args.peers):
            cells = []
            for c, metric in ((1, "p50_us"), (1, "p99_us"), (16, "throughput"), (64, "throughput")):
                values = [
                    row[metric]
                    for row in rows
                    if (row["model"], row["api"], row["concurrency"], row["server"])
                    == (model, "kserve", c, server)
                ]
                cells.append(f"{statistics.median(values):>11.0f}" if values else f"{'-':>11}")
            print(f"{model:<5} {server:<9} {' '.join(cells)}")
    print("\nservice/peer (latency and CPU: below 1 is better; throughput: above 1 is better)")
    print(f"{'model':<5} {'peer':<9} " + " ".join(f"{name:>19}" for name, _, _ in PEER_RATIOS))
    for key, value in summary.items():
        model, peer = key.split("/")
        ratios = " ".join(
            f"{value[name]:>19.2f}" if name in value else f"{'-':>19}" for name, _, _ in PEER_RATIOS
        )
        print(f"{model:<5} {peer:<9} {ratios}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    def names(text: str) -> list[str]:
        return [part for part in text.split(",") if part]

    parser = argparse.ArgumentParser(prog="bench.floor", description=__doc__.split("\n")[0])
    parser.add_argument("--models", type=names, default=["tiny", "mlp"])
    parser.add_argument("--apis", type=names, default=["kserve", "v1"])
    parser.add_argument("--concurrency", type=lambda t: [int(v) for v in names(t)], default=[1, 16])
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--duration", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin server and client")
    parser.add_argument("--profile", action="store_true", help="py-spy both servers on the MLP at c=16")
    parser.add_argument("--service-arg", action="append", default=[], help="an extra flag for the service")
    parser.add_argument(
        "--peers",
        type=names,
        default=[],
        help=f"established servers to measure too, KServe API only ({','.join(PEERS)}; make bench-peers)",
    )
    parser.add_argument("--instances", type=int, default=1, help="sessions per model in the service")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    unknown = sorted(set(args.peers) - set(PEERS))
    if unknown:
        parser.error(f"unknown peers {', '.join(unknown)} (known: {', '.join(PEERS)})")
    if args.peers and "kserve" not in args.apis:
        parser.error("the peers are measured through the KServe V2 API: keep kserve in --apis")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    return asyncio.run(run(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
