"""Serving overhead of unary Infer, as ratios measured in one run.

Three things are measured on the same tiny model (``scaled_identity``: one Mul, whose own run costs
microseconds, so that the serving path is what is measured) and the same payload:

  (a) raw ORT   ``onnxruntime.InferenceSession.run()`` in this process, sequentially;
  (b) echo      bench/echo_server.py, a bare grpc.aio InferenceService whose Infer echoes the inputs;
  (c) service   ``python -m service`` serving the model.

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
import importlib
import inspect
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
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnxruntime as ort
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.inference.v1 import tensor_pb2

from bench.processes import CLK_TCK, SERVICE_READY, ServerProcess
from models.demo_models import scaled_identity, write_model

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
NOISY_OTHER_CPU = 0.15  # other processes using more of a core than this disturb the measurement

Infer = Callable[[pb.InferRequest], Awaitable[pb.InferResponse]]


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (all cores), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    guest = sum(fields[8:10]) if len(fields) > 9 else 0  # already counted in user and nice
    return (sum(fields) - idle - guest) / CLK_TCK


# -- load generation -------------------------------------------------------------------------


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


# -- in-process breakdown of the service's request path (no gRPC) ----------------------------


def _per_call_us(fn: Callable[[], object], iterations: int, batches: int = 5) -> float:
    times = []
    for _ in range(batches):
        t0 = time.perf_counter_ns()
        for _ in range(iterations):
            fn()
        times.append((time.perf_counter_ns() - t0) / iterations / 1e3)
    return min(times)  # the least disturbed batch


async def _per_await_us(fn: Callable[[], Awaitable[object]], iterations: int, batches: int = 5) -> float:
    times = []
    for _ in range(batches):
        t0 = time.perf_counter_ns()
        for _ in range(iterations):
            await fn()
        times.append((time.perf_counter_ns() - t0) / iterations / 1e3)
    return min(times)


async def breakdown(repository: Path, request: pb.InferRequest, iterations: int) -> dict[str, float]:
    """Per-call CPU cost (us) of the handlers and of each step of the service's Infer, in this
    process: the same objects the service builds, called directly. Uses service internals, so it
    reports what it could not time instead of failing the benchmark."""
    from concurrent.futures import ThreadPoolExecutor

    from modelyard.tensors import to_arrays, to_tensors

    from service.api.errors import serving
    from service.api.inference_servicer import InferenceServicer
    from service.dataplane import DataPlane
    from service.metrics import ServiceMetrics
    from service.runtime.manager import ModelManager
    from service.runtime.providers import ProviderChoice

    class Context:  # what a successful Infer asks of its context; anything else means it failed
        def time_remaining(self) -> float | None:
            return None

        def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
            return ()

        async def send_initial_metadata(self, metadata: object) -> None:
            pass

        def __getattr__(self, name: str) -> Any:
            raise RuntimeError(f"context.{name} used: the request failed")

    results: dict[str, float] = {}
    context: Any = Context()
    executor = ThreadPoolExecutor(max_workers=2)
    manager = ModelManager(repository, ProviderChoice(False, "benchmark: CPU"))
    try:
        await manager.load_all()
        metrics = ServiceMetrics()
        metrics.known_models.add(MODEL)
        dataplane = DataPlane(manager, executor)
        # Built by parameter name, so that collaborators Infer does not use (they get None) can come
        # and go without breaking the benchmark.
        known: dict[str, Any] = {"dataplane": dataplane, "metrics": metrics}
        params = list(inspect.signature(InferenceServicer.__init__).parameters)[1:]
        servicer = InferenceServicer(**{name: known.get(name) for name in params})
        # The echo server's own handler class: bench/ is a package under `-m`, a folder as a script.
        echo_module = importlib.import_module(f"{__package__}.echo_server" if __package__ else "echo_server")
        echo = echo_module.EchoServicer()
        wire = request.SerializeToString()
        served = manager.resolve(MODEL)
        runner = served.runner
        arrays = to_arrays(request.inputs)
        names = runner.signature.select_outputs(list(request.output_names))
        outputs = dict(zip(names, runner.run(arrays, names), strict=True))
        tensors = to_tensors(outputs)
        response = await servicer.Infer(request, context)
        wire_response = response.SerializeToString()

        async def empty_serving() -> None:
            async with serving(context, metrics, "Infer", MODEL):
                pass

        def lease_and_check() -> None:
            with manager.lease(MODEL, "") as version:
                version.runner.signature.check_inputs(arrays)
                version.runner.signature.select_outputs(request.output_names)

        n = iterations
        steps: list[tuple[str, Callable[[], object] | None, Callable[[], Awaitable[object]] | None]] = [
            (
                "echo handler: InferResponse(outputs=request.inputs)",
                None,
                lambda: echo.Infer(request, context),
            ),
            (
                "service handler: InferenceServicer.Infer (all)",
                None,
                lambda: servicer.Infer(request, context),
            ),
            ("  serving() async context manager, empty body", None, empty_serving),
            ("  to_arrays(request.inputs)", lambda: to_arrays(request.inputs), None),
            (
                "  DataPlane.infer (lease, checks, run, stats)",
                None,
                lambda: dataplane.infer(MODEL, "", arrays, request.output_names),
            ),
            ("    lease + check_inputs + select_outputs", lease_and_check, None),
            ("    ModelRunner.run (ORT session.run)", lambda: runner.run(arrays, names), None),
            ("  to_tensors(outputs)", lambda: to_tensors(outputs), None),
            (
                "  InferResponse(...) from the built tensors",
                lambda: pb.InferResponse(model_name=MODEL, model_version="1", outputs=tensors, request_id=""),
                None,
            ),
            (
                "  metrics.observe_request",
                lambda: metrics.observe_request("Infer", MODEL, "1", grpc.StatusCode.OK, 1e-4),
                None,
            ),
            ("both: parse InferRequest from wire", lambda: pb.InferRequest.FromString(wire), None),
            ("both: serialize InferResponse", lambda: response.SerializeToString(), None),
            (
                "client: parse InferResponse from wire",
                lambda: pb.InferResponse.FromString(wire_response),
                None,
            ),
        ]
        for label, sync_fn, async_fn in steps:
            try:
                if sync_fn is not None:
                    sync_fn()
                    results[label] = _per_call_us(sync_fn, n)
                elif async_fn is not None:
                    await async_fn()
                    results[label] = await _per_await_us(async_fn, n)
            except Exception as exc:
                print(f"  breakdown: cannot time {label.strip()!r}: {exc!r}", file=sys.stderr)
    finally:
        await manager.close()
        executor.shutdown(wait=True)
    return results


# -- profiling -------------------------------------------------------------------------------

IDLE = "event loop: epoll select (mostly idle)"
FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")
THREAD = re.compile(r"^thread \((?P<tid>\d+)\): ?(?P<name>.*)$")

# (label, predicate on (function, file)); the innermost frame of a stack that matches decides.
# py-spy (without --native) sees no Cython frames: grpc.aio's server coroutines are Cython, so their
# work shows up as asyncio's Handle._run itself.
SERVICE_CATEGORIES: list[tuple[str, Callable[[str, str], bool]]] = [
    ("ORT session.run (+ ORT python wrapper)", lambda fn, f: "onnxruntime" in f or fn == "ModelRunner.run"),
    # Awaiting send_initial_metadata: its own batch into gRPC core (Cython, unseen by py-spy).
    ("x-served-version (send_initial_metadata)", lambda fn, f: fn.endswith("answered")),
    ("to_arrays (proto -> numpy)", lambda fn, f: fn in ("to_arrays", "to_array", "datatype_name")),
    ("to_tensors (numpy -> proto)", lambda fn, f: fn in ("to_tensors", "to_tensor", "to_wire")),
    ("KServe tensors (proto <-> numpy)", lambda fn, f: f.endswith("kserve_tensors.py")),
    ("signature checks", lambda fn, f: f.endswith(("signature.py", "datatypes.py"))),
    ("metrics (prometheus)", lambda fn, f: "observe_request" in fn or "prometheus_client" in f),
    ("per-version stats", lambda fn, f: "VersionStats" in fn),
    ("version lease / resolve", lambda fn, f: f.endswith(("table.py", "manager.py", "served.py"))),
    ("DataPlane (rest)", lambda fn, f: f.endswith("dataplane.py")),
    ("contextlib machinery", lambda fn, f: f.endswith("contextlib.py")),
    ("serving() wrapper (rest)", lambda fn, f: f.endswith("api/errors.py") or fn == "serving"),
    ("Infer handler (InferResponse, rest)", lambda fn, f: f.endswith("inference_servicer.py")),
    ("ModelInfer handler (KServe, rest)", lambda fn, f: f.endswith("kserve_servicer.py")),
    ("echo handler", lambda fn, f: f.endswith("echo_server.py")),
    ("bare server's handler (rest)", lambda fn, f: f.endswith("bare_server.py")),
]
TRANSPORT_CATEGORIES: list[tuple[str, Callable[[str, str], bool]]] = [
    ("grpc python", lambda fn, f: "grpc" in f),
    ("grpc.aio cython steps (Handle._run own)", lambda fn, f: fn == "Handle._run"),
    (IDLE, lambda fn, f: f.endswith("selectors.py")),
    ("event loop: asyncio python", lambda fn, f: "asyncio" in f),
]
CATEGORIES = SERVICE_CATEGORIES + TRANSPORT_CATEGORIES
SERVICE_LABELS = {label for label, _ in SERVICE_CATEGORIES}
IDLE_FUNCTIONS = ("EpollSelector.select (selectors.py)",)


@dataclass
class ThreadProfile:
    name: str
    samples: int = 0
    own: Counter[str] = field(default_factory=Counter)  # function (file) -> samples as the leaf
    categories: Counter[str] = field(default_factory=Counter)


def parse_raw_profile(text: str) -> dict[int, ThreadProfile]:
    """py-spy `record --format raw --threads` output -> samples per thread: own time per
    function and per category (innermost matching frame)."""
    threads: dict[int, ThreadProfile] = {}
    for line in text.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        thread = THREAD.match(frames[0])
        tid = int(thread.group("tid")) if thread else 0
        if thread:
            frames.pop(0)
        profile = threads.setdefault(tid, ThreadProfile(thread.group("name") if thread else "?"))
        parsed = []
        for frame in frames:
            m = FRAME.match(frame)
            parsed.append((m.group("func"), m.group("file")) if m else (frame, ""))
        profile.samples += count
        if parsed:
            profile.own[f"{parsed[-1][0]} ({parsed[-1][1]})"] += count
        label = ""
        for fn, f in reversed(parsed):
            label = next((lab for lab, match in CATEGORIES if match(fn, f)), "")
            if label:
                break
        profile.categories[label or "other"] += count
    return threads


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (comm, CPU seconds) of every thread of a process, from /proc."""
    result = {}
    for entry in os.scandir(f"/proc/{pid}/task"):
        try:
            with open(f"{entry.path}/comm") as f:
                comm = f.read().strip()
            with open(f"{entry.path}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        result[int(entry.name)] = (comm, (int(fields[11]) + int(fields[12])) / CLK_TCK)
    return result


@dataclass
class Profile:
    server: str
    rate: int
    seconds: float
    requests: int  # completed while py-spy ran
    throughput: float  # while py-spy ran (sampling slows the server down)
    main_cpu_us_per_req: float  # event-loop thread, from /proc
    threads_cpu_us_per_req: dict[str, float]  # every busy thread, from /proc
    main_samples: int
    own: dict[str, int]  # event-loop thread only
    categories: dict[str, int]  # event-loop thread only
    raw_file: str

    @property
    def busy_samples(self) -> int:
        """Samples not waiting in epoll: py-spy counts some of the loop's idle waits as active."""
        return max(self.main_samples - self.categories.get(IDLE, 0), 1)

    def us_per_request(self, samples: int) -> float:
        """Busy samples of the event-loop thread -> its CPU microseconds per request (shares from
        py-spy, magnitude from /proc)."""
        return samples / self.busy_samples * self.main_cpu_us_per_req


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return None


def write_json(path: Path, document: object) -> None:
    path.write_text(json.dumps(document, indent=2) + "\n")


def py_spy_path() -> str | None:
    local = Path(sys.executable).parent / "py-spy"
    return str(local) if local.exists() else shutil.which("py-spy")


async def profile_server(
    server: ServerProcess,
    infer: Infer,
    request: pb.InferRequest,
    concurrency: int,
    warmup_s: float,
    seconds: float,
    rate: int,
    raw_file: Path,
    blocking: bool = False,
) -> Profile | None:
    """Load the server at `concurrency` and sample it with py-spy meanwhile. py-spy gives the
    shape (which code the event-loop thread runs); /proc gives the CPU time per request."""
    spy_bin = py_spy_path()
    if spy_bin is None:
        print("  profile: py-spy not found; skipping", file=sys.stderr)
        return None
    stopping = asyncio.Event()
    completed = 0

    async def worker() -> None:
        nonlocal completed
        while not stopping.is_set():
            try:
                await infer(request)
            except grpc.aio.AioRpcError:
                continue
            completed += 1

    workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
    spy: asyncio.subprocess.Process | None = None
    try:
        await asyncio.sleep(warmup_s)
        argv = [spy_bin, "record", "--pid", str(server.pid), "--duration", f"{seconds:g}"]
        argv += ["--rate", str(rate), "--format", "raw", "--threads", "-o", str(raw_file)]
        if not blocking:
            # Pausing the process for every sample (ptrace, every thread) slows the service, which
            # has twice the echo server's threads, by several times: sample without pausing.
            argv.append("--nonblocking")
        cpu_before, done_before, started = thread_cpu(server.pid), completed, time.perf_counter()
        spy = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
        output, _ = await asyncio.wait_for(spy.communicate(), timeout=seconds + 60)
        cpu_after, done_after, ended = thread_cpu(server.pid), completed, time.perf_counter()
    finally:
        stopping.set()
        await asyncio.gather(*workers, return_exceptions=True)
        if spy is not None and spy.returncode is None:
            spy.kill()
            await spy.wait()
    text = output.decode(errors="replace")
    raw_text = read_text(raw_file)
    if spy.returncode != 0 or raw_text is None:
        print(f"  profile: py-spy could not sample {server.name} (exit {spy.returncode}):", file=sys.stderr)
        print("    " + "\n    ".join(text.strip().splitlines()[-5:]), file=sys.stderr)
        return None
    threads = parse_raw_profile(raw_text)
    requests = max(done_after - done_before, 1)
    names = {tid: t.name for tid, t in threads.items()}
    names[server.pid] = "MainThread"
    threads_cpu: dict[str, float] = {}
    for tid, (comm, after) in cpu_after.items():
        used = after - cpu_before.get(tid, (comm, 0.0))[1]
        if used > 0:
            label = f"{names.get(tid, comm)} [{tid}]"
            threads_cpu[label] = used / requests * 1e6
    main = threads.get(server.pid, ThreadProfile("MainThread"))
    return Profile(
        server=server.name,
        rate=rate,
        seconds=seconds,
        requests=requests,
        throughput=requests / (ended - started),
        main_cpu_us_per_req=threads_cpu.get(f"MainThread [{server.pid}]", 0.0),
        threads_cpu_us_per_req=dict(sorted(threads_cpu.items(), key=lambda kv: -kv[1])),
        main_samples=main.samples,
        own=dict(main.own.most_common()),
        categories=dict(main.categories.most_common()),
        raw_file=str(raw_file.relative_to(ROOT) if raw_file.is_relative_to(ROOT) else raw_file),
    )


# -- reporting -------------------------------------------------------------------------------


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


# -- the run ---------------------------------------------------------------------------------


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
                *(sys.executable, "-m", "service", "--repository", str(repository), "--listen", f"{HOST}:0"),
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
