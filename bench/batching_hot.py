"""The batcher's own cost per request, without gRPC: closed-loop tasks calling Batcher.infer in
one process, as the data plane calls it (bench/batching.py's settings: max_batch_size 64, two
priority levels, bounded queues, one batch at a time on two cores).

The model is bench/batching.py's dense one (`--model dense`, a real ONNX Runtime session), or a
runner that only sleeps (`--model sleep`: no model instructions, so that the counted ones are the
batcher's: queue, futures, concatenation, splitting, statistics, metrics). Prints requests per
second, the event loop thread's CPU and the process's CPU per request, and rows per run. Under
callgrind (`--callgrind`, with `--model sleep`) only the measured window is counted, so that two
trees' instructions per request are a steady before/after pair on a shared machine:

    PYTHONPATH=$(.venv/bin/python -m bench.lib.trees --pythonpath TREE) \\
        valgrind --tool=callgrind --instr-atstart=no \\
        --callgrind-out-file=OUT .venv/bin/python -m bench.batching_hot --model sleep --callgrind
    callgrind_annotate OUT | grep TOTALS    # divided by --requests

For scheduling questions, `--work-us BEFORE,AFTER` has each client spend that much of the loop's
CPU before each call and after its answer (each a turn of its own), a stand-in for the service's
gRPC and request path, so that batches are what the loop admits during one run, as in the
service; with `--model sleep --sleep-row-us US` a run's time grows with its rows, and the share of
one-row runs is printed. E.g. `--model sleep --sleep-ms 2 --sleep-row-us 100 --work-us 200,100`.
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
from modelyard.service.repository.model_config import parse_config
from modelyard.service.runtime.instances import Instances
from modelyard.service.runtime.providers import ProviderChoice
from modelyard.service.runtime.served import VersionStats
from modelyard.service.runtime.session import Runnable, load_runner
from modelyard.service.scheduling.queue import Scheduling


class SleepRunner:
    """A model whose run takes `seconds` and `per_row` more a row of wall time and no CPU (the GIL
    is let go meanwhile)."""

    def __init__(self, seconds: float, per_row: float = 0.0) -> None:
        self._seconds = seconds
        self._per_row = per_row
        self.one_row_runs = 0

    @property
    def runs_inline(self) -> bool:
        return False

    def run(
        self,
        feeds: Mapping[str, np.ndarray],
        output_names: Sequence[str],
        options: ort.RunOptions | None = None,
    ) -> list[np.ndarray]:
        rows = len(feeds["INPUT0"])
        self.one_row_runs += rows == 1
        time.sleep(self._seconds + self._per_row * rows)
        return [feeds["INPUT0"] for _ in output_names]


def callgrind(switch: str) -> None:
    subprocess.run(["callgrind_control", "-i", switch, str(os.getpid())], check=True, capture_output=True)


async def measure(
    batcher: Batcher, stats: VersionStats, args: argparse.Namespace, sleeper: SleepRunner | None
) -> None:
    x = np.random.default_rng(0).standard_normal((1, DENSE_WIDTH), dtype=np.float32)
    feeds, names, scheduling = {"INPUT0": x}, ("OUTPUT0",), Scheduling()
    left = args.requests

    before, after = args.work_us[0] / 1e6, args.work_us[1] / 1e6

    async def client() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await batcher.infer(feeds, names, scheduling)

    async def working_client() -> None:  # --work-us: the same, with the loop's work around each call
        nonlocal left
        while left > 0:
            left -= 1
            _work(before)
            await asyncio.sleep(0)  # the request's decoding and its answer are turns of their own
            await batcher.infer(feeds, names, scheduling)
            _work(after)
            await asyncio.sleep(0)

    for _ in range(100):  # warm-up
        await batcher.infer(feeds, names, scheduling)
    rows, runs = stats.inference_count, stats.execution_count
    lone = sleeper.one_row_runs if sleeper else 0
    gc.collect()
    if args.callgrind:
        gc.disable()
        callgrind("on")
    wall, loop, process = time.perf_counter(), time.thread_time(), time.process_time()
    clients = working_client if before or after else client
    await asyncio.gather(*(clients() for _ in range(args.clients)))
    wall, loop, process = (
        time.perf_counter() - wall,
        time.thread_time() - loop,
        time.process_time() - process,
    )
    if args.callgrind:
        callgrind("off")
        gc.enable()
    n = args.requests
    runs = max(stats.execution_count - runs, 1)
    per_run = (stats.inference_count - rows) / runs
    share = f"  {(sleeper.one_row_runs - lone) / runs:4.0%} one-row runs" if sleeper else ""
    print(
        f"{args.model}: {n / wall:6.0f}/s  loop CPU {loop / n * 1e6:5.1f} us/req  process CPU "
        f"{process / n * 1e6:6.1f} us/req  {per_run:4.1f} rows/run{share}"
    )


def _work(seconds: float) -> None:
    """Spend `seconds` of this thread's CPU (a stand-in for a request's gRPC and decoding work)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _work_us(text: str) -> tuple[float, float]:
    before, _, after = text.partition(",")
    return float(before), float(after or 0)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=("dense", "sleep"), default="dense")
    parser.add_argument("--sleep-ms", type=float, default=2.0, help="--model sleep: a run's wall time")
    parser.add_argument(
        "--sleep-row-us", type=float, default=0.0, help="--model sleep: a run's wall time more a row"
    )
    parser.add_argument(
        "--work-us",
        type=_work_us,
        default=(0.0, 0.0),
        help="BEFORE[,AFTER]: the loop's CPU a request spends before infer and after its answer, each "
        "a turn of its own (a stand-in for gRPC: batch sizes follow what the loop admits during a run)",
    )
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
        runner = SleepRunner(args.sleep_ms / 1e3, args.sleep_row_us / 1e6)
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
            await measure(batcher, stats, args, runner if isinstance(runner, SleepRunner) else None)
            await batcher.close()

        asyncio.run(run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
