"""Profiling a server under load: py-spy samples (which code its event-loop thread runs, by
category), /proc gives the CPU time per request, per thread."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from bench.lib.load import Infer
from bench.processes import CLK_TCK, ROOT, ServerProcess
from modelyard.inference.v1 import inference_service_pb2 as pb

IDLE = "event loop: epoll select (mostly idle)"
FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")
THREAD = re.compile(r"^thread \((?P<tid>\d+)\): ?(?P<name>.*)$")


# (label, predicate on (function, file)); the innermost frame of a stack that matches decides.
# py-spy (without --native) sees no Cython frames: grpc.aio's server coroutines are Cython, so their
# work shows up as asyncio's Handle._run itself.
SERVICE_CATEGORIES: list[tuple[str, Callable[[str, str], bool]]] = [
    ("ORT session.run (+ ORT python wrapper)", lambda fn, f: "onnxruntime" in f or fn == "ModelRunner.run"),
    # x-served-version: set_trailing_metadata for a unary answer; a stream awaits
    # send_initial_metadata (its own batch into gRPC core: Cython, unseen by py-spy).
    ("x-served-version", lambda fn, f: fn.endswith("answered")),
    ("to_arrays (proto -> numpy)", lambda fn, f: fn in ("to_arrays", "to_array", "datatype_name")),
    ("to_tensors (numpy -> proto)", lambda fn, f: fn in ("to_tensors", "to_tensor", "to_wire")),
    ("KServe tensors (proto <-> numpy)", lambda fn, f: f.endswith("kserve/tensors.py")),
    ("signature checks", lambda fn, f: f.endswith(("signature.py", "datatypes.py"))),
    ("metrics (prometheus)", lambda fn, f: "observe_request" in fn or "prometheus_client" in f),
    ("per-version stats", lambda fn, f: "VersionStats" in fn),
    ("version lease / resolve", lambda fn, f: f.endswith(("table.py", "manager.py", "served.py"))),
    ("DataPlane (rest)", lambda fn, f: f.endswith("dataplane.py")),
    ("contextlib machinery", lambda fn, f: f.endswith("contextlib.py")),
    ("serving() wrapper (rest)", lambda fn, f: f.endswith("api/errors.py") or fn == "serving"),
    ("Infer handler (InferResponse, rest)", lambda fn, f: f.endswith("inference_servicer.py")),
    ("ModelInfer handler (KServe, rest)", lambda fn, f: f.endswith("kserve/servicer.py")),
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
