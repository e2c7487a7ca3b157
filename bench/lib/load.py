"""Load generation: N coroutines sending requests back to back, latencies measured in a window
after a warm-up, with the server's, this client's and the rest of the machine's CPU over it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
import numpy as np

from bench.processes import CLK_TCK, ServerProcess
from modelyard.inference.v1 import inference_service_pb2 as pb

NOISY_OTHER_CPU = 0.15  # other processes using more of a core than this disturb the measurement

Infer = Callable[[pb.InferRequest], Awaitable[pb.InferResponse]]


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (all cores), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    guest = sum(fields[8:10]) if len(fields) > 9 else 0  # already counted in user and nice
    return (sum(fields) - idle - guest) / CLK_TCK


@dataclass
class LevelResult:
    server: str
    concurrency: int
    round: int
    requests: int
    window_s: float
    throughput: float  # requests completed per second in the measurement window
    p50_us: float
    p90_us: float
    p99_us: float
    mean_us: float
    server_cpu_util: float  # server process CPU seconds per wall second (2.0 = both cores)
    server_cpu_us_per_req: float
    client_cpu_util: float
    other_cpu_util: float  # the rest of the machine: other processes competing for the cores


class RequestFailed(Exception):
    """A measured request failed: the numbers would be meaningless, so the run stops."""


async def drive(
    infer: Infer, request: pb.InferRequest, concurrency: int, warmup_s: float, duration_s: float
) -> tuple[np.ndarray, float]:
    """`concurrency` coroutines send requests back to back. Requests that complete within
    [warm-up end, warm-up end + duration) are measured. Returns (latencies ns, window s).
    The first failed request ends the run (RequestFailed)."""
    start = time.perf_counter_ns()
    window_start = start + int(warmup_s * 1e9)
    window_end = window_start + int(duration_s * 1e9)
    latencies: list[int] = []

    async def worker() -> None:
        record = latencies.append
        while True:
            t0 = time.perf_counter_ns()
            try:
                await infer(request)
            except grpc.aio.AioRpcError as exc:
                raise RequestFailed(f"{exc.code().name}: {exc.details()}") from None
            t1 = time.perf_counter_ns()
            if t1 >= window_end:
                return
            if t1 >= window_start:
                record(t1 - t0)

    workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
    try:
        await asyncio.gather(*workers)
    finally:
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    return np.asarray(latencies, dtype=np.int64), (window_end - window_start) / 1e9


async def measure(
    server: ServerProcess,
    infer: Infer,
    request: pb.InferRequest,
    concurrency: int,
    round_: int,
    warmup_s: float,
    duration_s: float,
) -> LevelResult:
    cpu: dict[str, tuple[float, float, float, float]] = {}

    async def sample_cpu() -> None:  # server, client and machine CPU at the window's edges
        await asyncio.sleep(warmup_s)
        cpu["start"] = (time.perf_counter(), server.cpu_seconds(), time.process_time(), machine_busy_s())
        await asyncio.sleep(duration_s)
        cpu["end"] = (time.perf_counter(), server.cpu_seconds(), time.process_time(), machine_busy_s())

    sampler = asyncio.create_task(sample_cpu())
    try:
        latencies, window_s = await drive(infer, request, concurrency, warmup_s, duration_s)
    except RequestFailed as exc:
        sampler.cancel()
        log = f"\n{server.name} log (last lines):\n{server.log_tail()}" if server.name == "service" else ""
        raise RequestFailed(f"{server.name} failed a request at c={concurrency}: {exc}{log}") from None
    await sampler
    wall = cpu["end"][0] - cpu["start"][0]
    server_util = (cpu["end"][1] - cpu["start"][1]) / wall
    client_util = (cpu["end"][2] - cpu["start"][2]) / wall
    other_util = max((cpu["end"][3] - cpu["start"][3]) / wall - server_util - client_util, 0.0)
    if latencies.size == 0:
        raise RuntimeError(f"{server.name}: no request completed at c={concurrency}")
    p50, p90, p99 = np.percentile(latencies, [50, 90, 99]) / 1e3
    throughput = latencies.size / window_s
    return LevelResult(
        server=server.name,
        concurrency=concurrency,
        round=round_,
        requests=int(latencies.size),
        window_s=window_s,
        throughput=throughput,
        p50_us=float(p50),
        p90_us=float(p90),
        p99_us=float(p99),
        mean_us=float(latencies.mean() / 1e3),
        server_cpu_util=server_util,
        server_cpu_us_per_req=server_util / throughput * 1e6,
        client_cpu_util=client_util,
        other_cpu_util=other_util,
    )
