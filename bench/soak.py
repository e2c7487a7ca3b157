"""Soak: mixed traffic at a steady load for a bounded time, the service's memory and tail latency
watched over it. Unary Infer, Generate streams read to the end, Generate streams cancelled after
their first token, undecodable and oversized requests, and version swaps, all at once.

    .venv/bin/python -m bench.soak [--duration-s 120] [--concurrency 6] [--swap-every-s 10]

The service runs in a child process (`python -m modelyard.service`, watch mode) on a temporary repository
with `m` (a dense classifier, batched, swapped every --swap-every-s seconds) and `lm` (the committed
demo language model). RSS is sampled every second. Reported: RSS growth per 10,000 requests (the
slope of RSS against requests answered, over the second half of the run, after warm-up), RSS
growth per swap (RSS just before each swap, fitted against the swap count), and p50/p99 of the
unary calls per window of the run.
"""

from __future__ import annotations

import argparse
import asyncio
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

from bench.processes import running_service
from bench.swaps import CLASSES, FEATURES, HIDDEN, publish, rss_mb
from models.demo_models import COMMITTED_ROOT, dense_classifier, write_model
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.inference.v1 import tensor_pb2
from modelyard.tensors import to_tensor

PROMPTS = ["def add(a, b):", "import os\n", "class Point:", "for i in range(10):"]
GARBAGE = b"\x0a\xff\xff\xff\xff\x0f\x01"


@dataclass
class Load:
    started: float = field(default_factory=time.perf_counter)
    answered: int = 0  # every request that got its answer, of any kind
    unary: list[tuple[float, float]] = field(default_factory=list)  # (time, latency)
    errors: dict[str, int] = field(default_factory=dict)
    stopping: bool = False

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1


async def unary(stub: Any, load: Load, request: pb.InferRequest) -> None:
    while not load.stopping:
        start = time.perf_counter()
        try:
            await stub.Infer(request)
            load.unary.append((start - load.started, time.perf_counter() - start))
        except grpc.aio.AioRpcError as exc:
            load.error(f"Infer {exc.code().name}")
        load.answered += 1


async def streams(stub: Any, load: Load, rng: np.random.Generator) -> None:
    while not load.stopping:
        prompt = PROMPTS[int(rng.integers(len(PROMPTS)))]
        cancel = rng.random() < 0.3
        call = stub.Generate(pb.GenerateRequest(model_name="lm", prompt=prompt, max_tokens=24))
        try:
            async for _ in call:
                if cancel:
                    call.cancel()
                    break
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                load.error(f"Generate {exc.code().name}")
        load.answered += 1


async def bad(chan: grpc.aio.Channel, stub: Any, load: Load) -> None:
    """Requests the service must refuse: undecodable bytes and a shape that overflows."""
    garbage = chan.unary_unary("/modelyard.inference.v1.InferenceService/Infer", None, None)
    huge = tensor_pb2.Tensor(name="INPUT0", datatype=tensor_pb2.DATA_TYPE_FP32, shape=[2**62, 0])
    overflowing = pb.InferRequest(model_name="m", inputs=[huge])
    while not load.stopping:
        for call in (lambda: garbage(GARBAGE), lambda: stub.Infer(overflowing)):
            try:
                await call()
                load.error("bad request answered OK")
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.INVALID_ARGUMENT:
                    load.error(f"bad request {exc.code().name}")
            load.answered += 1
        await asyncio.sleep(0.05)


def slope(xs: list[float], ys: list[float]) -> float:
    if len(xs) < 2 or max(xs) == min(xs):
        return float("nan")
    return float(np.polyfit(xs, ys, 1)[0])


async def run(args: argparse.Namespace, tmp: Path) -> int:
    root, staging = tmp / "models", tmp / "staging"
    write_model(root, "m", 1, dense_classifier(FEATURES, HIDDEN, CLASSES, seed=1), {"max_batch_size": 8})
    shutil.copytree(COMMITTED_ROOT / "codelm" / "1", root / "lm" / "1")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, FEATURES), dtype=np.float32)
    request = pb.InferRequest(model_name="m", inputs=[to_tensor("INPUT0", x)])
    samples: list[tuple[float, int, float]] = []  # (time, answered, rss)
    before_swap: list[float] = []
    async with (
        running_service(root, tmp) as server,
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as chan,
    ):
        stub: Any = pb_grpc.InferenceServiceStub(chan)
        load = Load()
        tasks = [asyncio.ensure_future(unary(stub, load, request)) for _ in range(args.concurrency)]
        readers = max(1, args.concurrency // 3)
        tasks += [asyncio.ensure_future(streams(stub, load, rng)) for _ in range(readers)]
        tasks.append(asyncio.ensure_future(bad(chan, stub, load)))
        version, next_swap = 1, args.swap_every_s
        end = load.started + args.duration_s
        while (now := time.perf_counter()) < end:
            samples.append((now - load.started, load.answered, rss_mb(server)))
            if now - load.started >= next_swap:
                before_swap.append(rss_mb(server))
                version += 1
                publish(root, staging, version)
                if (old := root / "m" / str(version - 2)).exists():
                    shutil.rmtree(old)
                next_swap += args.swap_every_s
            await asyncio.sleep(1.0)
        load.stopping = True
        await asyncio.gather(*tasks)
        rss_end = rss_mb(server)

    half = [s for s in samples if s[0] >= args.duration_s / 2]
    per_10k = slope([s[1] for s in half], [s[2] for s in half]) * 10_000
    per_swap = slope(list(range(len(before_swap))), before_swap)
    print(
        f"soak: {args.duration_s:.0f} s, {args.concurrency} unary clients + {max(1, args.concurrency // 3)} "
        f"Generate clients (30% cancelled) + bad requests, a swap every {args.swap_every_s:.0f} s, "
        f"{os.cpu_count()} cores"
    )
    print(
        f"requests answered: {load.answered} ({load.answered / args.duration_s:.0f}/s); "
        f"swaps: {version - 1}; RSS {samples[0][2]:.0f} MB at start, {rss_end:.0f} MB at the end"
    )
    print(f"RSS growth per 10k requests (second half): {per_10k:+.2f} MB")
    print(f"RSS growth per swap (before each swap): {per_swap:+.2f} MB over {len(before_swap)} swaps")
    window = args.duration_s / 6
    print(f"{'window s':<12}{'unary calls':>12}{'p50 ms':>9}{'p99 ms':>9}")
    for i in range(6):
        lat = sorted(d for t, d in load.unary if i * window <= t < (i + 1) * window)
        if lat:
            p50, p99 = statistics.median(lat) * 1e3, lat[int(0.99 * (len(lat) - 1))] * 1e3
            print(f"{i * window:>4.0f}-{(i + 1) * window:<7.0f}{len(lat):>12}{p50:>9.2f}{p99:>9.2f}")
    for what, count in sorted(load.errors.items()):
        print(f"  error: {what} x{count}")
    print(f"errors: {sum(load.errors.values())} (goal: 0)")
    return 1 if load.errors else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=120.0)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--swap-every-s", type=float, default=10.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        return asyncio.run(run(args, Path(tmp)))


if __name__ == "__main__":
    raise SystemExit(main())
