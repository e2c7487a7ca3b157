"""Throughput with 1, 2, ... worker processes (`--workers N`), and the service's CPU time per
1,000 requests (every process of the service: supervisor and workers).

For each worker count the service serves the tiny model (``scaled_identity``: one Mul, so that the
serving path is what is measured) and client processes drive unary Infer at each concurrency, each
over several TCP connections (so that the kernel spreads them over the workers). The load comes
from --clients processes, because one Python client saturates before two workers do.

    .venv/bin/python -m bench.workers [--workers 1,2] [--concurrency 16,64] [--duration 5] [--clients 2]

On a machine with more cores, `--workers 1,2,4,8 --clients 4` shows the scaling with the same
command. Results go to bench/results/workers.json. Every process started here is stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from bench.lib.procfs import tree_cpu_seconds
from bench.processes import ROOT, running_service
from models.demo_models import scaled_identity, write_model
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.tensors import to_tensor

DEFAULT_OUTPUT = ROOT / "bench" / "results" / "workers.json"


# -- a client process ------------------------------------------------------------------------


async def client(
    address: str, concurrency: int, connections: int, warmup_s: float, duration_s: float
) -> None:
    request = pb.InferRequest(model_name="tiny", inputs=[to_tensor("INPUT0", np.ones((1, 16), np.float32))])
    options = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(address, options=options) for _ in range(connections)]
    start = time.perf_counter()
    window = (start + warmup_s, start + warmup_s + duration_s)
    latencies: list[float] = []

    async def loop(channel: grpc.aio.Channel) -> None:
        infer = pb_grpc.InferenceServiceStub(channel).Infer
        while True:
            t0 = time.perf_counter()
            await infer(request)
            t1 = time.perf_counter()
            if t1 >= window[1]:
                return
            if t1 >= window[0]:
                latencies.append(t1 - t0)

    await asyncio.gather(*(loop(channels[i % connections]) for i in range(concurrency)))
    await asyncio.gather(*(c.close(None) for c in channels))
    print(json.dumps({"requests": len(latencies), "latencies_us": [round(x * 1e6, 1) for x in latencies]}))


# -- the run ---------------------------------------------------------------------------------


async def level(address: str, server_pid: int, concurrency: int, args: argparse.Namespace) -> dict[str, Any]:
    per_client = [concurrency // args.clients + (i < concurrency % args.clients) for i in range(args.clients)]
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bench.workers",
            "--client",
            address,
            "--client-concurrency",
            str(c),
            "--warmup",
            str(args.warmup),
            "--duration",
            str(args.duration),
            stdout=subprocess.PIPE,
            cwd=ROOT,
        )
        for c in per_client
        if c
    ]
    await asyncio.sleep(args.warmup + 0.5)  # the clients' own start-up (imports) comes first
    cpu0, t0 = tree_cpu_seconds(server_pid), time.perf_counter()
    outputs = [await p.communicate() for p in procs]
    cpu1, t1 = tree_cpu_seconds(server_pid), time.perf_counter()
    results = [json.loads(out) for out, _ in outputs]
    requests = sum(r["requests"] for r in results)
    latencies = np.asarray([x for r in results for x in r["latencies_us"]])
    throughput = requests / args.duration
    cpu_s = (cpu1 - cpu0) / (t1 - t0) * args.duration  # the CPU of the measured window, prorated
    return {
        "concurrency": concurrency,
        "throughput": round(throughput, 1),
        "p50_us": round(float(np.percentile(latencies, 50)), 1),
        "p99_us": round(float(np.percentile(latencies, 99)), 1),
        "server_cpu_s_per_1000": round(cpu_s / requests * 1000, 4),
        "server_cores_busy": round((cpu1 - cpu0) / (t1 - t0), 2),
    }


async def run(args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-workers-") as tmp:
        repository = Path(tmp) / "models"
        write_model(repository, "tiny", 1, scaled_identity(16, 2.0), {"max_batch_size": 0})
        for workers in args.workers:
            async with running_service(repository, Path(tmp), "--workers", str(workers)) as server:
                address = f"127.0.0.1:{server.port}"
                for concurrency in args.concurrency:
                    row = {"workers": workers, **await level(address, server.pid, concurrency, args)}
                    print(
                        f"workers {workers}  c={concurrency:<3}  {row['throughput']:>8.0f} req/s  "
                        f"p50 {row['p50_us']:>7.0f} us  p99 {row['p99_us']:>7.0f} us  "
                        f"server CPU {row['server_cpu_s_per_1000']:.3f} s/1000 req  "
                        f"({row['server_cores_busy']:.2f} cores busy)",
                        flush=True,
                    )
                    rows.append(row)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    document = {"cpus": os.cpu_count(), "clients": args.clients, "duration_s": args.duration, "rows": rows}
    args.output.write_text(json.dumps(document, indent=2))
    return 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    def ints(text: str) -> list[int]:
        return [int(part) for part in text.split(",") if part]

    parser = argparse.ArgumentParser(prog="bench.workers", description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=ints, default=[1, 2], help="worker counts (default 1,2)")
    parser.add_argument("--concurrency", type=ints, default=[16, 64], help="levels (default 16,64)")
    parser.add_argument("--clients", type=int, default=2, help="client processes (default 2)")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds per level")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--client", help=argparse.SUPPRESS)  # internal: run as a client process
    parser.add_argument("--client-concurrency", type=int, default=0, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.client:
        connections = max(1, min(args.client_concurrency, 8))
        asyncio.run(client(args.client, args.client_concurrency, connections, args.warmup, args.duration))
        return 0
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
