"""Hot reload under load: latency and throughput steady versus while versions are swapped, the
time from publishing a version to its first response, failed requests, and resident memory
after many swaps. All in one run, on the same machine.

    .venv/bin/python -m bench.swaps [--swaps 20] [--concurrency 8] [--phase-s 5] [--provider cpu|cuda]

With a GPU (NVML), the devices' used memory is read before the swaps, at its highest while they
run, and after the last retired version is released: a swap must give back what it took.

The service runs in a child process (`python -m modelyard.service`, watch mode, defaults) on a temporary
repository with one model, `m`, a dense classifier whose version N is built with seed N (so each
version computes something different and costs a real load). Clients keep `--concurrency`
requests in flight without a version pin. Phase 1 measures them steady; phase 2 publishes
`--swaps` versions the recommended way (write elsewhere, rename into the repository) at an even
pace over the same duration, deleting the version before the previous one each time. A response
is labelled with the version that computed it, so "publish -> first response by it" is measured
from the clients' side.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from bench.processes import ServerProcess, running_service
from models.demo_models import dense_classifier, serialize, write_model
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.service.gpu_memory import used_mib
from modelyard.tensors import to_tensor

FEATURES, HIDDEN, CLASSES = 512, 512, 16


@dataclass
class Phase:
    latencies_s: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    started: float = 0.0
    ended: float = 0.0

    def summary(self) -> dict[str, float]:
        ordered = sorted(self.latencies_s)
        return {
            "requests": len(ordered),
            "failed": len(self.failures),
            "p50_ms": statistics.median(ordered) * 1e3,
            "p99_ms": ordered[int(0.99 * (len(ordered) - 1))] * 1e3,
            "throughput": len(ordered) / (self.ended - self.started),
        }


@dataclass
class Clients:
    """Closed-loop clients; each response's version is noted when first seen."""

    stub: Any  # pb_grpc.InferenceServiceStub on an aio channel (its stub types are the sync ones)
    request: pb.InferRequest
    phase: Phase = field(default_factory=Phase)
    first_seen: dict[int, float] = field(default_factory=dict)
    stopping: bool = False
    last_version: int = 0  # set when the last version is published
    last_arrived: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        while not self.stopping:
            start = time.perf_counter()
            try:
                reply = await self.stub.Infer(self.request)
            except grpc.aio.AioRpcError as exc:
                self.phase.failures.append(f"{exc.code().name}: {exc.details()}")
                continue
            end = time.perf_counter()
            self.phase.latencies_s.append(end - start)
            version = int(reply.model_version)
            self.first_seen.setdefault(version, end)
            if version == self.last_version:
                self.last_arrived.set()


def publish(root: Path, staging: Path, version: int) -> None:
    folder = staging / str(version)
    folder.mkdir(parents=True)
    (folder / "model.onnx").write_bytes(serialize(dense_classifier(FEATURES, HIDDEN, CLASSES, seed=version)))
    os.rename(folder, root / "m" / str(version))


@dataclass
class DevicePeak:
    highest: float = 0.0

    async def sample(self) -> None:
        while True:
            self.highest = max(self.highest, used_mib() or 0.0)
            await asyncio.sleep(0.05)


def rss_mb(server: ServerProcess) -> float:
    for line in Path(f"/proc/{server.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def run(args: argparse.Namespace, tmp: Path) -> int:
    root, staging = tmp / "models", tmp / "staging"
    execution = {"execution": {"provider": args.provider}} if args.provider != "auto" else {}
    write_model(
        root, "m", 1, dense_classifier(FEATURES, HIDDEN, CLASSES, seed=1), {"max_batch_size": 8, **execution}
    )
    async with (
        running_service(root, tmp) as server,
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as chan,
    ):
        x = np.random.default_rng(0).standard_normal((1, FEATURES), dtype=np.float32)
        clients = Clients(
            pb_grpc.InferenceServiceStub(chan),
            pb.InferRequest(model_name="m", inputs=[to_tensor("INPUT0", x)]),
        )
        tasks = [asyncio.ensure_future(clients.run()) for _ in range(args.concurrency)]
        await asyncio.sleep(1.0)  # warm-up, not measured
        rss_start = rss_mb(server)
        device_start = used_mib()
        device_peak = DevicePeak()
        sampler = asyncio.ensure_future(device_peak.sample())

        steady = clients.phase = Phase(started=time.perf_counter())
        await asyncio.sleep(args.phase_s)
        steady.ended = time.perf_counter()

        swapping = clients.phase = Phase(started=time.perf_counter())
        published: dict[int, float] = {}
        clients.last_version = args.swaps + 1
        interval = args.phase_s / args.swaps
        for version in range(2, args.swaps + 2):
            publish(root, staging, version)
            published[version] = time.perf_counter()
            if (old := root / "m" / str(version - 2)).exists():
                shutil.rmtree(old)
            await asyncio.sleep(interval)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(clients.last_arrived.wait(), 10)
        swapping.ended = time.perf_counter()
        clients.stopping = True
        await asyncio.gather(*tasks)
        await asyncio.sleep(1.0)  # let the last retired version drain and be released
        rss_end = rss_mb(server)
        device_end = used_mib()
        sampler.cancel()

    delays = [clients.first_seen[v] - t for v, t in published.items() if v in clients.first_seen]
    skipped = [v for v in published if v not in clients.first_seen]
    a, b = steady.summary(), swapping.summary()
    print(
        f"hot reload under load: dense {FEATURES}x{HIDDEN}x{CLASSES} model, {args.concurrency} clients, "
        f"{args.swaps} swaps in {args.phase_s:.0f} s, {os.cpu_count()} cores"
    )
    print(f"{'phase':<10}{'requests':>10}{'failed':>8}{'p50 ms':>9}{'p99 ms':>9}{'req/s':>9}")
    for name, s in (("steady", a), ("swapping", b)):
        print(
            f"{name:<10}{s['requests']:>10.0f}{s['failed']:>8.0f}{s['p50_ms']:>9.2f}{s['p99_ms']:>9.2f}"
            f"{s['throughput']:>9.0f}"
        )
    print(
        f"swapping / steady: p50 {b['p50_ms'] / a['p50_ms']:.2f}x, p99 {b['p99_ms'] / a['p99_ms']:.2f}x, "
        f"throughput {b['throughput'] / a['throughput']:.2f}x"
    )
    if delays:
        print(
            f"publish -> first response by the new version: median {statistics.median(delays) * 1e3:.0f} ms, "
            f"max {max(delays) * 1e3:.0f} ms ({len(delays)} of {len(published)} versions answered"
            f"{'; superseded before answering: ' + str(skipped) if skipped else ''})"
        )
    print(f"service RSS: {rss_start:.1f} MB before the swaps, {rss_end:.1f} MB after {args.swaps} swaps")
    if device_start is not None and device_end is not None:
        print(
            f"device memory used: {device_start:.0f} MB before the swaps,"
            f" {device_peak.highest:.0f} MB at most while they ran,"
            f" {device_end:.0f} MB after the last retired version was released"
        )
    failures = steady.failures + swapping.failures
    for failure in sorted(set(failures))[:5]:
        print("  failure:", failure)
    print(f"failed requests: {len(failures)} (goal: 0)")
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--swaps", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--phase-s", type=float, default=10.0, help="duration of each phase")
    parser.add_argument(
        "--provider", choices=("auto", "cpu", "cuda"), default="auto", help="execution.provider"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        return asyncio.run(run(args, Path(tmp)))


if __name__ == "__main__":
    raise SystemExit(main())
