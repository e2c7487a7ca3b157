"""The batcher's own cost per request, without gRPC: closed-loop tasks calling Batcher.infer in
one process, as the data plane calls it (bench/batching.py's settings: max_batch_size 64, two
priority levels, bounded queues, one batch at a time on two cores).

The model is bench/batching.py's dense one (`--model dense`, a real ONNX Runtime session), or a
runner that only sleeps (`--model sleep`: no model instructions, so that the counted ones are the
batcher's: queue, futures, concatenation, splitting, statistics, metrics). Prints requests per
second, the event loop thread's CPU and the process's CPU per request, and rows per run. Under
callgrind (`--callgrind`, with `--model sleep`) only the measured window is counted, so that two
trees' instructions per request are a steady before/after pair on a shared machine:

    PYTHONPATH=TREE/proto/python valgrind --tool=callgrind --instr-atstart=no \\
        --callgrind-out-file=OUT .venv/bin/python -m bench.batching_hot --model sleep --callgrind
    callgrind_annotate OUT | grep TOTALS    # divided by --requests
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from bench.batching import BATCHING, DENSE_LAYERS, DENSE_WIDTH, EXECUTION, MAX_BATCH
from models.demo_models import dense_stack, write_model
from modelyard.service.batching.batcher import Batcher, BatchSettings
from modelyard.service.metrics import ServiceMetrics
from modelyard.service.repository.config import parse_config
from modelyard.service.runtime.instances import Instances
from modelyard.service.runtime.providers import ProviderChoice
from modelyard.service.runtime.served import VersionStats
from modelyard.service.runtime.session import Runnable, load_runner
from modelyard.service.scheduling.queue import Scheduling


class SleepRunner:
    """A model whose run takes `seconds` of wall time and no CPU (the GIL is let go meanwhile)."""

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds

    @property
    def runs_inline(self) -> bool:
        return False

    def run(
        self,
        feeds: Mapping[str, np.ndarray],
        output_names: Sequence[str],
        options: ort.RunOptions | None = None,
    ) -> list[np.ndarray]:
        time.sleep(self._seconds)
        return [feeds["INPUT0"] for _ in output_names]


def callgrind(switch: str) -> None:
    subprocess.run(["callgrind_control", "-i", switch, str(os.getpid())], check=True, capture_output=True)


async def measure(batcher: Batcher, stats: VersionStats, args: argparse.Namespace) -> None:
    x = np.random.default_rng(0).standard_normal((1, DENSE_WIDTH), dtype=np.float32)
    feeds, names, scheduling = {"INPUT0": x}, ("OUTPUT0",), Scheduling()
    left = args.requests

    async def client() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await batcher.infer(feeds, names, scheduling)

    for _ in range(100):  # warm-up
        await batcher.infer(feeds, names, scheduling)
    rows, runs = stats.inference_count, stats.execution_count
    gc.collect()
    if args.callgrind:
        gc.disable()
        callgrind("on")
    wall, loop, process = time.perf_counter(), time.thread_time(), time.process_time()
    await asyncio.gather(*(client() for _ in range(args.clients)))
    wall, loop, process = (
        time.perf_counter() - wall,
        time.thread_time() - loop,
        time.process_time() - process,
    )
    if args.callgrind:
        callgrind("off")
        gc.enable()
    n = args.requests
    per_run = (stats.inference_count - rows) / max(stats.execution_count - runs, 1)
    print(
        f"{args.model}: {n / wall:6.0f}/s  loop CPU {loop / n * 1e6:5.1f} us/req  process CPU "
        f"{process / n * 1e6:6.1f} us/req  {per_run:4.1f} rows/run"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=("dense", "sleep"), default="dense")
    parser.add_argument("--sleep-ms", type=float, default=2.0, help="--model sleep: a run's wall time")
    parser.add_argument("--wait-us", type=int, default=0, help="max_queue_delay_us (on: 0, on+wait: 5000)")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--callgrind", action="store_true", help="count the measured window only")
    args = parser.parse_args()
    config: dict[str, Any] = {"max_batch_size": MAX_BATCH, "execution": EXECUTION}
    config["dynamic_batching"] = BATCHING | {"max_queue_delay_us": args.wait_us}
    parsed = parse_config(config)
    runner: Runnable
    if args.model == "dense":
        root = Path(tempfile.mkdtemp(prefix="modelyard-batching-hot-"))
        path = write_model(root, "dense", 1, dense_stack(DENSE_LAYERS, DENSE_WIDTH, seed=0), config)
        runner = load_runner(path, parsed, ProviderChoice(False, "CPU only"))
    else:
        runner = SleepRunner(args.sleep_ms / 1e3)
    stats = VersionStats()
    with ThreadPoolExecutor(2) as executor:

        async def run() -> None:
            batcher = Batcher(
                Instances([runner]),
                BatchSettings.from_config(parsed, "CPUExecutionProvider", 2),
                executor,
                stats,
                ServiceMetrics().batching("dense", "1", 2),
                name="dense version 1",
            )
            await measure(batcher, stats, args)
            await batcher.close()

        asyncio.run(run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
