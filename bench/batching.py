"""Dynamic batching: throughput and latency with batching off and on, and priorities under a burst.

Two kinds of model, served from one temporary repository with batching off and on:

  dense   ``dense_stack(32, 512)``: 32 MatMuls of 512x512 (32 MiB of weights, built here, never
          committed). Bound by weight bandwidth: in ONNX Runtime here a run of 64 rows costs about
          6x one row, not 64x, so batching pays. Served off, on, and on+wait (see VARIANTS).
  tiny    ``scaled_identity(16)``: one Mul. Its run costs microseconds; all its cost is gRPC and
          Python, so batching cannot make the model cheaper and must not make serving dearer.

Phase 1, for concurrency 1, 8, 32 and 64 closed-loop clients of one row each: throughput, p50/p99
latency and rows per model run of every mode (the modes take turns level by level, in an order
rotated every round, so that drift in the machine's load hits them alike), and the gain of each
batched mode over batching off at 32 and 64.

Phase 2, the burst: 64 closed-loop clients of low-priority bulk traffic (8 rows per request)
saturate the batched dense model while an interactive client sends one row every 10 ms (paced,
not waiting for answers) and measures its latency: alone, under the bulk at priority 1, under the
bulk at the default (low) priority, and, for reference, under the same bulk on the unbatched model.

    .venv/bin/python -m bench.batching [--duration 3] [--rounds 3] [--levels 1,8,32,64] [--no-burst]
        [--trees base=/tmp/before,now=.]

With `--trees LABEL=PATH,...` each source tree's service (its code first on PYTHONPATH)
serves the same repository, and in phase 1 the trees take turns window by window (each mode of
every tree, next to each other in time), so that a change is judged by a paired before/after on
a shared machine: each tree's gains, and every later tree's CPU per request and throughput over
the first's (the median and range of the per-round ratios). Phase 2 runs on each tree in turn.

Beside throughput and latency, each point prints the service's CPU per answered request (its
process tree, from /proc) and this client's: on two shared cores they, not the model, bound the
batched modes, so the CPU per request is the steadier figure. The client is the same for every
mode (grpc.aio, pre-serialized bytes, no deserialization).

The service runs as a child process (`python -m modelyard.service`), on 127.0.0.1 only; this process is the
client (grpc.aio, pre-serialized requests, so that the client spends little per call). Results go
to bench/results/batching.json. Every process started here is stopped before exit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AsyncExitStack, ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from bench.lib.procfs import tree_cpu_seconds
from bench.lib.trees import pythonpath, source_trees
from models.demo_models import dense_stack, scaled_identity, write_model
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.kserve.v2 import grpc_service_pb2 as kpb
from modelyard.kserve.v2 import grpc_service_pb2_grpc as kpb_grpc
from modelyard.process import children
from modelyard.tensors import to_array, to_tensor

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "batching.json"
INFER = "/modelyard.inference.v1.InferenceService/Infer"
_SERVING = re.compile(r"serving gRPC on (\S+?)[;,]")

DENSE_LAYERS, DENSE_WIDTH = 32, 512
TINY_WIDTH = 16
MAX_BATCH = 64
BATCHING: dict[str, Any] = {
    "max_queue_delay_us": 0,  # per variant, below
    "priority_levels": 2,
    "default_priority_level": 2,
    "default_queue_policy": {"max_queue_size": 256},
    "priority_queue_policy": {1: {"max_queue_size": 64}},
}
# The same for every variant. One ONNX Runtime thread per run: on 2 cores, a run that took both
# would starve the event loop that serves gRPC (measured: every variant gains from it), and the
# two executor threads still run two unbatched requests at once.
EXECUTION = {"intra_op_threads": 1}
# kind -> mode -> (model, max_queue_delay_us; None = no batching). "on": a batch leaves as soon as
# the run slot is free, with whatever queued meanwhile (a lone request runs at once). "on+wait":
# a batch that is not full waits up to 5 ms for company, longer than a batch runs, so that the
# waves of requests that closed-loop clients send merge into fewer, larger batches; it costs a
# lone request those 5 ms (Triton's max_queue_delay semantics).
VARIANTS: dict[str, dict[str, tuple[str, int | None]]] = {
    "dense": {"off": ("dense", None), "on": ("dense-batched", 0), "on+wait": ("dense-batched-wait", 5000)},
    "tiny": {"off": ("tiny", None), "on": ("tiny-batched", 0)},
}
INTERACTIVE_INTERVAL_S = 0.010
BULK_CLIENTS = 64
BULK_ROWS = 8  # bulk callers send several rows per request, as batch jobs do


def build_repository(root: Path) -> None:
    graphs = {
        "dense": dense_stack(DENSE_LAYERS, DENSE_WIDTH, seed=0),
        "tiny": scaled_identity(TINY_WIDTH, 2.0),
    }
    for kind, modes in VARIANTS.items():
        for name, delay_us in modes.values():
            config: dict[str, Any] = {"max_batch_size": MAX_BATCH, "execution": EXECUTION}
            if delay_us is not None:
                config["dynamic_batching"] = BATCHING | {"max_queue_delay_us": delay_us}
            write_model(root, name, 1, graphs[kind], config)


@dataclass
class Server:
    proc: subprocess.Popen[str]
    address: str
    log: list[str] = field(default_factory=list)


@contextmanager
def served(repository: Path, tree: Path | None = None) -> Iterator[Server]:
    """The service, from this tree or from `tree` (run there, its code first on the path)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELYARD_")}
    if tree is not None:
        env["PYTHONPATH"] = f"{pythonpath(tree)}{os.pathsep}{tree}"
    cmd = [sys.executable, "-m", "modelyard.service", "--repository", str(repository)]
    cmd += ["--listen", "127.0.0.1:0", "--metrics-listen", "", "--log-level", "INFO"]
    proc: subprocess.Popen[str] = children.popen(
        cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env, cwd=tree or ROOT
    )
    lines: list[str] = []
    output = children.ReadyLine(_SERVING, lines.append)
    assert proc.stderr is not None
    ready = children.follow(proc.stderr, output)  # keeps reading: the child never blocks on a full pipe
    try:
        if not ready.wait(120) or output.match is None:
            raise RuntimeError("the service did not start:\n" + "\n".join(lines))
        yield Server(proc, output.match.group(1), lines)
    finally:
        children.stop(proc, signal.SIGTERM, grace_s=30)


def request_bytes(model: str, x: np.ndarray, priority: int = 0) -> bytes:
    request = pb.InferRequest(model_name=model, inputs=[to_tensor("INPUT0", x)], priority=priority)
    return request.SerializeToString()


def payload(kind: str, seed: int = 0, rows: int = 1) -> np.ndarray:
    width = DENSE_WIDTH if kind == "dense" else TINY_WIDTH
    return np.random.default_rng(seed).standard_normal((rows, width), dtype=np.float32)


@dataclass
class Measure:
    """Latencies (seconds) of the requests that started inside the measured window."""

    seconds: float
    latencies: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    # CPU per answered request, warm-up included (the CPU is read around the whole window):
    # the service's (its process tree, from /proc) and this client's own.
    answered: int = 0
    server_cpu_s: float = 0.0
    client_cpu_s: float = 0.0

    def merge(self, other: Measure) -> None:
        self.seconds += other.seconds
        self.latencies += other.latencies
        self.errors.update(other.errors)
        self.answered += other.answered
        self.server_cpu_s += other.server_cpu_s
        self.client_cpu_s += other.client_cpu_s

    def summary(self) -> dict[str, Any]:
        values = np.array(self.latencies) if self.latencies else np.array([np.nan])
        return {
            "throughput": len(self.latencies) / self.seconds,
            "p50_ms": float(np.percentile(values, 50)) * 1e3,
            "p99_ms": float(np.percentile(values, 99)) * 1e3,
            "requests": len(self.latencies),
            "errors": dict(self.errors),
            "server_cpu_us": self.server_cpu_s / max(self.answered, 1) * 1e6,
            "client_cpu_us": self.client_cpu_s / max(self.answered, 1) * 1e6,
        }


Call = grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]


async def closed_loop(
    call: Call, body: bytes, clients: int, warmup: float, duration: float, server_pid: int = 0
) -> Measure:
    """`clients` callers, each sending its next request when the last one is answered. With
    `server_pid`, the service's CPU and this client's over the window, per answered request."""
    start = time.perf_counter() + warmup
    stop = start + duration
    measure = Measure(duration)

    async def client() -> None:
        while (sent := time.perf_counter()) < stop:
            try:
                await call(body)
            except grpc.aio.AioRpcError as exc:
                if sent >= start:
                    measure.errors[exc.code().name] += 1
                continue
            measure.answered += 1
            if sent >= start:
                measure.latencies.append(time.perf_counter() - sent)

    server_cpu = tree_cpu_seconds(server_pid) if server_pid else 0.0
    client_cpu = time.process_time()
    await asyncio.gather(*(client() for _ in range(clients)))
    measure.client_cpu_s = time.process_time() - client_cpu
    measure.server_cpu_s = tree_cpu_seconds(server_pid) - server_cpu if server_pid else 0.0
    return measure


async def paced(call: Call, body: bytes, interval: float, warmup: float, duration: float) -> Measure:
    """One request every `interval` seconds, each on its own (open loop: a slow answer does not
    delay the next request, so queueing shows in the latencies)."""
    start = time.perf_counter() + warmup
    stop = start + duration
    measure = Measure(duration)
    tasks: list[asyncio.Task[None]] = []

    async def one(sent: float) -> None:
        try:
            await call(body)
        except grpc.aio.AioRpcError as exc:
            measure.errors[exc.code().name] += 1
            return
        if sent >= start:
            measure.latencies.append(time.perf_counter() - sent)

    due = time.perf_counter()
    while due < stop:
        tasks.append(asyncio.ensure_future(one(due)))
        due += interval
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
    await asyncio.gather(*tasks)
    return measure


def check_outputs(channel: grpc.Channel) -> dict[str, Any]:
    """Batched answers equal unbatched ones (tiny: exactly; dense: within float tolerance)."""
    from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc

    stub = pb_grpc.InferenceServiceStub(channel)
    found: dict[str, Any] = {}
    for kind in ("dense", "tiny"):
        x = payload(kind, seed=7)
        off = to_array(
            stub.Infer(pb.InferRequest(model_name=kind, inputs=[to_tensor("INPUT0", x)])).outputs[0]
        )
        on_request = pb.InferRequest(model_name=f"{kind}-batched", inputs=[to_tensor("INPUT0", x)])
        on = to_array(stub.Infer(on_request).outputs[0])
        found[kind] = {
            "bit_exact": bool(np.array_equal(off, on)),
            "max_abs_diff": float(np.abs(off - on).max()),
        }
        if not np.allclose(off, on, rtol=1e-5, atol=1e-5):
            raise AssertionError(f"{kind}: batched output differs from unbatched: {found[kind]}")
    return found


# Phase 1's measures of one tree, kind, level and mode: the rounds merged, and each round's own.
Key = tuple[str, str, int, str]


async def phase_levels(
    servers: Mapping[str, Server],
    levels: list[int],
    rounds: int,
    warmup: float,
    duration: float,
    kinds: Sequence[str] = tuple(VARIANTS),
) -> tuple[dict[str, dict[str, dict[int, dict[str, Any]]]], dict[Key, list[dict[str, Any]]]]:
    """-> (tree -> kind -> level -> mode -> summary, (tree, kind, level, mode) -> round summaries).
    In each round every mode of every tree runs once, the modes in an order rotated every round
    and, within a mode, the trees too: drift in the machine's load hits them alike."""
    results: dict[str, dict[str, dict[int, dict[str, Any]]]] = {label: {} for label in servers}
    per_round: dict[Key, list[dict[str, Any]]] = {}
    async with AsyncExitStack() as stack:
        calls: dict[str, tuple[Call, kpb_grpc.GRPCInferenceServiceAsyncStub]] = {}
        for label, server in servers.items():
            channel = await stack.enter_async_context(grpc.aio.insecure_channel(server.address))
            calls[label] = (
                channel.unary_unary(INFER, None, None),
                kpb_grpc.GRPCInferenceServiceStub(channel),
            )
        labels = list(servers)
        for kind in kinds:
            modes = VARIANTS[kind]
            bodies = {mode: request_bytes(name, payload(kind)) for mode, (name, _) in modes.items()}
            for level in levels:
                measures: dict[tuple[str, str], Measure] = {}
                runs: Counter[tuple[str, str, str]] = Counter()  # batched models' rows and runs, warm-up too
                order = list(modes)
                for round_ in range(rounds):
                    for mode in _rotated(order, round_):
                        for label in _rotated(labels, round_):
                            call, kserve = calls[label]
                            name = modes[mode][0]
                            before = await _counts(kserve, name)
                            pid = servers[label].proc.pid
                            measure = await closed_loop(call, bodies[mode], level, warmup, duration, pid)
                            after = await _counts(kserve, name)
                            runs[(label, mode, "rows")] += after[0] - before[0]
                            runs[(label, mode, "runs")] += after[1] - before[1]
                            per_round.setdefault((label, kind, level, mode), []).append(measure.summary())
                            if (label, mode) in measures:
                                measures[(label, mode)].merge(measure)
                            else:
                                measures[(label, mode)] = measure
                for label in labels:
                    summary = {mode: measures[(label, mode)].summary() for mode in modes}
                    for mode in summary:
                        rows, count = runs[(label, mode, "rows")], runs[(label, mode, "runs")]
                        summary[mode]["rows_per_run"] = rows / max(count, 1)
                    lines = "  ".join(_line(mode, summary[mode]) for mode in modes)
                    print(f"  {label + ' ' if label else ''}{kind:5} c={level:<3} {lines}")
                    results[label].setdefault(kind, {})[level] = summary
    return results, per_round


def _rotated(items: list[str], by: int) -> list[str]:
    by %= len(items)
    return items[by:] + items[:by]


def paired(
    per_round: Mapping[Key, list[dict[str, Any]]], first: str, other: str
) -> dict[str, dict[str, Any]]:
    """`other` tree over `first`, round by round (each pair ran next to each other): the service's
    CPU per request and the throughput, median and range, by "kind c=level mode"."""
    out: dict[str, dict[str, Any]] = {}
    for (label, kind, level, mode), theirs in per_round.items():
        if label != other:
            continue
        ours = per_round[(first, kind, level, mode)]
        found: dict[str, Any] = {}
        for metric in ("server_cpu_us", "throughput"):
            ratios = [b[metric] / max(a[metric], 1e-9) for a, b in zip(ours, theirs, strict=True)]
            found[metric] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
        out[f"{kind} c={level} {mode}"] = found
    return out


async def _counts(kserve: kpb_grpc.GRPCInferenceServiceAsyncStub, model: str) -> tuple[int, int]:
    """Rows and runs of the model so far (KServe statistics: inference and execution counts)."""
    stats = await kserve.ModelStatistics(kpb.ModelStatisticsRequest(name=model))
    return stats.model_stats[0].inference_count, stats.model_stats[0].execution_count


def _line(mode: str, s: dict[str, Any]) -> str:
    errors = f" errors {s['errors']}" if s["errors"] else ""
    rows = f" [{s['rows_per_run']:4.1f} rows/run]" if mode != "off" else ""
    cpu = f" cpu/req srv {s['server_cpu_us']:4.0f} cli {s['client_cpu_us']:3.0f} us"
    latency = f"p50 {s['p50_ms']:6.2f} p99 {s['p99_ms']:6.2f} ms"
    return f"{mode}: {s['throughput']:5.0f}/s {latency}{rows}{cpu}{errors}"


async def phase_burst(address: str, warmup: float, duration: float) -> dict[str, dict[str, Any]]:
    x = payload("dense", seed=1)
    scenarios = [
        ("alone, batched model", "dense-batched", None, 1),
        ("under bulk, batched, priority 1", "dense-batched", "dense-batched", 1),
        ("under bulk, batched, default priority", "dense-batched", "dense-batched", 0),
        ("under bulk, unbatched model", "dense", "dense", 0),
    ]
    results: dict[str, dict[str, Any]] = {}
    async with (
        grpc.aio.insecure_channel(address) as channel,
        grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as bulk_channel,
    ):
        call: Call = channel.unary_unary(INFER, None, None)
        bulk_call: Call = bulk_channel.unary_unary(INFER, None, None)
        for label, model, bulk_model, priority in scenarios:
            interactive = paced(
                call, request_bytes(model, x, priority), INTERACTIVE_INTERVAL_S, warmup, duration
            )
            if bulk_model is None:
                measure = await interactive
                bulk = None
            else:
                bulk_body = request_bytes(bulk_model, payload("dense", seed=2, rows=BULK_ROWS))
                measure, bulk = await asyncio.gather(
                    interactive, closed_loop(bulk_call, bulk_body, BULK_CLIENTS, warmup, duration)
                )
            entry: dict[str, Any] = {
                "interactive": measure.summary(),
                "bulk": bulk.summary() if bulk else None,
            }
            results[label] = entry
            line = f"  {label:38} interactive: p50 {entry['interactive']['p50_ms']:6.2f} ms"
            line += f" p99 {entry['interactive']['p99_ms']:7.2f} ms"
            if bulk is not None:
                line += f"   bulk: {entry['bulk']['throughput']:6.0f}/s p99 {entry['bulk']['p99_ms']:7.2f} ms"
            print(line)
    return results


def ratios(levels: dict[str, dict[int, dict[str, Any]]]) -> dict[str, dict[int, dict[str, dict[str, float]]]]:
    """Each batched mode against batching off, at the same concurrency."""
    out: dict[str, dict[int, dict[str, dict[str, float]]]] = {}
    for kind, per_level in levels.items():
        for level, modes in per_level.items():
            off = modes["off"]
            out.setdefault(kind, {})[level] = {
                mode: {
                    "throughput": values["throughput"] / off["throughput"],
                    "p99": values["p99_ms"] / off["p99_ms"],
                    # The service's CPU per request, off over on: the gain on a saturated machine.
                    "server_cpu": off["server_cpu_us"] / max(values["server_cpu_us"], 1e-9),
                }
                for mode, values in modes.items()
                if mode != "off"
            }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=3.0, help="measured seconds per point and round")
    parser.add_argument("--warmup", type=float, default=0.5, help="unmeasured seconds before each point")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per point, mode order rotating")
    parser.add_argument("--levels", default="1,8,32,64", help="client concurrency levels")
    parser.add_argument("--kinds", type=_kinds, default=list(VARIANTS), help="models of phase 1 (dense,tiny)")
    parser.add_argument("--no-burst", action="store_true", help="phase 1 only (a shorter run)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument(
        "--trees",
        type=_trees,
        default=None,
        help="LABEL=PATH,...: each tree's service, paired (the first is the reference)",
    )
    args = parser.parse_args()
    levels = [int(v) for v in args.levels.split(",")]

    trees: list[tuple[str, Path | None]] = list(args.trees) if args.trees else [("", None)]

    workdir = Path(tempfile.mkdtemp(prefix="modelyard-bench-batching-"))
    try:
        build_repository(workdir / "models")
        with ExitStack() as stack:
            servers = {label: stack.enter_context(served(workdir / "models", tree)) for label, tree in trees}
            for label, server in servers.items():
                where = f"on {server.address}; {os.cpu_count()} CPUs; {platform.machine()}"
                print(f"service {label + ' ' if label else ''}{where}")
                with grpc.insecure_channel(server.address) as channel:
                    exactness = check_outputs(channel)
            print(f"batched vs unbatched outputs: {exactness}")
            print("phase 1: closed-loop clients, batching off / on")
            by_level, per_round = asyncio.run(
                phase_levels(servers, levels, args.rounds, args.warmup, args.duration, args.kinds)
            )
            gains = {label: ratios(found) for label, found in by_level.items()}
            print("gains over batching off (throughput ratio; p99 ratio, lower is better):")
            for label, found in gains.items():
                for kind in found:
                    for level in (32, 64):
                        for mode, g in found[kind].get(level, {}).items():
                            ratio = f"throughput x{g['throughput']:.2f}, p99 x{g['p99']:.2f}"
                            ratio += f", service CPU per request x{1 / g['server_cpu']:.2f}"
                            print(f"  {label + ' ' if label else ''}{kind:5} c={level} {mode:7}: {ratio}")
            pairs = {label: paired(per_round, trees[0][0], label) for label, _ in trees[1:]}
            for label, pair in pairs.items():
                print(f"{label} over {trees[0][0]}, paired by round (median [range]):")
                for point, values in pair.items():
                    cpu, rate = values["server_cpu_us"], values["throughput"]
                    print(
                        f"  {point:20} service CPU per request x{cpu['median']:.3f} "
                        f"[{cpu['min']:.2f}-{cpu['max']:.2f}]  throughput x{rate['median']:.3f} "
                        f"[{rate['min']:.2f}-{rate['max']:.2f}]"
                    )
            burst: dict[str, dict[str, dict[str, Any]]] = {}
            if not args.no_burst:
                bulk = f"{BULK_CLIENTS} closed-loop low-priority clients on the dense model"
                for label, server in servers.items():
                    print(f"phase 2{' ' + label if label else ''}: burst (bulk: {bulk})")
                    burst[label] = asyncio.run(phase_burst(server.address, args.warmup, args.duration))
            batching_lines = [line for line in servers[trees[0][0]].log if "batches up to" in line]
        report: dict[str, Any] = {
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "settings": vars(args)
            | {"output": str(args.output), "trees": [(label, str(tree)) for label, tree in trees]},
            "models": {
                "dense": f"dense_stack({DENSE_LAYERS}, {DENSE_WIDTH}): weight-bandwidth bound",
                "tiny": f"scaled_identity({TINY_WIDTH}): overhead bound",
            },
            "config": {"max_batch_size": MAX_BATCH, "execution": EXECUTION, "dynamic_batching": BATCHING},
            "batchers": batching_lines,
            "outputs": exactness,
        }
        if args.trees:  # by tree, and the paired ratios to the first
            report |= {"levels": by_level, "gains": gains, "burst": burst, "paired": pairs}
        else:  # one tree: the report without a tree level
            report |= {"levels": by_level[""], "gains": gains[""], "burst": burst.get("", {})}
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2, default=str))
        print(f"results: {args.output}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def _kinds(text: str) -> list[str]:
    kinds = [part for part in text.split(",") if part]
    if not kinds or set(kinds) - set(VARIANTS):
        raise argparse.ArgumentTypeError(f"{text!r}: give some of {', '.join(VARIANTS)}")
    return kinds


def _trees(text: str) -> list[tuple[str, Path]]:
    pairs = source_trees(text)
    if len(pairs) < 2:
        raise argparse.ArgumentTypeError("give two trees or more: the first is the reference")
    return pairs


if __name__ == "__main__":
    raise SystemExit(main())
