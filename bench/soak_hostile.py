"""Hostile soak: normal traffic through the whole chain beside a low-rate mix of hostile requests,
in alternating quiet and hostile windows of one run, so that what the hostile mix costs the normal
callers is measured against the same stack, minutes apart.

    .venv/bin/python -m bench.soak_hostile [--duration-s 120] [--windows 8] [--unary 4] [--sse 2]
        [--only CLASS,...] [--skip CLASS,...] [--abandon-rate 8] [--trees base=DIR,now=DIR] [--repeat N]

The stack runs as `make up` runs it (python -m modelyard.deploy: service, sidecar, gateway, Envoy) on a
temporary repository: the demo models plus two whose cost depends on input values (`fill`, a
ConstantOfShape whose size is an input; `spin`, a Loop whose trip count is an input).

Normal traffic, all the time: unary Infer on `classifier` through the sidecar (tenant `good`) and
SSE generations of `codelm` through Envoy -> gateway. The hostile mix, in the hostile windows only,
each class at a few requests a second: path-escaping and malformed names (Infer, KServe
RepositoryModelLoad), a rotating stream of unknown model names and of tenants, a deadline storm and
a bad-values storm from one tenant, a huge ConstantOfShape, a Loop of 10^12 trips under a short
deadline, undecodable bytes, a message of a million tiny fields, bad HTTP bodies and headers at the
gateway, bad admin bodies at the sidecar, connections held open with half a request, and a client
that abandons streams: generations started through Envoy at --abandon-rate a second, each socket
dropped (RST) as soon as its answer's head is in, continuously (more abandoned streams than
decode slots must not make other clients wait out the resume window).

Reported: errors of the normal traffic (goal 0), p50/p99 of the normal traffic in the quiet and in
the hostile windows and their ratio (goal: p99 within 1.5x; the SSE clients' time to first token
within 2x), each process's RSS at the start and the end and its slope over the run, the sidecar's
and service's /metrics sizes, and every hostile answer that was a 5xx, INTERNAL, UNKNOWN or a hang
(goal: none). Exit status 1 when a goal is missed.

`--only CLASS,...` runs only those hostile classes (`--only "abandoned streams"`: the abandoned-stream
client alone). `--trees base=DIR,now=DIR` runs the soak once per source tree (each a whole stack from
that tree's code; the clients are this tree's), `--repeat N` times in turns, and ends with a table of
each run's TTFT figures and their spread: before/after on the same machine in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import queue
import shutil
import socket
import struct
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from multiprocessing import Queue
from multiprocessing.synchronize import Event as EventType
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np

from bench.lib.procfs import rss_kib
from bench.lib.trees import source_trees
from bench.stack import ROOT, Stack
from models import value_models
from models.demo_models import COMMITTED_ROOT, write_model
from modelyard.inference.v1 import inference_service_pb2 as pb
from modelyard.inference.v1 import inference_service_pb2_grpc as pb_grpc
from modelyard.kserve.v2 import grpc_service_pb2 as kpb
from modelyard.kserve.v2 import grpc_service_pb2_grpc as kpb_grpc
from modelyard.tensors import to_tensor

HANG_S = 10.0  # a hostile call unanswered for this long is a hang
HOSTILE_PAUSE_S = 1.0  # each hostile class sends about one request a second
BAD_CODES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
TTFT = "SSE TTFT via Envoy"  # the SSE clients' time to their first token event
# The most a hostile window may cost the normal traffic: p99 (and p50 for TTFT) x the quiet one's.
RATIO_GOAL = 1.5
TTFT_GOAL = 2.0  # issue 33: others' time to first token with the abandoned-stream client running
ABANDONED = "abandoned streams"
HELD = "held half-requests"


def build_repository(root: Path) -> None:
    for name in ("classifier", "codelm", "scaler"):
        shutil.copytree(COMMITTED_ROOT / name, root / name)
    write_model(root, "fill", 1, value_models.filled())
    write_model(root, "spin", 1, value_models.spin())


# --- what is recorded -----------------------------------------------------------------------------


@dataclass
class Record:
    started: float = field(default_factory=time.perf_counter)
    hostile: bool = False  # the current window's kind
    stopping: bool = False
    latencies: dict[tuple[str, bool], list[float]] = field(default_factory=dict)  # (kind, hostile)
    normal_errors: Counter[str] = field(default_factory=Counter)
    hostile_answers: Counter[str] = field(default_factory=Counter)  # "class: answer"
    findings: Counter[str] = field(default_factory=Counter)  # hostile answers that break the goal

    def latency(self, kind: str, seconds: float, hostile: bool) -> None:
        self.latencies.setdefault((kind, hostile), []).append(seconds)


# --- normal traffic -------------------------------------------------------------------------------


async def paced(interval_s: float, when: list[float]) -> None:
    """Wait for the next send time of a client that sends every `interval_s` (a steady load, not
    as fast as the answers come: what the hostile mix costs shows as latency, not as fewer calls);
    a client that fell behind sends at once."""
    when[0] += interval_s
    delay = when[0] - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    else:
        when[0] = time.perf_counter()


async def normal_unary(stub: Any, record: Record, interval_s: float) -> None:
    x = np.random.default_rng(0).standard_normal((1, 64), dtype=np.float32)
    request = pb.InferRequest(model_name="classifier", inputs=[to_tensor("INPUT0", x)])
    when = [time.perf_counter()]
    while not record.stopping:
        await paced(interval_s, when)
        hostile, start = record.hostile, time.perf_counter()
        try:
            await stub.Infer(request, metadata=(("x-tenant-id", "good"),), timeout=HANG_S)
            if hostile == record.hostile:  # a call that straddles two windows counts in neither
                record.latency("unary via sidecar", time.perf_counter() - start, hostile)
        except grpc.aio.AioRpcError as exc:
            record.normal_errors[f"Infer {exc.code().name} {exc.details()[:80]}"] += 1


async def normal_sse(edge: httpx.AsyncClient, record: Record, interval_s: float) -> None:
    """SSE generations through Envoy: each one's whole time and its time to first token. One that
    is refused or gets no token (an error, HANG_S without an answer) counts as HANG_S in the time
    to first token, so that a client locked out shows in the figure, not only in the errors."""
    body = {"prompt": "def add(a, b):", "max_tokens": 8}
    when = [time.perf_counter()]
    while not record.stopping:
        await paced(interval_s, when)
        hostile, start = record.hostile, time.perf_counter()
        first = 0.0
        try:
            async with edge.stream("POST", "/v1/models/codelm/generate", json=body) as response:
                if response.status_code != 200:
                    record.normal_errors[f"SSE HTTP {response.status_code}"] += 1
                    continue
                event, done = "", False
                async for line in response.aiter_lines():
                    if line.startswith("event: "):
                        event = line[7:]
                        done = done or event == "done"
                        if event == "token" and not first:
                            first = time.perf_counter()
                        if event == "error":
                            record.normal_errors["SSE event: error"] += 1
            if not done:
                record.normal_errors["SSE ended without done"] += 1
            elif hostile == record.hostile:
                record.latency("SSE via Envoy", time.perf_counter() - start, hostile)
        except httpx.HTTPError as exc:
            record.normal_errors[f"SSE {type(exc).__name__}"] += 1
        finally:
            if hostile == record.hostile:
                record.latency(
                    TTFT, first - start if first else max(HANG_S, time.perf_counter() - start), hostile
                )


# --- the hostile mix ------------------------------------------------------------------------------

Attempt = Callable[[], Awaitable[str]]  # returns a short description of the answer


async def grpc_answer(call: Awaitable[Any]) -> str:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        trailing: Any = exc.trailing_metadata() or ()
        reason = next((str(v) for k, v in trailing if k == "x-error-reason"), "")
        return f"{exc.code().name}/{reason}" if reason else exc.code().name
    return "OK"


def tiny_fields(count: int) -> bytes:
    """An InferRequest of `count` empty unknown fields (field 1000, varint 0) and then a name."""
    return b"\xc0\x3e\x00" * count + b"\x0a\x0aclassifier"


def hostile_attempts(
    sidecar: grpc.aio.Channel, gateway: httpx.AsyncClient, admin: httpx.AsyncClient | None, planted: Path
) -> dict[str, Attempt]:
    stub: Any = pb_grpc.InferenceServiceStub(sidecar)
    kstub: Any = kpb_grpc.GRPCInferenceServiceStub(sidecar)
    raw = sidecar.unary_unary("/modelyard.inference.v1.InferenceService/Infer", None, None)
    counter = iter(range(10**9))
    names = ["../../" + str(planted), "", ".", "a\x00b", "x" * 1_000_000, "/etc/passwd", "a/../b"]

    def infer(name: str, **inputs: np.ndarray) -> pb.InferRequest:
        return pb.InferRequest(model_name=name, inputs=[to_tensor(k, v) for k, v in inputs.items()])

    async def bad_name() -> str:
        name = names[next(counter) % len(names)]
        return await grpc_answer(stub.Infer(infer(name), timeout=HANG_S))

    async def planted_upload() -> str:
        request = kpb.RepositoryModelLoadRequest(model_name=f"../{planted.name}")
        request.parameters["config"].string_param = "{}"
        request.parameters["file:1/model.onnx"].bytes_param = b"not a model"
        return await grpc_answer(kstub.RepositoryModelLoad(request, timeout=HANG_S))

    async def unknown_name() -> str:
        return await grpc_answer(stub.Infer(infer(f"ghost-{next(counter)}"), timeout=HANG_S))

    async def rotating_tenant() -> str:
        x = np.zeros((1, 64), np.float32)
        meta = (("x-tenant-id", f"tenant-{next(counter)}"),)
        return await grpc_answer(stub.Infer(infer("classifier", INPUT0=x), metadata=meta, timeout=HANG_S))

    async def deadline_storm() -> str:
        x = np.zeros((1, 64), np.float32)
        meta = (("x-tenant-id", "storm"),)
        answers = await asyncio.gather(
            *(
                grpc_answer(stub.Infer(infer("classifier", INPUT0=x), metadata=meta, timeout=1e-3))
                for _ in range(8)
            )
        )
        return ",".join(sorted(set(answers)))

    async def bad_values() -> str:
        # A shape value that ConstantOfShape cannot make (negative): the request's fault, not the model's.
        meta = (("x-tenant-id", "storm"),)
        return await grpc_answer(
            stub.Infer(infer("fill", SHAPE=np.array([-5, 1], np.int64)), metadata=meta, timeout=HANG_S)
        )

    async def huge_fill() -> str:
        # 64 GiB of float32 from an 8-byte request: past any run-memory bound of this machine.
        return await grpc_answer(
            stub.Infer(infer("fill", SHAPE=np.array([1 << 17, 1 << 17], np.int64)), timeout=HANG_S)
        )

    async def long_loop() -> str:
        request = infer("spin", N=np.array([value_models.FOREVER], np.int64))
        return await grpc_answer(stub.Infer(request, timeout=0.1))

    async def undecodable() -> str:
        return await grpc_answer(raw(b"\x0a\xff\xff\xff\xff\x0f\x01", timeout=HANG_S))

    async def many_fields() -> str:
        return await grpc_answer(raw(tiny_fields(1_000_000), timeout=HANG_S))

    bodies: list[tuple[str, bytes, dict[bytes, bytes]]] = [
        ("nested", b"[" * 100_000 + b"]" * 100_000, {}),
        ("big int", json.dumps({"prompt": "x", "max_tokens": 10**18}).encode(), {}),
        ("token ids", json.dumps({"prompt_token_ids": [2**70]}).encode(), {}),
        ("seed", json.dumps({"prompt": "x", "seed": 2**64}).encode(), {}),
        ("priority", json.dumps({"prompt": "x", "priority": 2**33}).encode(), {}),
        ("surrogate", b'{"prompt": "\\ud800"}', {}),
        ("header", json.dumps({"prompt": "x", "max_tokens": 1}).encode(), {b"x-tenant-id": b"caf\xe9"}),
        ("oversized", b'{"prompt": "' + b"x" * (17 << 20) + b'"}', {}),
    ]

    async def bad_http() -> str:
        what, body, headers = bodies[next(counter) % len(bodies)]
        try:
            response = await gateway.post(
                "/v1/models/codelm/generate",
                content=body,
                headers={b"content-type": b"application/json", **headers},
                timeout=HANG_S,
            )
        except httpx.TransportError as exc:
            if what != "oversized":
                raise
            # The gateway answers 413 from the Content-Length and closes; a client still writing
            # the body may see the close before the answer.
            return f"{what}: closed while sending ({type(exc).__name__})"
        return f"{what} HTTP {response.status_code}"

    async def bad_admin() -> str:
        if admin is None:
            return "no admin"
        body = [b"[]", b"[" * 100_000, b'"x"', b"{" * 50_000][next(counter) % 4]
        response = await admin.put("/canary/classifier", content=body, timeout=HANG_S)
        return f"admin HTTP {response.status_code}"

    return {
        "bad name": bad_name,
        "planted upload": planted_upload,
        "unknown name": unknown_name,
        "rotating tenant": rotating_tenant,
        "deadline storm": deadline_storm,
        "bad values": bad_values,
        "huge fill": huge_fill,
        "long loop": long_loop,
        "undecodable": undecodable,
        "many fields": many_fields,
        "bad http": bad_http,
        "bad admin": bad_admin,
    }


# The classes hostile_attempts makes, each sent about once a second in the hostile windows.
ATTEMPTS = (
    "bad name",
    "planted upload",
    "unknown name",
    "rotating tenant",
    "deadline storm",
    "bad values",
    "huge fill",
    "long loop",
    "undecodable",
    "many fields",
    "bad http",
    "bad admin",
)
# Classes whose request must be refused: an OK means the harm was done (a model planted, 2 GiB
# allocated, a loop run to the end, a bad body taken as a request).
MUST_REFUSE = {"bad name", "planted upload", "unknown name", "huge fill", "long loop", "undecodable"}


def is_finding(name: str, answer: str) -> bool:
    """A hostile answer that breaks the goal: a server error, an internal code, a hang, or the
    harm done."""
    if answer.startswith(("INTERNAL", "UNKNOWN", "hang", "connection")) or " HTTP 5" in answer:
        return True
    if name in MUST_REFUSE and answer == "OK":
        return True
    return name in {"bad http", "bad admin"} and " HTTP 2" in answer


class HostileSide:
    """The hostile child's view of the run: the windows' switch and the end, from the parent
    (multiprocessing events), and what its requests were answered."""

    def __init__(self, switch: EventType, stop: EventType) -> None:
        self._switch, self._stop = switch, stop
        self.stopping = False
        self.stopped = asyncio.Event()  # set with `stopping`
        self.hostile_answers: Counter[str] = Counter()
        self.findings: Counter[str] = Counter()

    @property
    def hostile(self) -> bool:
        return self._switch.is_set()

    async def until_stopped(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self._stop.wait)
        self.stopping = True
        self.stopped.set()


async def hostile_loop(name: str, attempt: Attempt, record: HostileSide) -> None:
    while not record.stopping:
        if not record.hostile:
            await asyncio.sleep(0.05)
            continue
        try:
            answer = await asyncio.wait_for(attempt(), HANG_S + 5)
        except TimeoutError:
            answer = "hang"
        except (httpx.HTTPError, OSError) as exc:
            answer = f"connection {type(exc).__name__}"
        except Exception as exc:  # the client's own refusal to send it: not the server's answer
            answer = f"not sent ({type(exc).__name__})"
        record.hostile_answers[f"{name}: {answer}"] += 1
        if is_finding(name, answer):
            record.findings[f"{name}: {answer}"] += 1
        await asyncio.sleep(HOSTILE_PAUSE_S)


async def held_connections(host: str, port: int, record: HostileSide, count: int = 16) -> None:
    """Connections that send half a request and then nothing; each one the server closes is replaced."""
    loop = asyncio.get_running_loop()
    closed = 0

    async def hold() -> None:
        nonlocal closed
        sock = socket.create_connection((host, port))
        sock.setblocking(False)
        try:
            await loop.sock_sendall(sock, b"POST /v1/models/codelm/generate HTTP/1.1\r\nHost: x\r\n")
            while await loop.sock_recv(sock, 1024):
                pass  # whatever the server answers (a 408), then its close
            closed += 1
        finally:
            sock.close()

    async def keep() -> None:
        while not record.stopping:
            if record.hostile:
                task = asyncio.ensure_future(hold())
                stop = asyncio.ensure_future(record.stopped.wait())
                await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
                stop.cancel()
                task.cancel()
            else:
                await asyncio.sleep(0.05)

    await asyncio.gather(*(keep() for _ in range(count)))
    record.hostile_answers[f"held half-requests: closed by the server x{closed}"] += 1


async def abandoned_streams(
    host: str, port: int, side: HostileSide, rate: float, inflight: int = 256
) -> None:
    """Generations started through Envoy, each connection dropped (RST, as a closed tab's or a
    killed client's) as soon as the answer's head is in: the generation has started (its first
    token, or the gateway's first-event wait) and nobody will ever read it. `rate` a second, in
    the hostile windows, at most `inflight` at once."""
    body = json.dumps({"prompt": "def main(", "max_tokens": 256}).encode()
    request = (
        b"POST /v1/models/codelm/generate HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    places = asyncio.Semaphore(inflight)
    answers: Counter[str] = Counter()

    async def one() -> None:
        writer = None
        try:
            async with asyncio.timeout(HANG_S):
                reader, writer = await asyncio.open_connection(host, port)
                writer.write(request)
                status = (await reader.readline()).split(b" ")
                answers[f"started HTTP {status[1].decode() if len(status) > 1 else '?'}"] += 1
        except TimeoutError:
            answers["hang"] += 1
        except OSError as exc:
            answers[f"connection {type(exc).__name__}"] += 1
        finally:
            places.release()
            if writer is not None:
                sock = writer.get_extra_info("socket")
                if sock is not None:  # a reset, not an orderly close: the client is gone
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.close()

    tasks: set[asyncio.Task[None]] = set()
    when = [time.perf_counter()]
    while not side.stopping:
        if not side.hostile:
            await asyncio.sleep(0.05)
            when = [time.perf_counter()]
            continue
        await paced(1 / rate, when)
        await places.acquire()
        task = asyncio.ensure_future(one())
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await asyncio.gather(*tasks, return_exceptions=True)
    for answer, count in answers.items():
        side.hostile_answers[f"{ABANDONED}: {answer}"] += count
        if is_finding(ABANDONED, answer):
            side.findings[f"{ABANDONED}: {answer}"] += count


async def hostile_main(
    addresses: dict[str, str], planted: Path, classes: set[str], abandon_rate: float, side: HostileSide
) -> None:
    async with (
        grpc.aio.insecure_channel(addresses["sidecar"]) as sidecar,
        httpx.AsyncClient(base_url=addresses["gateway"], timeout=60) as gateway,
        httpx.AsyncClient(base_url=addresses["admin"], timeout=30) as admin,
    ):
        attempts = hostile_attempts(sidecar, gateway, admin, planted)
        assert tuple(attempts) == ATTEMPTS
        host, _, port = addresses["gateway"].removeprefix("http://").rpartition(":")
        tasks = [asyncio.ensure_future(hostile_loop(n, a, side)) for n, a in attempts.items() if n in classes]
        if HELD in classes:
            tasks.append(asyncio.ensure_future(held_connections(host, int(port), side)))
        if ABANDONED in classes:
            edge_host, _, edge_port = addresses["edge"].removeprefix("http://").rpartition(":")
            tasks.append(
                asyncio.ensure_future(abandoned_streams(edge_host, int(edge_port), side, abandon_rate))
            )
        await side.until_stopped()
        _, pending = await asyncio.wait(tasks, timeout=HANG_S + 10)
        for task in pending:
            task.cancel()
        if pending:
            side.findings[f"hostile calls unanswered {HANG_S + 10:.0f} s after the end"] += len(pending)


def hostile_child(
    addresses: dict[str, str],
    planted: str,
    classes: list[str],
    abandon_rate: float,
    switch: EventType,
    stop: EventType,
    results: Queue[tuple[dict[str, int], dict[str, int]]],
) -> None:
    """The hostile mix in a process of its own: what it costs the client side (building and
    sending 17 MB bodies, million-field messages) must not show as the normal callers' latency;
    only what it costs the stack may."""
    side = HostileSide(switch, stop)
    asyncio.run(hostile_main(addresses, Path(planted), set(classes), abandon_rate, side))
    results.put((dict(side.hostile_answers), dict(side.findings)))


# --- the run --------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))] if ordered else float("nan")


def slope(xs: list[float], ys: list[float]) -> float:
    if len(xs) < 2 or max(xs) == min(xs):
        return float("nan")
    return float(np.polyfit(xs, ys, 1)[0])


async def metrics_size(client: httpx.AsyncClient | None) -> int:
    if client is None:
        return 0
    return len((await client.get("/metrics", timeout=10)).content)


def hostile_classes(args: argparse.Namespace) -> list[str]:
    """The hostile classes this run sends: --only's (default all), less --skip's."""
    known = [*ATTEMPTS, HELD, ABANDONED]
    only = [c for c in args.only.split(",") if c] or known
    skip = {c for c in args.skip.split(",") if c}
    unknown = sorted((set(only) | skip) - set(known))
    if unknown:
        raise SystemExit(f"unknown hostile classes {unknown}; the classes are {known}")
    return [c for c in known if c in only and c not in skip]


async def run(args: argparse.Namespace, tmp: Path, tree: Path = ROOT) -> tuple[int, Record]:
    root = tmp / "models"
    build_repository(root)
    planted = tmp / "planted"
    stack = Stack("--repository", str(root), metrics=True, tree=tree)
    processes = {name: stack.pid_of(name) for name in ("service", "sidecar", "gateway")}
    rss: dict[str, list[tuple[float, float]]] = {name: [] for name in processes}
    record = Record()
    try:
        assert stack.sidecar, "the hostile soak needs the sidecar installed"
        limits = httpx.Limits(max_connections=args.sse + 16)
        async with (
            grpc.aio.insecure_channel(stack.sidecar) as sidecar,
            httpx.AsyncClient(base_url=stack.edge, timeout=HANG_S, limits=limits) as edge,
            httpx.AsyncClient(base_url=f"http://{stack.sidecar_admin}", timeout=30) as admin,
            httpx.AsyncClient(base_url=f"http://{stack.service_metrics}", timeout=30) as service_metrics,
        ):
            stub = pb_grpc.InferenceServiceStub(sidecar)
            sizes = [(await metrics_size(admin), await metrics_size(service_metrics))]
            spawn = multiprocessing.get_context("spawn")
            switch, stop, results = spawn.Event(), spawn.Event(), spawn.Queue()
            addresses = {
                "sidecar": stack.sidecar,
                "gateway": stack.gateway,
                "edge": stack.edge,
                "admin": f"http://{stack.sidecar_admin}",
            }
            child = spawn.Process(
                target=hostile_child,
                args=(
                    addresses,
                    str(planted),
                    hostile_classes(args),
                    args.abandon_rate,
                    switch,
                    stop,
                    results,
                ),
            )
            child.start()
            unary_every, sse_every = args.unary / args.unary_rate, args.sse / args.sse_rate
            tasks = [
                asyncio.ensure_future(normal_unary(stub, record, unary_every)) for _ in range(args.unary)
            ]
            tasks += [asyncio.ensure_future(normal_sse(edge, record, sse_every)) for _ in range(args.sse)]
            window_s = args.duration_s / args.windows
            for window in range(args.windows):
                record.hostile = window % 2 == 1
                (switch.set if record.hostile else switch.clear)()
                end = record.started + (window + 1) * window_s
                while (now := time.perf_counter()) < end:
                    for name, pid in processes.items():
                        rss[name].append((now - record.started, rss_kib(pid) / 1024))
                    await asyncio.sleep(min(1.0, max(0.0, end - now)))
                sizes.append((await metrics_size(admin), await metrics_size(service_metrics)))
            record.stopping = True
            switch.clear()
            stop.set()
            _, pending = await asyncio.wait(tasks, timeout=HANG_S + 10)
            for task in pending:  # a call that never came back: the stack hangs
                task.cancel()
            if pending:
                record.findings[f"clients still waiting {HANG_S + 10:.0f} s after the end"] += len(pending)
            try:
                answers, findings = await asyncio.get_running_loop().run_in_executor(
                    None, results.get, True, 2 * HANG_S + 20
                )
                record.hostile_answers.update(answers)
                record.findings.update(findings)
            except queue.Empty:
                record.findings["the hostile client never finished"] += 1
            child.join(10)
            if child.is_alive():
                child.kill()
    finally:
        stack.stop()
    return report(args, record, rss, sizes, planted), record


def report(
    args: argparse.Namespace,
    record: Record,
    rss: dict[str, list[tuple[float, float]]],
    sizes: list[tuple[int, int]],
    planted: Path,
) -> int:
    print(
        f"hostile soak: {args.duration_s:.0f} s in {args.windows} alternating quiet/hostile windows; "
        f"{args.unary_rate:.0f} unary calls/s via the sidecar, {args.sse_rate:.0f} SSE generations/s via "
        f"Envoy; "
        f"{len(record.hostile_answers)} kinds of hostile answer"
    )
    print(
        f"\n{'normal traffic':<22}{'window':>9}{'calls':>8}{'p50 ms':>9}{'p99 ms':>9}"
        f"{'p50 x quiet':>13}{'p99 x quiet':>13}"
    )
    worst, worst_ttft = 0.0, 0.0
    for kind in sorted({k for k, _ in record.latencies}):
        ratios = {
            label: ratio for label, ratio in zip(("p50", "p99"), ttft_ratios(record, kind), strict=True)
        }
        if kind == TTFT:
            worst_ttft = max(worst_ttft, *ratios.values())
        else:
            worst = max(worst, ratios["p99"])
        for label, hostile in (("quiet", False), ("hostile", True)):
            values = record.latencies.get((kind, hostile), [])
            shown = f"{ratios['p50']:>13.2f}{ratios['p99']:>13.2f}" if hostile else ""
            print(
                f"{kind:<22}{label:>9}{len(values):>8}{percentile(values, 0.5) * 1e3:>9.2f}"
                f"{percentile(values, 0.99) * 1e3:>9.2f}{shown}"
            )
    # The slope over the second half, after warm-up (allocators and caches settle in the first).
    print("\nRSS (MB)            start      end   second-half slope MB/min   at each window's end")
    window_s = args.duration_s / args.windows
    for name, samples in rss.items():
        if samples:
            late = [(t, r) for t, r in samples if t >= args.duration_s / 2]
            per_min = slope([t for t, _ in late], [r for _, r in late]) * 60
            ends = [[r for t, r in samples if t < (w + 1) * window_s][-1:] for w in range(args.windows)]
            shown = " ".join(f"{r[0]:.0f}" if r else "-" for r in ends)
            print(f"  {name:<16}{samples[0][1]:>7.0f}{samples[-1][1]:>9.0f}{per_min:>+27.2f}   {shown}")
    # After the first two windows every series normal traffic makes exists; hostile input adds none.
    print("\n/metrics bytes at the start and after each window:")
    print("  sidecar " + " ".join(str(a) for a, _ in sizes))
    print("  service " + " ".join(str(b) for _, b in sizes))
    print(f"planted file outside the repository: {'YES' if planted.exists() else 'no'}")
    print("\nhostile answers:")
    for what, count in sorted(record.hostile_answers.items()):
        print(f"  {what} x{count}")
    print(f"\nnormal-traffic errors: {sum(record.normal_errors.values())} (goal: 0)")
    for what, count in sorted(record.normal_errors.items()):
        print(f"  {what} x{count}")
    findings = sum(record.findings.values())
    print(f"hostile answers that are 5xx / INTERNAL / UNKNOWN / hangs / harm done: {findings} (goal: 0)")
    for what, count in sorted(record.findings.items()):
        print(f"  {what} x{count}")
    print(f"worst p99 ratio hostile/quiet: {worst:.2f} (goal: <= {RATIO_GOAL})")
    print(f"worst TTFT ratio (p50 or p99) hostile/quiet: {worst_ttft:.2f} (goal: <= {TTFT_GOAL})")
    missed = (
        record.normal_errors
        or record.findings
        or worst > RATIO_GOAL
        or worst_ttft > TTFT_GOAL
        or planted.exists()
    )
    return 1 if missed else 0


def ttft_ratios(record: Record, kind: str = TTFT) -> tuple[float, float]:
    """The hostile windows' p50 and p99 of `kind` over the quiet windows'."""
    quiet = record.latencies.get((kind, False), [])
    loud = record.latencies.get((kind, True), [])
    out = []
    for q in (0.5, 0.99):
        base = percentile(quiet, q)
        out.append(percentile(loud, q) / base if base else float("nan"))
    return out[0], out[1]


def summary(runs: list[tuple[str, int, Record]]) -> None:
    """Each run's TTFT figures, by tree, and the spread of each tree's ratios over its runs."""
    print(f"\n== {TTFT}, quiet vs hostile windows, by tree and run ==")
    print(
        f"{'tree':<10}{'run':>4}{'quiet p50':>11}{'quiet p99':>11}{'hostile p50':>13}{'hostile p99':>13}"
        f"{'p50 x':>8}{'p99 x':>8}{'errors':>8}"
    )
    for label, number, record in runs:
        quiet = record.latencies.get((TTFT, False), [])
        loud = record.latencies.get((TTFT, True), [])
        p50, p99 = ttft_ratios(record)
        print(
            f"{label:<10}{number:>4}"
            f"{percentile(quiet, 0.5) * 1e3:>9.1f}ms{percentile(quiet, 0.99) * 1e3:>9.1f}ms"
            f"{percentile(loud, 0.5) * 1e3:>11.1f}ms{percentile(loud, 0.99) * 1e3:>11.1f}ms"
            f"{p50:>8.2f}{p99:>8.2f}{sum(record.normal_errors.values()):>8}"
        )
    for label in dict.fromkeys(label for label, _, _ in runs):
        ratios = [ttft_ratios(record) for name, _, record in runs if name == label]
        p50s, p99s = [r[0] for r in ratios], [r[1] for r in ratios]
        print(
            f"{label}: p50 x {min(p50s):.2f}-{max(p50s):.2f}, p99 x {min(p99s):.2f}-{max(p99s):.2f} "
            f"over {len(ratios)} runs (goal: <= {TTFT_GOAL})"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=120.0)
    parser.add_argument("--windows", type=int, default=8, help="alternating quiet/hostile windows (even)")
    parser.add_argument("--unary", type=int, default=4, help="unary Infer clients via the sidecar")
    parser.add_argument("--unary-rate", type=float, default=200.0, help="unary calls a second, all clients")
    parser.add_argument("--sse", type=int, default=2, help="SSE generation clients via Envoy")
    parser.add_argument("--sse-rate", type=float, default=4.0, help="SSE generations a second, all clients")
    parser.add_argument("--skip", default="", help="hostile classes to leave out, comma-separated")
    parser.add_argument("--only", default="", help="the only hostile classes to send, comma-separated")
    parser.add_argument(
        "--abandon-rate",
        type=float,
        default=8.0,
        help="streams a second the abandoned-stream client starts (issue 33's figure: 32)",
    )
    parser.add_argument(
        "--trees",
        type=source_trees,
        default=[("now", ROOT)],
        metavar="NAME=TREE,...",
        help="run the stack from each source tree in turn (before/after pairs)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="runs of each tree, in turns")
    args = parser.parse_args()
    hostile_classes(args)  # an unknown class name stops here, before any stack starts
    runs: list[tuple[str, int, Record]] = []
    code = 0
    for number in range(1, args.repeat + 1):
        for label, tree in args.trees:
            if len(args.trees) > 1 or args.repeat > 1:
                print(f"\n== tree {label} ({tree}), run {number} ==", flush=True)
            with tempfile.TemporaryDirectory() as tmp:
                code, record = asyncio.run(run(args, Path(tmp), tree))
            runs.append((label, number, record))
    if len(runs) > 1:
        summary(runs)
    return code  # the last run's (the last tree's: the tree under test)


if __name__ == "__main__":
    raise SystemExit(main())
